"""Streamed tiled decode of the video VAE: diffusers' decoder run tile by tile, each finished frame handed on at once.

diffusers' `AutoencoderKLMiniMaxH3.decode` keeps every decoded tile of a temporal clip until it blends and
concatenates them into a canvas-sized clip, keeps every clip in a list, concatenates those, and the pipeline's decode
step then makes further whole-video copies (de-normalisation, clamp, stack): several buffers the size of the video.
Its peak memory therefore grows with the canvas and the length, although each decoder call only sees one tile.

`decode_video` runs the very same modules on the very same tiles and applies the very same arithmetic (diffusers'
own `_blend` for the spatial and temporal cross-fades, then the decode step's `x.float() * std + mean` and clamp),
but as soon as a tile's pixels are final it writes them into a buffer the caller's `FrameSink` provides and forgets
them. Every operation is element-wise on the same values in the same order, so the frames are bit-identical to
diffusers' decode (tests/test_vae_stream.py checks it in float32 on several tiles and clips).

A frame is final only after the last tile of its clip, and the decoder makes all of a tile's frames in one call. So
besides one tile's work (the same at every canvas) the decode holds, per canvas pixel:

* the clip's output frames, waiting in the sink for its last tile (the last clip's 5 tail frames with them: 22
  frames, 66 bytes a pixel as uint8);
* the raw overlap strips the next row of tiles and the next tile blend with (diffusers blends with the tiles *before*
  they were blended themselves), only for frames that reach an output: one block for the row, two for the left strip;
* for a clip that another clip follows, its 5 tail frames in the decoder's dtype (60 bytes a pixel in float32): the
  next clip's first frames cross-fade with them. The last clip's tail frames go to the sink with its other frames.

Every buffer that outlives a tile is one block, allocated before the first decoder call (so the decoder's
short-lived tensors do not fragment the heap around it), and the latents are de-normalised tile by tile (the same
element-wise steps), so nothing the size of the latent video is copied either. With the released decoder (a ViT
2048 features wide) one tile's work is far larger than these buffers; with the embedded tiny one (32 wide) they
dominate the peak (`bench/vae_wide.py` measures both on this code).

Where frames go is the sink's business:

* `TensorSink`: one preallocated float32 `[F, H, W, 3]` video (what ComfyUI's IMAGE output and `Decoded.video`
  are): the peak is that video plus the decode's working set, never a second copy of it;
* `WriterSink`: one reusable uint8 buffer handed to a frame writer (the mp4 encoder) after each clip, so the
  decoded video never exists in memory at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import diffusers_adapter, facts, progress
from .progress import check_cancel


class VaeStreamError(ValueError):
    """A latent or a VAE the streamed decode cannot take (named constraint)."""


@dataclass(frozen=True)
class DecodePlan:
    """The geometry of one decode, as diffusers' `_decode` / `_decode_clip` lay it out (computed before any work)."""

    frames: int  # output frames, after the trailing pad frames are cut
    height: int
    width: int
    chunks: int  # temporal clips, each one decoder call per spatial tile
    chunk_tokens: int  # latent frames a clip advances by
    clip_tokens: int  # latent frames one clip decodes (its chunk plus the overlap the token drop left)
    pad_tokens: int  # latent frames repeated at the end to fill the last chunk
    pre: int  # leading pixel frames of each chunk that belong to no output frame
    kept: int  # output frames each clip contributes
    tail: int  # frames after the chunk a clip decodes, cross-faded into the next clip's first ones
    ys: tuple[tuple[int, int, int], ...]  # (start px, length px, overlap with the next tile px) down the canvas
    xs: tuple[tuple[int, int, int], ...]  # the same across

    @property
    def tiles_per_clip(self) -> int:
        return len(self.ys) * len(self.xs)

    @property
    def decoder_calls(self) -> int:
        return self.chunks * self.tiles_per_clip

    def clip_frames(self, c: int) -> int:
        """Output frames clip `c` hands over: its kept frames; the last one also its tail (nothing follows to
        cross-fade with), less the frames of the repeated pad latents."""
        return self.kept if c < self.chunks - 1 else self.frames - c * self.kept


