"""The video VAE's ViT decoder in two halves: its transformer (once per tile) and its pixel head (per frame group).

diffusers' MiniMax H3 video decoder turns every latent voxel into one token, runs full self-attention over a tile's
tokens, then expands each token on its own (`norm_out`, `proj_out`, unpatchify) into a `patch_size_t x patch_size x
patch_size` block of pixels. The pixel head is per token, so the pixels of any run of latent frames come from those
frames' tokens alone, with the same values whether the head sees all of a tile's tokens or only some (checked bit
for bit by tests/test_vae_stream.py).

When a token is smaller than the uint8 pixels it expands into (a small decoder, like the embedded tiny H3's), the
streamed decode keeps the tokens of a clip's tiles instead of its finished frames and makes and hands over one frame
at a time; with a wide decoder (the released H3's: 2048 float32 features for 3072 uint8 pixel values) it keeps
pixels.
"""

from __future__ import annotations

import torch

from . import diffusers_adapter


class _StopAtHead(Exception):
    """Raised at the pixel head's door to end the decoder's forward early, carrying the transformer's output."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stop before the pixel head")
        self.hidden = hidden


def splittable(decoder) -> bool:
    """True when `decoder` has the ViT layout (transformer, then a per-token `norm_out` and `proj_out`) and one of its
    tokens takes fewer bytes than the uint8 pixel values it expands into."""
    proj, norm = getattr(decoder, "proj_out", None), getattr(decoder, "norm_out", None)
    if not isinstance(proj, torch.nn.Linear) or not isinstance(norm, torch.nn.LayerNorm):
        return False
    if not all(hasattr(decoder, name) for name in ("patch_size", "patch_size_t", "out_channels")):
        return False
    if proj._forward_hooks or proj._forward_pre_hooks or hasattr(proj, "_diffusers_hook"):
        return False  # its weight is not what it multiplies by (layerwise casting, offloading): use it whole only
    if decoder._forward_hooks or hasattr(decoder, "_hf_hook") or torch.nn.modules.module._global_forward_hooks:
        return False  # someone watches the decoder's whole forward (which `tokens` stops early): let it run whole
    dtype = diffusers_adapter.parameter_dtype(proj)
    return proj.in_features * dtype.itemsize < proj.out_features


def tokens(decoder, x: torch.Tensor) -> torch.Tensor:
    """The decoder run on `x` `[1, C, t, h, w]` up to its pixel head: `[1, t * h * w, features]`, the input `proj_out`
    gets (after `norm_out` and the cast to `proj_out`'s dtype), latent voxels only (no register tokens)."""

    def stop(_module, args):
        raise _StopAtHead(args[0])

    handle = decoder.norm_out.register_forward_pre_hook(stop)
    try:
        decoder(x)
    except _StopAtHead as done:
        hidden = done.hidden
    else:
        raise RuntimeError("the video VAE decoder never reached its norm_out (unsupported decoder layout)")
    finally:
        handle.remove()
    voxels = x.shape[2] * x.shape[3] * x.shape[4]
    return decoder.norm_out(hidden[:, :voxels]).to(diffusers_adapter.parameter_dtype(decoder.proj_out))


def pixels(decoder, cached: torch.Tensor, grid: tuple[int, int], start: int, stop: int) -> torch.Tensor:
    """Decoded frames `[start, stop)` of a tile from its `tokens` (latent grid `(h, w)`): `[1, C, stop - start,
    h * patch_size, w * patch_size]`, the decoder's values laid out as it lays them. A latent frame's whole pixel
    block goes through `proj_out` itself; a part of it through the rows of `proj_out`'s weight and bias that make
    those frames (each output value is one row's dot product with the token, so the same value)."""
    h, w = grid
    p, pt, channels = decoder.patch_size, decoder.patch_size_t, decoder.out_channels
    head = decoder.proj_out
    pieces = []
    while start < stop:
        k, t0 = divmod(start, pt)
        t1 = min(pt, t0 + stop - start)
        voxels = cached[:, k * h * w: (k + 1) * h * w]
        if (t0, t1) == (0, pt):
            out = head(voxels)
        else:
            weight = head.weight.view(channels, pt, p * p, -1)[:, t0:t1].reshape(-1, head.in_features)
            bias = None if head.bias is None else head.bias.view(channels, pt, p * p)[:, t0:t1].reshape(-1)
            out = torch.nn.functional.linear(voxels, weight, bias)
        out = out.view(1, h, w, channels, t1 - t0, p, p).permute(0, 3, 4, 1, 5, 2, 6)
        pieces.append(out.reshape(1, channels, t1 - t0, h * p, w * p))
        start += t1 - t0
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
