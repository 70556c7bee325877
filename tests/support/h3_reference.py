"""Diffusers' monolithic MiniMaxH3ModularPipeline on the same inputs: the reference our split must match."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from h3_core.request import EncodeRequest


def monolithic(diffusers_root, request: EncodeRequest, task: str, seed: int, steps: int) -> dict[str, torch.Tensor]:
    """Run the whole request through diffusers' own pipeline, as a user of diffusers would."""
    from diffusers import ModularPipeline
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    pipe = ModularPipeline.from_pretrained(str(diffusers_root), workflow=task)
    pipe.load_components(dtype=torch.float32)
    kwargs = dict(
        prompt=request.prompt,
        num_frames=request.num_frames,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="pt",
    )
    if request.width is not None:
        kwargs.update(width=request.width, height=request.height)
    if task == "fl2va":
        if request.first_frame is not None:
            kwargs["image"] = Image.fromarray(request.first_frame)
        if request.last_frame is not None:
            kwargs["last_image"] = Image.fromarray(request.last_frame)
    if task == "ref2va":
        refs = [MiniMaxH3ImageReference(image=Image.fromarray(image)) for image in request.ref_images]
        for video in request.ref_videos:
            audio = None if video.audio is None else torch.from_numpy(np.array(video.audio, dtype=np.float32))
            refs.append(
                MiniMaxH3VideoReference(frames=video.frames, fps=video.fps, audio=audio, sample_rate=video.sample_rate)
            )
        for audio in request.ref_audios:
            refs.append(
                MiniMaxH3AudioReference(audio=torch.from_numpy(audio.waveform.copy()), sample_rate=audio.sample_rate)
            )
        kwargs["references"] = refs
    state = pipe(**kwargs)
    video = state.get("videos")[0].permute(0, 2, 3, 1).float()  # [F, H, W, 3]
    return {
        "video": video,
        "audio": state.get("audio")[0].float(),  # [2, S] untrimmed
        "latents": state.get("latents"),
        "audio_latents": state.get("audio_latents"),
        "prompt_embeds": state.get("prompt_embeds"),
    }
