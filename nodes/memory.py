"""What a node asks ComfyUI to keep free for its own work (`load_models_gpu(memory_required=...)`).

The figure is the planner's activation estimate for this job (h3_core.planning.planner: canvas, frames, tokens, the
loaded model's own widths) with a fifth more for the allocator's fragmentation, plus ComfyUI's own inference minimum
(kernels' workspace). ComfyUI adds --reserve-vram on top, keeps the sum free and streams the weights that no
longer fit; an estimate that is too small would leave weights resident and run out of memory mid-forward.
"""

from __future__ import annotations

import comfy.model_management as mm
import torch

from ..h3_core.planning import planner

MARGIN = 1.2


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
        width=cond.width,
        height=cond.height,
        frames=cond.num_frames,
        text_tokens=int(cond.prompt_embeds.shape[1]),
        dtype=dtype,
        component="transformer",
        config=_config(module),
    )
    return _request(activations)


def text_encoding_bytes(prepared, tokenizer, module: torch.nn.Module, dtype: torch.dtype) -> int:
    """One text-encoder forward over this request's presentation (every layer's hidden state kept, as H3 reads
    layer 50)."""
    activations = planner.activation_bytes(
        width=prepared.width,
        height=prepared.height,
        frames=prepared.num_frames,
        text_tokens=planner.text_tokens(prepared, tokenizer),
        dtype=dtype,
        component="text_encoder",
        config=_config(module),
    )
    return _request(activations)
