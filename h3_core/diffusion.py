"""Stage 1 of the split: the DiT flow-matching loop and the decode-only VAEs.

STAGE BOUNDARY: input is an `H3Conditioning` (h3_core/contract/), nothing else from stage 0.
Built from diffusers' *resolved* workflow for the task (`denoise.*` + `decode.*` leaf blocks,
see docs/ARCHITECTURE.md), so stage 1 never loads the text encoder, tokenizer or processor and
never lets an auto block pick a branch from inputs it does not have.

    H3Conditioning --sample()--> AVLatents (video [1,24,T,h,w], audio [2,32,Ta], diffusers layout)
                   --decode()--> Decoded  (video float32 [F,H,W,3] in 0..1, audio float32 [2,S] @ 32 kHz)
                   --decode_to_mp4()--> an mp4 file, the video streamed clip by clip (never held whole)
                   --decode_to_png()--> a PNG of the first frame (text to image: a 5-frame job, audio discarded)

Per-call choices (steps, seed, shifts, LoRA, progress, cancel) travel as one `SamplingOptions`, so a
new sampling feature is a new field there, not a new argument of every caller. `seed` means exactly
what diffusers' monolithic pipeline does with `generator=torch.Generator("cpu").manual_seed(seed)`:
one request generator drawing condition noise, then video noise, then audio noise (all in stage 1).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from . import dtypes, facts, guide_layout, previews, progress, rules, step_cache, vae_stream
from .blocks import pipeline_for, run_blocks, workflow_blocks
from .contract import H3Conditioning
from .lora import LoRA
from .models import PARTITION_OF_TASK, ModelSource, ModelSourceError
from .offload import STREAMABLE, Streaming, activation_estimate, place
from .progress import ProgressFn, check_cancel
from .weights import file_identity

# (step done, total steps, the step's clean-video estimate [1, 24, T, H/16, W/16] float32 CPU)
PreviewFn = Callable[[int, int, torch.Tensor], None]


@dataclass
class AVLatents:
    video: torch.Tensor  # [1, 24, latent_t, H/16, W/16], normalised (diffusers' `latents`)
    audio: torch.Tensor  # [2, 32, audio_t]: stereo as the batch of the mono audio VAE
    passes: step_cache.Passes | None = None  # block passes computed / total in the run that made these latents

    def to_comfy_audio(self) -> torch.Tensor:
        """ComfyUI core's audio latent layout [1, 32, 2, T] (a view change, lossless)."""
        return self.audio.permute(1, 0, 2)[None].contiguous()

    @staticmethod
    def audio_from_comfy(audio: torch.Tensor) -> torch.Tensor:
        return audio[0].permute(1, 0, 2).contiguous()


@dataclass
class Decoded:
    video: torch.Tensor  # float32 [F, H, W, 3] in 0..1
    audio: torch.Tensor  # float32 [2, S] at 32 kHz, trimmed to the video's duration
    sample_rate: int = facts.AUDIO_SAMPLE_RATE
    fps: int = facts.FPS