def plan(vae, latent_shape) -> DecodePlan:
    """How `vae` decodes a latent of `latent_shape` `[1, C, T, h, w]`: clips, tiles and the output frame count."""
    if len(latent_shape) != 5 or int(latent_shape[0]) != 1:
        raise VaeStreamError("the video latent must be [1, channels, frames, height, width], got "
                             f"{tuple(latent_shape)}")
    tokens, h_lat, w_lat = (int(v) for v in latent_shape[2:])
    if tokens < 1 or h_lat < 1 or w_lat < 1:
        raise VaeStreamError(f"the video latent is empty: {tuple(latent_shape)}")
    chunk, drop, t_ratio = int(vae.tokens_chunk_size), int(vae.config.token_drop), int(vae.temporal_compression_ratio)
    pre, ratio = int(vae.frame_pre_padding), int(vae.spatial_compression_ratio)
    num_tokens = tokens + drop
    pad = (-num_tokens) % chunk
    chunks = (num_tokens + pad) // chunk - int(drop > 0)
    if chunks < 1:
        # Too few latent frames for one chunk (T = 2: the 5-frame clip text to image makes). diffusers' decode has no
        # chunk for it; ComfyUI core's decode (comfy/ldm/minimax/vae.py `_decode_temporal_chunks`) pads one more
        # chunk of the last latent frame and cuts its frames off again: the same here.
        pad += chunk
        chunks += 1
    clip_tokens = chunk + int(vae.token_overlap) if drop else chunk
    chunk_frames = chunk * t_ratio
    kept = chunk_frames - pre
    tail = max(clip_tokens * t_ratio - chunk_frames - pre, 0) if drop else 0
    pad_frames = 0
    if pad:  # diffusers' rule: a chunk's last latent frame covers clip_length % t_ratio frames, the others t_ratio
        intra_tail = int(vae.config.clip_length) % t_ratio
        pad_frames = sum(intra_tail if intra_tail and (tokens + k) % chunk == 0 else t_ratio for k in range(pad))
    height, width = h_lat * ratio, w_lat * ratio
    return DecodePlan(
        frames=chunks * kept + tail - pad_frames, height=height, width=width, chunks=chunks, chunk_tokens=chunk,
        clip_tokens=clip_tokens, pad_tokens=pad, pre=pre, kept=kept, tail=tail,
        ys=_tiles(vae, height, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height),
        xs=_tiles(vae, width, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width),
    )


def _tiles(vae, length: int, size: int, overlap: int) -> tuple[tuple[int, int, int], ...]:
    if not vae.use_tiling:
        return ((0, length, 0),)
    starts, lengths, overlaps = diffusers_adapter.vae_split_tiles(vae, length, size, overlap)
    return tuple(zip(starts, lengths, [*overlaps, 0], strict=True))


# --- where frames go ----------------------------------------------------------------------------------------------


class FrameSink:
    """Receives decoded frames clip by clip: `buffer(start, count)` gives the `[count, H, W, 3]` CPU tensor (float32
    in 0..1, or uint8) the decode fills tile by tile; `commit(start, count)` says those frames are final."""

    def open(self, plan: DecodePlan) -> None:
        """Called once before the first clip, with the whole decode's geometry."""

    def buffer(self, start: int, count: int) -> torch.Tensor:
        raise NotImplementedError

    def commit(self, start: int, count: int) -> None:
        """The frames `[start, start + count)` of the buffer last handed out are final."""


class TensorSink(FrameSink):
    """Everything into one preallocated float32 `[F, H, W, 3]` video (`.video` once the decode returned)."""

    def __init__(self):
        self.video: torch.Tensor | None = None

    def open(self, plan: DecodePlan) -> None:
        self.video = torch.empty(plan.frames, plan.height, plan.width, 3, dtype=torch.float32)

    def buffer(self, start: int, count: int) -> torch.Tensor:
        return self.video[start: start + count]


