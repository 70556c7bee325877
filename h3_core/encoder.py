"""Stage 0 of the split: the three H3 encoders (Qwen3-VL text encoder, video VAE, audio VAE).

STAGE BOUNDARY: this module ends at `H3Conditioning` (h3_core/contract/); `diffusion.py` starts
there. The cut is the one described in docs/ARCHITECTURE.md §2: stage 0 = diffusers' resolved
`before_encode` + `text_encoder` blocks of the task's workflow, then the video VAE encode (`vae_encode.py`, the
clip-by-clip form of diffusers' recipe) and the audio VAE encode (`encode_audio`).

    request --prepare()--> Prepared --encode_text()----> prompt_embeds, text_token_tags
                                    --encode_video()---> condition_latents        (video VAE)
                                    --encode_audio()---> audio_condition_latents  (audio VAE)
                                    assemble()         -> H3Conditioning

`prepare` runs diffusers' own media-normalisation block (canvas, 17k+5, reference sizing, 24 fps);
the text step is diffusers' own text-encoder block of the task; the video VAE step is diffusers'
`encode_vae_condition` recipe (posterior sampled under seed 42 through fp16, as the release does) run clip
by clip from the uint8 frames (`vae_encode.py`, bit-identical), the audio step the audio VAE's posterior
mean; split per encoder so each can run (and be loaded) on its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from . import component_cache, facts, guides, media, progress, rules
from .blocks import pipeline_for, run_blocks, workflow_blocks
from .contract import H3Conditioning, H3Reference
from .contract.conditioning import H3Guide
from .models import ModelSource
from .offload import activation_estimate, place
from .progress import ProgressFn, check_cancel
from .request import EncodeRequest, NeedsEncoders

ENCODER_COMPONENTS = ("text", "video", "audio")


class StageError(RuntimeError):
    """A stage was asked for work its loaded components cannot do."""


@dataclass
class Prepared(NeedsEncoders):
    """A request after diffusers' media normalisation: everything the three encoders read."""

    task: str
    prompt: str
    width: int
    height: int
    num_frames: int
    keyframes: list = field(default_factory=list)  # PIL images on the canvas (fl2va)
    keyframe_anchors: tuple = ()
    references: list = field(default_factory=list)  # diffusers Minimax reference dataclasses (ref2va)
    encoders: tuple[str, ...] = ("text",)  # EncodeRequest.needed_encoders() of the request this was prepared from
    guides: list = field(default_factory=list)  # guides.PreparedGuide on the canvas (fl2va), after the keyframes

    @property
    def guide_entries(self) -> tuple[H3Guide, ...]:
        """The contract's guide entries: each guide's frame and which rows it brings."""
        return tuple(H3Guide(g.frame, g.pixels is not None, g.audio is not None) for g in self.guides)

    @property
    def text_task(self) -> str:
        """The workflow whose text step presents the prompt: guides add no vision block (core's AddGuide encodes
        them with the VAEs only), so a guided request without keyframes presents as t2va."""
        return "t2va" if self.task == "fl2va" and not self.keyframes else self.task


def _to_diffusers_references(request: EncodeRequest) -> list:
    """Our fixed reference order (images, videos, audios) as diffusers' reference dataclasses.

    Audio is resampled to 32 kHz stereo here, with av, so diffusers never needs torchaudio and every
    entry path resamples identically.
    """
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    references = [MiniMaxH3ImageReference(image=Image.fromarray(image)) for image in request.ref_images]
    for video in request.ref_videos:
        audio = None
        if video.audio is not None:
            audio = torch.from_numpy(media.resample_audio(video.audio, video.sample_rate, facts.AUDIO_SAMPLE_RATE))
        references.append(
            MiniMaxH3VideoReference(
                frames=video.frames,
                fps=float(video.fps),
                audio=audio,
                sample_rate=None if audio is None else facts.AUDIO_SAMPLE_RATE,
            )
        )
    for audio in request.ref_audios:
        waveform = torch.from_numpy(media.resample_audio(audio.waveform, audio.sample_rate, facts.AUDIO_SAMPLE_RATE))
        references.append(MiniMaxH3AudioReference(audio=waveform, sample_rate=facts.AUDIO_SAMPLE_RATE))
    return references


