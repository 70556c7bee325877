"""MiniMax H3 Sampler: conditioning + seed + steps -> the AV latent (core's NestedTensor pair)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..h3_core import assembly, facts, sequence_parallel, sequence_parallel_workers, step_cache
from ..h3_core.diffusion import DiffusionStage, SamplingOptions
from ..h3_core.lora import LoRA, LoRAStack, Schedule
from ..h3_core.models import COMPONENT_NAMES, PARTITION_OF_TASK
from . import comfy_bridge as bridge
from . import graph_checks, loaders, memory, model_files, progress_text
from .input_checks import declared_problems, report
from .loaders import DiTLoader
from .types import SAMPLING_CATEGORY, DiT, Schema

NO_LORA = "none"
EXTRA_LORA_SLOTS = (2, 3)
_CACHE_DIT_HERE = {True: "", False: " (not installed in this ComfyUI: a run with them is refused when queued)"}


def partition_problem(task: str, partition: str) -> str | None:
    """The Sampler's refusal of a DiT of the other partition than the conditioning's task needs."""
    needed = PARTITION_OF_TASK[task]
    if partition == needed:
        return None
    return (f"this {task} conditioning needs the {COMPONENT_NAMES[needed]}; the loaded DiT is the "
            f"{COMPONENT_NAMES[partition]} (in {DiTLoader.DISPLAY_NAME}, pick a DiT file of the other partition, or "
            "set `partition` for a model folder)")


class Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
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
                    "exact. quality / balanced / fast: cache-dit's adaptive DBCache, faster and further from off in "
                    "that order; these three need cache-dit, which the pack's requirements.txt does not install: "
                    f"{graph_checks.CACHE_DIT_INSTALL}{_CACHE_DIT_HERE[graph_checks.cache_dit_installed()]}. "
                    "every:K: the DiT's blocks on every K-th step only (about 1/K of the work), nothing to install. "
                    "The progress text shows how much of the DiT's block runs the cache skipped.",
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
                    "divide by N (checked from its file's header when the prompt is queued). The text encoder stays "
                    "where its loader put it.",
                ),
                # Appended after `gpus` (saved workflows keep their widget order): more LoRAs stacked on `lora`.
                *(
                    widget
                    for slot in EXTRA_LORA_SLOTS
                    for widget in (
                        io.Combo.Input(
                            f"lora_{slot}",
                            options=[NO_LORA] + folder_paths.get_filename_list("loras"),
                            default=NO_LORA,
                            optional=True,
                            tooltip=f"LoRA {slot}, stacked on `lora`: each adds its own update at its own strength.",
                        ),
                        io.Float.Input(
                            f"lora_{slot}_strength", default=1.0, min=-4.0, max=4.0, step=0.05, optional=True,
                            tooltip=f"Multiplier on LoRA {slot}'s update.",
                        ),
                    )
                ),
                io.Boolean.Input(
                    "lora_skip_audio",
                    default=False,
                    optional=True,
                    tooltip="Leave the LoRAs' audio-branch weights out (the audio patch projection in and head out, "
                    "each block's AdaLN audio rows, a PDD audio head bank): for a video-only LoRA that should not "
                    "touch the sound.",
                ),
            ],
            outputs=[io.Latent.Output(tooltip="AV latent: video [1,24,T,H/16,W/16] + audio [1,32,2,Ta].")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **inputs):
        """Queue time, no model loaded: the widgets' bounds, `cache`, and what the graph fixes (graph_checks): the
        DiT partition against the conditioning's task, `gpus` against the DiT's attention heads (its header)."""
        problems = [problem for problem in declared_problems(cls, inputs) if problem[0] != "cache"]
        if inputs.get("cache") is not None:  # None: linked (a primitive), checked when it runs
            wrong = graph_checks.cache_problem(inputs["cache"])
            if wrong:
                problems.append(("cache", wrong))
        blamed = {name for name, _ in problems}
        return report(problems + [problem for problem in graph_problems(cls, inputs) if problem[0] not in blamed])

    @classmethod
    def execute(
        cls, dit, conditioning, seed, steps, video_shift, audio_shift, lora=NO_LORA, lora_strength=1.0,
        cache=step_cache.OFF, gpus=1, lora_2=NO_LORA, lora_2_strength=1.0, lora_3=NO_LORA, lora_3_strength=1.0,
        lora_skip_audio=False,
    ) -> io.NodeOutput:
        cond = assembly.conditioning_from_core(conditioning)  # complete + valid, before any heavy work
        needed = PARTITION_OF_TASK[cond.task]
        mismatch = partition_problem(cond.task, dit.extra["partition"])
        if mismatch:
            raise ValueError(mismatch)
        chosen = [(folder_paths.get_full_path_or_raise("loras", name), strength)
                  for name, strength in ((lora, lora_strength), (lora_2, lora_2_strength), (lora_3, lora_3_strength))
                  if name not in (None, NO_LORA)]
        # With gpus > 1 the workers load the LoRAs from their files (SamplingOptions.to_wire): none is loaded here.
        adapter = None if gpus > 1 else lora_stack(chosen, steps, video_shift, audio_shift, bool(lora_skip_audio))
        # one tick and one "DiT forward k/n" line per forward: steps - 1 of them; with a step cache the same line
        # ends with what it skipped so far (one line: the step count stays readable)
        cached: dict = {}
        report = progress_text.with_text(bridge.progress_callback(cls.hidden.unique_id), cls.hidden.unique_id,
                                         "denoise", suffix=lambda: cache_suffix(cached.get("passes")))
        started = time.monotonic()
        options = SamplingOptions(
            steps=steps,
            seed=seed,
            video_shift=video_shift,
            audio_shift=audio_shift,
            progress=report,
            preview=bridge.preview_callback(cls.hidden.unique_id, report),
            cancel=bridge.InterruptFlag(),
            lora=adapter,
            cache=cache,
            # the running count of the DiT's block runs, for the steps' line (none for `off`: nothing is skipped)
            on_cache=None if cache == step_cache.OFF else lambda passes: cached.__setitem__("passes", passes),
        )
        if gpus > 1:
            latents = bridge.run_interruptible(_sample_parallel, dit, needed, gpus, cond, options, chosen,
                                               not lora_skip_audio, cls.hidden.unique_id)
        else:
            # The user went back to one process: the workers' N DiT copies are not kept for a later gpus > 1.
            sequence_parallel_workers.close_pool("a MiniMax H3 Sampler ran with gpus 1")
            # Room for this job's activations: ComfyUI streams the DiT's layers that no longer fit beside them.
            device = bridge.use(dit.patcher, memory_required=memory.sampling_bytes(cond, dit.module, dit.dtype))
            stage = DiffusionStage(modules={needed: dit.module}, pipeline_config=dit.pipeline_config, device=device,
                                   dtype=dit.dtype)
            latents = bridge.run_interruptible(stage.sample, cond, options)
            # the last line says it is done (not a step count that looks stuck) and, cached, what the cache saved;
            # with gpus > 1 the workers' line ("2 DiT workers warm: 2.2 GB") stays instead
            passes = latents.passes if cache != step_cache.OFF else None
            progress_text.leave(cls.hidden.unique_id, progress_text.sampler_summary(
                time.monotonic() - started, max(steps - 1, 0), None if passes is None else passes.skipped_percent))
        return io.NodeOutput(bridge.av_latent(latents.video, latents.to_comfy_audio()))


def cache_suffix(passes) -> str:
    """What the steps' line adds during a cached run: the share of the DiT's block runs skipped so far."""
    return "" if passes is None or not passes.total else f", cache skipped {passes.skipped_percent}%"


def lora_stack(chosen, steps, video_shift, audio_shift, skip_audio: bool):
    """SamplingOptions.lora for `chosen` [(path, strength)]: a LoRAStack carrying the run's schedule (a PDD head bank
    needs it), or None."""
    loras = [(LoRA.load(path, audio=not skip_audio), strength) for path, strength in chosen]
    return LoRAStack(tuple(loras), Schedule(steps, video_shift, audio_shift)) if loras else None


# What a cold worker start shows on the Sampler (PhaseText adds " - N s" while a line stays): seconds on the tiny
# model, minutes with a 33B DiT per rank, where the last run's "DiT forward 49/49" would otherwise look finished.
WORKER_START_TEXT = {"connect": "starting {total} DiT workers: {done}/{total}",
                     "load": "loading the DiT in {total} workers"}
POOL_UNLOAD_HOOK = "the MiniMax H3 Sampler's sequence-parallel workers"


def _sample_parallel(dit, component: str, gpus: int, cond, options, loras, lora_audio: bool, node_id=None):
    """The DiT sequence-parallel on `gpus` warm worker processes from the DiT Loader's device on, each loading the
    loader's file (h3_core/sequence_parallel_workers.py); the loader's own copy stays where ComfyUI keeps it. The
    workers stop with ComfyUI's Unload Models; while they live, the node's last line says what they hold."""
    heads = getattr(dit.module.config, "num_attention_heads", None)
    layout = sequence_parallel.check(gpus, "ulysses", dit.patcher.load_device, heads, what="gpus")
    recipe = sequence_parallel_workers.DiTRecipe.of(dit.source, component, dit.dtype, dit.fingerprint)
    bridge.on_unload_models(POOL_UNLOAD_HOOK, lambda: sequence_parallel_workers.close_pool("ComfyUI unloaded models"))
    # its heartbeat ends with the start, before the steps' text (no summary: the steps' first line follows)
    with progress_text.PhaseText(node_id, summarize=False) as text:
        sequence_parallel_workers.warm_pool(recipe, layout, options.cancel,
                                            on_start=lambda stage, done, total: text.show(WORKER_START_TEXT[stage],
                                                                                          done, total))
    latents = sequence_parallel_workers.sample(recipe, layout, cond, options, loras, lora_audio)
    summary = sequence_parallel_workers.warm_summary()
    if summary:
        bridge.progress_text(node_id, "{}")(summary)
    return latents


# --- queue time: what the graph fixes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuedDiT:
    """What the DiT Loader feeding a Sampler will load, read from its widgets and its file's header."""

    partition: str | None  # the slot (transformer / transformer_ref); None when only loading can tell
    path: Path | None  # the file or component folder the heads are read from
    device: str | None  # the loader's `device` widget
    heads: int | None = None  # known without a file (the embedded tiny H3 before its first build)


