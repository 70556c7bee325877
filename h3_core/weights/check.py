"""Verify a checkpoint against the model it should load into - from headers only.

For each component: derive the config from shapes (and whatever config the checkpoint states),
build the model on the `meta` device, run the header's data-free meta tensors through the same
key converter the loaders use, and require zero missing keys, zero unexpected keys and equal
shapes. Nothing reads tensor data, so a release-size check takes seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import components
from .detect import Detection, scan
from .errors import H3WeightsError, KeyMismatchError, preview
from .headers import meta_state_dict


@dataclass
class ComponentCheck:
    path: str
    detection: Detection | None = None
    config: dict | None = None
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)  # (name, file shape, model shape)
    error: str | None = None
    seconds: float = 0.0
    # The meta model the check built; loaders assign weights into it instead of building another.
    model: object = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None and not (self.missing or self.unexpected or self.mismatched)

    def problems(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing ({preview(self.missing)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected ({preview(self.unexpected)})")
        if self.mismatched:
            shown = "; ".join(f"{n}: file {list(a)} vs model {list(b)}" for n, a, b in self.mismatched[:3])
            parts.append(f"{len(self.mismatched)} shape mismatches ({shown})")
        return ", ".join(parts)

    def render(self) -> str:
        if self.error is not None:
            return f"FAIL {self.path}\n     {self.error}"
        det = self.detection
        head = f"{'OK  ' if self.ok else 'FAIL'} {self.path}\n     {det.summary()}"
        lines = [head]
        for note in det.notes:
            lines.append(f"     note: {note}")
        target = det.handler.model_class
        if self.ok:
            lines.append(f"     maps onto {target}: 0 missing, 0 unexpected, all shapes equal ({self.seconds:.2f}s)")
        else:
            lines.append(f"     does not map onto {target}: {self.problems()}")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise H3WeightsError(self.error)
        if not self.ok:
            target = self.detection.handler.model_class
            raise KeyMismatchError(f"{self.path}: does not map onto {target}: {self.problems()}")


@dataclass
class CheckReport:
    path: str
    components: list

    @property
    def ok(self) -> bool:
        return bool(self.components) and all(c.ok for c in self.components)

    def __str__(self) -> str:
        verdict = "all components OK" if self.ok else "PROBLEMS FOUND"
        body = "\n".join(c.render() for c in self.components)
        return f"MiniMax-H3 weights check of {self.path}: {verdict}\n{body}"


def compare(expected: components.ExpectedKeys, converted: dict) -> tuple[list, list, list]:
    """(missing, unexpected, mismatched) between a model's needs and converted tensors."""
    missing = sorted(set(expected.shapes) - set(converted))
    unexpected, mismatched = [], []
    for name, tensor in converted.items():
        wanted = expected.shapes.get(name)
        if wanted is None and name in expected.aliases:
            wanted = expected.shapes[expected.aliases[name]]
        if wanted is None:
            unexpected.append(name)
        elif tuple(tensor.shape) != wanted:
            mismatched.append((name, tuple(tensor.shape), wanted))
    return missing, sorted(unexpected), sorted(mismatched)


def check_detection(det: Detection) -> ComponentCheck:
    """Header-only verification of one detected component."""
    start = time.perf_counter()
    result = ComponentCheck(path=det.path, detection=det)
    try:
        result.config = components.resolve_config(det)
        converted, unexpected_file_keys = components.to_model_names(det, meta_state_dict(det.header), result.config)
        model = components.empty_model(det, result.config)
        missing, unexpected, mismatched = compare(components.expected_keys(model), converted)
        result.missing, result.mismatched = missing, mismatched
        result.unexpected = sorted(unexpected_file_keys + unexpected)
        result.model = model
    except H3WeightsError as exc:
        result.error = str(exc)
    result.seconds = time.perf_counter() - start
    return result


def check(path: str) -> CheckReport:
    """Check every component at `path` (file, component folder or pipeline root). `str(report)`
    is the human-readable report; `report.ok` the verdict."""
    results = []
    for item in scan(path):
        if isinstance(item, H3WeightsError):
            results.append(ComponentCheck(path=getattr(item, "path", path), error=str(item)))
        else:
            results.append(check_detection(item))
    return CheckReport(path=path, components=results)
