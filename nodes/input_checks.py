"""Queue-time checks of widget values, reported one problem per line, each on the input that causes it.

ComfyUI 0.3.75 (execution.py, `validate_inputs`) copies whatever a node's `validate_inputs` returns onto every
input that function receives (all of them with **kwargs): one bad length became the same message on six inputs,
and the frontend's red ring landed on the first socket (`text_encoder`). So the pack's validators return a
*report*, one `input: message` line per problem (`report`), and `validation_errors.py` rewrites the copies in
POST /prompt's node_errors into one error per line, attached to the input the line names. Without that rewrite the
report still reads correctly (every problem, each naming its input), only repeated as core does.

ComfyUI also skips its own min/max checks for every input `validate_inputs` receives, and 0.3.75 never checks V3
combo values at all; `declared_problems` reads the bounds from the node's own schema, so this check cannot drift
from the widgets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Problem = tuple[str, str]  # (input name, what is wrong with it, in user terms)


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def report(problems: Iterable[Problem]) -> bool | str:
    """True when there are none, else one `input: message` line per problem (what validate_inputs returns)."""
    lines = [f"{name}: {message}" for name, message in problems]
    return "\n".join(lines) if lines else True


def parse_report(text: str, inputs: Iterable[str]) -> list[Problem]:
    """The problems of a `report` (lines that name no known input are kept whole, under the input ``""``)."""
    known = set(inputs)
    problems: list[Problem] = []
    for line in text.splitlines():
        name, sep, message = line.partition(": ")
        if sep and name in known:
            problems.append((name, message))
        elif line.strip():
            problems.append(("", line))
    return problems


def declared_problems(node_cls, values: Mapping[str, object]) -> list[Problem]:
    """The inputs outside their declared type, bounds or options, one problem each.

    Values of linked inputs (absent or None at validation time) are not checked here: the linked node's output
    type was checked by ComfyUI.
    """
    declared = node_cls.INPUT_TYPES()
    problems: list[Problem] = []
    for section in ("required", "optional"):
        for name, spec in (declared.get(section) or {}).items():
            value = values.get(name)
            if value is None or not isinstance(spec, (tuple, list)) or not spec:
                continue
            problem = _declared_problem(spec, value)
            if problem:  # the message names its input: it also reads right where ComfyUI shows it alone
                problems.append((name, f"{name} {problem}"))
    return problems


def _declared_problem(spec, value) -> str | None:
    kind = spec[0]
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if kind == "INT" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"must be an integer, got {_shown(value)}"
    if kind == "FLOAT" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"must be a number, got {_shown(value)}"
    if kind in ("INT", "FLOAT"):
        low, high = extra.get("min"), extra.get("max")
        if low is not None and value < low:
            return f"must be at least {low}, got {_shown(value)}"
        if high is not None and value > high:
            return f"must be at most {high}, got {_shown(value)}"
    elif kind == "STRING" and not isinstance(value, str):
        return f"must be text, got {_shown(value)}"
    elif kind == "COMBO" or isinstance(kind, list):
        options = kind if isinstance(kind, list) else extra.get("options") or []
        if value not in options:
            return f"must be one of {_shown(options, 300)}, got {_shown(value)}"
    return None


def check_declared(node_cls, values: Mapping[str, object]) -> bool | str:
    """True, or a message naming the first input outside its declared type, bounds or options (for execute,
    where linked widget values arrive unchecked)."""
    problems = declared_problems(node_cls, values)
    if not problems:
        return True
    return problems[0][1]
