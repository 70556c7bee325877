"""Keyframes and references: collect the request's media in the order the prompt refers to it.

One MINIMAX_H3_MEDIA bundle feeds the text encoder (which labels each item `<Picture i>`,
`<Video k>`, `<Audio j>`) and rides inside the conditioning to the VAE encoders, so the encoders
cannot disagree about ordering. Order is fixed: images, then videos (each soundtrack labelled right
before its video), then standalone audios. Bundles chain: a References node can extend another.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from comfy_api.latest import io

from ..h3_core import facts
from ..h3_core.guides import GuideMedia
from ..h3_core.request import AudioInput, EncodeRequest, VideoInput
from ..h3_core.rules import H3InputError
from . import comfy_bridge as bridge
from .types import CONDITIONING_CATEGORY, Media, Schema

MAX_IMAGE_SOCKETS, MAX_VIDEO_SOCKETS, MAX_AUDIO_SOCKETS = (
    facts.MAX_REF_IMAGES,
    facts.MAX_REF_VIDEOS,
    facts.MAX_REF_AUDIOS,
)


@dataclass(frozen=True)
class MediaBundle:
    first_frame: np.ndarray | None = None
    last_frame: np.ndarray | None = None
    ref_images: tuple[np.ndarray, ...] = ()
    ref_videos: tuple[VideoInput, ...] = ()
    ref_audios: tuple[AudioInput, ...] = ()
    guides: tuple[GuideMedia, ...] = ()  # MiniMax H3 Guide / Continue Video (nodes/guides.py)

    def to_request(self, prompt: str, task: str | None, width: int | None, height: int | None, num_frames: int):
        return EncodeRequest(
            prompt=prompt,
            task=task,
            width=width,
            height=height,
            num_frames=num_frames,
            first_frame=self.first_frame,
            last_frame=self.last_frame,
            ref_images=list(self.ref_images),
            ref_videos=list(self.ref_videos),
            ref_audios=list(self.ref_audios),
            guides=list(self.guides),
        )


class Keyframes(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitKeyframes",
            display_name="MiniMax H3 Keyframes (first / last frame)",
            category=CONDITIONING_CATEGORY,
            description="The first and/or last frame the video starts and ends on (task fl2va): connect images "
            "(Load Image), then `media` to MiniMax H3 Text Encode. The first frame is stretched onto the canvas, the "
            "last one cover-cropped; with width/height 0 the video takes the first frame's aspect ratio (768 px "
            "short edge at full size).",
            inputs=[
                io.Image.Input("first_frame", optional=True, tooltip="Frame 0 of the video (one image)."),
                io.Image.Input("last_frame", optional=True, tooltip="The video's final frame (one image)."),
            ],
            outputs=[Media.Output(display_name="media")],
        )

    @classmethod
    def execute(cls, first_frame=None, last_frame=None) -> io.NodeOutput:
        if first_frame is None and last_frame is None:
            raise ValueError("MiniMax H3 Keyframes needs a first_frame, a last_frame, or both")
        return io.NodeOutput(
            MediaBundle(
                first_frame=None if first_frame is None else bridge.image_to_uint8(first_frame, "first_frame"),
                last_frame=None if last_frame is None else bridge.image_to_uint8(last_frame, "last_frame"),
            )
        )


class References(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        images = [
            io.Image.Input(f"ref_image_{i}", optional=True, tooltip=f"Reference image, addressed as <Picture {i}>.")
            for i in range(1, MAX_IMAGE_SOCKETS + 1)
        ]
        videos = [
            io.Video.Input(
                f"ref_video_{i}",
                optional=True,
                tooltip=f"Reference video (2-15 s), addressed as <Video {i}>; its soundtrack, if any, is conditioned "
                "on too (2-15 s, soundtracks share one 15 s budget). Resampled to 24 fps.",
            )
            for i in range(1, MAX_VIDEO_SOCKETS + 1)
        ]
        audios = [
            io.Audio.Input(
                f"ref_audio_{i}",
                optional=True,
                tooltip="Reference audio (2-15 s each, 15 s in all; cut to the output length), resampled to 32 kHz "
                "stereo. Numbered after the video soundtracks in the prompt's <Audio j> tags.",
            )
            for i in range(1, MAX_AUDIO_SOCKETS + 1)
        ]
        return Schema(
            node_id="H3SplitReferences",
            display_name="MiniMax H3 References",
            category=CONDITIONING_CATEGORY,
            description="Reference images (<= 9), videos with their soundtracks (<= 3) and audios (<= 3) for task "
            "ref2va, in the order the prompt's tags count them: <Picture i> images, then <Video k> videos, then "
            "<Audio j> (soundtracks first, then standalone audios). Connect `media` to MiniMax H3 Text Encode; chain a "
            "second References node through `media` to append.",
            inputs=[Media.Input("media", optional=True, tooltip="References to extend (appended after these).")]
            + images
            + videos
            + audios,
            outputs=[Media.Output(display_name="media")],
        )

    @classmethod
    def execute(cls, media=None, **sockets) -> io.NodeOutput:
        bundle = media or MediaBundle()
        images, videos, audios = list(bundle.ref_images), list(bundle.ref_videos), list(bundle.ref_audios)
        added = {}  # socket -> the clip it brought, in the order the prompt's tags count them
        for i in range(1, MAX_IMAGE_SOCKETS + 1):
            if sockets.get(f"ref_image_{i}") is not None:
                images.append(bridge.image_to_uint8(sockets[f"ref_image_{i}"], f"ref_image_{i}"))
        for i in range(1, MAX_VIDEO_SOCKETS + 1):
            if sockets.get(f"ref_video_{i}") is not None:
                frames, fps, audio, rate = bridge.video_components(sockets[f"ref_video_{i}"])
                videos.append(VideoInput(frames=frames, fps=fps, audio=audio, sample_rate=rate))
                added[f"ref_video_{i}"] = videos[-1]
        for i in range(1, MAX_AUDIO_SOCKETS + 1):
            if sockets.get(f"ref_audio_{i}") is not None:
                waveform, rate = bridge.audio_to_numpy(sockets[f"ref_audio_{i}"], f"ref_audio_{i}")
                audios.append(AudioInput(waveform=waveform, sample_rate=rate))
                added[f"ref_audio_{i}"] = audios[-1]
        if not (images or videos or audios):
            raise ValueError("MiniMax H3 References needs at least one reference image, video or audio")
        _check_clip_lengths(bundle, added)
        return io.NodeOutput(
            replace(bundle, ref_images=tuple(images), ref_videos=tuple(videos), ref_audios=tuple(audios))
        )


def _clip_problem(what: str, seconds: float | None, low: float, high: float) -> str | None:
    if seconds is None or low <= seconds <= high:
        return None
    return f"{what} must be {low:g}-{high:g} s long, got {seconds:.2f} s"


def _check_clip_lengths(bundle: MediaBundle, sockets: dict) -> None:
    """Each clip this node adds, against H3's per-clip bounds: a clip of the wrong length is this node's (and its
    Load Video / Load Audio's) error, not Text Encode's. The budgets that depend on the output length (15 s of
    audio in all, cut to the video's length) stay with the encode nodes, which know the length."""
    videos = [(name, item) for name, item in sockets.items() if name.startswith("ref_video_")]
    audios = [(name, item) for name, item in sockets.items() if name.startswith("ref_audio_")]
    for index, (socket, video) in enumerate(videos, start=len(bundle.ref_videos) + 1):
        for problem in (
            _clip_problem(f"reference video {index}", video.seconds, facts.MIN_REFERENCE_VIDEO_S,
                          facts.MAX_AUDIO_CLIP_S),
            _clip_problem(f"the soundtrack of reference video {index}", video.soundtrack_seconds,
                          facts.MIN_AUDIO_CLIP_S, facts.MAX_AUDIO_CLIP_S),
        ):
            if problem:
                raise H3InputError(f"{problem} (MiniMax H3 References, {socket}: trim or replace that video)")
    for index, (socket, audio) in enumerate(audios, start=len(bundle.ref_audios) + 1):
        problem = _clip_problem(f"reference audio {index}", audio.seconds, facts.MIN_AUDIO_CLIP_S,
                                facts.MAX_AUDIO_CLIP_S)
        if problem:
            raise H3InputError(f"{problem} (MiniMax H3 References, {socket}: trim or replace that audio)")


NODES = [Keyframes, References]
