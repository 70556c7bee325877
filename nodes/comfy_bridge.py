"""The place that touches ComfyUI internals: model management, progress, interrupts, types (low_vram.py adds
the cast-weights protocol its streamed models speak; comfy_queue_seam.py holds the queue and executor internals
encode-ahead reads).

Everything else in `nodes/` converts ComfyUI values to h3_core calls through these helpers.
"""

from __future__ import annotations

import logging
import os
import time
from fractions import Fraction
from pathlib import Path

import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
import folder_paths
import numpy as np
import torch

from ..h3_core import facts, media, previews, rules, safe_paths
from ..h3_core.progress import Cancelled
from ..h3_core.tiny import files as tiny_files
from . import low_vram

PACK_FOLDER = "minimax_h3"  # models/minimax_h3/: diffusers roots, native partitions, the embedded tiny H3
TINY_CHOICE = "[embedded] tiny H3 (noise)"  # short, so "noise" shows in a loader's widget (web/ adds a badge)
LEGACY_TINY_CHOICES = ("[embedded] tiny H3 (random weights, outputs are noise)",)  # saved by 0.2-0.4 workflows
TINY_FILE_PREFIX = "[embedded] tiny H3 / "  # + one of the tiny's single files (fp32, twins, pruned twins)


def register_model_folder() -> None:
    """models/minimax_h3/ for whole-model folders; single files stay in core's standard folders."""
    if PACK_FOLDER not in folder_paths.folder_names_and_paths:
        path = Path(folder_paths.models_dir) / PACK_FOLDER
        folder_paths.add_model_folder_path(PACK_FOLDER, str(path), is_default=True)


def tiny_dir() -> Path:
    """The embedded tiny H3: $H3_TINY_DIR if it holds one, else built on first use into
    models/minimax_h3/tiny (deterministic, offline, ~15 s)."""
    import os

    preset = os.environ.get("H3_TINY_DIR")
    if preset and (Path(preset) / "tiny.json").is_file():
        return Path(preset)
    register_model_folder()
    target = Path(folder_paths.get_folder_paths(PACK_FOLDER)[0]) / "tiny"
    if not (target / "tiny.json").is_file():
        from ..h3_core import tiny

        tiny.build(target, seed=0)
    return target


def model_choices(folder: str) -> list[str]:
    """Files in one of core's model folders, plus whole-model folders and the embedded tiny H3."""
    register_model_folder()
    choices = [TINY_CHOICE, *(TINY_FILE_PREFIX + name for name in tiny_files.in_folder(folder))]
    roots = []
    for base in folder_paths.get_folder_paths(PACK_FOLDER):
        base_path = Path(base)
        if base_path.is_dir():
            roots += sorted(f"{PACK_FOLDER}/{p.name}" for p in base_path.iterdir() if p.is_dir() and p.name != "tiny")
    files = [name for name in folder_paths.get_filename_list(folder) if name.endswith(".safetensors")]
    return choices + roots + files + gguf_files(folder)


# ComfyUI core does not list .gguf files; ComfyUI-GGUF, when installed, registers these keys for its own loaders.
GGUF_KEYS = {"diffusion_models": "unet_gguf", "text_encoders": "clip_gguf"}


def _gguf_roots(folder: str) -> list[str]:
    keys = [folder]
    if GGUF_KEYS.get(folder) in folder_paths.folder_names_and_paths:
        keys.append(GGUF_KEYS[folder])
    roots = []
    for key in keys:
        roots += [base for base in folder_paths.get_folder_paths(key) if base not in roots]
    return roots


def gguf_files(folder: str) -> list[str]:
    """GGUF files (DiT, text encoder) in a model folder and its legacy / ComfyUI-GGUF aliases (unet, clip)."""
    if folder not in GGUF_KEYS:
        return []
    names = set()
    for base in _gguf_roots(folder):
        names.update(_bounded_gguf_walk(Path(base)))
    return sorted(names)


# A model folder is the operator's, but it may hold (or link to) a large tree: the walk that lists it is bounded, as
# every listing of the pack is (depth, entries looked at), and follows no directory link.
GGUF_WALK_DEPTH, GGUF_WALK_ENTRIES = 4, 20_000


