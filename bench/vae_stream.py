"""What would bound tiled VAE decode memory: a streaming re-arrangement of diffusers' own decode (prototype).

diffusers' `AutoencoderKLMiniMaxH3._decode` keeps every decoded tile of a 17-frame clip until `_stitch_tiles`
blends and concatenates them (a canvas-sized clip, plus copies), then keeps every clip in a list and concatenates
those: buffers proportional to the whole video, several times over. `streaming_decode` runs the very same modules
on the very same tiles with the very same (element-wise) blend arithmetic, but as soon as a tile's pixels are final
it cross-fades them in time with the previous clip's tail and writes them straight into one preallocated output.
It holds only: the output, the raw overlap strips the next tiles blend with, and the previous clip's tail frames
(5 of 28). With `out_dtype=torch.uint8` it also quantises per tile (what an mp4 writer consumes), so the float
video never exists.

Float32 output is bit-identical to `vae.decode(z).sample` (checked by tests/test_bench_quick.py and by the bench).
Used only by the benchmark to measure the achievable curve; not part of h3_core.
"""

from __future__ import annotations

import torch


def _tiles(vae, height: int, width: int):
    if not vae.use_tiling:
        return ([0], [height], []), ([0], [width], [])
    return (vae._split_tiles(height, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height),
            vae._split_tiles(width, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width))


@torch.no_grad()
def streaming_decode(vae, z: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`vae.decode(z).sample` (float32), or its uint8 frames round((x/2 + 0.5).clamp(0, 1) * 255), streamed."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    z = z.to(get_parameter_dtype(vae.post_quant_conv))
    chunk_tokens, drop, t_ratio = vae.tokens_chunk_size, vae.config.token_drop, vae.temporal_compression_ratio
    chunk_frames, pre = chunk_tokens * t_ratio, vae.frame_pre_padding
    num_tokens = z.shape[2] + drop
    pad = (-num_tokens) % chunk_tokens
    num_chunks = (num_tokens + pad) // chunk_tokens - int(drop > 0)
    if pad > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
    ratio = vae.spatial_compression_ratio
    b, height, width = z.shape[0], z.shape[-2] * ratio, z.shape[-1] * ratio
    clip_tokens = chunk_tokens + vae.token_overlap if drop else chunk_tokens
    kept = chunk_frames - pre
    tail = max(clip_tokens * t_ratio - chunk_frames - pre, 0) if drop else 0
    total = num_chunks * kept + tail  # frames before the pad trim
    channels = vae.config.out_channels
    out = torch.empty(b, channels, total, height, width, dtype=out_dtype)
    (ys, y_lens, y_ovs), (xs, x_lens, x_ovs) = _tiles(vae, height, width)
    prev_tail = next_tail = None  # float32 [b, C, tail, H, W]: the previous clip's last frames, unblended
    pos = 0

    def put(frames: torch.Tensor, t0: int, y: int, x: int) -> None:
        region = out[:, :, t0: t0 + frames.shape[2], y: y + frames.shape[-2], x: x + frames.shape[-1]]
        if out_dtype == torch.uint8:
            region.copy_((frames / 2 + 0.5).clamp(0, 1).mul(255).round())
        else:
            region.copy_(frames)

    for c in range(num_chunks):
        clip_z = z[:, :, c * chunk_tokens: c * chunk_tokens + clip_tokens]
        if tail:
            next_tail = torch.empty(b, channels, tail, height, width) if next_tail is None else next_tail
        above: list[torch.Tensor | None] = [None] * len(xs)
        y_out = 0
        for i, (i_pos, i_len) in enumerate(zip(ys, y_lens)):
            left, x_out, strips = None, 0, []
            for j, (j_pos, j_len) in enumerate(zip(xs, x_lens)):
                raw = vae.decoder(vae.post_quant_conv(
                    clip_z[..., i_pos // ratio: (i_pos + i_len) // ratio, j_pos // ratio: (j_pos + j_len) // ratio]))
                tile = raw
                if i > 0:
                    tile = vae._blend(above[j], tile, y_ovs[i - 1], dim=-2)  # diffusers' arithmetic, strip as `a`
                if j > 0:
                    tile = vae._blend(left, tile, x_ovs[j - 1], dim=-1)
                strips.append(raw[..., -y_ovs[i]:, :].clone() if i < len(ys) - 1 else None)
                left = raw[..., :, -x_ovs[j]:].clone() if j < len(xs) - 1 else None
                del raw
                if i < len(ys) - 1:
                    tile = tile[..., : -y_ovs[i], :]
                if j < len(xs) - 1:
                    tile = tile[..., :, : -x_ovs[j]]
                h, w = tile.shape[-2], tile.shape[-1]
                head = tile[:, :, :chunk_frames][:, :, pre:]
                if prev_tail is not None:
                    head = vae._blend(prev_tail[..., y_out: y_out + h, x_out: x_out + w], head, vae.frame_overlap,
                                      dim=-3)
                put(head, pos, y_out, x_out)
                if tail:
                    next_tail[..., y_out: y_out + h, x_out: x_out + w] = tile[:, :, chunk_frames:][:, :, pre:]
                x_out += w
                del tile, head
            above = strips
            y_out += h
        pos += kept
        if tail:
            prev_tail, next_tail = next_tail, prev_tail
    if tail:
        put(prev_tail, pos, 0, 0)
        pos += tail
    out = out[:, :, :pos]
    if pad > 0:
        intra_tail = vae.config.clip_length % t_ratio
        before_pad = z.shape[2] - pad
        pad_frames = sum(intra_tail if intra_tail and (before_pad + k) % chunk_tokens == 0 else t_ratio
                         for k in range(pad))
        out = out[:, :, :-pad_frames]
    return out
