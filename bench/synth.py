"""Synthetic conditionings at the real H3 width (Qwen3-VL layer-50 states: 5120 wide, bf16)."""

from __future__ import annotations

REAL_TEXT_DIM = 5120
BYTES_PER_TOKEN = REAL_TEXT_DIM * 2 + 8  # bf16 hidden state + int64 tag

# Contract sizes named in the issue: ~0.2 MB (a short prompt), ~10 MB, ~70 MB (the 6,883-token presentation of a
# one-image Ref2VA request logged on GB10; docs/ARCHITECTURE.md §9).
SIZES = {"0.2MB": 20, "10MB": 977, "70MB": 6883}


def synth_conditioning(tokens: int, width: int = 1344, height: int = 768, num_frames: int = 124,
                       text_dim: int = REAL_TEXT_DIM, metadata: dict | None = None, seed: int = 0):
    """A valid t2va H3Conditioning with `tokens` random bf16 rows (incompressible, like real hidden states)."""
    import torch

    from h3_core.contract import H3Conditioning

    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, tokens, text_dim, generator=generator).to(torch.bfloat16)
    tags = torch.ones(tokens, dtype=torch.int64)
    tags[: tokens // 2] = 0  # vision-block rows first, as a reference presentation has them
    return H3Conditioning(task="t2va", height=height, width=width, num_frames=num_frames, prompt_embeds=embeds,
                          text_token_tags=tags, metadata=dict(metadata or {}))


def raw_tensor_bytes(cond) -> int:
    tensors = [cond.prompt_embeds, cond.text_token_tags, *cond.condition_latents, *cond.audio_condition_latents]
    return sum(t.numel() * t.element_size() for t in tensors)
