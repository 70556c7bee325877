"""Check widget values against what a node declares, for nodes whose `validate_inputs` takes **kwargs.

ComfyUI skips its own min/max checks for every input a node's `validate_inputs` receives (all of them with
**kwargs), and 0.3.75 never checks V3 combo values at all. Reading the bounds from the node's own schema keeps
this check from drifting from the widgets.
"""

from __future__ import annotations

from collections.abc import Mapping


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_declared(node_cls, values: Mapping[str, object]) -> bool | str:
    """True, or a message naming the first input outside its declared type, bounds or options.

    Values of linked inputs (absent or None at validation time) are not checked here: the linked node's output
    type was checked by ComfyUI.
    """
    declared = node_cls.INPUT_TYPES()
    for section in ("required", "optional"):
        for name, spec in (declared.get(section) or {}).items():
            value = values.get(name)
            if value is None or not isinstance(spec, (tuple, list)) or not spec:
                continue
            kind = spec[0]
            extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if kind == "INT" and (isinstance(value, bool) or not isinstance(value, int)):
                return f"{name} must be an integer, got {_shown(value)}"
            if kind == "FLOAT" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                return f"{name} must be a number, got {_shown(value)}"
            if kind in ("INT", "FLOAT"):
                low, high = extra.get("min"), extra.get("max")
                if low is not None and value < low:
                    return f"{name} must be at least {low}, got {_shown(value)}"
                if high is not None and value > high:
                    return f"{name} must be at most {high}, got {_shown(value)}"
            elif kind == "STRING" and not isinstance(value, str):
                return f"{name} must be text, got {_shown(value)}"
            elif kind == "COMBO" or isinstance(kind, list):
                options = kind if isinstance(kind, list) else extra.get("options") or []
                if value not in options:
                    return f"{name} must be one of {_shown(options, 300)}, got {_shown(value)}"
    return True
