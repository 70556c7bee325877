"""Synthetic conditionings at the real H3 width (Qwen3-VL layer-50 states: 5120 wide, bf16)."""

from __future__ import annotations

REAL_TEXT_DIM = 5120
BYTES_PER_TOKEN = REAL_TEXT_DIM * 2 + 8  # bf16 hidden state + int64 tag

# Contract sizes named in the issue: ~0.2 MB (a short prompt), ~10 MB, ~70 MB (the 6,883-token presentation of a
# one-image Ref2VA request logged on GB10; docs/ARCHITECTURE.md §8).
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


# --- the lean wire prototype (bench/wire_server.py lean_server, bench/wire.py lean_fetch) -------------

def lean_header(cond) -> tuple[bytes, list[memoryview]]:
    """JSON header (contract fields + tensor table) and zero-copy views of the tensors, in wire order."""
    import json

    import torch

    from h3_core.safetensors_header import DTYPE_TAGS

    tensors = {"prompt_embeds": cond.prompt_embeds, "text_token_tags": cond.text_token_tags}
    tensors.update({f"condition_latents.{i}": t for i, t in enumerate(cond.condition_latents)})
    tensors.update({f"audio_condition_latents.{i}": t for i, t in enumerate(cond.audio_condition_latents)})
    table, views, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        table[name] = {"dtype": DTYPE_TAGS[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + view.nbytes]}
        views.append(view)
        offset += view.nbytes
    header = {"task": cond.task, "height": cond.height, "width": cond.width, "num_frames": cond.num_frames,
              "keyframe_anchors": list(cond.keyframe_anchors),
              "references": [{"kind": r.kind, "has_audio": r.has_audio} for r in cond.references],
              "metadata": dict(cond.metadata), "tensors": table}
    return json.dumps(header, separators=(",", ":")).encode(), views


def lean_parse(header: dict, buf: bytearray):
    """Tensors viewed straight out of the received buffer (no copy), validated by the contract's constructor."""
    import torch

    from h3_core.contract import H3Conditioning
    from h3_core.safetensors_header import DTYPES

    tensors = {}
    for name, info in header["tensors"].items():
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        t = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin) if end > begin \
            else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"])
    cond = [tensors[k] for k in sorted(tensors) if k.startswith("condition_latents.")]
    audio = [tensors[k] for k in sorted(tensors) if k.startswith("audio_condition_latents.")]
    return H3Conditioning(task=header["task"], height=header["height"], width=header["width"],
                          num_frames=header["num_frames"], prompt_embeds=tensors["prompt_embeds"],
                          text_token_tags=tensors["text_token_tags"], condition_latents=cond,
                          audio_condition_latents=audio, keyframe_anchors=header["keyframe_anchors"],
                          references=header["references"], metadata=header["metadata"])
