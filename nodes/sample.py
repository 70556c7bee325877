"""MiniMax H3 Sampler: conditioning + seed + steps -> the AV latent (core's NestedTensor pair)."""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from ..h3_core import assembly, facts, sequence_parallel, sequence_parallel_workers, step_cache
from ..h3_core.diffusion import DiffusionStage, SamplingOptions
from ..h3_core.lora import LoRA
from ..h3_core.models import COMPONENT_NAMES, PARTITION_OF_TASK
from . import comfy_bridge as bridge
from . import memory, progress_text
from .loaders import DiTLoader
from .types import SAMPLING_CATEGORY, DiT

NO_LORA = "none"


class Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitSampler",
            display_name="MiniMax H3 Sampler",
            category=SAMPLING_CATEGORY,
            description="Makes the video and its sound together from the conditioning: connect the DiT loader and the "
            "conditioning (encode nodes, Remote Encode or Load Conditioning), then MiniMax H3 VAE Decode. Each step "
            "runs the DiT once (no negative prompt, no CFG). The release uses 50 steps with shifts 12 (video) and 3 "
            "(audio); a seed gives the same result as diffusers' H3 pipeline with that seed.",
            inputs=[
                DiT.Input("dit", tooltip=f"From {DiTLoader.DISPLAY_NAME}: the partition the task needs."),
                io.Conditioning.Input(
                    "conditioning", tooltip="From the H3 encode nodes, Remote Encode or Load Conditioning."
                ),
                io.Int.Input(
                    "seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                    tooltip="The noise the video and sound start from: the same seed, inputs and settings give the "
                    "same result (as `python -m h3_core generate --seed`). control after generate: randomize picks "
                    "a new one each run, fixed keeps it.",
                ),
                io.Int.Input(
                    "steps",
                    default=50,
                    min=2,
                    max=200,
                    tooltip="Sampling steps as diffusers counts them (num_inference_steps: noise levels including the "
                    "final 0), so steps - 1 DiT forwards, one progress tick each (8 -> 7). 50 is the release's "
                    "setting for the real weights; a Turbo LoRA uses 5 or 9 (its card).",
                ),
                io.Float.Input(
                    "video_shift",
                    default=facts.VIDEO_SHIFT,
                    min=0.1,
                    max=100.0,
                    step=0.1,
                    tooltip="Flow shift of the video stream (12 released; 6 for some Turbo LoRAs).",
                ),
                io.Float.Input(
                    "audio_shift",
                    default=facts.AUDIO_SHIFT,
                    min=0.1,
                    max=100.0,
                    step=0.1,
                    tooltip="Flow shift of the audio stream (3 released).",
                ),
                io.Combo.Input(
                    "lora",
                    options=[NO_LORA] + folder_paths.get_filename_list("loras"),
                    default=NO_LORA,
                    optional=True,
                    tooltip="A DiT LoRA from models/loras (e.g. a Turbo LoRA: 5 or 9 steps, "
                    "video shift 6 or 12 per its card), applied beside the weights for this run only.",
                ),
                io.Float.Input(
                    "lora_strength",
                    default=1.0,
                    min=-4.0,
                    max=4.0,
                    step=0.05,
                    optional=True,
                    tooltip="Multiplier on the LoRA's update.",
                ),
                io.Combo.Input(
                    "cache",
                    options=list(step_cache.CHOICES),
                    default=step_cache.OFF,
                    optional=True,
                    tooltip="Step caching of the DiT: skip the block stack on steps where it barely changes. off: "
                    "exact. quality / balanced / fast: cache-dit's adaptive DBCache (needs `pip install cache-dit`), "
                    "faster and further from off in that order. every:K: the stack every K-th step only (about 1/K "
                    "of the block passes). The progress text shows block passes computed.",
                ),
                io.Int.Input(
                    "gpus",
                    default=1,
                    min=1,
                    max=64,
                    optional=True,
                    tooltip="Processes (one per GPU) the DiT samples on, sequence-parallel; same result as 1. 1: in "
                    "ComfyUI's process. N > 1: N warm worker processes on cuda:k..cuda:k+N-1 (cuda:k = the DiT "
                    "Loader's device; on a CPU-only machine N CPU processes), each loading the DiT from its file (N "
                    "copies of its weights, each GPU holding 1/N of the activations); the DiT's attention heads must "
                    "divide by N. The text encoder stays where its loader put it.",
                ),
            ],
            outputs=[io.Latent.Output(tooltip="AV latent: video [1,24,T,H/16,W/16] + audio [1,32,2,Ta].")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, dit, conditioning, seed, steps, video_shift, audio_shift, lora=NO_LORA, lora_strength=1.0,
        cache=step_cache.OFF, gpus=1,
    ) -> io.NodeOutput:
        cond = assembly.conditioning_from_core(conditioning)  # complete + valid, before any heavy work
        needed = PARTITION_OF_TASK[cond.task]
        if dit.extra["partition"] != needed:
            raise ValueError(
                f"this {cond.task} conditioning needs the {COMPONENT_NAMES[needed]}; the loaded DiT is the "
                f"{COMPONENT_NAMES[dit.extra['partition']]} (in {DiTLoader.DISPLAY_NAME}, pick a DiT file of the "
                "other partition, or set `partition` for a model folder)"
            )
        adapter = None if lora in (None, NO_LORA) else LoRA.load(folder_paths.get_full_path_or_raise("loras", lora))
        # one tick and one "DiT forward k/n" line per forward: steps - 1 of them
        report = progress_text.with_text(bridge.progress_callback(cls.hidden.unique_id), cls.hidden.unique_id,
                                         "denoise")
        options = SamplingOptions(
            steps=steps,
            seed=seed,
            video_shift=video_shift,
            audio_shift=audio_shift,
            progress=report,
            preview=bridge.preview_callback(cls.hidden.unique_id, report),
            cancel=bridge.InterruptFlag(),
            lora=adapter,
            lora_strength=lora_strength,
            cache=cache,
            # the running block-pass count as the node's progress text (none for `off`: nothing is skipped)
            on_cache=None if cache == step_cache.OFF else bridge.progress_text(cls.hidden.unique_id, "cache: {}"),
        )
        if gpus > 1:
            lora_path = None if adapter is None else folder_paths.get_full_path_or_raise("loras", lora)
            latents = bridge.run_interruptible(_sample_parallel, dit, needed, gpus, cond, options, lora_path)
        else:
            # Room for this job's activations: ComfyUI streams the DiT's layers that no longer fit beside them.
            device = bridge.use(dit.patcher, memory_required=memory.sampling_bytes(cond, dit.module, dit.dtype))
            stage = DiffusionStage(modules={needed: dit.module}, pipeline_config=dit.pipeline_config, device=device,
                                   dtype=dit.dtype)
            latents = bridge.run_interruptible(stage.sample, cond, options)
        return io.NodeOutput(bridge.av_latent(latents.video, latents.to_comfy_audio()))


def _sample_parallel(dit, component: str, gpus: int, cond, options, lora_path: str | None):
    """The DiT sequence-parallel on `gpus` warm worker processes from the DiT Loader's device on, each loading the
    loader's file (h3_core/sequence_parallel_workers.py); the loader's own copy stays where ComfyUI keeps it."""
    heads = getattr(dit.module.config, "num_attention_heads", None)
    layout = sequence_parallel.check(gpus, "ulysses", dit.patcher.load_device, heads, what="gpus")
    recipe = sequence_parallel_workers.DiTRecipe.of(dit.source, component, dit.dtype, dit.fingerprint)
    return sequence_parallel_workers.sample(recipe, layout, cond, options, lora_path)


NODES = [Sampler]
