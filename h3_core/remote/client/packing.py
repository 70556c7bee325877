"""Client-side packing: an `EncodeRequest` -> the JSON request and the multipart/form-data body.

Images go as PNG and waveforms as float32 WAV (both lossless); videos as lossless mp4 (H.264 RGB at qp 0, or PNG
frames) with the exact frame rate in the JSON and their soundtrack as a separate float32 WAV part, so the server's
`ingest.build_request` rebuilds the same arrays and a remote encode is bit-identical to a local one. Guides (protocol
feature "guides") go the same way: what the encoder anchors of each (one image as PNG, a clip as lossless mp4) and
its audio as float32 WAV, cut to `protocol.GUIDE_AUDIO_SECONDS`.
"""

from __future__ import annotations

import io
import json
import math
import secrets
import threading
from fractions import Fraction
from typing import Any, Iterable, Mapping

import numpy as np

from ... import facts, media
from ...progress import check_cancel
from ...request import EncodeRequest
from ..protocol import GUIDE_AUDIO_SECONDS, PROTOCOL_VERSION, REQUEST_PART, Limits

__all__ = ["request_to_wire", "encode_multipart", "json_part", "conditioning_bound"]

# Generous per-item sizes for the answer bound (`conditioning_bound`): more than the released model's text width
# (5120, `configs.RELEASE_TRANSFORMER["text_dim"]`) in float32, and more latent channels than any H3 VAE has.
_MAX_TEXT_WIDTH = 8192
_MAX_LATENT_CHANNELS = 128
_PIXELS_PER_TOKEN = facts.VISION_PATCH_PX**2  # a vision token covers at least one patch (Qwen3-VL merges 2x2)
_PIXELS_PER_LATENT = facts.VAE_SPATIAL_FACTOR**2
# The most latents an audio clip may have x stereo x width x float32.
_AUDIO_CLIP_BYTES = facts.audio_latents(facts.MAX_AUDIO_CLIP_S) * facts.AUDIO_CHANNELS * facts.AUDIO_LATENT_CHANNELS * 4


def _lossless_mp4(frames: np.ndarray, fps: float) -> bytes:
    """uint8 RGB frames -> an mp4 that `media.read_video` decodes to the same bytes.

    H.264 High 4:4:4 in RGB at qp 0 (libx264rgb) where FFmpeg has it, else PNG frames in the mp4 container;
    both are lossless for rgb24.
    """
    import av

    count, height, width = frames.shape[:3]
    rate = Fraction(float(fps)).limit_denominator(1_000_000)
    if rate <= 0:
        raise media.MediaError(f"reference video fps must be positive, got {fps!r}")
    codec = "libx264rgb" if "libx264rgb" in av.codecs_available else "png"
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
        if codec == "libx264rgb":
            stream.options = {"qp": "0", "preset": "veryfast"}
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[index]), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def _lossy_mp4(frames: np.ndarray, fps: float) -> bytes:
    if frames.shape[1] % 2 or frames.shape[2] % 2:  # yuv420p needs even sizes
        return _lossless_mp4(frames, fps)
    return media.encode_mp4_bytes(frames, None, fps=fps)


def request_to_wire(
    request: EncodeRequest,
    *,
    lossless_video: bool = True,
    cancel: threading.Event | None = None,
) -> tuple[dict[str, Any], list[tuple[str, str, str, bytes]]]:
    """The JSON request and the media parts ``(name, content_type, filename, bytes)`` for an `EncodeRequest`.

    Images go as PNG and waveforms as float32 WAV (both lossless); videos as lossless mp4 with the exact frame
    rate in the JSON and their soundtrack as a separate float32 WAV part, so the server rebuilds the same arrays.
    ``lossless_video=False`` sends H.264 yuv420p at CRF 18 instead (far smaller, no longer bit-identical).
    """
    parts: list[tuple[str, str, str, bytes]] = []

    def add(name: str, content_type: str, extension: str, data: bytes) -> dict[str, str]:
        parts.append((name, content_type, f"{name}.{extension}", data))
        return {"part": name}

    def png(name: str, image: np.ndarray) -> dict[str, str]:
        check_cancel(cancel, "while packing the request media")
        return add(name, "image/png", "png", media.encode_png_bytes(image, compress_level=1))

    def wav(name: str, waveform: np.ndarray, rate: int) -> dict[str, str]:
        check_cancel(cancel, "while packing the request media")
        return add(name, "audio/wav", "wav", media.encode_wav_bytes(waveform, int(rate), sample_format="f32"))

    body: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "prompt": request.prompt,
        "task": request.task,
        "num_frames": int(request.num_frames),
    }
    if request.width is not None or request.height is not None:
        body["width"], body["height"] = request.width, request.height
    if request.first_frame is not None:
        body["first_frame"] = png("first_frame", request.first_frame)
    if request.last_frame is not None:
        body["last_frame"] = png("last_frame", request.last_frame)
    body["ref_images"] = [png(f"image{index}", image) for index, image in enumerate(request.ref_images)]
    videos = []
    for index, video in enumerate(request.ref_videos):
        check_cancel(cancel, "while packing the request media")
        frames = np.ascontiguousarray(video.frames)
        data = _lossless_mp4(frames, video.fps) if lossless_video else _lossy_mp4(frames, video.fps)
        entry: dict[str, Any] = add(f"video{index}", "video/mp4", "mp4", data)
        entry["fps"] = float(video.fps)
        if video.audio is not None:
            entry["soundtrack"] = wav(f"soundtrack{index}", video.audio, video.sample_rate)["part"]
        else:
            entry["soundtrack"] = False
        videos.append(entry)
    body["ref_videos"] = videos
    body["ref_audios"] = [wav(f"audio{index}", audio.waveform, audio.sample_rate)
                          for index, audio in enumerate(request.ref_audios)]
    guides = []
    for index, guide in enumerate(request.guides):
        check_cancel(cancel, "while packing the request media")
        entry = {"frame_index": int(guide.frame_index)}
        if guide.frames is not None:
            # What the encoder anchors (`GuideMedia.frame_count`): one image, or the clip cut down to 17k+5.
            kept = np.ascontiguousarray(guide.frames[:guide.frame_count])
            if kept.shape[0] == 1:
                entry["image"] = png(f"guide{index}", kept[0])
            else:
                data = _lossless_mp4(kept, facts.FPS) if lossless_video else _lossy_mp4(kept, facts.FPS)
                entry["video"] = add(f"guide{index}", "video/mp4", "mp4", data)
        if guide.audio is not None:
            keep = int(GUIDE_AUDIO_SECONDS * int(guide.sample_rate))  # the server's decode cut: the same samples
            entry["audio"] = wav(f"guide{index}_audio", guide.audio[:, :keep], guide.sample_rate)
        guides.append(entry)
    if guides:  # absent without guides: such a request is what servers without the feature have always read
        body["guides"] = guides
    return body, parts


