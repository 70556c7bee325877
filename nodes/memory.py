"""What a node asks ComfyUI to keep free for its own work (`load_models_gpu(memory_required=...)`).

The figure is the planner's activation estimate for this job (h3_core.planner: canvas, frames, tokens, the loaded
model's own widths) with a fifth more for the allocator's fragmentation, plus ComfyUI's own inference minimum
(kernels' workspace). ComfyUI adds --reserve-vram on top, keeps the sum free and streams the weights that no
longer fit; an estimate that is too small would leave weights resident and run out of memory mid-forward.
"""

from __future__ import annotations

import math

import comfy.model_management as mm
import torch

from ..h3_core import planner

MARGIN = 1.2
VISION_PATCH_PX = 32  # Qwen3-VL: 16 px patches merged 2 x 2 into one token
VIDEO_BLOCKS_PER_FRAME = 1 / 24  # references run at 24 fps, read at 2 fps in merged pairs: one block per second


def _request(activations: int) -> int:
    return int(activations * MARGIN) + int(mm.minimum_inference_memory())


def _config(module: torch.nn.Module) -> dict:
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config or {})


def sampling_bytes(cond, module: torch.nn.Module, dtype: torch.dtype) -> int:
    """One DiT forward for this conditioning: its canvas, frames and prompt length, the loaded DiT's widths."""
    activations = planner.activation_bytes(
        width=cond.width, height=cond.height, frames=cond.num_frames,
        text_tokens=int(cond.prompt_embeds.shape[1]), dtype=dtype, component="transformer", config=_config(module),
    )  # fmt: skip
    return _request(activations)


def _image_tokens(width: int, height: int) -> int:
    return math.ceil(width / VISION_PATCH_PX) * math.ceil(height / VISION_PATCH_PX)


def text_tokens(prepared, tokenizer) -> int:
    """The Qwen presentation's length, estimated from above: the prompt's tokens plus one vision block per keyframe
    or reference image and per second of reference video (each block one token per 32 x 32 px), plus labels."""
    tokens = len(tokenizer(prepared.prompt)["input_ids"]) + 64
    for image in prepared.keyframes:
        tokens += _image_tokens(*image.size) + 16
    for ref in prepared.references:
        if getattr(ref, "image", None) is not None:
            tokens += _image_tokens(*ref.image.size) + 16
        frames = getattr(ref, "frames", None)
        if frames is not None and len(frames):
            height, width = frames.shape[1:3] if hasattr(frames, "shape") else frames[0].size[::-1]
            blocks = math.ceil(len(frames) * VIDEO_BLOCKS_PER_FRAME)
            tokens += blocks * (_image_tokens(width, height) + 16)
    return tokens


def text_encoding_bytes(prepared, tokenizer, module: torch.nn.Module, dtype: torch.dtype) -> int:
    """One text-encoder forward over this request's presentation (every layer's hidden state kept, as H3 reads
    layer 50)."""
    activations = planner.activation_bytes(
        width=prepared.width, height=prepared.height, frames=prepared.num_frames,
        text_tokens=text_tokens(prepared, tokenizer), dtype=dtype, component="text_encoder", config=_config(module),
    )  # fmt: skip
    return _request(activations)
