"""Errors raised by `h3_core.weights`.

All of them derive from `ValueError` so callers that only care about "bad input" can catch one
type, while a UI can tell an unsupported (but recognised) checkpoint from a broken one.
"""

from __future__ import annotations


class H3WeightsError(ValueError):
    """A checkpoint that cannot be used as given. The message says what was expected."""


class UnrecognisedCheckpointError(H3WeightsError):
    """The path holds no MiniMax-H3 component this package knows how to read."""


class UnsupportedCheckpointError(H3WeightsError):
    """A recognised MiniMax-H3 variant this package deliberately refuses (pruned, quantised)."""


class IncompleteFileError(H3WeightsError):
    """A safetensors or GGUF file shorter than its own header says (an interrupted download)."""


class KeyMismatchError(H3WeightsError):
    """After key conversion the tensors do not map one-to-one (or not shape-for-shape) onto the model."""


def preview(names, limit: int = 5) -> str:
    """A short, stable rendering of a list of key names for error messages."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
