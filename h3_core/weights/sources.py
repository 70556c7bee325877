"""Where a component's tensors and configs live, for every published container.

Containers:
- a single `.safetensors` file (Comfy-Org layout; config can only come from shapes, plus the
  `h3.config` metadata this package's writers add);
- a component folder: `config.json` + `*.safetensors`, possibly sharded with a
  `*.safetensors.index.json` (diffusers / transformers layout, and native component folders);
- a root: a diffusers root (`model_index.json`, `transformer/`, `transformer_ref/`, `vae/`,
  `audio_vae/`, `text_encoder/`), a native MiniMaxAI partition (`FL2VA/` or `Ref2VA/` with
  `model_index.json` carrying `_minimax_h3`, `transformer/`, `video_vae/`, `audio_vae/`,
  `text_encoder/`) or the folder holding both, or a ComfyUI models folder
  (`diffusion_models/`, `text_encoders/`, `vae/` with loose single files).

Native VAE folders: diffusers' conversion script (scripts/convert_minimax_h3_to_diffusers.py)
shows `video_vae/config.json` pointing at its weights through `source_path` /
`source_safetensors_path` (reference/Comfy key names, latents mean/std in the config.json) and
`audio_vae/model.safetensors` holding weight-normed tensors under the diffusers names, with
`metadata.json` + `config.json` beside it. Both are handled, and so are native VAE folders that use
the Comfy key names with a config.json (key detection decides, not the folder name).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field

from . import digest as weight_digest
from .components import HANDLERS
from .errors import H3WeightsError, UnrecognisedCheckpointError
from .gguf_file import is_gguf, is_projector, projector_for
from .safetensors_io import SHARD_INDEX_SUFFIX

# Sub-folder names of pipeline roots (diffusers root, native partition), from the handlers.
_ALL_FOLDERS = tuple(name for handler in HANDLERS.values() for name in handler.folders)
_PARTITION_TOKEN = re.compile(r"(?<![a-z0-9])(fl2va|ref2va)(?![a-z0-9])", re.IGNORECASE)


@dataclass
class Source:
    """The files and stated configs of one component."""

    path: str
    container: str  # "file" | "folder"
    files: list[str]
    config: dict = field(default_factory=dict)  # config.json, if any
    extra_config: dict = field(default_factory=dict)  # native audio metadata.json kwargs, if any
    native_root: str | None = None
    native_partition: str | None = None  # from the native model_index.json / folder name


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise H3WeightsError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise H3WeightsError(f"{path}: expected a JSON object")
    return data


def partition_token(text: str) -> str | None:
    """'fl2va' / 'ref2va' when the text names exactly one of them as a token (file or folder name)."""
    found = {match.lower() for match in _PARTITION_TOKEN.findall(text)}
    return found.pop() if len(found) == 1 else None


def native_root_info(root: str) -> tuple[bool, str | None]:
    """(is a native partition root, its partition) from model_index.json or the folder name."""
    index_path = os.path.join(root, "model_index.json")
    partition = partition_token(os.path.basename(os.path.normpath(root)))
    is_native = False
    if os.path.isfile(index_path):
        meta = _read_json(index_path).get("_minimax_h3")
        if isinstance(meta, dict):
            is_native = True
            stated = str(meta.get("partition", "")).lower()
            partition = partition_token(stated) or partition
    elif partition is not None and any(os.path.isdir(os.path.join(root, n)) for n in ("transformer", "video_vae")):
        is_native = True
    return is_native, partition


# ComfyUI's model folders hold loose single files: the DiT in diffusion_models/ (formerly unet/),
# the text encoder in text_encoders/ (formerly clip/), both VAEs in vae/.
COMFYUI_FOLDERS = ("diffusion_models", "unet", "text_encoders", "clip", "vae")
_ROOT_FOLDERS = tuple(dict.fromkeys(_ALL_FOLDERS + COMFYUI_FOLDERS))
_SHARD_NAME = re.compile(r".*-\d{5}-of-\d{5}\.safetensors$")


def loose_files(folder: str) -> list[str]:
    """The stand-alone single files of a plain folder (a ComfyUI `models/...` directory): no
    config.json and no shard index - every diffusers, transformers and native component folder
    has one or the other - and non-shard `.safetensors` files."""
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, "config.json")):
        return []
    if glob.glob(os.path.join(folder, "*" + SHARD_INDEX_SUFFIX)):
        return []
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if any(_SHARD_NAME.match(os.path.basename(f)) for f in files):
        return []
    # A vision-projector GGUF is part of the text encoder beside it (`component_source`), not a component.
    ggufs = [f for f in glob.glob(os.path.join(folder, "*.gguf")) if is_gguf(f) and not is_projector(f)]
    return sorted(files + ggufs)


def partition_roots(folder: str) -> list[str]:
    """Native partition roots directly inside `folder` (the folder holding FL2VA/ and Ref2VA/)."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in sorted(os.listdir(folder)):
        sub = os.path.join(folder, name)
        if os.path.isdir(sub) and native_root_info(sub)[0]:
            found.append(sub)
    return found


