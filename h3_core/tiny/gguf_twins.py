"""GGUF twins of the tiny DiT and text encoder, as ComfyUI-GGUF's converter lays such files out.

`write_gguf_twins(models_dir)` reads the tiny fp32 Comfy files and writes, for every GGML type of
`QUANT_TYPES` (the plain tiny build: `DEFAULT_TYPES`), into the same ComfyUI `models/` folder:

    diffusion_models/minimax_h3_tiny_{fl2va,ref2va,fl2va_pruned}_<TYPE>.gguf   the DiT (full both partitions;
                                                                               the pruned "AdaLN curve" fl2va)
    text_encoders/qwen3vl_minimax_h3_tiny_<TYPE>.gguf                          the 50-layer text encoder
    text_encoders/qwen3vl_minimax_h3_tiny_split_Q8_0/                          the same without its vision tower,
                                                                               and the tower as a separate
                                                                               projector ("mmproj") file
    text_encoders/qwen3vl_minimax_h3_tiny_llamacpp_Q8_0/                       that pair as llama.cpp's
                                                                               convert_hf_to_gguf.py names it
                                                                               (`llamacpp_twin`)

Tensor names are the Comfy safetensors names. The tensors a community GGUF quantises (the DiT's block and
AdaLN linears; the text encoder's language linears, token table and vision tower, its patch-embedding
kernel as one flat run of blocks) are stored in the GGML type; every other tensor is F32, except F16 for
the pruned AdaLN projections (as published).

Q8_0, Q5_1, Q4_0 are the `gguf` package's own quantisers applied to the fp32 weights. The package has no
K-quant quantiser, so the Q4_K / Q5_K / Q6_K twins hold *valid random blocks*: random codes and scale bytes
with finite F16 super-block scales sized so each layer keeps roughly its dense weight's range (the tiny
model is random anyway; what is tested is that these blocks load and dequantise exactly as the `gguf`
package's numpy dequantiser does). K-quant blocks hold 256 values and no tiny row is that long, so those
layers are stored as one flat run of blocks with their shape in `comfy.gguf.orig_shape.<name>`
(ComfyUI-GGUF's convention); the fused qkv and fc1 rows the loaders reorder cannot be flat, and fall back
to Q8_0, as llama.cpp's quantiser falls back where a type does not fit a tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..weights.release_headers import DIT_BLOCK_LINEARS, TE_LINEARS

QUANT_TYPES = ("Q8_0", "Q5_1", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
# What the plain tiny build writes (about 3 s of its ~55 s; every type takes ~8 s): one type the package
# quantises and one K-quant, with the split and llama.cpp-named text-encoder pairs (SPLIT_TYPE is among them).
DEFAULT_TYPES = ("Q8_0", "Q4_K")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SOURCES = {  # twin family -> the tiny fp32 file it is made from (relative to the models folder)
    "fl2va": "diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors",
    "ref2va": "diffusion_models/minimax_h3_tiny_ref2va_fp32.safetensors",
    "fl2va_pruned": "diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors",
    "text_encoder": "text_encoders/qwen3vl_minimax_h3_tiny_fp32.safetensors",
}
_ADALN = re.compile(r"blocks\.\d+\.adaln_proj\.linear\.weight")
_VISION = re.compile(r"visual\..*\.weight")
_ROW_REORDERED = re.compile(r".*\.(attn\.qkv_proj|mlp\.fc1)\.weight")  # split / half-swapped by the DiT loader
ARCH = {"fl2va": "minimax_h3", "ref2va": "minimax_h3", "fl2va_pruned": "minimax_h3", "text_encoder": "qwen3vl"}


def gguf_path(family: str, ggml_type: str) -> str:
    """Where a GGUF twin lives in the models folder, e.g. ("fl2va", "Q4_K") -> diffusion_models/..._Q4_K.gguf."""
    if family == "text_encoder":
        return f"text_encoders/qwen3vl_minimax_h3_tiny_{ggml_type}.gguf"
    return f"diffusion_models/minimax_h3_tiny_{family}_{ggml_type}.gguf"


def _quantised_layers(family: str, tensors: dict) -> list[str]:
    if family == "text_encoder":  # as the community's Comfy-format TE files: language, token table, vision tower
        return sorted(name for name in tensors if TE_LINEARS.fullmatch(name) or name == "model.embed_tokens.weight"
                      or (_VISION.fullmatch(name) and tensors[name].dim() >= 2))
    return sorted(name for name in tensors if DIT_BLOCK_LINEARS.fullmatch(name) or _ADALN.fullmatch(name))


def _random_kquant(ggml_type: str, dense: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Valid random K-quant blocks, [n_blocks, type_size] bytes, whose values span about `dense`'s range."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, size=(dense.size // block, size), dtype=np.uint8)
    peak = float(np.abs(dense).max()) or 1.0
    if ggml_type == "Q6_K":  # ql[128] qh[64] int8 scales[16] d[f16]: w = d * scale * (q - 32)
        blocks[:, 192:208] = rng.integers(-16, 17, size=(blocks.shape[0], 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = np.full((blocks.shape[0], 1), peak / (16 * 32), dtype=np.float16).view(np.uint8)
        return blocks
    # Q4_K / Q5_K: d[f16] dmin[f16] scales[12] (6-bit scales and mins) ...: w = d * sc * q - dmin * m
    levels = 15 if ggml_type == "Q4_K" else 31
    d = peak / (63 * levels)
    blocks[:, 0:2] = np.full((blocks.shape[0], 1), d, dtype=np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((blocks.shape[0], 1), d * levels / 2, dtype=np.float16).view(np.uint8)
    return blocks


def _quantise(name: str, tensor: torch.Tensor, ggml_type: str, rng: np.random.Generator):
    """(stored array, GGML type, original shape to record or None) of one quantised layer."""
    import gguf

    dense = tensor.to(torch.float32).numpy()
    if ggml_type in K_QUANTS and (_ROW_REORDERED.fullmatch(name) or dense.size % 256):
        ggml_type = "Q8_0"
    qtype = gguf.GGMLQuantizationType[ggml_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows = dense.ndim == 2 and dense.shape[1] % block == 0
    if ggml_type in K_QUANTS:
        return _random_kquant(ggml_type, dense, rng), qtype, None if rows else list(dense.shape)
    if rows:
        return gguf.quants.quantize(dense, qtype), qtype, None
    # one flat run of blocks, the shape recorded beside it (a conv kernel; rows not whole blocks)
    return gguf.quants.quantize(dense.reshape(-1, block), qtype), qtype, list(dense.shape)


def gguf_twin(family: str, tensors: dict, ggml_type: str, path: Path, metadata: dict | None = None) -> Path:
    """Write one GGUF twin of `tensors` (Comfy names) to `path`, `metadata` as string fields (the tiny files'
    `h3.config`: tiny widths are not all visible in shapes); deterministic for equal inputs."""
    import gguf

    rng = np.random.default_rng(sum(map(ord, family + ggml_type)))
    writer = gguf.GGUFWriter(str(path), ARCH[family])
    for key, value in sorted((metadata or {}).items()):
        writer.add_string(key, str(value))
    quantised = set(_quantised_layers(family, tensors))
    for name in sorted(tensors):
        tensor = tensors[name]
        if name in quantised and tensor.numel() % 32 == 0:
            stored, qtype, orig_shape = _quantise(name, tensor, ggml_type, rng)
            if orig_shape is not None:
                writer.add_array(f"comfy.gguf.orig_shape.{name}", orig_shape)
            writer.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=qtype)
        elif tensor.dtype == torch.float16:
            writer.add_tensor(name, tensor.to(torch.float16).numpy(), raw_dtype=gguf.GGMLQuantizationType.F16)
        else:
            writer.add_tensor(name, tensor.to(torch.float32).numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPLIT_TYPE = "Q8_0"  # the text encoder also written as a language-model file + a separate vision projector


def split_paths(ggml_type: str = SPLIT_TYPE) -> tuple[str, str]:
    """(text-encoder file without its tower, its vision-projector file), in their own folder under text_encoders/."""
    folder = f"text_encoders/qwen3vl_minimax_h3_tiny_split_{ggml_type}"
    name = f"qwen3vl_minimax_h3_tiny_{ggml_type}.gguf"
    return f"{folder}/{name}", f"{folder}/mmproj_{name}"


def _sources(models_dir: Path) -> dict:
    from ..weights.headers import read_header
    from ..weights.pruned import prune_comfy_state_dict
    from ..weights.safetensors_io import load_tensors

    out = {}
    for family, rel in SOURCES.items():
        header = read_header([str(models_dir / rel)])
        tensors = load_tensors(header)
        out[family] = (prune_comfy_state_dict(tensors) if family.endswith("_pruned") else tensors, header.metadata)
    return out


def write_gguf_twins(models_dir: str | Path, types=QUANT_TYPES) -> list[Path]:
    """Write every GGUF twin next to the tiny fp32 files (which must exist); returns the paths written."""
    models_dir = Path(models_dir)
    written = []
    for family, (tensors, metadata) in _sources(models_dir).items():
        for ggml_type in types:
            path = models_dir / gguf_path(family, ggml_type)
            written.append(gguf_twin(family, tensors, ggml_type, path, metadata))
        if family == "text_encoder" and SPLIT_TYPE in types:
            language, projector = (models_dir / rel for rel in split_paths())
            vision = {name for name in tensors if name.startswith("visual.")}
            written.append(gguf_twin(family, {k: v for k, v in tensors.items() if k not in vision}, SPLIT_TYPE,
                                     language, metadata))
            written.append(gguf_twin(family, {k: tensors[k] for k in vision}, SPLIT_TYPE, projector))
            written += llamacpp_twin(language, projector, *(models_dir / rel for rel in llamacpp_paths()))
    return written


# --- the same text encoder as llama.cpp's convert_hf_to_gguf.py names it ------------------------------------

def llamacpp_paths(ggml_type: str = SPLIT_TYPE) -> tuple[str, str]:
    """(language file, its `mmproj-` vision file) in llama.cpp's names, in their own folder under text_encoders/."""
    folder = f"text_encoders/qwen3vl_minimax_h3_tiny_llamacpp_{ggml_type}"
    name = f"qwen3vl_minimax_h3_tiny_{ggml_type}.gguf"
    return f"{folder}/{name}", f"{folder}/mmproj-{name}"


