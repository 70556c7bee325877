"""ComfyUI core 0.33's own H3 (`comfy/ldm/minimax`, `comfy/model_base.MiniMaxH3`, its sampler) on a tiny DiT file.

A second, independent implementation of the H3 DiT beside diffusers: `tests/test_core_fidelity.py` feeds it the
CONDITIONING the pack's contract builds (`h3_core.contract.comfy.encode`) and the packed inputs diffusers saw, and
compares. Core is never imported into the caller's process (its `comfy.cli_args` parses argv, `model_management`
probes devices at import): `run(job)` starts one Python that puts the core folder first on `sys.path`, sets
`sys.argv = ['main.py', '--cpu']`, loads the Comfy-format DiT file with core's own loader
(`comfy.sd.load_diffusion_model`: core detects H3 and infers every size from tensor shapes), does the job and
writes its tensors as safetensors (no pickle either way). This file is also that worker (`python core_reference.py
JOB_DIR`); the worker half imports only torch, safetensors and core. `python tests/support/core_reference.py
--report TINY_DIR` (repo root, the venv's Python) prints the per-task tables (`report`).

A job (`Job`) holds:
  * `conditioning`: core's CONDITIONING `[[prompt_embeds, extras]]`, exactly as `contract.comfy.encode` makes it;
  * `forwards`: one DiT forward each (video `[1, 24, T, H, W]`, audio `[1, 32, 2, T]`, the video sigma); the
    result is returned as diffusers' *data-ward* velocity (core returns its negation, the CONST convention);
  * `samples`: a whole sampling each, from the given noise over the given video sigmas, either
    `loop="core"` (core's own `comfy.sample.sample_custom` with its `euler` sampler, `ModelSamplingAV`, its audio
    carry, everything a ComfyUI user runs; the shifts set by core's own `ModelSamplingMiniMaxH3` node) or
    `loop="two_schedules"` (core's DiT stepped by diffusers' recipe: video and audio Euler-stepped separately over
    their own sigma lists; isolates the DiT from the sampler).

Two switches state where the harness departs from stock core, and why (the test measures both departures):
  * `cond_noise="given"`: the condition latents in `conditioning` are already noise-augmented (diffusers' rows,
    drawn from the request generator) and core's own augmentation (`_cond_video_rows`, a fresh
    `Generator(seed)` per condition) is switched off for the rows only; the rows still run at core's 0.999 label.
    `"core"` runs stock core.
  * `refine_text="always"`: core's `preprocess_text_embeds` decides "already refined" from the width
    (`shape[-1] == hidden_size`); the tiny DiT has `text_dim == hidden_size == 64`, so stock core would skip
    `condition_proj` + the token refiner on it. `"always"` refines once, which is what core does for every
    release-size DiT (text_dim 5120 != hidden 5376). `"core"` runs stock core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CORE_DIR_ENV = "H3_CORE033_DIR"
# Modules core 0.33 imports on the path this harness takes, beyond what the pack's own tests use.
CORE_MODULES = ("comfy_aimdo", "comfy_kitchen", "einops", "torchsde", "scipy", "psutil", "yaml", "safetensors")
TIMEOUT_S = 900


def core_dir() -> Path:
    """Where ComfyUI core 0.33 is extracted: `$H3_CORE033_DIR`, else `<repo>/.comfyui-0.33`."""
    return Path(os.environ.get(CORE_DIR_ENV) or REPO / ".comfyui-0.33")


def core_overlay() -> Path:
    """Core 0.33's own pins (comfy-kitchen 0.2.31, comfy-aimdo, ...) beside the venv: scripts/setup_comfyui.sh section
    6 installs there whatever core needs that the venv (ComfyUI 0.3.75's) lacks or has at another version."""
    return Path(sys.prefix) / "h3-comfyui-0.33-site"


def unavailable() -> str | None:
    """Why core's H3 cannot run here (a skip reason), or None."""
    import importlib.util

    root = core_dir()
    if not (root / "comfy" / "ldm" / "minimax" / "model.py").is_file():
        return (f"ComfyUI core 0.33 (with comfy/ldm/minimax) not found at {root}: set {CORE_DIR_ENV} or run "
                "scripts/setup_comfyui.sh")
    overlay = core_overlay()
    missing = [name for name in CORE_MODULES if importlib.util.find_spec(name) is None
               and not (overlay / name).is_dir() and not (overlay / f"{name}.py").is_file()]
    if missing:
        return f"ComfyUI core 0.33's requirements are not installed in this venv: {', '.join(missing)}"
    return None


# The bars the pack's H3 is held to against core's, relative (max |d| / max |ref|, fp32, CPU): one DiT forward at every
# step, and the final latents of a whole sampling with core's own sampler (tests/test_core_fidelity.py,
# tests/test_guides_core.py).
FORWARD_BAR = 1e-4
SAMPLING_BAR = 1e-3


@pytest.fixture(scope="module")
def core_ready():
    """Skips, saying why, before anything is loaded, when core 0.33 or its requirements are missing (a module that
    imports this fixture uses it)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


@dataclass
class Job:
    dit: str  # a Comfy-format single-file DiT (e.g. the tiny's diffusion_models/minimax_h3_tiny_fl2va_fp32)
    conditioning: list  # core's CONDITIONING: [[prompt_embeds, extras]]
    seed: int = 0
    cond_noise: str = "given"  # "given" | "core" (see the module docstring)
    refine_text: str = "always"  # "always" | "core"
    threads: int = 2
    forwards: list[dict] = field(default_factory=list)  # {"name", "sigma", "video", "audio"}
    samples: list[dict] = field(default_factory=list)  # {"name", "loop", "sigmas", "noise_video", "noise_audio",
    #                                                      "audio_sigmas" (two_schedules), "shift_video", "shift_audio"}


# --- tensors <-> JSON + one safetensors file -------------------------------------------------------------------

def _pack(value, tensors: dict, path: str):
    if isinstance(value, torch.Tensor):
        for name, stored in tensors.items():  # one tensor reached twice is stored once
            if stored is value:
                return {"__tensor__": name}
        tensors[path] = value
        return {"__tensor__": path}
    if isinstance(value, dict):
        return {"__dict__": [[k, _pack(v, tensors, f"{path}.{k}")] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_pack(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{path}: {type(value).__name__} cannot cross to the core worker")


def _unpack(value, tensors: dict):
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        return {k: _unpack(v, tensors) for k, v in value["__dict__"]}
    if isinstance(value, list):
        return [_unpack(v, tensors) for v in value]
    return value


def run(job: Job, workdir: str | Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Run `job` in one fresh Python on core; returns (tensors by "<name>.video" / "<name>.audio", info)."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        tensors: dict[str, torch.Tensor] = {}
        spec = _pack({k: getattr(job, k) for k in job.__dataclass_fields__}, tensors, "job")
        tensors = {name: t.detach().cpu().clone() for name, t in tensors.items()}
        save_file(tensors, str(tmp / "inputs.safetensors"), metadata={"job": json.dumps(spec)})
        paths = [str(core_overlay()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "H3_CORE033_DIR": str(core_dir()), "OMP_NUM_THREADS": str(job.threads),
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(paths)}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(tmp)], env=env, cwd=str(tmp),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"core worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        info = json.loads((tmp / "info.json").read_text())
        return load_file(str(tmp / "outputs.safetensors")), info


# --- the diffusers side: its packed inputs, turned into core's ---------------------------------------------------

def fidelity(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, that / max |ref|): the relative figure the fidelity bars are stated in."""
    if got.shape != ref.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(ref.shape)}")
    diff = (got.double() - ref.double()).abs().max().item()
    return diff, diff / max(ref.double().abs().max().item(), 1e-30)