def json_part(request_json: Mapping[str, Any]) -> bytes:
    """The bytes of the JSON request part (compact, ASCII)."""
    return json.dumps(request_json, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def encode_multipart(request_json: Mapping[str, Any], parts: Iterable[tuple[str, str, str, bytes]]
                     ) -> tuple[str, list[bytes]]:
    """``(content_type, buffers)`` of a multipart/form-data body: the JSON part first, then the media parts.

    ``buffers`` is ``[json_head, json_bytes, *rest]``: joined, they are the body. The JSON part changes on every
    attempt (deadline, pinned model), so a caller replaces ``buffers[1]`` (see `json_part`) and sends the media
    buffers as they are, without copying or searching them.
    """
    boundary = "h3-" + secrets.token_hex(16)

    def head(name: str, content_type: str, filename: str | None = None) -> bytes:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        return (f"--{boundary}\r\nContent-Disposition: {disposition}\r\nContent-Type: {content_type}\r\n\r\n"
                .encode("ascii"))

    buffers = [head(REQUEST_PART, "application/json"), json_part(request_json)]
    for name, content_type, filename, data in parts:
        buffers += [b"\r\n" + head(name, content_type, filename), data]
    buffers.append(f"\r\n--{boundary}--\r\n".encode("ascii"))
    return f"multipart/form-data; boundary={boundary}", buffers


def conditioning_bound(request: EncodeRequest) -> int:
    """The most bytes a correct conditioning for `request` can take: the client's cap on the server's answer.

    Tokens: the prompt (at most one per UTF-8 byte, plus a template allowance) and the vision tokens of every
    image and video frame; each at most `_MAX_TEXT_WIDTH` float32 values. Latents: one latent frame per keyframe
    or image, one per 4 frames at 24 fps (+2) per reference video or guide clip, each at most
    `_MAX_LATENT_CHANNELS` channels over the canvas (the request's, else the largest a server accepts); audio clips
    (soundtracks, reference and guide audios) at their maximum length.
    Loose by design (several times the real size), but it follows the request, not a fixed gigabyte.
    """
    canvas = request.width * request.height if request.width and request.height else Limits().max_canvas_pixels
    latent_frame_bytes = _MAX_LATENT_CHANNELS * (canvas // _PIXELS_PER_LATENT + 1) * 4
    tokens = 1024 + 4 * len(request.prompt.encode("utf-8", "surrogatepass"))
    latent_frames = audio_clips = 0
    images = [image for image in (request.first_frame, request.last_frame) if image is not None]
    for image in images + list(request.ref_images):
        tokens += image.shape[0] * image.shape[1] // _PIXELS_PER_TOKEN + 64
        latent_frames += 1
    for video in request.ref_videos:
        count, height, width = video.frames.shape[:3]
        tokens += count * height * width // _PIXELS_PER_TOKEN + 64
        latent_frames += math.ceil(video.seconds * facts.FPS) // 4 + 2
        audio_clips += int(video.audio is not None)
    audio_clips += len(request.ref_audios)
    for guide in request.guides:  # no vision tokens: guides go through the VAEs only
        latent_frames += guide.frame_count // 4 + 2 if guide.frames is not None else 0
        audio_clips += int(guide.audio is not None)
    return (1 << 20) + tokens * (_MAX_TEXT_WIDTH * 4 + 8) + latent_frames * latent_frame_bytes + \
        audio_clips * _AUDIO_CLIP_BYTES
