"""The plumbing every media decoder shares: sources, the one error type, error mapping and release.

Part of :mod:`h3_core.media` (import from there); split out so the audio and video decoders can share it.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import traceback
from typing import Any, BinaryIO, Union

import av
import numpy as np

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]


class MediaError(ValueError):
    """Media that cannot be read, written or accepted; the message names the media kind and the constraint."""


class TooManyFrames(MediaError):
    """A video with more frames than the decoder's ``max_frames`` (the encoder server answers 413, not 422)."""


# --------------------------------------------------------------------------------------------------------------
# sources and error mapping


def load_source(src: Source, kind: str) -> tuple[str | bytes, str]:
    """``(path or bytes, label for messages)``; a file object is read to its end so it can be opened twice."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise MediaError(f"{kind} input is zero-length (0 bytes)")
        return data, f"<{len(data)} bytes>"
    if hasattr(src, "read"):
        data = src.read()
        if not isinstance(data, (bytes, bytearray)):
            raise MediaError(f"{kind} file object must be opened in binary mode")
        if not data:
            raise MediaError(f"{kind} input is zero-length (0 bytes)")
        return bytes(data), f"<{len(data)} bytes from {getattr(src, 'name', 'a file object')!r}>"
    try:
        path = os.fspath(src)
    except TypeError:
        raise MediaError(
            f"{kind} source must be a path, bytes or a binary file object, got {type(src).__name__}"
        ) from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not os.path.isfile(path):
        raise MediaError(f"{kind} file not found: {path!r}")
    if os.path.getsize(path) == 0:
        raise MediaError(f"{kind} file is zero-length (0 bytes): {path!r}")
    return path, repr(path)


def av_open(data: str | bytes):
    return av.open(data if isinstance(data, str) else io.BytesIO(data), mode="r")


class wrap_errors:
    """Turn PyAV/Pillow/OS failures inside the block into :class:`MediaError` naming ``kind`` and ``label``."""

    def __init__(self, kind: str, label: str, action: str = "decode"):
        self.kind, self.label, self.action = kind, label, action

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, MediaError):
            return False
        if isinstance(exc, (av.FFmpegError, OSError, EOFError, SyntaxError, ValueError, struct.error)):
            what = "unreadable container or corrupt data" if self.action == "decode" else "encoder failure"
            raise MediaError(f"could not {self.action} {self.kind} {self.label} ({what}): {exc}") from exc
        return False


def _release_traceback(error: BaseException | None) -> None:
    """Clear the locals of every frame a failure (and the failures chained to it) went through."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def releases_on_failure(function):
    """Raise a decoder's :class:`MediaError` as a fresh one of the same type carrying the message only.

    A traceback references every frame the failure went through, and with them the decoded pixels or samples, the
    container and FFmpeg's decoder threads; a server that keeps the exception (a job's future) or a reference cycle
    through it would keep all of that alive. The frames are cleared and the error re-raised outside the ``except``
    block, so it chains to nothing. Other exceptions (``MemoryError``, ``KeyboardInterrupt``) propagate as they are,
    their frames cleared the same way.
    """

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        failure = None
        try:
            return function(*args, **kwargs)
        except MediaError as error:
            failure = type(error), str(error)  # the type says which constraint (TooManyFrames), not the text
            _release_traceback(error)
        except BaseException as error:
            _release_traceback(error.__cause__)
            _release_traceback(error.__context__)
            traceback.clear_frames(error.__traceback__)
            raise
        kind, message = failure
        raise kind(message)

    return wrapper


def check_pixels(kind: str, label: str, width: int, height: int, max_pixels: int | None) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"{kind} {label} has no pixels ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(
            f"{kind} {label} is {width}x{height} = {width * height} pixels, over the limit of max_pixels={max_pixels}"
        )


def to_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array or a torch tensor (any device; bfloat16 widened to float32, exactly)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, duck-typed so torch is never imported here
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.cpu().numpy()
    return np.asarray(x)