def is_root(path: str) -> bool:
    """A folder of component folders (pipeline root, native partition(s), ComfyUI models folder)
    rather than one component."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "model_index.json")) or partition_roots(path):
        return True
    has_weights = bool(glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "*.gguf")))
    return not has_weights and any(os.path.isdir(os.path.join(path, name)) for name in _ROOT_FOLDERS)


def component_paths(path: str) -> list[str]:
    """Every component path under `path`: itself (a file or component folder), the files of a
    plain folder, or the component folders / files of a root, in a stable order."""
    if not is_root(path):
        return loose_files(path) or [path]
    targets = []
    for root in partition_roots(path) or [path]:
        for name in _ROOT_FOLDERS:
            folder = os.path.join(root, name)
            if os.path.isdir(folder):
                targets.extend(loose_files(folder) or [folder])
    return targets


def _folder_files(folder: str, config: dict) -> list[str]:
    indexes = sorted(glob.glob(os.path.join(folder, "*" + SHARD_INDEX_SUFFIX)))
    if len(indexes) > 1:
        raise H3WeightsError(f"{folder}: several shard indexes {[os.path.basename(p) for p in indexes]}; keep one")
    if indexes:
        weight_map = _read_json(indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise H3WeightsError(f"{indexes[0]}: no weight_map")
        files = sorted({os.path.join(folder, name) for name in weight_map.values()})
        absent = [p for p in files if not os.path.isfile(p)]
        if absent:
            raise H3WeightsError(f"{indexes[0]}: shards listed but absent: {[os.path.basename(p) for p in absent]}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    # Native video_vae/: config.json names the weights file under a sub-folder.
    if "source_safetensors_path" in config:
        weights = os.path.join(folder, str(config.get("source_path", "")), str(config["source_safetensors_path"]))
        if os.path.isfile(weights):
            return [weights]
        raise H3WeightsError(f"{folder}/config.json points at {weights}, which does not exist")
    nested = sorted(glob.glob(os.path.join(folder, "*", "*.safetensors")))
    if nested:
        return nested
    raise UnrecognisedCheckpointError(f"{folder}: no .safetensors weights found")


def component_source(path: str) -> Source:
    """Locate one component's files and configs (file or component folder)."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        if is_gguf(path):  # told by its magic: GGUF files carry no config beside them
            return Source(path=path, container="file", files=[path, *projector_for(path)])
        if not path.endswith((".safetensors", ".gguf")):  # a .gguf name on other bytes: the header parser decides
            raise UnrecognisedCheckpointError(
                f"{path}: only .safetensors and GGUF checkpoints are read (never pickled .ckpt/.pt/.bin files)"
            )
        # A diffusers weights file handed over on its own: its folder's config.json still applies
        # (the DiT's rope_freq_dim, for one, is not visible in any diffusers tensor shape).
        sibling = os.path.join(os.path.dirname(path), "config.json")
        config = _read_json(sibling) if os.path.isfile(sibling) else {}
        if not (str(config.get("_class_name", "")).startswith(("MiniMaxH3", "AutoencoderKLMiniMaxH3"))
                or config.get("model_type") == "qwen3_vl"):
            config = {}
        return Source(path=path, container="file", files=[path], config=config)
    if not os.path.isdir(path):
        raise UnrecognisedCheckpointError(f"{path}: no such file or folder")
    config_path = os.path.join(path, "config.json")
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    metadata_path = os.path.join(path, "metadata.json")
    extra = {}
    if os.path.isfile(metadata_path):
        kwargs = _read_json(metadata_path).get("metadata", {})
        extra = kwargs.get("kwargs", {}) if isinstance(kwargs, dict) else {}
    parent = os.path.dirname(path)
    is_native, partition = native_root_info(parent)
    return Source(
        path=path,
        container="folder",
        files=_folder_files(path, config),
        config=config,
        extra_config=extra if isinstance(extra, dict) else {},
        native_root=parent if is_native else None,
        native_partition=partition if is_native else None,
    )


def identity(salt: str, named_paths: dict) -> str:
    """A short digest of the weights at `named_paths` (name -> file or folder) that changes with any byte of them.

    Small files (configs, tokenizer, up to 16 MiB) contribute the SHA-256 of their bytes; larger ones a full-content
    xxh3-128 computed once per file version and remembered per user (weights/digest.py), so a 66 GB file is read
    once, not on every load. Touching or moving the files does not change it (a touched file is hashed again, to the
    same value); new weights - a fine-tune that changes only middle tensors included - or a re-quantisation do.
    """
    digest = hashlib.sha256(salt.encode())
    for name, path in sorted(named_paths.items()):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(f"{name}/{file.name}:".encode())
            digest.update(weight_digest.file_identity(file))
    return digest.hexdigest()[:16]

