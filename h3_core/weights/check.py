"""Verify a checkpoint against the model it should load into - from headers only.

For each component: derive the config from shapes (and whatever config the checkpoint states),
build the model on the `meta` device, run the header's data-free meta tensors through the same
key converter the loaders use, and require zero missing keys, zero unexpected keys and equal
shapes. The only tensor data read are a quantised file's scales (a few MB even at release size):
a NaN or an infinite scale would make every output of its layer non-finite, so it is reported by
layer here instead of surfacing as a black video at the end of `generate`.

A GGUF file keeps its fp16 scales inside every quant block, so its scales cannot be read apart from its weights:
`check` (the command) reads the whole file once, in bounded pieces, and tests every block scale and every dense
value (`non_finite_gguf`); a load does not read it twice but tests each tensor as it reads it
(`gguf_file.read_tensor`), so both refuse a NaN or infinity by layer before anything runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..safetensors_header import HeaderError
from ..safetensors_header import read_header as read_safetensors_header
from . import components
from .detect import Detection, scan
from .errors import H3WeightsError, KeyMismatchError, preview
from .formats import PRUNED_TABLE_KEY
from .headers import meta_state_dict
from .quant import route as quant_route
from .quant.plan import meta_with_markers

_PIECE = 1 << 20  # elements per finiteness pass: a bounded temporary whatever the scale's size


def format_line(det: Detection) -> str:
    """How every layer family of a checkpoint is stored, in one line, e.g. "DiT fl2va · pruned AdaLN table
    [1025, 8] · block linears int8_convrot (group 256) x200 · other tensors BF16/F16/F32 · 20.96 GB"."""
    parts = [f"{det.handler.label} {det.partition}" if det.partition else det.handler.label]
    table = det.header.tensors.get(PRUNED_TABLE_KEY)
    if table is not None:
        parts.append(f"pruned AdaLN table {list(table.shape)}")
    stored = set()
    if det.quant is not None:
        parts += [f"{family} {label} x{count}" for family, label, count in det.quant.families()]
        stored = det.quant.stored_keys()
    rest = sorted({info.dtype for key, info in det.header.tensors.items() if key not in stored})
    parts.append(f"{'other tensors' if det.quant is not None else 'dense'} {'/'.join(rest)}")
    parts.append(f"{det.total_bytes / 1e9:.2f} GB")
    return " · ".join(parts)


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
        lines = [head, f"     formats: {format_line(det)}"]
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


def _finite(raw: bytes, dtype: torch.dtype) -> bool:
    """No NaN and no infinity among the values `raw` holds. fp8 codes are tested on their bits (e4m3fn's only
    non-finite codes are S.1111.111, e5m2's are those with every exponent bit set): a release's block scales are
    GBs, and a bit test over bytes costs a fraction of a float conversion."""
    codes = np.frombuffer(raw, dtype=np.uint8)
    if dtype == torch.float8_e4m3fn:
        return not bool(((codes & 0x7F) == 0x7F).any())
    if dtype == torch.float8_e5m2:
        return not bool(((codes & 0x7C) == 0x7C).any())
    if dtype == getattr(torch, "float8_e8m0fnu", None):  # mxfp8 block scales: 0xFF is its NaN, no infinity
        return not bool((codes == 0xFF).any())
    flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    return all(bool(torch.isfinite(flat[i:i + _PIECE]).all()) for i in range(0, flat.numel(), _PIECE))


