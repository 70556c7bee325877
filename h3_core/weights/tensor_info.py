"""One tensor as a checkpoint's header describes it (safetensors or GGUF): the record every header reader returns.

Its own module so the readers (`headers`, `gguf_file`) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..safetensors_header import DTYPES


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    dtype: str
    shape: tuple[int, ...]
    file: str
    # GGUF files only (`gguf_file`): the GGML type, the absolute data offset, and the dense shape a
    # block-quantised tensor stands for (`shape` is then that of its U8 bytes).
    ggml_type: str | None = None
    offset: int | None = None
    dense_shape: tuple[int, ...] | None = None
    # A tensor the file stores as several dense tensors, stacked on `gguf_llama_names.TEMPORAL_DIM` when read
    # (llama.cpp's mmproj splits the Conv3D patch kernel in two Conv2D kernels).
    parts: tuple["TensorInfo", ...] = ()

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        torch_dtype = DTYPES.get(self.dtype)
        itemsize = torch_dtype.itemsize if torch_dtype is not None else 1
        return numel * itemsize