def queued_dit(graph_: dict | None, sampler_id) -> QueuedDiT | None:
    """The DiT the Sampler `sampler_id` gets, from its DiT Loader's widgets and header; None when the graph does not
    say (another node feeds `dit`, the embedded tiny H3 is not built yet: queue time never builds it)."""
    source = graph_checks.linked(graph_, sampler_id, "dit")
    if source is None or source[1].get("class_type") != graph_checks.DIT_LOADER:
        return None
    widgets = source[1]["inputs"]
    choice, widget = widgets.get(DiTLoader.INPUT_ID), widgets.get("partition")
    if not isinstance(choice, str):
        return None
    device = widgets.get("device") if isinstance(widgets.get("device"), str) else None
    if (model_files.is_tiny(choice) or choice in bridge.LEGACY_TINY_CHOICES) and model_files.tiny_needs_build():
        return _unbuilt_tiny(choice, widget, device)
    if model_files.problems(DiTLoader.FOLDER, model_files.DIT, choice, {}):
        return None  # the loader refuses it itself
    try:
        path, whole_folder = bridge.resolve_model_path(DiTLoader.FOLDER, choice)
        said = None if whole_folder else model_files.identify(path).partition
    except (OSError, ValueError):
        return None
    partition = model_files.PARTITION_SLOTS[said] if said else loaders.PARTITIONS.get(widget)
    if whole_folder:
        path = _component_folder(path, partition)
    return QueuedDiT(partition, path, device)


