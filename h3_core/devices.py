"""Where the headless path runs: `--device`, `--dtype`, `--offload` and what the machine has.

One `Placement` (device, dtype override, offload mode) travels from the CLI or the encoder server into
the stages; `add_arguments` is the whole flag surface, so `cli.py` only calls it. Memory figures come
from the driver (`torch.cuda.mem_get_info`) and `/proc/meminfo`; nothing here allocates on a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import dtypes

OFFLOAD_MODES = ("auto", "none", "block")


class DeviceError(ValueError):
    """A device the user named does not exist here (no CUDA, index out of range, unknown kind)."""


def parse_device(spec) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' -> a torch.device that exists on this machine."""
    if isinstance(spec, torch.device):
        device = spec
    else:
        text = str(spec or "cpu").strip().lower()
        try:
            device = torch.device(text)
        except RuntimeError:
            raise DeviceError(f"unknown device {spec!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device {spec!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r} asked for, but torch sees no CUDA device on this machine")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def visible_devices() -> list[str]:
    """The devices torch sees here, as `parse_device` spells them: cpu, then cuda:0, cuda:1, ..."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"cuda:{index}" for index in range(count))]


def device_memory(device) -> tuple[int, int]:
    """(free, total) bytes on `device`; for the CPU, host RAM (available, total)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return host_memory()


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM, from /proc/meminfo (cgroup limits are not consulted)."""
    values = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages
    return values.get("MemAvailable", values.get("MemFree", 0)), values.get("MemTotal", 0)


@dataclass(frozen=True)
class Placement:
    """Where and how the stages run their models (see `dtypes` for the dtype rule)."""

    device: torch.device = torch.device("cpu")
    dtype: str | None = None  # None: the rule; else a `dtypes.NAMES` spelling
    offload: str = "none"  # one of OFFLOAD_MODES

    def __post_init__(self):
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")
        dtypes.parse(self.dtype)  # fail early on a misspelt dtype

    def dtype_of(self, component: str) -> torch.dtype:
        return dtypes.compute_dtype(component, self.device, self.dtype)

    @classmethod
    def from_args(cls, args) -> "Placement":
        dtype = getattr(args, "dtype", None)
        return cls(
            device=parse_device(getattr(args, "device", None) or "cpu"),
            dtype=None if dtype in dtypes.DEFAULT_NAMES else dtype,
            offload=getattr(args, "offload", None) or "none",
        )


def stage_kwargs(args, component: str) -> dict:
    """EncoderStage / DiffusionStage keyword arguments from parsed CLI flags."""
    placement = Placement.from_args(args)
    return {"device": placement.device, "dtype": placement.dtype_of(component), "offload": placement.offload}


def add_arguments(parser, *, offload_default: str = "auto", dtype_default: str = "auto",
                  dtype_help: str | None = None) -> None:
    """The placement flags every model-running command takes (encode, generate, serve)."""
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--dtype",
        choices=dtypes.CHOICES,
        default=dtype_default,
        help=dtype_help
        or "compute dtype of the DiT and text encoder (auto: float32 on CPU, bfloat16 on CUDA; VAEs follow "
        "the official rule)",
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default=offload_default,
        help="block: stream DiT blocks / text-encoder layers from host RAM; none: keep weights on the device; "
        "auto: stream only when the planner says the weights and activations do not fit (default %(default)s)",
    )
