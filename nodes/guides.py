"""Guides at any frame, and video continuation: media nodes that add to the MINIMAX_H3_MEDIA bundle.

A guide anchors an image, a clip, an audio or a clip with its soundtrack at any frame of the output (ComfyUI core's
`MiniMaxH3AddGuide` semantics, `h3_core/guides.py`). Like keyframes and references, guides ride in the media bundle
to the encoders: Text Encode (or Remote Encode) takes the bundle, the Video VAE Encode encodes the guide frames, the
Audio VAE Encode the guide audio, and the CONDITIONING carries them under core's `minimax_keyframes` key, so core's
sampler reads them too. Guides chain (`media` in, `media` out), after Keyframes or alone.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from comfy_api.latest import io

from ..h3_core import facts, guides
from ..h3_core.guides import GuideMedia
from ..h3_core.rules import H3InputError
from . import comfy_bridge as bridge
from .media import MediaBundle
from .types import CONDITIONING_CATEGORY, Media, Schema


def _frames(image, label: str) -> np.ndarray:
    """An IMAGE batch [N, H, W, C] float 0..1 as uint8 RGB [N, H, W, 3] (each frame quantised like one image)."""
    return np.stack([bridge.image_to_uint8(image[i:i + 1], label) for i in range(image.shape[0])])


def _added(media, guide: GuideMedia) -> MediaBundle:
    bundle = media or MediaBundle()
    if len(bundle.guides) >= facts.MAX_GUIDES:
        raise ValueError(f"at most {facts.MAX_GUIDES} guides per video, this chain already has "
                         f"{len(bundle.guides)}")
    return replace(bundle, guides=(*bundle.guides, guide))


class Guide(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitGuide",
            display_name="MiniMax H3 Guide (any frame)",
            category=CONDITIONING_CATEGORY,
            description="Anchor an image, a clip, an audio, or a clip with its soundtrack at any frame of the video "
            "(as core's Add Guide for MiniMax H3). Chain several through `media`; connect the last `media` to "
            "MiniMax H3 Text Encode or Remote Encode. The frames are cover-cropped onto the canvas.",
            inputs=[
                Media.Input("media", optional=True, tooltip="Keyframes, or guides, to add this guide after."),
                io.Int.Input("frame_idx", default=0, min=-facts.MAX_FRAMES, max=facts.MAX_FRAMES - 1,
                             tooltip="Output frame (24 fps) the image, or the clip's first frame, and the audio start "
                             "at. Negative values count from the end (-1 is the last frame)."),
                io.Image.Input("image", optional=True,
                               tooltip="One image, or a batch of frames anchored as a clip: cut down to the video "
                               f"VAE's 5, 22, 39, ... (17k+5) frames, at most {guides.MAX_GUIDE_FRAMES}; a batch "
                               "of fewer than 5 frames anchors its first image only."),
                io.Audio.Input("audio", optional=True,
                               tooltip="Soundtrack starting at frame_idx, cut to what the video has left after it "
                               "(and to 15 s). Resampled to 32 kHz stereo."),
            ],
            outputs=[Media.Output(display_name="media")],
        )

    @classmethod
    def execute(cls, frame_idx, media=None, image=None, audio=None) -> io.NodeOutput:
        if image is None and audio is None:
            raise ValueError("MiniMax H3 Guide needs an image (or a clip of frames), an audio, or both to anchor")
        waveform, rate = (None, None) if audio is None else bridge.audio_to_numpy(audio, "audio")
        frames = None if image is None else _frames(image[:guides.clip_frames(int(image.shape[0]))], "image")
        return io.NodeOutput(_added(media, GuideMedia(int(frame_idx), frames, waveform, rate)))


class ContinueVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitContinueVideo",
            display_name="MiniMax H3 Continue Video",
            category=CONDITIONING_CATEGORY,
            description="Extend a clip: its last frames and the soundtrack under them become the first frames of the "
            "new video (a guide at frame 0), and the prompt says what happens next. Connect `media` to MiniMax H3 "
            "Text Encode or Remote Encode; join the source and the result with the overlap cut once.",
            inputs=[
                io.Video.Input("video", tooltip="The clip to continue (Load Video); its soundtrack, if any, is "
                               "continued too."),
                io.Int.Input("overlap_frames", default=22, min=facts.MIN_FRAMES, max=guides.MAX_GUIDE_FRAMES,
                             step=facts.FRAMES_PER_CLIP,
                             tooltip="How many of the clip's last frames (24 fps) the new video starts with: 5, 22, "
                             "39, ... (17k+5; other values are cut down to that grid). More frames hold motion and "
                             "voice better, fewer leave more new video."),
                Media.Input("media", optional=True, tooltip="Guides to add after this one (e.g. a last frame)."),
            ],
            outputs=[Media.Output(display_name="media")],
        )

    @classmethod
    def execute(cls, video, overlap_frames, media=None) -> io.NodeOutput:
        frames, fps, audio, rate = bridge.video_components(video)
        try:
            guide = guides.continuation(frames, fps, audio, rate, int(overlap_frames))
        except H3InputError as error:
            raise ValueError(f"MiniMax H3 Continue Video: {error}") from None
        return io.NodeOutput(_added(media, guide))


NODES = [Guide, ContinueVideo]
