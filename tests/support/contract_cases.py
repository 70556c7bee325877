"""Shared cases for the tests of h3_core.contract: the probe requests of every task.

Shapes follow the tiny H3's stage-split probe requests (64x64 canvas, 124 frames, text width D=64): t2va (1,24,64);
fl2va (1,36,64) + one (1,24,1,4,4) keyframe; ref2va (1,43,64) + a (1,24,1,4,6) image + a (240,32) audio;
ref2va+video adds a (1,24,7,4,4) video reference with a soundtrack. (The probe's soundtrack was 0.92 s = 37
latents, under the contract's 80-latent floor, so the soundtrack here is 3 s like the audio reference.)
"""

import json

import pytest
import safetensors.torch as st
import torch

from h3_core.contract import CHECKSUM_KEY, HEADER_KEY, ContractError, H3Conditioning, H3Reference
from h3_core.contract.wire import checksum_of

H = W = 64
NF = 124
D = 64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _tags(length, zeros=0, start=3):
    tags = torch.ones(length, dtype=torch.int64)
    tags[start:start + zeros] = 0
    return tags


def _kwargs(kind, prompt_dtype=torch.float32):
    """Constructor kwargs for one of the probe requests."""
    if kind == "t2va":
        return dict(task="t2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 24, D, seed=1, dtype=prompt_dtype), text_token_tags=_tags(24))
    if kind == "fl2va":
        return dict(task="fl2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 36, D, seed=2, dtype=prompt_dtype), text_token_tags=_tags(36, 6),
                    condition_latents=[_randn(1, 24, 1, 4, 4, seed=3)], keyframe_anchors=("first",))
    if kind == "fl2va_both":
        return dict(task="fl2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 48, D, seed=4, dtype=prompt_dtype), text_token_tags=_tags(48, 12),
                    condition_latents=[_randn(1, 24, 1, 4, 4, seed=5), _randn(1, 24, 1, 4, 4, seed=6)],
                    keyframe_anchors=("first", "last"))
    if kind == "fl2va_last":
        return dict(task="fl2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 36, D, seed=7, dtype=prompt_dtype), text_token_tags=_tags(36, 6),
                    condition_latents=[_randn(1, 24, 1, 4, 4, seed=8)], keyframe_anchors=("last",))
    if kind == "ref2va":
        return dict(task="ref2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 43, D, seed=9, dtype=prompt_dtype), text_token_tags=_tags(43, 8),
                    condition_latents=[_randn(1, 24, 1, 4, 6, seed=10)],
                    audio_condition_latents=[_randn(240, 32, seed=11)],
                    references=[H3Reference("image", False), H3Reference("audio", True)],
                    metadata={"model": "tiny-minimax-h3", "pack": "0.1"})
    if kind == "ref2va_video":
        return dict(task="ref2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 66, D, seed=12, dtype=prompt_dtype), text_token_tags=_tags(66, 14),
                    condition_latents=[_randn(1, 24, 1, 4, 6, seed=13), _randn(1, 24, 7, 4, 4, seed=14)],
                    audio_condition_latents=[_randn(240, 32, seed=15), _randn(240, 32, seed=16)],
                    references=[("image", False), ("audio", True), ("video", True)])
    if kind == "ref2va_silent_video":
        return dict(task="ref2va", height=H, width=W, num_frames=NF,
                    prompt_embeds=_randn(1, 40, D, seed=17, dtype=prompt_dtype), text_token_tags=_tags(40, 10),
                    condition_latents=[_randn(1, 24, 2, 6, 4, seed=18)], references=[{"kind": "video",
                                                                                      "has_audio": False}])
    raise KeyError(kind)


KINDS = ["t2va", "fl2va", "fl2va_both", "fl2va_last", "ref2va", "ref2va_video", "ref2va_silent_video"]


def make(kind="t2va", prompt_dtype=torch.float32, **changes):
    kwargs = _kwargs(kind, prompt_dtype)
    kwargs.update(changes)
    return H3Conditioning(**kwargs)


def _st_metadata(data):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["__metadata__"]


def _st_header(data):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), 8 + n


def _retamper(data, edit_header=None, edit_tensors=None, seal=True):
    """Re-serialise a payload with an edited contract header and/or tensor dict, re-sealed with a matching
    checksum (a self-consistent hostile payload) unless `seal=False`."""
    header = json.loads(_st_metadata(data)[HEADER_KEY])
    tensors = {k: v.clone() for k, v in st.load(data).items()}
    if edit_header:
        edit_header(header)
    if edit_tensors:
        edit_tensors(tensors)
    text = json.dumps(header)
    unsealed = st.save(tensors, metadata={HEADER_KEY: text})
    if not seal:
        return unsealed
    table, start = _st_header(unsealed)
    table.pop("__metadata__")
    return st.save(tensors, metadata={HEADER_KEY: text, CHECKSUM_KEY: checksum_of(text, table, unsealed[start:])})


def expect_contract_error(read, data, fragment, kind=ContractError, field="payload"):
    """`read(data)` raises `kind` on `field`, naming `fragment`; returns the error for further checks."""
    with pytest.raises(kind) as info:
        read(data)
    assert info.value.field == field
    assert fragment in str(info.value), str(info.value)
    return info.value