@dataclass(frozen=True)
class SamplingOptions:
    """Everything one `DiffusionStage.sample` call may vary, validated on construction.

    `steps` = number of sigma points including the final 0 (diffusers' num_inference_steps), so
    `steps - 1` DiT forwards. Shifts default to the release's (video 12, audio 3). `lora` (e.g. a
    Turbo distillation, with its own steps/shift) runs beside the DiT for this call only.
    """

    steps: int
    seed: int = 0
    video_shift: float | None = None
    audio_shift: float | None = None
    lora: LoRA | None = None
    lora_strength: float = 1.0
    progress: ProgressFn | None = None
    cancel: threading.Event | None = None
    # Called after every step with the clean-video estimate (h3_core/previews.py), instead of `progress`
    # for that step (it carries the same counts).
    preview: PreviewFn | None = None
    # Step caching (h3_core/step_cache.py): off / quality / balanced / fast / every:K / dbcache:...; `on_cache` is
    # called after every DiT forward with the running block-pass count.
    cache: str = step_cache.OFF
    on_cache: step_cache.PassesFn | None = None

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise rules.H3InputError(
                f"steps must be an integer >= 2 (sigma points incl. the final 0), got {self.steps!r}"
            )
        step_cache.parse(self.cache)  # a bad cache string fails here, before any weights load

    def generator(self) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(int(self.seed))

    # --- across a process boundary (the sequence-parallel workers): the one place every field is decided ---------
    #: Fields that travel as they are (JSON values).
    WIRE_FIELDS = ("steps", "seed", "video_shift", "audio_shift", "cache", "lora_strength")
    #: The host's callbacks: the wire says which are set, and the other side puts its own relays in their place.
    CALLBACK_FIELDS = ("progress", "cancel", "preview", "on_cache")
    #: `lora` travels as the files it was loaded from (`to_wire`'s `loras`), which the other side loads again.
    LOADED_FIELDS = ("lora",)

    def to_wire(self, loras=(), lora_audio: bool = True) -> dict:
        """This call's options as JSON values; `loras` [(path, strength)] and `lora_audio` are what `lora` was built
        from (an in-memory LoRA does not cross a process boundary: its file does)."""
        return {"fields": {name: getattr(self, name) for name in self.WIRE_FIELDS},
                "callbacks": [name for name in self.CALLBACK_FIELDS if getattr(self, name) is not None],
                "loras": [[str(path), float(strength)] for path, strength in loras], "lora_audio": bool(lora_audio)}

    @classmethod
    def from_wire(cls, wire: dict, **callbacks) -> "SamplingOptions":
        """The options `to_wire` described, with `callbacks` (name -> the relay of this side) for those the host set,
        and its LoRAs loaded here from their files (as a stack carrying the run's schedule)."""
        from .lora import stack_for_run

        fields = dict(wire["fields"])
        lora = stack_for_run([tuple(entry) for entry in wire["loras"]], steps=int(fields["steps"]),
                             video_shift=fields["video_shift"], audio_shift=fields["audio_shift"],
                             audio=bool(wire["lora_audio"]))
        relays = {name: callbacks.get(name) for name in wire["callbacks"]}
        return cls(**fields, lora=lora, **relays)


class _StepReporter:
    """Hooks on the DiT: report progress, send previews and honour cancellation at every step.

    diffusers' loop has no callback, but every step is exactly one DiT forward (no CFG), so hooks
    on the transformer see each step without changing the loop. The preview reads the forward's
    input rows and predicted velocity and writes nothing, so results are the same with or without it.
    """

    def __init__(self, total: int, options: SamplingOptions, scheduler=None, geometry=None):
        self.total, self.progress, self.cancel, self.done = total, options.progress, options.cancel, 0
        self.preview, self.scheduler, self.geometry = options.preview, scheduler, geometry

    def __call__(self, module, args, kwargs):
        check_cancel(self.cancel, f"after {self.done} of {self.total} denoising steps")
        if self.progress is not None and self.done == 0:
            self.progress(0, self.total)

    def after(self, module, args, kwargs, output):
        step = self.done
        self.done += 1
        video = self._estimate(step, kwargs, output) if self.preview is not None else None
        if video is not None:
            self.preview(self.done, self.total, video)  # carries the step count: it stands for `progress` here
        elif self.progress is not None:
            self.progress(self.done, self.total)

    def _estimate(self, step: int, kwargs: dict, output) -> torch.Tensor | None:
        sigmas = getattr(self.scheduler, "sigmas", None)
        hidden = kwargs.get("hidden_states")
        if sigmas is None or step >= len(sigmas) or hidden is None or self.geometry is None:
            return None
        return previews.denoised_video(hidden[0], output[0][0], float(sigmas[step]), self.geometry)


