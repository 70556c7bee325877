"""Streamed tiled decode of the video VAE: diffusers' decoder run tile by tile, each finished frame handed on at once.

diffusers' `AutoencoderKLMiniMaxH3.decode` keeps every decoded tile of a temporal clip until it blends and
concatenates them into a canvas-sized clip, keeps every clip in a list, concatenates those, and the pipeline's decode
step then makes further whole-video copies (de-normalisation, clamp, stack): several buffers the size of the video.
Its peak memory therefore grows with the canvas and the length, although each decoder call only sees one tile.

`decode_video` runs the very same modules on the very same tiles and applies the very same arithmetic (diffusers'
own `_blend` for the spatial and temporal cross-fades, then the decode step's `x.float() * std + mean` and clamp),
but as soon as a tile's pixels are final it writes them into a buffer the caller's `FrameSink` provides and forgets
them. Every operation is element-wise on the same values in the same order, so the frames are bit-identical to
diffusers' decode (tests/test_vae_stream.py checks it in float32 on several tiles and clips, both ways below).

A frame is final only after the last tile of its clip, and the decoder makes all of a tile's frames in one call. So
besides one tile's work (the same at every canvas) the decode holds, per canvas pixel:

* the frames not yet handed over. Stitching decoder pixels (any decoder), a whole clip's output frames wait in the
  sink (the last clip's 5 tail frames with them: 22 frames, 66 bytes a pixel as uint8). When the decoder's tokens are
  smaller than the pixels they expand into (`vae_tokens`: the tiny H3's ViT decoder, 32 features for 3072 pixel
  values; not the released one's), the tiles' tokens are kept instead (a 22-frame clip: about 6 bytes a pixel, tile
  overlaps included) and frames are made and handed over one at a time (3 bytes a pixel as uint8);
* the raw overlap strips the next row of tiles and the next tile blend with (diffusers blends with the tiles *before*
  they were blended themselves), only for the frames being made: one block for the row, two for the left strip;
* for a clip that another clip follows, what its 5 tail frames need, since the next clip's first frames cross-fade
  with them: stitching pixels, the tail frames themselves in the decoder's dtype (60 bytes a pixel in float32);
  keeping tokens, that clip's tokens, from which its tail is made (and stitched) again when the next clip needs it.
  The last clip's tail frames go to the sink with its other frames.

Every buffer that outlives a tile is one block, allocated before the first decoder call (so the decoder's
short-lived tensors do not fragment the heap around it), and the latents are de-normalised tile by tile (the same
element-wise steps), so nothing the size of the latent video is copied either.

Where frames go is the sink's business:

* `TensorSink`: one preallocated float32 `[F, H, W, 3]` video (what ComfyUI's IMAGE output and `Decoded.video`
  are): the peak is that video plus the decode's working set, never a second copy of it;
* `WriterSink`: one reusable uint8 buffer handed to a frame writer (the mp4 encoder) after each clip or frame, so the
  decoded video never exists in memory at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import diffusers_adapter, facts, progress, vae_tokens
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
        raise VaeStreamError(f"a video latent of {tokens} frames is shorter than one decode chunk")
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
def decode_video(vae, latents: torch.Tensor, sink: FrameSink, *, cancel: threading.Event | None = None,
                 token_cache: bool | None = None) -> DecodePlan:
    """Decode normalised video latents `[1, 24, T, h, w]` (the sampler's output) into `sink`, clip by clip.

    The frames equal diffusers' decode step (`latents * std + mean`, `vae.decode`, `x.float() * pixel_std +
    pixel_mean`, clamp to [0, 1]) bit for bit. Reports the `decode_video` progress phase per tile and checks
    `cancel` between tiles. `token_cache`: keep the tiles' decoder tokens and hand frames over one at a time
    (`vae_tokens`); None: in float32 on CPU when the decoder's tokens are smaller than the pixels they make.
    Returns the plan (frame count and geometry)."""
    geometry = plan(vae, latents.shape)
    device = latents.device
    latents_mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    latents_std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    hook = getattr(vae, "_hf_hook", None)  # what diffusers' `apply_forward_hook` on `vae.decode` does first
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(vae)
    source = (latents, latents_std, latents_mean, diffusers_adapter.parameter_dtype(vae.post_quant_conv))
    pixel_mean = torch.tensor(facts.PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
    pixel_std = torch.tensor(facts.PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
    sink.open(geometry)
    counter = progress.Counter("decode_video", geometry.decoder_calls) if progress.active() else None
    if token_cache is None:  # checked bit for bit in float32 on CPU; other kernels may round a part differently
        token_cache = (splits(vae) and device.type == "cpu"
                       and diffusers_adapter.parameter_dtype(vae.decoder.proj_out) == torch.float32)
    elif token_cache and not splits(vae):
        raise VaeStreamError("this video VAE's decoder cannot be split into tokens and a pixel head")
    _Decode(vae, source, geometry, sink, (pixel_mean, pixel_std), counter, cancel, token_cache).run()
    return geometry


def splits(vae) -> bool:
    """Whether the decode keeps `vae`'s decoder tokens rather than its pixels (`vae_tokens.splittable`, with the
    decoder's patches as large as the VAE's compression)."""
    decoder = vae.decoder
    return (vae_tokens.splittable(decoder) and int(decoder.patch_size) == int(vae.spatial_compression_ratio)
            and int(decoder.patch_size_t) == int(vae.temporal_compression_ratio))


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
    """One decode's state: the stitching, the tail frames or cached tokens, and where frames go.

    A clip is decoded in frame groups: all of it at once when the decoder's pixels are stitched, one frame at a time
    (the first frames a clip cross-fades with the previous tail together) when its tokens are kept (`vae_tokens`).
    Spatial blends are per frame, so each group is stitched on its own. Every buffer that outlives one tile is
    allocated once per decode (one block each, so the decoder's short-lived tensors do not fragment the heap around
    it) and holds only frames that reach an output: a clip's kept frames, then the tail frames after its chunk."""

    def __init__(self, vae, source, geometry: DecodePlan, sink: FrameSink, pixels, counter, cancel, split: bool):
        self.vae, self.source, self.g, self.sink, self.pixels = vae, source, geometry, sink, pixels
        self.counter, self.cancel, self.split = counter, cancel, split
        self.t_ratio = int(vae.temporal_compression_ratio)
        self.chunk_frames = geometry.chunk_tokens * self.t_ratio
        # Stitching pixels: the previous clip's tail (raw decoder output, spatially blended), overwritten region by
        # region with this clip's tail right after that region's head frames were cross-faded with it. Only a clip
        # that another clip follows keeps its tail; the last clip's tail frames go to the sink with its kept frames.
        self.tails: torch.Tensor | None = None
        self.stitch: dict[str, _Stitch] = {}
        # Keeping tokens: a block of the tiles' tokens per clip, two clips' worth: the previous clip's tail frames are
        # made again from its tokens (and stitched on their own) when this clip's first frames cross-fade with them.
        self.blocks: list[torch.Tensor | None] = [None, None]
        self.have: list[set[int]] = [set(), set()]  # the tiles whose tokens each block holds

    def run(self) -> None:
        g, pt = self.g, self.t_ratio
        groups = [self._groups(c, g.clip_frames(c)) for c in range(g.chunks)]
        self.most = max(len(used) for clip in groups for _, _, used in clip)
        # The first group is made while the tiles' transformers run, from their fresh tokens: only the latent frames
        # of the later groups are kept, and of a clip that another clip follows, those of its tail.
        self.keep = [clip[1][0] // pt if len(clip) > 1 else g.clip_tokens for clip in groups]
        if g.tail:
            self.keep[:-1] = [min(k, (self.chunk_frames + g.pre) // pt) for k in self.keep[:-1]]
        self.kept_tokens = g.clip_tokens - min(self.keep)
        self._allocate()
        for c, clip in enumerate(groups):
            self.have[c % 2].clear()
            for start, stop, used in clip:
                self._group(c, start, stop, used)

    def _allocate(self) -> None:
        """Every buffer that lives across tiles, before the first decoder call (while the heap is still tidy: freed
        decoder work would otherwise sit around buffers placed among it)."""
        g, vae = self.g, self.vae
        dtype = diffusers_adapter.parameter_dtype(vae.decoder.proj_out if self.split else vae.decoder)
        device = self.source[0].device
        self.stitch["clip"] = _Stitch(g, self.most, dtype, device)
        if g.chunks > 1 and g.tail and self.split:
            self.stitch["tail"] = _Stitch(g, g.tail, dtype, device)
        elif g.chunks > 1 and g.tail:
            self.tails = torch.empty(1, 3, g.tail, g.height, g.width, dtype=dtype, device=device)
        if self.split and self.kept_tokens:
            ratio, (_, y_len, _), (_, x_len, _) = int(vae.spatial_compression_ratio), g.ys[0], g.xs[0]
            voxels = (y_len // ratio) * (x_len // ratio) * self.kept_tokens
            shape = (len(g.ys) * len(g.xs), 1, voxels, vae.decoder.proj_out.in_features)
            self.blocks = [torch.empty(shape, dtype=dtype, device=device) if k < g.chunks else None for k in range(2)]

    def _groups(self, c: int, count: int) -> list[tuple[int, int, list[int]]]:
        """(first decoded frame, end, the decoded frames from the first that reach an output or the next clip) per
        group."""
        g, pt, cf = self.g, self.t_ratio, self.chunk_frames
        tail = max(count - g.kept, 0) if c == g.chunks - 1 else g.tail
        used = [*range(g.pre, cf), *range(cf + g.pre, cf + g.pre + tail)]
        if not self.split:
            return [(0, g.clip_tokens * pt, used)]
        # one frame a time, but the first frames a clip cross-fades with the previous tail together (the cross-fade's
        # weights depend on how many frames it sees); a tail for the next clip is made again then, not now
        together = min(int(self.vae.frame_overlap), g.kept) if c and g.tail else 1
        groups = [(g.pre, g.pre + together, list(range(together)))]
        later = [d for d in used if d >= g.pre + together and (d - g.pre < count if d < cf else c == g.chunks - 1)]
        return groups + [(d, d + 1, [0]) for d in later]

    def _tile(self, c: int, i: int, j: int, start: int, stop: int, used: list[int]) -> torch.Tensor:
        """The decoded frames `used` (counted from `start`) of tile (i, j) of clip `c`: `[1, 3, len(used), h, w]`."""
        g, vae, pt = self.g, self.vae, self.t_ratio
        ratio = int(vae.spatial_compression_ratio)
        (y0, y_len, _), (x0, x_len, _) = g.ys[i], g.xs[j]
        n, block, grid = i * len(g.xs) + j, c % 2, (y_len // ratio, x_len // ratio)
        if self.split and n in self.have[block]:
            skip = self.keep[c] * pt  # decoded frames before the kept tokens' first latent frame
            tile = vae_tokens.pixels(vae.decoder, self.blocks[block][n], grid, start - skip, stop - skip)
        else:
            # diffusers de-normalises the whole latent, casts it, repeats its last frame `pad_tokens` times and cuts
            # clips and tiles from that; the same element-wise steps on this tile's part of it give the same values
            latents, std, mean, dtype = self.source
            t0 = c * g.chunk_tokens
            frames = torch.arange(t0, t0 + g.clip_tokens).clamp_(max=latents.shape[2] - 1).to(latents.device)
            part = latents[..., y0 // ratio: (y0 + y_len) // ratio, x0 // ratio: (x0 + x_len) // ratio]
            tile_z = (part.index_select(2, frames) * std + mean).to(dtype)
            if self.split:
                fresh = vae_tokens.tokens(vae.decoder, vae.post_quant_conv(tile_z))
                voxels = fresh.shape[1] // g.clip_tokens
                if self.kept_tokens:
                    if self.blocks[block] is None or self.blocks[block].dtype != fresh.dtype:  # (all the same size)
                        self.blocks[block] = fresh.new_empty(len(g.ys) * len(g.xs), 1, self.kept_tokens * voxels,
                                                             fresh.shape[2])
                    kept = fresh[:, self.keep[c] * voxels:]
                    self.blocks[block][n][:, : kept.shape[1]].copy_(kept)
                    self.have[block].add(n)
                tile = vae_tokens.pixels(vae.decoder, fresh, grid, start, stop)
                del fresh
            else:
                tile = vae.decoder(vae.post_quant_conv(tile_z))
            if self.counter is not None:
                self.counter.advance()
        if self.split and len(used) == stop - start:
            return tile
        if tile.shape[2] <= used[-1]:
            raise RuntimeError(f"the VAE decoder returned {tile.shape[2]} frames for a clip; the decode plan expected "
                               "more (unsupported VAE geometry)")
        return tile.index_select(2, torch.tensor(used, device=tile.device))

    def _stitched(self, name: str, frames: int, tile: torch.Tensor, i: int, j: int) -> torch.Tensor:
        if name not in self.stitch or self.stitch[name].lefts[0].dtype != tile.dtype:  # never a silent cast
            self.stitch[name] = _Stitch(self.g, frames, tile.dtype, tile.device)
        return self.stitch[name](self.vae, tile, i, j)

    def _group(self, c: int, start: int, stop: int, used: list[int]) -> None:
        g, vae, cf = self.g, self.vae, self.chunk_frames
        last_clip = c == g.chunks - 1
        decoded = [start + d for d in used]  # frame numbers within the clip's decoded frames
        n_head = sum(d < cf for d in decoded)
        head0 = decoded[0] - g.pre  # kept-frame number of the first head frame
        tail0 = decoded[n_head] - cf - g.pre if n_head < len(decoded) else 0
        outs = [d - g.pre for d in decoded[:n_head] if d - g.pre < g.clip_frames(c)]
        if last_clip:
            outs += [g.kept + tail0 + k for k in range(len(decoded) - n_head)]
        out_start = c * g.kept + (outs[0] if outs else 0)
        target = self.sink.buffer(out_start, len(outs)) if outs else None
        emitted = sum(d - g.pre < g.clip_frames(c) for d in decoded[:n_head])  # head frames output (from the first)
        head_at, tail_at = head0 - (outs[0] if outs else 0), g.kept + tail0 - (outs[0] if outs else 0)
        fade = c > 0 and g.tail and n_head and head0 == 0  # diffusers' _decode: cross-fade with the previous tail
        y_out = 0
        for i in range(len(g.ys)):
            x_out = 0
            for j in range(len(g.xs)):
                check_cancel(self.cancel, f"while decoding video clip {c + 1} of {g.chunks}")
                tile = self._stitched("clip", self.most, self._tile(c, i, j, start, stop, used), i, j)
                h, w = tile.shape[-2], tile.shape[-1]
                region = (Ellipsis, slice(y_out, y_out + h), slice(x_out, x_out + w))
                head, after = tile[:, :, :n_head], tile[:, :, n_head:]
                if fade and self.split:
                    first = cf + g.pre  # the previous clip's tail, made again from its tokens
                    tail = self._tile(c - 1, i, j, first, first + g.tail, list(range(g.tail)))
                    _blend_into(vae, self._stitched("tail", g.tail, tail, i, j), head, vae.frame_overlap, dim=-3)
                elif fade:
                    _blend_into(vae, self.tails[region], head, vae.frame_overlap, dim=-3)
                if emitted:
                    self._emit(head[:, :, :emitted], target, head_at, y_out, x_out)
                if after.shape[2] and last_clip:
                    self._emit(after, target, tail_at, y_out, x_out)
                elif after.shape[2]:  # stitching pixels: keep the tail for the next clip
                    if self.tails.dtype != tile.dtype:  # never a silent cast
                        self.tails = torch.empty(1, 3, g.tail, g.height, g.width, dtype=tile.dtype, device=tile.device)
                    self.tails[:, :, tail0: tail0 + after.shape[2]][region] = after
                del tile, head, after
                x_out += w
            y_out += h
        if outs:
            self.sink.commit(out_start, len(outs))

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