def _bounded_gguf_walk(root: Path) -> list[str]:
    """`*.gguf` files under `root`, at most GGUF_WALK_DEPTH folders deep, after at most GGUF_WALK_ENTRIES entries."""
    found, seen = [], 0
    if not root.is_dir():
        return found
    for folder, dirs, files in os.walk(root, followlinks=False):
        depth = len(Path(folder).relative_to(root).parts)
        if depth >= GGUF_WALK_DEPTH:
            dirs[:] = []
        seen += len(dirs) + len(files)
        found += [(Path(folder) / name).relative_to(root).as_posix() for name in files if name.endswith(".gguf")]
        if seen > GGUF_WALK_ENTRIES:
            logging.getLogger("h3_core").warning("MiniMax H3: stopped listing GGUF files under %s after %d entries",
                                                 root, GGUF_WALK_ENTRIES)
            break
    return found


def resolve_model_path(folder: str, choice: str) -> tuple[Path, bool]:
    """(path, is_whole_model_folder) for a loader's combo value."""
    if choice == TINY_CHOICE or choice in LEGACY_TINY_CHOICES:
        return tiny_dir(), True
    if choice.startswith(TINY_FILE_PREFIX):
        name = choice[len(TINY_FILE_PREFIX):]
        if name not in tiny_files.in_folder(folder):  # a fixed list of names: never a path from the workflow
            raise ValueError(f"{name[:200]!r} is not one of the embedded tiny H3's files in {folder}/")
        return tiny_dir() / "comfyui" / folder / name, False
    if choice.startswith(PACK_FOLDER + "/"):
        # ComfyUI 0.3.75 does not hold V3 combo values to their options: the name after the prefix must be one
        # folder directly inside a models/minimax_h3 root, never a path ('../..', '/etc').
        register_model_folder()
        path = safe_paths.resolve_child_dir(folder_paths.get_folder_paths(PACK_FOLDER), choice.split("/", 1)[1],
                                            what="model folder", folder_label=f"models/{PACK_FOLDER}/")
        return path, True
    if choice.lower().endswith(".gguf") and folder in GGUF_KEYS:
        if choice not in gguf_files(folder):  # only a listed file: never a path a workflow makes up
            raise ValueError(f"{str(choice)[:200]!r} is not a .gguf file in models/{folder}/")
        for base in _gguf_roots(folder):
            path = Path(base) / choice
            if path.is_file():
                return path, False
    if not choice.lower().endswith(".safetensors"):  # the listed choices; never a pickle a workflow names
        raise ValueError(f"{str(choice)[:200]!r} is not a .safetensors file in models/{folder}/")
    return Path(folder_paths.get_full_path_or_raise(folder, choice)), False


# --- model management -----------------------------------------------------------------------------


class _Holder(torch.nn.Module):
    """Gives ComfyUI's ModelPatcher a plain module to manage (diffusers models have a read-only
    `.device`, which the patcher sets); moving the holder moves the model inside it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model


def managed(model: torch.nn.Module, load_device: torch.device, offload_device: torch.device, stream: bool = False):
    """Wrap a loaded module so ComfyUI decides where it lives (GPU while used, offloaded after). With `stream`, its
    layers speak ComfyUI's cast-weights protocol, so what does not fit in VRAM streams per layer (low_vram.py)."""
    if stream:
        return low_vram.streamed_patcher(_Holder(model), model, load_device, offload_device)
    return comfy.model_patcher.ModelPatcher(_Holder(model), load_device=load_device, offload_device=offload_device)


def use(*patchers, memory_required: int = 0) -> torch.device:
    """Bring models onto their compute device for the node that is running; returns that device.

    `memory_required`: bytes the node's own work will allocate on that device besides the weights (activations).
    ComfyUI keeps that much (plus --reserve-vram) free and streams the layers that no longer fit; the models are
    never moved by the pack itself."""
    active = [patcher for patcher in patchers if patcher is not None]
    mm.load_models_gpu(active, memory_required=int(memory_required))
    return active[0].load_device if active else mm.get_torch_device()


def unwrap(patcher) -> torch.nn.Module:
    return patcher.model.model


_UNLOAD_HOOKS = "_h3_unload_hooks"  # name -> hook, kept on the wrapper itself: one wrapper however often it is hooked


