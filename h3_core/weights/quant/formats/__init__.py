"""The built-in quantised layer formats, one `LayerFormat` class each (see `quant.layer_format`).

`BUILT_IN` is the registration list `quant.layouts` reads: adding a format is one class in a module here and
one entry below. The order is the order refusals list the supported formats in.
"""

from __future__ import annotations

from .fp8 import Float8E4M3
from .gguf import GGUF
from .int8 import Int8Tensorwise
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4
from .w4a8 import AsymW4A8Int8

BUILT_IN = (Int8Tensorwise, Float8E4M3, AsymW4A8Int8, NVFP4, MXFP8, GGUF)

__all__ = ["BUILT_IN", "GGUF", "MXFP8", "NVFP4", "AsymW4A8Int8", "Float8E4M3", "Int8Tensorwise"]