def _unbuilt_tiny(choice: str, widget, device: str | None) -> QueuedDiT | None:
    """The embedded tiny H3 before its first build (queue time never builds it, ~30 s): its files' names say their
    partition, and both its DiTs have the tiny config's heads."""
    from ..h3_core import configs

    if choice.startswith(bridge.TINY_FILE_PREFIX):
        name = choice.removeprefix(bridge.TINY_FILE_PREFIX)
        said = next((token for token in model_files.PARTITION_SLOTS if f"_{token}_" in name), None)
        if said is None:
            return None
        partition = model_files.PARTITION_SLOTS[said]
    else:
        partition = loaders.PARTITIONS.get(widget)
    heads = configs.get("transformer", tiny=True).get("num_attention_heads")
    return QueuedDiT(partition, None, device, heads if isinstance(heads, int) else None)


def _component_folder(root: Path, slot: str | None) -> Path | None:
    from ..h3_core.models import ModelSource

    if slot is None:
        return None
    try:
        return ModelSource.from_path(root).paths.get(slot)
    except Exception:  # noqa: BLE001 - a folder only loading can judge: the run says what is wrong with it
        return None


_HEADS: dict[tuple[str, int, int], int | None] = {}


def dit_heads(path: Path | None) -> int | None:
    """The DiT's attention heads from its header and config (sequence_parallel.dit_heads; cached by path, size and
    mtime); None when they cannot be read without loading."""
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HEADS:
        if len(_HEADS) >= 1024:
            _HEADS.clear()
        try:
            _HEADS[key] = sequence_parallel.dit_heads(path)
        except Exception:  # noqa: BLE001 - unreadable here: the run checks the loaded module's config instead
            _HEADS[key] = None
    return _HEADS[key]


@graph_checks.guarded
def graph_problems(node_cls, inputs: dict) -> list[tuple[str, str]]:
    """The Sampler's refusals the graph already fixes: a DiT of the other partition than the conditioning's task
    (on `dit`), `gpus` the DiT's heads (or this machine's GPUs) cannot take (on `gpus`)."""
    graph_ = graph_checks.graph()
    sampler_id = getattr(getattr(node_cls, "hidden", None), "unique_id", None)
    if graph_ is None or sampler_id is None:
        return []
    dit = queued_dit(graph_, sampler_id)
    if dit is None:
        return []
    problems = []
    task = graph_checks.conditioning_task(graph_, sampler_id)
    if task is not None and dit.partition is not None:
        mismatch = partition_problem(task, dit.partition)
        if mismatch:
            problems.append(("dit", mismatch))
    gpus = inputs.get("gpus")
    if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 1:
        try:
            device = loaders._placed(dit.device, *DiTLoader.devices())[0]
        except ValueError:  # a device this machine lacks: the DiT Loader's own error
            return problems
        try:
            heads = dit.heads if dit.heads is not None else dit_heads(dit.path)
            sequence_parallel.check(gpus, "ulysses", device, heads, what="gpus")
        except sequence_parallel.SequenceParallelError as error:
            problems.append(("gpus", str(error)))
    return problems


NODES = [Sampler]