class DiffusionStage:
    """Holds the DiT partition(s) and the decoders; loads each partition on first use."""

    def __init__(
        self,
        source: ModelSource | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        offload: str = "none",
        modules: dict | None = None,
        pipeline_config: dict | None = None,
        parallel=None,
    ):
        """Load components from `source` on first use, or adopt already-loaded `modules` (keys
        transformer / transformer_ref / vae / audio_vae: the ComfyUI nodes' loaders own the weights).

        `parallel` (a `sequence_parallel.Layout` of N > 1 ranks, inside its process group): the DiT runs
        sequence-parallel, each rank holding 1/N of its activations (h3_core/sequence_parallel.py)."""
        if source is None and modules is None:
            raise ValueError("DiffusionStage needs a model source or loaded modules")
        self.source = source
        self.dtype = dtype
        self.device = torch.device(device)
        self.offload = offload  # DiT placement: none / block / auto (h3_core.offload)
        self.parallel = parallel if parallel is not None and parallel.degree > 1 else None
        self.streaming: dict[str, Streaming] = {}
        self._job = {"width": 0, "height": 0, "frames": facts.DEFAULT_FRAMES, "text_tokens": 0}
        self.pipeline_config = dict(pipeline_config if pipeline_config is not None else source.pipeline_config)
        modules = modules or {}
        self._transformers = {
            name: modules[name] for name in ("transformer", "transformer_ref") if modules.get(name) is not None
        }
        self._vae = modules.get("vae")
        self._audio_vae = modules.get("audio_vae")

    def _load(self, name: str, **kwargs) -> torch.nn.Module:
        if self.source is None:
            raise ModelSourceError(f"this diffusion stage was given no {name}, which the request needs")
        module = self.source.load(name, **kwargs)
        dtype = kwargs.get("dtype", torch.float32)
        ranks = self.parallel.degree if self.parallel is not None and name in PARTITION_OF_TASK.values() else 1
        activations = activation_estimate(name, module, dtype, ranks=ranks, **self._job) if name in STREAMABLE else 0
        self.streaming[name] = place(module, name, self.device, self.offload, activation_bytes=activations)
        return module

    # --- components ------------------------------------------------------------------------------

    def transformer(self, task: str) -> torch.nn.Module:
        name = PARTITION_OF_TASK[task]  # FL2VA for t2va/fl2va, Ref2VA for ref2va
        if name not in self._transformers:
            self._transformers[name] = self._load(name, dtype=self.dtype)
        if self.parallel is not None:
            from . import sequence_parallel

            sequence_parallel.parallelize(self._transformers[name], self.parallel)  # once per module
        return self._transformers[name]

    @property
    def vae(self):
        if self._vae is None:
            self._vae = self._load("vae")
        return self._vae

    @property
    def audio_vae(self):
        if self._audio_vae is None:
            self._audio_vae = self._load("audio_vae")
        return self._audio_vae

    # --- sampling --------------------------------------------------------------------------------

    def sample(self, cond: H3Conditioning, options: SamplingOptions) -> AVLatents:
        """Run the flow-matching loop for `cond` as `options` say (see `SamplingOptions`)."""
        from diffusers import MiniMaxH3Scheduler
        from diffusers.modular_pipelines.minimax_h3 import (
            MiniMaxH3AudioReference,
            MiniMaxH3ImageReference,
            MiniMaxH3VideoReference,
        )

        # `cond` validated itself on construction / receipt; here only its fit to the loaded DiT is left.
        for untrained in (rules.trained_range_warning(cond.num_frames),
                          rules.canvas_trained_warning(cond.width, cond.height)):
            if untrained:  # allowed (ComfyUI core allows it too), but said where every caller's log shows it
                logging.getLogger("h3_core").warning("MiniMax H3: %s", untrained)
        # sizes `--offload auto`: every row that is not the generated video's or audio's counts like a text row
        # (keyframes, references and guides: up to 16 clips of 345 frames add as many rows as the video itself)
        condition_rows = sum(lat.shape[2] * (lat.shape[3] // 2) * (lat.shape[4] // 2) for lat in cond.condition_latents)
        condition_rows += sum(rows.shape[0] for rows in cond.audio_condition_latents)
        self._job = {"width": cond.width, "height": cond.height, "frames": cond.num_frames,
                     "text_tokens": int(cond.prompt_embeds.shape[1]) + int(condition_rows)}
        transformer = self.transformer(cond.task)
        file_identity.check_unchanged(transformer, "DiT")  # an in-place rewrite of a mapped file: refuse, not SIGBUS
        cond.check_compatible(text_dim=transformer.config.text_dim, latent_channels=transformer.config.in_channels)
        video_scheduler = MiniMaxH3Scheduler(shift=_or(options.video_shift, facts.VIDEO_SHIFT))
        components = {
            "transformer_ref" if cond.task == "ref2va" else "transformer": transformer,
            "scheduler": video_scheduler,
            "audio_scheduler": MiniMaxH3Scheduler(shift=_or(options.audio_shift, facts.AUDIO_SHIFT)),
        }
        blocks = workflow_blocks(cond.task, ("denoise",))
        if cond.guides:  # guides at any frame: the pack's layout (h3_core/guide_layout.py), diffusers' other blocks
            blocks = guide_layout.guided_blocks(blocks)
        pipe = pipeline_for(blocks, components, self.pipeline_config)

        inputs = {
            "prompt_embeds": cond.prompt_embeds.to(self.device),  # the DiT never moves its text input itself
            "text_token_tags": cond.text_token_tags,
            "height": cond.height,
            "width": cond.width,
            "num_frames": cond.num_frames,
            "num_inference_steps": options.steps,
            "generator": options.generator(),
        }
        if cond.task in ("fl2va", "ref2va"):
            inputs["condition_latents"] = list(cond.condition_latents)
        if cond.task == "fl2va":
            inputs["keyframe_anchors"] = tuple(cond.keyframe_anchors)
        if cond.guides:
            inputs["keyframe_anchors"] = ()  # the anchors are among the guide rows
            inputs["guide_rows"] = guide_layout.entries_of(cond)
            inputs["audio_condition_latents"] = list(cond.audio_condition_latents)
        if cond.task == "ref2va":
            inputs["audio_condition_latents"] = list(cond.audio_condition_latents)
            # Stage 1 reads only each reference's kind and has_audio (never their media): stand-ins.
            stubs = {
                "image": lambda has_audio: MiniMaxH3ImageReference(image=None),
                "audio": lambda has_audio: MiniMaxH3AudioReference(audio=None),
                "video": lambda has_audio: MiniMaxH3VideoReference(
                    frames=None, audio=torch.empty(0) if has_audio else None
                ),
            }
            inputs["normalized_references"] = [stubs[ref.kind](ref.has_audio) for ref in cond.references]

        geometry = None
        if options.preview is not None:
            geometry = previews.generated_video_geometry(cond.num_frames, cond.height, cond.width)
        reporter = _StepReporter(options.steps - 1, options, video_scheduler, geometry)
        handles = [
            transformer.register_forward_pre_hook(reporter, with_kwargs=True),
            transformer.register_forward_hook(reporter.after, with_kwargs=True),
        ]
        lora = options.lora
        lora_context = contextlib.nullcontext() if lora is None else lora.applied(transformer, options.lora_strength)
        caching = step_cache.applied(transformer, step_cache.parse(options.cache), options.steps - 1, options.on_cache)
        try:
            with lora_context, caching as passes:
                state = run_blocks(pipe, **inputs)
        finally:
            for handle in handles:
                handle.remove()
        return AVLatents(video=state.get("latents"), audio=state.get("audio_latents"), passes=passes)

    # --- decoding --------------------------------------------------------------------------------

    def decode(self, latents: AVLatents, *, cancel: threading.Event | None = None) -> Decoded:
        """Decode video (streamed, tile by tile, into one preallocated float32 video: h3_core/vae_stream.py) and
        audio; audio trimmed to the video's duration. Bit-identical to diffusers' decode steps."""
        sink = vae_stream.TensorSink()
        self.decode_video(latents, sink, cancel)
        return Decoded(video=sink.video, audio=self.decode_audio(latents, sink.video.shape[0], cancel=cancel))

    def decode_to_mp4(self, latents: AVLatents, path, *, cancel: threading.Event | None = None, **mp4_options) -> str:
        """Decode straight into an mp4 (media.write_mp4's format): each clip's frames go to the encoder as uint8
        as soon as they are final, so the decoded video never exists in memory. The file equals
        `media.write_mp4(path, *decode(latents))` byte for byte."""
        from . import media

        geometry = vae_stream.plan(self.vae, latents.video.shape)
        with media.streamed_mp4(path, geometry.width, geometry.height, fps=facts.FPS, with_audio=True,
                                sample_rate=facts.AUDIO_SAMPLE_RATE, **mp4_options) as writer:
            self.decode_video(latents, vae_stream.WriterSink(writer.write), cancel)
            writer.finish(self.decode_audio(latents, geometry.frames, cancel=cancel))
        return str(path)

    def decode_to_png(self, latents: AVLatents, path, *, cancel: threading.Event | None = None) -> str:
        """Text to image: the first decoded frame as a PNG (as ComfyUI core's text to image keeps the first frame of
        its shortest, 5-frame, clip); the audio is not decoded. The pixels are the mp4 writer's uint8 rounding of
        that frame."""
        from pathlib import Path

        from . import media

        first: list = []

        def keep_first(frames) -> None:  # each finished run of frames, uint8 [n, H, W, 3]
            if not first:
                first.append(frames[0].copy())

        self.decode_video(latents, vae_stream.WriterSink(keep_first), cancel)
        Path(path).write_bytes(media.encode_png_bytes(first[0]))
        return str(path)

    @torch.no_grad()
    def decode_video(self, latents: AVLatents, sink: vae_stream.FrameSink,
                     cancel: threading.Event | None = None) -> vae_stream.DecodePlan:
        """The video only, into `sink` clip by clip (reports the `decode_video` phase, one unit per tile).

        On CUDA the decoder runs under the official fp16 autocast (dtypes.vae_decode_autocast); on CPU nothing
        changes, so the decode stays bitwise diffusers' fp32 decode. The audio VAE never runs under it."""
        file_identity.check_unchanged(self.vae, "video VAE")
        vae_dtype = next(self.vae.parameters()).dtype
        with dtypes.vae_decode_autocast(self.device, vae_dtype):
            return vae_stream.decode_video(self.vae, latents.video.to(self.device), sink, cancel=cancel)

    @torch.no_grad()
    def decode_audio(self, latents: AVLatents, num_frames: int, *,
                     cancel: threading.Event | None = None) -> torch.Tensor:
        """float32 [2, S] at 32 kHz, trimmed to `num_frames` of video (diffusers' audio decode step, the same block
        in every task's workflow). `cancel` is checked before each of the decoder's layers (`AudioCancel`)."""
        file_identity.check_unchanged(self.audio_vae, "audio VAE")
        blocks = {name: block for name, block in workflow_blocks("t2va", ("decode",)).items() if name == "decode.audio"}
        pipe = pipeline_for(blocks, {"audio_vae": self.audio_vae}, self.pipeline_config)
        check_cancel(cancel, "before the audio decode")
        with _AudioReporter(self.audio_vae), AudioCancel(self.audio_vae, cancel):
            state = pipe(audio_latents=latents.audio.to(self.device))
        audio = state.get("audio")[0].float().cpu()  # [2, S], S = audio_t * 800 (not trimmed by diffusers)
        samples = round(num_frames / facts.FPS * facts.AUDIO_SAMPLE_RATE)
        return audio[:, :samples].contiguous()

    def generate(self, cond: H3Conditioning, options: SamplingOptions) -> tuple[AVLatents, Decoded]:
        latents = self.sample(cond, options)
        return latents, self.decode(latents, cancel=options.cancel)


class AudioCancel:
    """Checks `cancel` before every layer of the audio decoder (BigVGAN: each transposed convolution, each
    convolution and alias-free activation of its AMP blocks: hundreds of checkpoints in one pass), so a cancel
    stops the decode within one layer instead of after the whole pass.

    Why hooks and not a decode in temporal chunks: the decoder's receptive field is finite, but chunked
    convolutions sum in another order at the seams (and replicate-pad the chunk's edges), so chunks would not be
    bitwise the one-pass decode. A forward pre-hook that returns None leaves every input and output untouched: the
    pass, and its result, are diffusers' own. `checks` counts the checkpoints passed (tests count them)."""

    def __init__(self, audio_vae, cancel: threading.Event | None):
        self.audio_vae, self.cancel, self.handles, self.checks = audio_vae, cancel, [], 0

    def _check(self, *_) -> None:
        self.checks += 1
        check_cancel(self.cancel, f"in the audio decode (after {self.checks - 1} of its layers)")

    def __enter__(self):
        decoder = getattr(self.audio_vae, "decoder", None)
        if self.cancel is None or decoder is None:
            return self
        for module in decoder.modules():  # the decoder itself first, then every layer inside it
            self.handles.append(module.register_forward_pre_hook(self._check))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        return False


class _AudioReporter:
    """Reports the `decode_audio` progress phase (one unit) through hooks on the audio decoder that read nothing;
    inert without a sink."""

    def __init__(self, audio_vae):
        self.audio_vae, self.handles = audio_vae, []

    def __enter__(self):
        if not progress.active():
            return self
        audio = {}

        def audio_start(*_):
            audio["counter"] = progress.Counter("decode_audio", 1)

        def audio_done(*_):
            (audio.pop("counter", None) or progress.Counter("decode_audio", 1)).advance()

        decoder = getattr(self.audio_vae, "decoder", None)
        if decoder is not None:
            self.handles.append(decoder.register_forward_pre_hook(audio_start))
            self.handles.append(decoder.register_forward_hook(audio_done))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)