def prepare(request: EncodeRequest, pipeline_config: dict) -> Prepared:
    """Validate the request and normalise its media exactly as diffusers' `before_encode` block does."""
    task = request.validate()
    width, height = request.width, request.height
    if task == "t2va" or (task == "fl2va" and request.first_frame is None and request.last_frame is None):
        if width is None:
            width, height = rules.resolve_canvas(
                16, 9, pipeline_config["canvas_short_edge"], pipeline_config["canvas_max_pixels"]
            )
        return Prepared(task, request.prompt, width, height, request.num_frames, encoders=request.needed_encoders(),
                        guides=guides.prepare(request.guides, width, height, request.num_frames))

    inputs: dict = {"height": height, "width": width, "num_frames": request.num_frames}
    if task == "fl2va":
        inputs["image"] = None if request.first_frame is None else Image.fromarray(request.first_frame)
        inputs["last_image"] = None if request.last_frame is None else Image.fromarray(request.last_frame)
    else:
        inputs["references"] = _to_diffusers_references(request)
    pipe = pipeline_for(workflow_blocks(task, ("before_encode",)), {}, pipeline_config)
    try:
        state = run_blocks(pipe, **inputs)
    except ValueError as error:  # diffusers' own rule checks: same message, our error type
        raise rules.H3InputError(str(error)) from None
    width, height = int(state.get("width")), int(state.get("height"))
    num_frames = int(state.get("num_frames") or request.num_frames)
    return Prepared(
        task=task,
        prompt=request.prompt,
        width=width,
        height=height,
        num_frames=num_frames,
        keyframes=list(state.get("keyframes") or []),
        keyframe_anchors=tuple(state.get("keyframe_anchors") or ()),
        references=list(state.get("normalized_references") or []),
        encoders=request.needed_encoders(),
        guides=guides.prepare(request.guides, width, height, num_frames),
    )


def references_table(prepared: Prepared) -> tuple[H3Reference, ...]:
    return tuple(H3Reference(kind=ref.kind, has_audio=bool(ref.has_audio)) for ref in prepared.references)


