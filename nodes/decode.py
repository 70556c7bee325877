"""MiniMax H3 VAE Decode: AV latent -> core VIDEO (with audio), IMAGE frames, AUDIO and the first frame (IMAGE)."""

from __future__ import annotations

from comfy_api.latest import io

from ..h3_core import facts
from ..h3_core.diffusion import AVLatents, DiffusionStage
from . import comfy_bridge as bridge
from . import loaders, progress_text
from .types import LATENT_CATEGORY, AudioVAE, Schema, VideoVAE


class Decode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
            node_id="H3SplitDecode",
            display_name="MiniMax H3 VAE Decode (video + audio)",
            category=LATENT_CATEGORY,
            description="Turns the Sampler's latent into the video (24 fps) and its stereo soundtrack (32 kHz, as long "
            "as the video), decoded tile by tile so memory holds the video once. Connect `video` to Save Video; "
            "`frames` and `audio` feed any image or audio node; `image` is the first frame (text to image).",
            inputs=[
                io.Latent.Input("latent", tooltip="From MiniMax H3 Sampler."),
                VideoVAE.Input("vae", tooltip=f"From {loaders.VideoVAELoader.DISPLAY_NAME}."),
                AudioVAE.Input("audio_vae", tooltip=f"From {loaders.AudioVAELoader.DISPLAY_NAME}."),
            ],
            outputs=[
                io.Video.Output(display_name="video"),
                io.Image.Output(display_name="frames"),
                io.Audio.Output(display_name="audio"),
                # appended (saved workflows link outputs by index): text to image, as core's text to image
                io.Image.Output(display_name="image", tooltip="The first frame alone (one IMAGE): text to image. Make "
                                f"a {facts.IMAGE_FRAMES}-frame video (Text Encode's length), the shortest clip, and "
                                "connect this to Save Image; the audio is discarded."),
            ],
        )

    @classmethod
    def execute(cls, latent, vae, audio_vae) -> io.NodeOutput:
        video, audio = bridge.split_av_latent(latent)
        device = bridge.use(vae.patcher, audio_vae.patcher)
        stage = DiffusionStage(modules={"vae": vae.module, "audio_vae": audio_vae.module},
                               pipeline_config=vae.pipeline_config, device=device)
        latents = AVLatents(video=video, audio=AVLatents.audio_from_comfy(audio))
        # Streamed tile by tile into one preallocated float32 video, which is the IMAGE output itself (and the
        # VIDEO's frames, shared, not copied): the node holds the video once plus one tile's work.
        # An interrupt is acknowledged on the node at once ("cancelling after the current layer") and stops the work
        # at the next tile of the video or the next layer of the audio decoder.
        interrupt = bridge.InterruptFlag()
        with progress_text.phases(cancel=interrupt):  # decode tiles, then the audio decode
            decoded = bridge.run_interruptible(stage.decode, latents, cancel=interrupt)
        video_out, frames, audio_out = bridge.to_video(decoded.video, decoded.audio, decoded.sample_rate, facts.FPS)
        return io.NodeOutput(video_out, frames, audio_out, frames[:1])  # image: a view of the first frame


NODES = [Decode]
