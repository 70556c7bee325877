"""`ContractError` and the small checks every part of the contract shares."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class ContractError(ValueError):
    """A conditioning payload violates the H3 contract. `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ChecksumError(ContractError):
    """A payload's bytes differ from what was written (its checksum does not match): corruption in transit or on
    disk, not a malformed contract, so fetching or reading it again may help."""


def fail(field_name: str, constraint: str) -> ContractError:
    """`ContractError("field: constraint")`, the one message shape every check uses."""
    return ContractError(f"{field_name}: {constraint}", field=field_name)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def check_tensor(name: str, t: Any, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
                 ndim: int | None = None) -> torch.Tensor:
    """Refuse anything but a tensor of `dtype` (one of, for a tuple) and `ndim` dimensions; return it."""
    if not isinstance(t, torch.Tensor):
        raise fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            names = "/".join(str(d).removeprefix("torch.") for d in allowed)
            raise fail(name, f"dtype must be {'one of ' if len(allowed) > 1 else ''}{names}, got {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise fail(name, f"must have {ndim} dimensions, got shape {shape(t)}")
    return t


def preview(names: Iterable[Any], limit: int = 10) -> str:
    """A sorted list for an error message, cut after `limit` entries ("[...] and N more"): names can come
    from a hostile file, and a message must stay short whatever it holds."""
    items = sorted(ascii(n) if isinstance(n, str) else repr(n) for n in names)
    shown = [item if len(item) <= 60 else item[:56] + "...'" for item in items[:limit]]
    text = "[" + ", ".join(shown) + "]"
    return text if len(items) <= limit else f"{text[:-1]}, ...] and {len(items) - limit} more"