def non_finite_scales(det: Detection) -> list[str]:
    """The scale tensors (`<layer>.weight_scale`, ...) of a quantised file that hold a NaN or an infinity. Each is
    read on its own with a plain read of its byte range (no mapping of a file that may be tens of GB)."""
    if det.quant is None or det.header.container != "safetensors":  # GGUF scales live inside their quant blocks
        return []
    # Every side tensor of a quantised layer (the floating ones are read below: scales, an AWQ pre-scale, a codebook).
    names = {f"{layer}.{suffix}" for layer, spec in det.quant.layers.items() for suffix in spec.tensors
             if suffix != "weight"} & set(det.header.tensors)
    by_file: dict[str, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(det.header.tensors[name].file, []).append(name)
    bad = []
    for path, file_names in by_file.items():
        try:
            parsed = read_safetensors_header(path)
            with open(path, "rb") as handle:
                for name in file_names:
                    entry = parsed.tensors[name]
                    dtype = entry.torch_dtype
                    if dtype is None or not dtype.is_floating_point or not entry.nbytes:
                        continue
                    handle.seek(parsed.data_start + entry.begin)
                    raw = handle.read(entry.nbytes)
                    if len(raw) == entry.nbytes and not _finite(raw, dtype):
                        bad.append(name)
        except (OSError, HeaderError) as exc:
            raise H3WeightsError(f"{path}: cannot read its quantisation scales ({exc})") from None
    return bad


_GGUF_PIECE = 16 << 20  # bytes read at a time by `non_finite_gguf` (rounded down to whole blocks)


def non_finite_gguf(det: Detection) -> list[str]:
    """The tensors of a GGUF checkpoint whose block scales (quantised) or values (dense) hold a NaN or an infinity,
    by name; every tensor is read in pieces of whole blocks, so memory stays bounded whatever the file's size."""
    from .quant import ggml

    if det.header.container != "gguf":
        return []
    bad = []
    for name, info in sorted(det.header.tensors.items()):
        for part in info.parts or (info,):
            block = 1 if part.ggml_type in ggml.DENSE_TYPES else ggml.block_sizes(part.ggml_type)[1]
            step = max(block, _GGUF_PIECE // block * block)
            try:
                with open(part.file, "rb") as handle:
                    handle.seek(part.offset)
                    for start in range(0, part.nbytes, step):
                        raw = handle.read(min(step, part.nbytes - start))
                        if len(raw) < min(step, part.nbytes - start):
                            raise H3WeightsError(f"{part.file}: {name}: tensor data ends early (interrupted download?)")
                        if ggml.non_finite(np.frombuffer(raw, dtype=np.uint8), part.ggml_type):
                            bad.append(name)
                            break
            except OSError as exc:
                raise H3WeightsError(f"{part.file}: cannot read {name} ({exc.strerror or exc})") from None
            if bad and bad[-1] == name:
                break
    return bad


def check_detection(det: Detection) -> ComponentCheck:
    """Header-only verification of one detected component."""
    start = time.perf_counter()
    result = ComponentCheck(path=det.path, detection=det)
    try:
        result.config = components.resolve_config(det)
        tensors = quant_route.before_conversion(det, meta_with_markers(det.quant, meta_state_dict(det.header)))
        converted, unexpected_file_keys = components.to_model_names(det, tensors, result.config)
        model = components.empty_model(det, result.config)
        converted, quant_mismatched = quant_route.install(model, converted)
        missing, unexpected, mismatched = compare(components.expected_keys(model), converted)
        result.missing, result.mismatched = missing, sorted(mismatched + quant_mismatched)
        result.unexpected = sorted(unexpected_file_keys + unexpected)
        result.model = model
        bad = non_finite_scales(det)
        if bad:
            result.error = (f"{det.path}: {len(bad)} quantised layer scale(s) hold NaN or infinite values (a corrupted "
                            f"or hostile file; every output of those layers would be NaN): {preview(bad)}")
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
            result = check_detection(item)
            bad = non_finite_gguf(item) if result.ok else []
            if bad:
                result.error = (f"{item.path}: {len(bad)} GGUF tensor(s) hold NaN or infinite block scales or values "
                                f"(a corrupted or hostile file; every output of those layers would be NaN): "
                                f"{preview(bad)}")
            results.append(result)
    return CheckReport(path=path, components=results)