class WriterSink(FrameSink):
    """Each finished run of frames as uint8 `[n, H, W, 3]` (numpy, rounded as `media.frames_to_uint8` rounds) to
    `write`; one buffer, as large as the largest hand-over, reused."""

    def __init__(self, write: Callable[[np.ndarray], None]):
        self.write, self._frames, self._size = write, None, (0, 0)

    def open(self, plan: DecodePlan) -> None:
        self._frames, self._size = None, (plan.height, plan.width)

    def buffer(self, start: int, count: int) -> torch.Tensor:
        if self._frames is None or self._frames.shape[0] < count:
            self._frames = None  # the smaller one goes before the larger one is allocated
            self._frames = torch.empty(count, *self._size, 3, dtype=torch.uint8)
        return self._frames[:count]

    def commit(self, start: int, count: int) -> None:
        self.write(self._frames[:count].numpy())


# --- the decode ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def decode_video(vae, latents: torch.Tensor, sink: FrameSink, *, cancel: threading.Event | None = None) -> DecodePlan:
    """Decode normalised video latents `[1, 24, T, h, w]` (the sampler's output) into `sink`, clip by clip.

    The frames equal diffusers' decode step (`latents * std + mean`, `vae.decode`, `x.float() * pixel_std +
    pixel_mean`, clamp to [0, 1]) bit for bit. Reports the `decode_video` progress phase per tile and checks
    `cancel` between tiles. Returns the plan (frame count and geometry)."""
    geometry = plan(vae, latents.shape)
    device = latents.device
    latents_mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    latents_std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    diffusers_adapter.run_offload_hook(vae)  # what diffusers' `apply_forward_hook` on `vae.decode` does first
    source = (latents, latents_std, latents_mean, diffusers_adapter.parameter_dtype(vae.post_quant_conv))
    pixel_mean = torch.tensor(facts.PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
    pixel_std = torch.tensor(facts.PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
    sink.open(geometry)
    counter = progress.Counter("decode_video", geometry.decoder_calls) if progress.active() else None
    _Decode(vae, source, geometry, sink, (pixel_mean, pixel_std), counter, cancel).run()
    return geometry


class _Stitch:
    """diffusers' `_stitch_tiles` for one run of frames, tile by tile in row order: each tile is blended in place with
    the raw bottom strip of the tile above and the raw right strip of the tile to the left (diffusers blends with the
    tiles *before* they were blended themselves), and keeps its own for the tiles that follow: one block for the row
    of bottom strips, two for the right strips (this tile's and the one to its left)."""

    def __init__(self, g: DecodePlan, frames: int, dtype, device):
        y_ov, width = max(ov for _, _, ov in g.ys), sum(length for _, length, _ in g.xs)
        x_ov, y_len = max(ov for _, _, ov in g.xs), max(length for _, length, _ in g.ys)
        self.g, self.x_at = g, [sum(length for _, length, _ in g.xs[:j]) for j in range(len(g.xs))]
        self.strips = torch.empty(1, 3, frames, y_ov, width, dtype=dtype, device=device) if y_ov else None
        self.lefts = [torch.empty(1, 3, frames, y_len, x_ov, dtype=dtype, device=device) for _ in range(2)]

    def __call__(self, vae, tile: torch.Tensor, i: int, j: int) -> torch.Tensor:
        """`tile` `[1, 3, n, h, w]` blended in place; returns the part of it that is final (no overlap with the tiles
        below and to the right)."""
        g, n = self.g, slice(0, tile.shape[2])
        y_ov, x_ov, above_ov = g.ys[i][2], g.xs[j][2], g.ys[i - 1][2] if i else 0
        lefts = [left[:, :, n] for left in self.lefts]
        if j < len(g.xs) - 1:
            lefts[j % 2][..., : tile.shape[-2], :x_ov].copy_(tile[..., -x_ov:])
        bottom = None
        if i < len(g.ys) - 1:
            bottom = tile[..., -y_ov:, :]
            if above_ov + y_ov > tile.shape[-2]:  # the blend from above reaches into it: copy it first
                bottom = bottom.clone()
        strip = None if self.strips is None else self.strips[:, :, n, :, self.x_at[j]: self.x_at[j] + g.xs[j][1]]
        if i > 0:
            _blend_into(vae, strip[..., :above_ov, :], tile, above_ov, dim=-2)
        if bottom is not None:
            strip[..., :y_ov, :].copy_(bottom)
        if j > 0:
            x_prev = g.xs[j - 1][2]
            _blend_into(vae, lefts[(j - 1) % 2][..., : tile.shape[-2], :x_prev], tile, x_prev, dim=-1)
        return tile[..., : tile.shape[-2] - y_ov, : tile.shape[-1] - x_ov]


class _Decode:
    """One decode's state: the stitching, the tail frames, and where frames go.

    Each clip is decoded tile by tile in row order; every tile gives all of the clip's frames at once. Every buffer
    that outlives one tile is allocated once per decode, before the first decoder call (one block each, so the
    decoder's short-lived tensors do not fragment the heap around it), and holds only frames that reach an output:
    a clip's kept frames, then the tail frames after its chunk."""

    def __init__(self, vae, source, geometry: DecodePlan, sink: FrameSink, pixels, counter, cancel):
        self.vae, self.source, self.g, self.sink, self.pixels = vae, source, geometry, sink, pixels
        self.counter, self.cancel = counter, cancel
        self.t_ratio = int(vae.temporal_compression_ratio)
        self.chunk_frames = geometry.chunk_tokens * self.t_ratio
        # The previous clip's tail (raw decoder output, spatially blended), overwritten region by region with this
        # clip's tail right after that region's head frames were cross-faded with it. Only a clip that another clip
        # follows keeps its tail; the last clip's tail frames go to the sink with its kept frames.
        self.tails: torch.Tensor | None = None
        self.stitch: _Stitch | None = None

    def run(self) -> None:
        g = self.g
        used = [self._used(c, g.clip_frames(c)) for c in range(g.chunks)]
        self._allocate(max(len(u) for u in used))
        for c in range(g.chunks):
            self._clip(c, used[c])

    def _allocate(self, most: int) -> None:
        """Every buffer that lives across tiles, before the first decoder call (while the heap is still tidy: freed
        decoder work would otherwise sit around buffers placed among it)."""
        g = self.g
        dtype = diffusers_adapter.parameter_dtype(self.vae.decoder)
        device = self.source[0].device
        self.stitch = _Stitch(g, most, dtype, device)
        if g.chunks > 1 and g.tail:
            self.tails = torch.empty(1, 3, g.tail, g.height, g.width, dtype=dtype, device=device)

    def _used(self, c: int, count: int) -> list[int]:
        """The decoded frames of clip `c` that reach an output or the next clip: its head, then its tail."""
        g, cf = self.g, self.chunk_frames
        tail = max(count - g.kept, 0) if c == g.chunks - 1 else g.tail
        return [*range(g.pre, cf), *range(cf + g.pre, cf + g.pre + tail)]

    def _tile(self, c: int, i: int, j: int, used: list[int]) -> torch.Tensor:
        """The decoded frames `used` of tile (i, j) of clip `c`: `[1, 3, len(used), h, w]`."""
        g, vae = self.g, self.vae
        ratio = int(vae.spatial_compression_ratio)
        (y0, y_len, _), (x0, x_len, _) = g.ys[i], g.xs[j]
        # diffusers de-normalises the whole latent, casts it, repeats its last frame `pad_tokens` times and cuts
        # clips and tiles from that; the same element-wise steps on this tile's part of it give the same values
        latents, std, mean, dtype = self.source
        t0 = c * g.chunk_tokens
        frames = torch.arange(t0, t0 + g.clip_tokens).clamp_(max=latents.shape[2] - 1).to(latents.device)
        part = latents[..., y0 // ratio: (y0 + y_len) // ratio, x0 // ratio: (x0 + x_len) // ratio]
        tile_z = (part.index_select(2, frames) * std + mean).to(dtype)
        tile = vae.decoder(vae.post_quant_conv(tile_z))
        if self.counter is not None:
            self.counter.advance()
        if tile.shape[2] <= used[-1]:
            raise RuntimeError(f"the VAE decoder returned {tile.shape[2]} frames for a clip; the decode plan expected "
                               "more (unsupported VAE geometry)")
        return tile.index_select(2, torch.tensor(used, device=tile.device))

    def _clip(self, c: int, used: list[int]) -> None:
        g, vae, cf = self.g, self.vae, self.chunk_frames
        last_clip = c == g.chunks - 1
        n_head = sum(d < cf for d in used)
        count = g.clip_frames(c)
        emitted = sum(d - g.pre < count for d in used[:n_head])  # head frames that are output frames
        outs = emitted + (len(used) - n_head if last_clip else 0)
        out_start = c * g.kept
        target = self.sink.buffer(out_start, outs) if outs else None
        fade = c > 0 and g.tail and n_head  # diffusers' _decode: cross-fade with the previous clip's tail
        y_out = 0
        for i in range(len(g.ys)):
            x_out = 0
            for j in range(len(g.xs)):
                check_cancel(self.cancel, f"while decoding video clip {c + 1} of {g.chunks}")
                tile = self._stitched(self._tile(c, i, j, used), i, j)
                h, w = tile.shape[-2], tile.shape[-1]
                region = (Ellipsis, slice(y_out, y_out + h), slice(x_out, x_out + w))
                head, after = tile[:, :, :n_head], tile[:, :, n_head:]
                if fade:
                    _blend_into(vae, self.tails[region], head, vae.frame_overlap, dim=-3)
                if emitted:
                    self._emit(head[:, :, :emitted], target, 0, y_out, x_out)
                if after.shape[2] and last_clip:  # the last clip's tail frames are output frames too
                    self._emit(after, target, g.kept, y_out, x_out)
                elif after.shape[2]:  # keep the tail for the next clip
                    if self.tails.dtype != tile.dtype:  # never a silent cast
                        self.tails = torch.empty(1, 3, g.tail, g.height, g.width, dtype=tile.dtype, device=tile.device)
                    self.tails[region] = after
                del tile, head, after
                x_out += w
            y_out += h
        if outs:
            self.sink.commit(out_start, outs)

    def _stitched(self, tile: torch.Tensor, i: int, j: int) -> torch.Tensor:
        if self.stitch.lefts[0].dtype != tile.dtype:  # never a silent cast
            self.stitch = _Stitch(self.g, self.stitch.lefts[0].shape[2], tile.dtype, tile.device)
        return self.stitch(self.vae, tile, i, j)

    def _emit(self, frames: torch.Tensor, target: torch.Tensor, first: int, y: int, x: int) -> None:
        """Decoder-space frames `[1, 3, n, h, w]` -> the decode step's pixels, into `target[first.., y.., x..]`: the
        decode step's `x.float() * std + mean` and clamp (in place on one temporary: the same operations, the same
        values)."""
        pixel_mean, pixel_std = self.pixels
        values = frames.float() * pixel_std
        values.add_(pixel_mean).clamp_(0, 1)
        if target.dtype == torch.uint8:  # media.frames_to_uint8's rounding: (x * 255).round().clip(0, 255)
            values.mul_(255.0).round_().clamp_(0, 255)
        values = values[0].permute(1, 2, 3, 0)
        target[first: first + values.shape[0], y: y + values.shape[1], x: x + values.shape[2]].copy_(values)


def _blend_into(vae, a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> None:
    """diffusers' `_blend(a, b, extent, dim)` written over `b`'s first `extent` slices in place (its cross-fade on
    exactly those slices, so the same values; `b`'s other slices are what `_blend` concatenates unchanged)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return
    head = b.narrow(dim, 0, extent)
    head.copy_(diffusers_adapter.vae_blend(vae, a.narrow(dim, a.shape[dim] - extent, extent), head, extent, dim))