class EncoderStage:
    """Holds the loaded encoders and turns requests into `H3Conditioning`.

    Built with a subset of `components` ("text", "video", "audio"), it loads only those weights and
    refuses requests that need a missing one.
    """

    def __init__(
        self,
        source: ModelSource | None = None,
        components: tuple[str, ...] = ENCODER_COMPONENTS,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        offload: str = "none",
        modules: dict | None = None,
        pipeline_config: dict | None = None,
        fingerprint: str | None = None,
    ):
        """Load `components` from `source`, or adopt already-loaded `modules` (the ComfyUI nodes do:
        their loaders own the weights), keyed text_encoder/tokenizer/processor/vae/audio_vae."""
        self.device = torch.device(device)
        self.streaming = None
        if modules is not None:
            self.text_encoder = modules.get("text_encoder")
            self.tokenizer, self.processor = modules.get("tokenizer"), modules.get("processor")
            self.vae, self.audio_vae = modules.get("vae"), modules.get("audio_vae")
            self.components = tuple(
                name
                for name, module in (("text", self.text_encoder), ("video", self.vae), ("audio", self.audio_vae))
                if module is not None
            )
            self.pipeline_config = dict(pipeline_config or {})
            self.fingerprint = fingerprint or ""
            # Adopted modules: the one identity the caller gave covers each of them (none: never cached).
            self.identities = {name: self.fingerprint for name in self.components}
            return
        unknown = set(components) - set(ENCODER_COMPONENTS)
        if unknown:
            raise StageError(f"unknown encoder components {sorted(unknown)}; choose from {ENCODER_COMPONENTS}")
        self.components = tuple(components)
        self.pipeline_config = dict(source.pipeline_config)
        self.fingerprint = source.fingerprint()  # identity of the weights, for caches and handshakes
        # Per encoder, for the component cache: new VAE weights leave the cached text entries valid.
        self.identities = {name: source.component_fingerprint(name) for name in self.components}
        self.text_encoder = self.tokenizer = self.processor = self.vae = self.audio_vae = None
        self.load_seconds: dict[str, float] = {}  # per component, for the server's metrics
        if "text" in components:
            started = time.perf_counter()
            # resident or layer-streamed (`offload`: none / block / auto, h3_core.offload)
            self.text_encoder = source.load("text_encoder", dtype=dtype)
            self.streaming = place(self.text_encoder, "text_encoder", self.device, offload,
                                   activation_bytes=activation_estimate("text_encoder", self.text_encoder, dtype,
                                                                        width=0, height=0, frames=facts.DEFAULT_FRAMES))
            self.tokenizer = source.load_tokenizer()
            self.processor = source.load_processor()
            self.load_seconds["text"] = time.perf_counter() - started
        if "video" in components:
            started = time.perf_counter()
            self.vae = source.load("vae", dtype=torch.float32).to(self.device)
            self.load_seconds["video"] = time.perf_counter() - started
        if "audio" in components:
            started = time.perf_counter()
            self.audio_vae = source.load("audio_vae", dtype=torch.float32).to(self.device)
            self.load_seconds["audio"] = time.perf_counter() - started

    # --- the three encoders ----------------------------------------------------------------------

    def _require(self, component: str, why: str) -> None:
        if component not in self.components:
            raise StageError(f"this encoder stage was built without the {component} encoder, which {why} needs")

    @torch.no_grad()
    def encode_text(self, prepared: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-VL presentation -> (prompt_embeds [1, L, D] in the encoder's dtype, tags int64 [L])."""
        self._require("text", "every request")
        address, cached = self._lookup("text", "text", lambda: self._text_key(prepared))
        if cached is not None:
            return cached["prompt_embeds"], cached["text_token_tags"]
        blocks = workflow_blocks(prepared.text_task, ("text_encoder",))
        pipe = pipeline_for(
            blocks,
            {"text_encoder": self.text_encoder, "tokenizer": self.tokenizer, "processor": self.processor},
            self.pipeline_config,
        )
        inputs = {"prompt": prepared.prompt}
        if prepared.text_task == "fl2va":
            inputs["keyframes"] = prepared.keyframes
        elif prepared.task == "ref2va":
            inputs["normalized_references"] = prepared.references
        with LayerCounter(self.text_encoder, "text"):
            state = run_blocks(pipe, **inputs)
        prompt_embeds, tags = state.get("prompt_embeds").cpu(), state.get("text_token_tags").cpu()
        component_cache.store(address, {"prompt_embeds": prompt_embeds, "text_token_tags": tags})
        return prompt_embeds, tags

    @torch.no_grad()
    def encode_video(self, prepared: Prepared) -> list[torch.Tensor]:
        """Keyframes / image and video references -> normalised latents [1, 24, T, h, w] each, packed order."""
        if not prepared.needs_video_vae:
            return []
        self._require("video", f"a {prepared.task} request with keyframes or visual references")
        from .vae_encode import encode_condition, units

        pixels = [_pixels(image) for image in prepared.keyframes]
        for ref in prepared.references:
            if ref.kind == "image":
                pixels.append(_pixels(ref.image))
            elif ref.kind == "video":
                # Snap *down* to 17k+5 so the VAE encodes without padding (diffusers' reference step).
                count = rules.snap_frames_down(ref.frames.shape[0])
                pixels.append(torch.from_numpy(np.ascontiguousarray(ref.frames[:count])).permute(3, 0, 1, 2)[None])
        pixels += [guide.pixels for guide in prepared.guides if guide.pixels is not None]  # after the keyframes
        found = [self._lookup("video", f"video.{index}", lambda p=p: self._video_key(p))
                 for index, p in enumerate(pixels)]
        # One unit per temporal clip (a keyframe or an image is one): a long reference moves the bar as it encodes.
        # Only the parts to encode count; with every part cached there is no VAE phase at all.
        clips = sum(units(self.vae, int(p.shape[2])) for p, (_, cached) in zip(pixels, found) if cached is None)
        counter = progress.Counter("video_vae", clips) if clips else None
        latents = []
        for p, (address, cached) in zip(pixels, found):
            if cached is not None:
                latents.append(cached["latents"])
                continue
            # Clip by clip from the uint8 frames: no float copy of a whole reference video (h3_core/vae_encode.py).
            latents.append(encode_condition(self.vae, p.to(self.device), facts.PIXEL_MEAN, facts.PIXEL_STD,
                                            encode_seed=facts.KEYFRAME_ENCODE_SEED, on_clip=counter.advance))
            component_cache.store(address, {"latents": latents[-1]})
        return latents

    @torch.no_grad()
    def encode_audio(self, prepared: Prepared) -> list[torch.Tensor]:
        """Soundtracks and standalone audios -> normalised channel-major rows [2*T, 32] each, packed order."""
        if not prepared.needs_audio_vae:
            return []
        self._require("audio", "a request with reference audio or soundtracks")
        config = self.audio_vae.config
        mean = torch.tensor(config.latents_mean).view(1, 1, -1)
        std = torch.tensor(config.latents_std).view(1, 1, -1)
        audios = [ref.audio for ref in prepared.references if ref.has_audio]
        caps = [None] * len(audios)
        for guide in prepared.guides:
            if guide.audio is not None:
                audios.append(torch.from_numpy(guide.audio))
                caps.append(guide.audio_cap)  # core's rule: cut to what the output leaves after the guide's frame
        found = [self._lookup("audio", f"audio.{index}", lambda audio=audio: self._audio_key(audio))
                 for index, audio in enumerate(audios)]
        rows = []
        computed = sum(1 for _, cached in found if cached is None)
        counter = progress.Counter("audio_vae", computed) if computed else None
        for audio, cap, (address, cached) in zip(audios, caps, found):
            if cached is not None:
                rows.append(cached["rows"] if cap is None else guides.crop_audio_rows(cached["rows"], cap))
                continue
            # Stereo channels are the batch of the mono audio VAE; references use the posterior mean.
            posterior = self.audio_vae.encode(audio.to(self.device)[:, None], return_dict=False)[0]
            latents = posterior.mode().float().cpu().transpose(1, 2)
            rows.append(((latents - mean) / std).reshape(-1, config.latent_channels))
            component_cache.store(address, {"rows": rows[-1]})
            if cap is not None:
                rows[-1] = guides.crop_audio_rows(rows[-1], cap)
            counter.advance()
        return rows

    # --- the component cache's keys (h3_core/component_cache.py) ------------------------------------

    def _lookup(self, component: str, label: str, entry_key):
        """(key, cached tensors or None) for one part; nothing is hashed unless a cache is installed, and a
        stage whose weights have no identity (adopted modules without a fingerprint) is never cached."""
        if not self.identities.get(component):
            return None, None
        return component_cache.lookup(label, entry_key)

    def _identity(self, component: str, module: torch.nn.Module) -> dict:
        first = next(module.parameters(), None)  # where the weights are, not the stage's default (sharded stages)
        dtype, device = (torch.float32, self.device) if first is None else (first.dtype, first.device)
        return component_cache.execution_identity(self.identities[component], dtype, device)

    def _text_key(self, prepared: Prepared) -> str:
        """The prompt, the canvas and every vision input the presentation shows (keyframes, references)."""
        vision = [component_cache.digest(image) for image in prepared.keyframes]
        vision += [_reference_digest(ref) for ref in prepared.references]
        params = {"task": prepared.text_task, "prompt": prepared.prompt, "width": prepared.width,
                  "height": prepared.height, "num_frames": prepared.num_frames,
                  "anchors": list(prepared.keyframe_anchors), "pipeline": self.pipeline_config}
        return component_cache.key("text", self._identity("text", self.text_encoder), params,
                                   component_cache.digest(*vision))

    def _video_key(self, pixels: torch.Tensor) -> str:
        params = {"seed": facts.KEYFRAME_ENCODE_SEED, "pixel_mean": facts.PIXEL_MEAN, "pixel_std": facts.PIXEL_STD}
        return component_cache.key("video", self._identity("video", self.vae), params,
                                   component_cache.digest(pixels))

    def _audio_key(self, audio: torch.Tensor) -> str:
        return component_cache.key("audio", self._identity("audio", self.audio_vae), {"posterior": "mode"},
                                   component_cache.digest(audio))

    # --- whole requests --------------------------------------------------------------------------

    def prepare(self, request: EncodeRequest) -> Prepared:
        return prepare(request, self.pipeline_config)

    def encode(
        self,
        request: EncodeRequest,
        metadata: dict[str, str] | None = None,
        cancel: threading.Event | None = None,
        progress: ProgressFn | None = None,
    ) -> H3Conditioning:
        """Encode a whole request; `cancel` is checked between encoders, `progress` counts them."""
        prepared = self.prepare(request)
        # Fail before any heavy work when a needed encoder is missing.
        self._require("text", "every request")
        if prepared.needs_video_vae:
            self._require("video", f"a {prepared.task} request with keyframes or visual references")
        if prepared.needs_audio_vae:
            self._require("audio", "a request with reference audio or soundtracks")
        steps = [("text", self.encode_text), ("video", self.encode_video), ("audio", self.encode_audio)]
        outputs = {}
        for done, (name, step) in enumerate(steps):
            check_cancel(cancel, f"before the {name} encoder")
            if progress is not None:
                progress(done, len(steps))
            outputs[name] = step(prepared)
        if progress is not None:
            progress(len(steps), len(steps))
        prompt_embeds, tags = outputs["text"]
        return assemble(
            prepared,
            prompt_embeds,
            tags,
            outputs["video"],
            outputs["audio"],
            metadata={"model": self.fingerprint, **(metadata or {})} if self.fingerprint else dict(metadata or {}),
        )


class LayerCounter:
    """Reports a model's forward as a progress phase, one unit per decoder layer (the text encoder's
    `layers` stack: 50 at release), through forward hooks that read nothing; inert without a sink."""

    def __init__(self, model: torch.nn.Module, phase: str):
        self.model, self.phase, self.handles = model, phase, []

    def __enter__(self):
        if not progress.active():
            return self
        stacks = [m for name, m in self.model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"]
        layers = max(stacks, key=len) if stacks else []
        counter = progress.Counter(self.phase, max(len(layers), 1))
        self.handles = [layer.register_forward_hook(lambda *_: counter.advance()) for layer in layers]
        self.counter = counter
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        if exc[0] is None and getattr(self, "counter", None) is not None:
            self.counter.finish()
        return False


def _reference_digest(ref) -> str:
    """A normalised reference's content: kind, media bytes, rates (what the text step's presentation reads)."""
    items = [ref.kind, bool(ref.has_audio)]
    for name in ("image", "frames", "fps", "audio", "sample_rate"):
        value = getattr(ref, name, None)
        if isinstance(value, list):
            items += [name, len(value), *value]
        elif value is not None:
            items += [name, value if not isinstance(value, (int, float)) else float(value)]
    return component_cache.digest(*items)


def _pixels(image) -> torch.Tensor:
    """A PIL image as the uint8 [1, 3, 1, H, W] tensor diffusers' VAE step builds."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None, :, None]


def assemble(
    prepared: Prepared,
    prompt_embeds: torch.Tensor,
    text_token_tags: torch.Tensor,
    condition_latents: list[torch.Tensor],
    audio_condition_latents: list[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> H3Conditioning:
    """Join the three encoders' outputs into the validated contract."""
    return H3Conditioning(
        task=prepared.task,
        height=prepared.height,
        width=prepared.width,
        num_frames=prepared.num_frames,
        prompt_embeds=prompt_embeds,
        text_token_tags=text_token_tags,
        condition_latents=tuple(condition_latents),
        audio_condition_latents=tuple(audio_condition_latents),
        keyframe_anchors=prepared.keyframe_anchors if prepared.task == "fl2va" else (),
        references=references_table(prepared) if prepared.task == "ref2va" else (),
        metadata=dict(metadata or {}),
        guides=prepared.guide_entries,
    )