def _stored(path: Path) -> tuple[dict, dict]:
    """{name: (stored array, GGML type, original shape or None)} of a GGUF file, and its string metadata."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    orig = {key[len("comfy.gguf.orig_shape."):]: list(field.contents()) for key, field in reader.fields.items()
            if key.startswith("comfy.gguf.orig_shape.")}
    strings = {key: field.contents() for key, field in reader.fields.items()
               if not key.startswith("GGUF.") and isinstance(field.contents(), str)}
    return {t.name: (np.array(t.data), t.tensor_type, orig.get(t.name)) for t in reader.tensors}, strings


def llamacpp_twin(language: Path, projector: Path, out_language: Path, out_projector: Path) -> list[Path]:
    """Rewrite the Comfy-named language + projector pair in llama.cpp's names and metadata, the stored bytes
    unchanged: the loaded twin must equal the Comfy-named one bit for bit. llama.cpp keeps the patch kernel
    dense and split in two temporal halves, so a quantised kernel is stored as its float32 dequantisation
    (what the loader makes of the quantised one at load). The config values llama.cpp records go in its own
    keys (rope theta and mrope sections, RMSNorm epsilon, vision heads, DeepStack layers), no `h3.config`."""
    import json

    import gguf

    from ..weights import gguf_llama_names

    text, metadata = _stored(language)
    vision, _ = _stored(projector)
    config = json.loads(metadata["h3.config"])
    text_config, vision_config = config["text_config"], config["vision_config"]
    deepstack = list(vision_config["deepstack_visual_indexes"])

    def write(path: Path, writer, tensors: dict) -> None:
        for name in sorted(tensors):
            stored, qtype, orig_shape = tensors[name]
            if name == gguf_llama_names.PATCH:
                dense = stored if qtype.name in ("F32", "F16") else gguf.quants.dequantize(stored, qtype)
                dense = np.asarray(dense, dtype=np.float32).reshape(orig_shape or stored.shape)
                for part, suffix in enumerate(("", ".1")):
                    writer.add_tensor(gguf_llama_names.llama_name(name, deepstack) + suffix,
                                      np.ascontiguousarray(dense[:, :, part]))
                continue
            if orig_shape is not None:
                raise ValueError(f"{name}: a tensor stored flat has no llama.cpp form")
            writer.add_tensor(gguf_llama_names.llama_name(name, deepstack), stored, raw_shape=stored.shape,
                              raw_dtype=qtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    writer = gguf.GGUFWriter(str(out_language), gguf_llama_names.TEXT_ARCHITECTURE)
    rope = text_config["rope_parameters"]
    writer.add_block_count(sum(1 for n in text if n.endswith(".input_layernorm.weight")))
    writer.add_embedding_length(text_config["hidden_size"])
    writer.add_feed_forward_length(text_config["intermediate_size"])
    writer.add_head_count(text_config["num_attention_heads"])
    writer.add_head_count_kv(text_config["num_key_value_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(text_config["rms_norm_eps"])
    writer.add_rope_dimension_sections([*rope["mrope_section"], *[0] * (4 - len(rope["mrope_section"]))])
    writer.add_num_deepstack_layers(len(deepstack))
    write(out_language, writer, text)

    writer = gguf.GGUFWriter(str(out_projector), gguf_llama_names.PROJECTOR_ARCHITECTURE)
    writer.add_type("mmproj")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf_llama_names.PROJECTOR_TYPE)
    writer.add_vision_block_count(vision_config["depth"])
    writer.add_vision_head_count(vision_config["num_heads"])
    writer.add_vision_is_deepstack_layers([i in deepstack for i in range(vision_config["depth"])])
    write(out_projector, writer, vision)
    return [out_language, out_projector]


def default_files() -> list[str]:
    """The GGUF files of the plain tiny build a loader offers (`tiny_files`): every twin of `DEFAULT_TYPES` and the
    language file of each text-encoder pair (a vision-projector file is part of its pair, never chosen alone)."""
    files = [gguf_path(family, kind) for family in SOURCES for kind in DEFAULT_TYPES]
    return sorted([*files, split_paths()[0], llamacpp_paths()[0]])