def on_unload_models(name: str, hook) -> bool:
    """Call `hook()` whenever ComfyUI unloads all its models: the menu's "Unload Models" and "Unload Models and
    Execution Cache" (POST /free), an out-of-memory error, and --disable-smart-memory after each prompt. For what
    the pack holds outside ComfyUI's model management (the Sampler's sequence-parallel worker processes), so it goes
    with the models. ComfyUI has no event for this: `comfy.model_management.unload_all_models`, which ComfyUI 0.3.x
    and core 0.33 call through the module, is wrapped once (feature-detected: False, with a log line, when it is not
    there). Registering `name` again replaces its hook. A hook's error is logged; the unload itself always runs."""
    import functools
    import logging

    current = getattr(mm, "unload_all_models", None)
    if not callable(current):
        logging.warning("MiniMax H3: this ComfyUI has no comfy.model_management.unload_all_models; its Unload Models "
                        "commands will not stop %s", name)
        return False
    hooks = getattr(current, _UNLOAD_HOOKS, None)
    if hooks is None:
        hooks, original = {}, current

        @functools.wraps(original)
        def unload_all_models(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                for hook_name, stop in list(hooks.items()):
                    try:
                        stop()
                    except Exception:  # noqa: BLE001 - one hook's failure must not break ComfyUI's unload
                        logging.exception("MiniMax H3: stopping %s on unload failed", hook_name)

        setattr(unload_all_models, _UNLOAD_HOOKS, hooks)
        mm.unload_all_models = unload_all_models
    hooks[name] = hook
    return True


# --- progress and interruption --------------------------------------------------------------------


class InterruptFlag:
    """ComfyUI's interrupt flag seen as the `threading.Event` h3_core's loops check (and wait on: the remote
    client's retry back-off)."""

    POLL_S = 0.05  # ComfyUI's flag has no waiters: `wait` looks at it this often

    def is_set(self) -> bool:
        return mm.processing_interrupted()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set (True) or `timeout` seconds pass (False), as `threading.Event.wait`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            time.sleep(self.POLL_S if left is None else min(self.POLL_S, left))
        return True


def progress_callback(node_id: str | None, *, every_step: bool = False):
    """A `report(done, total, preview=None)` driving the node's progress bar. Core >= 0.33 throttles a bar's updates
    (one per 100 ms, later ones in between dropped, not delayed): right for the DiT's steps, wrong for a few phases
    that matter each (Remote Encode's: a dropped "text" step hid a 20 s phase), so `every_step` gives each update a
    fresh bar, whose first update core always sends (0.3.75 has no throttle: the same bar either way)."""
    bar = {}

    def report(done: int, total: int, preview=None) -> None:
        if "bar" not in bar or every_step:
            bar["bar"] = comfy.utils.ProgressBar(total, node_id=node_id)
        bar["bar"].update_absolute(done, total, preview)

    return report


def progress_text(node_id: str | None, template: str):
    """A callback showing `template.format(value)` as the node's progress text (ComfyUI's text channel, as core's
    image-size node uses); nothing without a server or node id."""
    from server import PromptServer

    def show(value) -> None:
        server = getattr(PromptServer, "instance", None)
        if server is not None and node_id is not None:
            server.send_progress_text(template.format(value), node_id)

    return show


# --- live previews --------------------------------------------------------------------------------


def preview_method() -> str:
    """The user's preview setting (`--preview-method`: none / auto / latent2rgb / taesd), as a string."""
    from comfy.cli_args import args

    method = getattr(args, "preview_method", None)
    return str(getattr(method, "value", method) or "none").lower()


def rgb_factors():
    """(factors [24, 3], bias [3] or None, where from): the running core's own H3 table when it has one
    (`latent_formats.MiniMaxH3Video`), else the pack's fallback (h3_core/previews.py says what it is)."""
    import comfy.latent_formats as formats

    for name in ("MiniMaxH3Video", "MiniMaxH3"):
        fmt = getattr(formats, name, None)
        factors = getattr(fmt, "latent_rgb_factors", None) if fmt is not None else None
        if factors is not None and len(factors) == facts.VIDEO_LATENT_CHANNELS and len(factors[0]) == 3:
            return factors, getattr(fmt, "latent_rgb_factors_bias", None), f"core {name}"
    return previews.TINY_RGB_FACTORS, previews.TINY_RGB_BIAS, "pack (tiny H3 fit)"


def core_tae_name() -> str | None:
    """The tiny decoder core previews H3 with (core 0.33: `latent_formats.MiniMaxH3Video.taesd_decoder_name`,
    "taeh3", one of latent_preview's video TAEs), or None where the running core has none (0.3.75)."""
    import comfy.latent_formats as formats
    import latent_preview

    fmt = getattr(formats, "MiniMaxH3Video", None)
    name = getattr(fmt, "taesd_decoder_name", None)
    return name if isinstance(name, str) and name in getattr(latent_preview, "VIDEO_TAES", ()) else None


def core_tae_previewer():
    """Core's own H3 previewer, decoding with its tiny decoder: only with `--preview-method taesd`, a core that
    has one (`core_tae_name`) and its file in models/vae_approx; else None (the pack's linear map previews)."""
    name = core_tae_name() if preview_method() == "taesd" else None
    if name is None or not any(f.startswith(name) for f in folder_paths.get_filename_list("vae_approx")):
        return None
    import comfy.latent_formats as formats
    import latent_preview

    previewer = latent_preview.get_previewer(mm.get_torch_device(), formats.MiniMaxH3Video())
    return previewer if isinstance(previewer, latent_preview.TAESDPreviewerImpl) else None


def preview_callback(node_id: str | None, report):
    """An h3_core `PreviewFn` sending ComfyUI's own preview with each step's progress, or None when the
    user's preview method is `none`. With `taesd`, core's own H3 tiny decoder (taeh3) where core has one and its
    file is in models/vae_approx (`core_tae_previewer`); otherwise the linear map (as core's previewer falls back
    when it finds no TAESD decoder)."""
    if preview_method() in ("none", "nopreviews", ""):
        return None
    from comfy.cli_args import args
    from PIL import Image

    factors, bias, _ = rgb_factors()
    max_size = int(getattr(args, "preview_size", 512) or 512)
    tae = core_tae_previewer()

    def send(done: int, total: int, video: torch.Tensor) -> None:
        if tae is not None:  # the same latent frame the linear map shows (the middle one), decoded by core's TAE
            middle = video.shape[2] // 2
            report(done, total, tae.decode_latent_to_preview_image("JPEG", video[:1, :, middle:middle + 1]))
            return
        image = Image.fromarray(previews.preview_rgb(video, factors, bias))
        report(done, total, ("JPEG", image, max_size))

    return send


def run_interruptible(fn, *args, **kwargs):
    """Run h3_core work; a cancel seen inside becomes ComfyUI's own interrupt (not a node error)."""
    try:
        return fn(*args, **kwargs)
    except Cancelled:
        mm.throw_exception_if_processing_interrupted()
        raise


# --- ComfyUI values <-> h3_core arrays ------------------------------------------------------------


def image_to_uint8(image: torch.Tensor, label: str) -> np.ndarray:
    """One IMAGE ([1,H,W,C] float 0..1) as uint8 RGB, quantised like the reference pipeline."""
    if image.ndim != 4 or image.shape[0] != 1:
        raise rules.H3InputError(f"{label} must be a single image (batch of 1), got a batch of {image.shape[0]}")
    return media.image_to_uint8(image[0, ..., :3])


def audio_to_numpy(audio: dict, label: str) -> tuple[np.ndarray, int]:
    """AUDIO {"waveform": [B,C,T], "sample_rate"} -> (float32 [C,T], rate)."""
    waveform = audio["waveform"]
    if waveform.ndim != 3 or waveform.shape[0] != 1:
        raise rules.H3InputError(f"{label} must be one clip (batch of 1), got waveform {tuple(waveform.shape)}")
    return waveform[0].float().cpu().numpy(), int(audio["sample_rate"])


def video_components(video) -> tuple[np.ndarray, float, np.ndarray | None, int | None]:
    """VIDEO -> (uint8 frames [F,H,W,3], fps, soundtrack float32 [C,T] or None, rate or None)."""
    components = video.get_components()
    frames = media.frames_to_uint8(components.images[..., :3])
    audio, rate = (None, None)
    if components.audio is not None:
        audio, rate = audio_to_numpy(components.audio, "reference video soundtrack")
    return frames, float(components.frame_rate), audio, rate


def to_video(frames: torch.Tensor, audio: torch.Tensor, sample_rate: int, fps: int):
    """Decoded H3 output as core VIDEO / IMAGE / AUDIO values."""
    from comfy_api.latest import InputImpl, Types

    audio_value = {"waveform": audio[None].contiguous(), "sample_rate": sample_rate}
    video = InputImpl.VideoFromComponents(
        Types.VideoComponents(images=frames, audio=audio_value, frame_rate=Fraction(fps))
    )
    return video, frames, audio_value


def av_latent(video: torch.Tensor, audio_comfy: torch.Tensor) -> dict:
    """Core's H3 AV LATENT: NestedTensor(video [1,24,T,H/16,W/16], audio [1,32,2,Ta])."""
    from comfy.nested_tensor import NestedTensor

    return {"samples": NestedTensor((video, audio_comfy))}


def split_av_latent(latent: dict) -> tuple[torch.Tensor, torch.Tensor]:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    tensors = getattr(samples, "tensors", None)
    if not tensors or len(tensors) != 2:
        raise ValueError("expected an H3 AV latent (NestedTensor of video and audio), e.g. from MiniMax H3 Sampler")
    return tensors[0], tensors[1]