@dataclass
class Trace:
    """diffusers' run of one conditioning (the pack's stage 1), every DiT call recorded, in core's layouts."""

    task: str
    video_shape: tuple  # [1, 24, T, H, W]
    sigmas: torch.Tensor  # the video scheduler's sigmas, final 0 included
    audio_sigmas: torch.Tensor  # the audio scheduler's
    inputs: list  # per step: (video [1, 24, T, H, W], audio [1, 32, 2, Ta]) the generated rows
    velocities: list  # per step: (video, audio) diffusers' velocity of the generated rows, same layouts
    condition_latents: list  # the condition latents as diffusers packed them (noise-augmented), [1, 24, t, h, w]
    final_video: torch.Tensor
    final_audio: torch.Tensor  # [1, 32, 2, Ta]


def diffusers_trace(stage, cond, steps: int, seed: int) -> Trace:
    """Sample `cond` on the pack's `DiffusionStage` (diffusers' blocks, bit-identical to its monolithic pipeline)
    and record the packed inputs and outputs of every DiT call."""
    from diffusers import MiniMaxH3Scheduler

    from h3_core import facts
    from h3_core.contract.layout import audio_rows_to_latent, unpatchify_video_rows
    from h3_core.diffusion import AVLatents, SamplingOptions

    transformer = stage.transformer(cond.task)
    calls = []

    def record(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"][0].detach().float().cpu().clone(),
                      kwargs["audio_hidden_states"][0].detach().float().cpu().clone(),
                      output[0][0].detach().float().cpu().clone(), output[1][0].detach().float().cpu().clone()))

    handle = transformer.register_forward_hook(record, with_kwargs=True)
    try:
        latents = stage.sample(cond, SamplingOptions(steps=steps, seed=seed))
    finally:
        handle.remove()

    _, c, t, h, w = latents.video.shape
    n_video = t * (h // 2) * (w // 2)
    n_audio = latents.audio.shape[0] * latents.audio.shape[-1]

    def video(rows):
        return unpatchify_video_rows(rows[-n_video:], t, h, w, c)

    def audio(rows):
        return audio_rows_to_latent(rows[-n_audio:])

    conditions, offset = [], 0
    for lat in cond.condition_latents:
        _, cc, ct, ch, cw = lat.shape
        n = ct * (ch // 2) * (cw // 2)
        conditions.append(unpatchify_video_rows(calls[0][0][offset:offset + n], ct, ch, cw, cc))
        offset += n
    if offset != calls[0][0].shape[0] - n_video:
        raise AssertionError(f"condition rows: {offset} unpacked, {calls[0][0].shape[0] - n_video} packed")

    schedules = []
    for shift in (facts.VIDEO_SHIFT, facts.AUDIO_SHIFT):
        scheduler = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(steps)
        schedules.append(scheduler.sigmas.float().cpu())
    return Trace(
        task=cond.task, video_shape=tuple(latents.video.shape), sigmas=schedules[0], audio_sigmas=schedules[1],
        inputs=[(video(v), audio(a)) for v, a, _, _ in calls],
        velocities=[(video(v), audio(a)) for _, _, v, a in calls],
        condition_latents=conditions,
        final_video=latents.video.float().cpu(),
        final_audio=AVLatents(video=latents.video, audio=latents.audio).to_comfy_audio().float().cpu(),
    )


def core_conditioning(cond, trace: Trace | None = None) -> list:
    """Core's CONDITIONING as the contract builds it (`H3Conditioning.to_comfy` / `contract.comfy.encode`); with
    `trace`, each condition latent replaced by the noise-augmented one diffusers packed (for `cond_noise="given"`),
    in the same (packed) order core's `extra_conds` collects them."""
    from h3_core.contract import comfy as contract_comfy

    [[embeds, extras]] = contract_comfy.encode(cond)
    if trace is None:
        return [[embeds, extras]]
    noised = iter(trace.condition_latents)
    extras = dict(extras)
    for key in ("minimax_keyframes", "minimax_refs"):
        if key in extras:
            extras[key] = [{**entry, "latent": next(noised)} if entry.get("latent") is not None else dict(entry)
                           for entry in extras[key]]
    if next(noised, None) is not None:
        raise AssertionError("more condition latents than core entries")
    return [[embeds, extras]]


def job_for(dit: str | Path, cond, trace: Trace, seed: int, *, cond_noise: str = "given",
            refine_text: str = "always", forwards: bool = True, loops: tuple = ("core", "two_schedules"),
            threads: int | None = None) -> Job:
    """The job that replays `trace` on core: one forward per traced step, one sampling per loop."""
    from h3_core import facts

    job = Job(dit=str(dit), conditioning=core_conditioning(cond, trace if cond_noise == "given" else None),
              seed=seed, cond_noise=cond_noise, refine_text=refine_text,
              threads=threads if threads is not None else int(os.environ.get("H3_THREADS", "2")))
    if forwards:
        job.forwards = [{"name": f"step{i}", "sigma": float(trace.sigmas[i]), "video": v, "audio": a}
                        for i, (v, a) in enumerate(trace.inputs)]
    noise_video, noise_audio = trace.inputs[0]  # sigma 1: the generated rows are the initial noise
    job.samples = [{"name": loop, "loop": loop, "sigmas": trace.sigmas, "audio_sigmas": trace.audio_sigmas,
                    "noise_video": noise_video, "noise_audio": noise_audio, "shift_video": facts.VIDEO_SHIFT,
                    "shift_audio": facts.AUDIO_SHIFT} for loop in loops]
    return job


# --- the numbers, per task (also `python tests/support/core_reference.py --report [TINY_DIR]`) -------------------

TASK_CASES = {"t2va": "t2va-64x64-seed0", "fl2va": "fl2va-first-last-seed1", "ref2va": "ref2va-image-video-audio-seed2"}


def tiny_dit(tiny_dir: str | Path, task: str) -> Path:
    """The tiny Comfy-format fp32 DiT of `task`'s partition (what core's UNETLoader would load)."""
    from h3_core import tiny

    key = "transformer_ref" if task == "ref2va" else "transformer"
    return Path(tiny_dir) / "comfyui" / tiny.COMFY_FILES[key]


def measure(trace: Trace, out: dict, sample_names=("core", "two_schedules")) -> dict:
    """Every comparison of one core run with its diffusers trace: `forward` (worst step), each sampling's final."""
    rows = {}
    fwd = {"video": (0.0, 0.0), "audio": (0.0, 0.0)}
    for i, (v, a) in enumerate(trace.velocities):
        if f"step{i}.video" not in out:
            break
        for stream, ref in (("video", v), ("audio", a)):
            got = fidelity(out[f"step{i}.{stream}"], ref)
            fwd[stream] = max(fwd[stream], got, key=lambda x: x[1])
    if "step0.video" in out:
        rows["forward"] = fwd
    for name in sample_names:
        if f"{name}.video" in out:
            rows[name] = {"video": fidelity(out[f"{name}.video"], trace.final_video),
                          "audio": fidelity(out[f"{name}.audio"], trace.final_audio)}
    return rows


CROP_SECONDS, CROP_FRAMES = 8.0, 124  # an 8 s audio reference for a 124-frame (5.17 s) generation


def crop_report(encoder, diffusion, tiny_dir, steps: int) -> str:
    """Core's ReferenceToVideo node encodes a reference audio whole; diffusers (and the pack's stage 0) cut every
    reference audio to the generated duration. Replayed on core: the cut conditioning vs the same conditioning with
    the uncut latent in its place (what core's node would have made from the same waveform)."""
    from h3_core import testing
    from h3_core.contract.layout import audio_rows_to_latent
    from h3_core.request import AudioInput, EncodeRequest

    def request(frames):
        return EncodeRequest(prompt="<Picture 1> sings, <Audio 1> plays.", num_frames=frames,
                             ref_images=[testing.image(3, 64, 96)],
                             ref_audios=[AudioInput(testing.tone(CROP_SECONDS), 32000)])

    seed = 3
    cond = encoder.encode(request(CROP_FRAMES))
    longer = encoder.prepare(request(int(CROP_SECONDS * 24) + 17))  # long enough that nothing is cut
    [full_rows] = encoder.encode_audio(longer)
    trace = diffusers_trace(diffusion, cond, steps, seed)
    cut_job = job_for(tiny_dit(tiny_dir, "ref2va"), cond, trace, seed, forwards=False, loops=("core",))
    full_job = job_for(tiny_dit(tiny_dir, "ref2va"), cond, trace, seed, forwards=False, loops=("core",))
    [[embeds, extras]] = full_job.conditioning
    full = audio_rows_to_latent(full_rows)
    extras = {**extras, "minimax_refs": [
        {**ref, "audio_latent": full, "ref_audio_t": int(full.shape[-1])} if ref["kind"] == "audio" else ref
        for ref in extras["minimax_refs"]]}
    full_job.conditioning = [[embeds, extras]]
    cut_out, _ = run(cut_job)
    full_out, _ = run(full_job)
    cut_t = int(cond.audio_condition_latents[0].shape[0] // 2)
    lines = [f"### reference-audio crop: an {CROP_SECONDS:g} s audio reference, {CROP_FRAMES} frames generated", "",
             f"diffusers / the pack: {cut_t} audio latent frames ({2 * cut_t} rows); core's node: {full.shape[-1]} "
             f"({2 * full.shape[-1]} rows); the target's time origin moves by {full.shape[-1] - cut_t}", "",
             "| conditioning replayed on core | video max abs | video rel | audio max abs | audio rel |",
             "|---|---|---|---|---|"]
    for label, out in (("cut (the contract's)", cut_out), ("uncut (core's node)", full_out)):
        (va, vr), (aa, ar) = (fidelity(out[f"core.{s}"], ref)
                              for s, ref in (("video", trace.final_video), ("audio", trace.final_audio)))
        lines.append(f"| {label} | {va:.2e} | {vr:.2e} | {aa:.2e} | {ar:.2e} |")
    return "\n".join(lines)


def report(tiny_dir: str | Path, steps: int = 4) -> str:
    """Markdown tables: core vs diffusers per task (the harness's two switches on), then stock core's departures."""
    from h3_core.diffusion import DiffusionStage
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.testing import CASES

    source = ModelSource.from_path(Path(tiny_dir))
    encoder, diffusion = EncoderStage(source), DiffusionStage(source)
    variants = {
        "harness (cond noise given, text refined)": dict(cond_noise="given", refine_text="always"),
        "stock core condition noise (core's Generator(seed) per condition)": dict(cond_noise="core",
                                                                                 refine_text="always"),
        "stock core text path (refiner skipped when text_dim == hidden_size)": dict(cond_noise="given",
                                                                                   refine_text="core"),
    }
    lines = [crop_report(encoder, diffusion, tiny_dir, steps), ""]
    lines += [f"core 0.33 ({core_dir()}) vs diffusers, tiny H3 fp32 on CPU, {steps} sigma points "
             f"({steps - 1} DiT forwards), max |d| (relative = max |d| / max |ref|)", ""]
    for title, switches in variants.items():
        lines += [f"### {title}", "", "| task | what | video max abs | video rel | audio max abs | audio rel |",
                  "|---|---|---|---|---|---|"]
        for task, case in TASK_CASES.items():
            request, _, seed = CASES[case]
            cond = encoder.encode(request)
            trace = diffusers_trace(diffusion, cond, steps, seed)
            out, _ = run(job_for(tiny_dit(tiny_dir, task), cond, trace, seed, **switches))
            for what, streams in measure(trace, out).items():
                label = {"forward": "one forward (worst step)", "core": "sampling: core sampler (euler, carry)",
                         "two_schedules": "sampling: core DiT, diffusers' two schedules"}[what]
                (va, vr), (aa, ar) = streams["video"], streams["audio"]
                lines.append(f"| {task} | {label} | {va:.2e} | {vr:.2e} | {aa:.2e} | {ar:.2e} |")
        lines.append("")
    return "\n".join(lines)


# --- the worker (runs in its own Python, core first on sys.path) ------------------------------------------------

def _worker(job_dir: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(job_dir / "inputs.safetensors"), "pt") as f:
        spec = json.loads(f.metadata()["job"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    job = _unpack(spec, tensors)
    torch.set_num_threads(int(job["threads"]))

    root = os.environ["H3_CORE033_DIR"]
    sys.path.insert(0, root)
    sys.argv = ["main.py", "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.ldm.minimax.model as core_dit
    import comfy.model_management
    import comfy.nested_tensor
    import comfy.sample
    import comfy.samplers
    import comfy.sd

    if not Path(core_dit.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise RuntimeError(f"imported core's H3 from {core_dit.__file__}, not from {root}")

    if job["cond_noise"] == "given":
        stock_rows = core_dit.MiniMaxH3Model._cond_video_rows

        def given_rows(self, payload, device):
            # the latents are already augmented: pack them as they are (the 0.999 label is kept by _forward)
            return stock_rows(self, {**payload, "visual_cond_noise_aug": 1.0}, device)

        core_dit.MiniMaxH3Model._cond_video_rows = given_rows
    if job["refine_text"] == "always":
        def refine(self, text_states):
            return self.token_refiner(self.condition_proj(text_states[0])).unsqueeze(0)

        core_dit.MiniMaxH3Model.preprocess_text_embeds = refine

    patcher = comfy.sd.load_diffusion_model(job["dit"], model_options={"dtype": torch.float32})
    base = patcher.model
    dm = base.diffusion_model
    info = {
        "core_h3": str(Path(core_dit.__file__).resolve()),
        "model_class": type(base).__name__,
        "model_sampling": type(base.model_sampling).__mro__[1].__name__,
        "dtype": str(base.get_dtype_inference()),
        "unet_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in base.model_config.unet_config.items()
                        if isinstance(v, (int, float, str, bool, list, tuple))},
        "device": str(comfy.model_management.get_torch_device()),
    }
    device = comfy.model_management.get_torch_device()
    embeds, extras = job["conditioning"][0]
    out: dict[str, torch.Tensor] = {}

    def conds_for(latent_shapes):
        kwargs = {k: v for k, v in extras.items()}
        conds = base.extra_conds(cross_attn=embeds, device=device, seed=int(job["seed"]),
                                 latent_shapes=latent_shapes, **kwargs)
        # the raw forwards see each stream's own latent: no audio carry, whatever a core sampling left in
        # `base.latent_shapes` (the sampler sets it; `audio_scale()` reads it)
        return conds["c_crossattn"].cond, {**conds["minimax_payload"].cond, "audio_scale": 1.0}

    def velocity(video, audio, sigma, context, payload, transformer_options=None):
        t = base.model_sampling.timestep(torch.tensor([float(sigma)], dtype=torch.float32)).float()
        res = dm([video.to(device), audio.to(device)], t, context=context,
                 transformer_options=dict(transformer_options or {}), minimax_payload=payload)
        return -res[0].float().cpu(), -res[1].float().cpu()  # core returns the noise-ward velocity

    with torch.no_grad():
        for fw in job["forwards"]:
            shapes = [tuple(fw["video"].shape), tuple(fw["audio"].shape)]
            context, payload = conds_for(shapes)
            v, a = velocity(fw["video"], fw["audio"], fw["sigma"], context, payload)
            out[f"{fw['name']}.video"], out[f"{fw['name']}.audio"] = v, a

        for sp in job["samples"]:
            noise_v, noise_a = sp["noise_video"].float(), sp["noise_audio"].float()
            sigmas = sp["sigmas"].float()
            if sp["loop"] == "two_schedules":
                context, payload = conds_for([tuple(noise_v.shape), tuple(noise_a.shape)])
                audio_sigmas = sp["audio_sigmas"].float()
                xv, xa = noise_v.clone(), noise_a.clone()
                for i in range(len(sigmas) - 1):
                    v, a = velocity(xv, xa, sigmas[i], context, payload)
                    # diffusers' MiniMaxH3Scheduler.step: x' = r x + (1 - r)(x + sigma v), r = sigma' / sigma
                    rv, ra = sigmas[i + 1] / sigmas[i], audio_sigmas[i + 1] / audio_sigmas[i]
                    xv = rv * xv + (1.0 - rv) * (xv + sigmas[i] * v)
                    xa = ra * xa + (1.0 - ra) * (xa + audio_sigmas[i] * a)
            elif sp["loop"] == "core":
                model = _with_shifts(patcher, float(sp.get("shift_video", 12.0)), float(sp.get("shift_audio", 3.0)))
                info[f"{sp['name']}.model_sampling"] = {
                    "shift": float(model.get_model_object("model_sampling").shift),
                    "audio_shift": float(model.get_model_object("model_sampling").audio_shift),
                    "audio_scale": float(model.get_model_object("model_sampling").audio_scale),
                }
                latent = comfy.nested_tensor.NestedTensor([torch.zeros_like(noise_v), torch.zeros_like(noise_a)])
                noise = comfy.nested_tensor.NestedTensor([noise_v, noise_a])
                sampler = comfy.samplers.sampler_object(sp.get("sampler", "euler"))
                result = comfy.sample.sample_custom(model, noise, 1.0, sampler, sigmas, job["conditioning"],
                                                    job["conditioning"], latent, disable_pbar=True,
                                                    seed=int(job["seed"]))
                xv, xa = (t.float().cpu() for t in result.unbind())
            else:
                raise ValueError(f"unknown loop {sp['loop']!r}")
            out[f"{sp['name']}.video"], out[f"{sp['name']}.audio"] = xv.contiguous(), xa.contiguous()

    save_file({k: v.contiguous() for k, v in out.items()}, str(job_dir / "outputs.safetensors"))
    (job_dir / "info.json").write_text(json.dumps(info))


def _with_shifts(patcher, shift_video: float, shift_audio: float):
    """Core's own ModelSamplingMiniMaxH3 node (`MiniMaxH3SigmaShift`) applied to the loaded model."""
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3SigmaShift

    return MiniMaxH3SigmaShift.execute(patcher, shift_video, shift_audio).result[0]


if __name__ == "__main__":
    if sys.argv[1] == "--report":  # the per-task tables; run from the repo root with its venv
        sys.path.insert(0, str(REPO))
        torch.set_num_threads(int(os.environ.get("H3_THREADS", "2")))
        print(report(sys.argv[2] if len(sys.argv) > 2 else os.environ["H3_TINY_DIR"]))
    else:
        _worker(Path(sys.argv[1]))
