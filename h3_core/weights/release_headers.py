"""Release-size headers of every published Comfy-Org MiniMax-H3 file: names, dtypes, shapes - no data.

`release_header(name)` describes one published file as `({tensor: (dtype tag, shape)}, {tensor:
bytes})`: the second dict holds the only data a header-only reader needs, the `.comfy_quant`
markers. `write_sparse` writes that as a valid safetensors file whose data region is a hole (right
size, no disk use), so detection, `check` and the planners can be exercised on release-size files
without the weights.

Names and shapes come from the release configs' meta-instantiated models run through this package's
own writers' key converters (nothing is typed in by hand); dtypes follow the published files (DiT
bf16 with float32 islands, text encoder bf16, video VAE fp16, audio VAE fp32); quantised layers are
described by `quant.writer.quantised_header`, the header-only twin of the quantiser. The pruned
("AdaLN curve") files replace the time embedder with `adaln_t_table` F32 [1025, 8] and store every
AdaLN projection as F16 [rows, 8]. What is inferred rather than read from a real header is marked
in `PUBLISHED` (`pinned=False`) and in the builders' comments.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from dataclasses import dataclass

from .. import configs, facts
from ..safetensors_header import DTYPES
from . import audio_vae_keys, text_encoder_keys, transformer_keys, video_vae_keys
from .errors import H3WeightsError
from .quant import markers
from .quant.writer import quantised_header

PRUNED_GRID, PRUNED_RANK = 1025, 8
DIT_FP32_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                     "final_layer.audio_out.", "rope.")
DIT_BLOCK_LINEARS = re.compile(r"blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))\.weight")
_REFINER_LINEAR = re.compile(r"token_refiner\.blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))\.weight")
_ADALN = re.compile(r"(blocks\.\d+\.|final_layer\.)adaln_proj\.linear\.(weight|bias)")
TE_LINEARS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
TE_AWQ = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight")
VAE_DECODER_LINEARS = re.compile(r"decoder\.transformer_blocks\.\d+\.(attn\.(to_qkv|to_out)|ff\.(w1|w2))\.weight")


@dataclass(frozen=True)
class PublishedFile:
    name: str  # path inside a ComfyUI models/ folder
    component: str  # weights handler name
    variant: str
    bytes: int  # published size
    pinned: bool  # True: size pinned (with sha256) by download manifests; False: listed or estimated


def _dit_files(partition: str) -> list[PublishedFile]:
    base = f"diffusion_models/minimax_h3_{partition}"
    return [
        PublishedFile(f"{base}_bf16.safetensors", "transformer", "bf16", 66_300_000_000, False),
        PublishedFile(f"{base}_int8_convrot.safetensors", "transformer", "int8_convrot", 34_038_892_334, True),
        PublishedFile(f"{base}_pruned_bf16.safetensors", "transformer", "pruned_bf16", 40_230_000_000, False),
        PublishedFile(f"{base}_pruned_int8_convrot.safetensors", "transformer", "pruned_int8_convrot",
                      20_970_379_616, True),
        PublishedFile(f"{base}_pruned_fp8_scaled.safetensors", "transformer", "pruned_fp8_scaled",
                      20_958_205_608, False),
        PublishedFile(f"{base}_pruned_w6a8.safetensors", "transformer", "pruned_w6a8", 15_980_000_000, False),
    ]


PUBLISHED = {f.name: f for f in [
    *_dit_files("fl2va"),
    *_dit_files("ref2va"),
    PublishedFile("text_encoders/qwen3vl_32b_minimax_h3_bf16.safetensors", "text_encoder", "bf16",
                  51_500_000_000, False),
    PublishedFile("text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors", "text_encoder", "int8_convrot",
                  27_141_342_152, True),
    PublishedFile("text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoder", "nvfp4_awq",
                  15_687_142_551, True),
    PublishedFile("vae/minimax_h3_video_vae_fp16.safetensors", "vae", "fp16", 5_207_808_496, True),
    PublishedFile("vae/minimax_h3_video_vae_int8_convrot.safetensors", "vae", "int8_convrot", 2_811_065_184, True),
    PublishedFile("vae/minimax_h3_audio_vae_fp32.safetensors", "audio_vae", "fp32", 605_254_808, True),
]}

_TAG = {dtype: tag for tag, dtype in DTYPES.items()}


def _meta_model(component: str):
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if component == "text_encoder":
            from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

            return Qwen3VLForConditionalGeneration(Qwen3VLConfig(**configs.get("text_encoder", tiny=False)))
        import diffusers

        cls = {"transformer": "MiniMaxH3Transformer3DModel", "vae": "AutoencoderKLMiniMaxH3",
               "audio_vae": "AutoencoderKLMiniMaxH3Audio"}[component]
        return getattr(diffusers, cls).from_config(configs.get(component, tiny=False))


@functools.lru_cache(maxsize=None)
def _comfy_shapes(component: str) -> tuple:
    """The component's Comfy-file tensor names and shapes (sorted pairs), from the release meta model."""
    model = _meta_model(component)
    state = model.state_dict()
    config = configs.get(component, tiny=False)
    if component == "transformer":
        tensors = transformer_keys.from_diffusers(state, config, "comfy")
    elif component == "vae":
        tensors = video_vae_keys.from_diffusers(state, config)
    elif component == "audio_vae":
        tensors = audio_vae_keys.from_diffusers(state, config)
    else:
        tensors = text_encoder_keys.from_transformers(state, facts.TEXT_ENCODER_LAYER)
    return tuple(sorted((name, tuple(t.shape)) for name, t in tensors.items()))


def _dense(component: str, dtype_of) -> dict:
    return {name: (dtype_of(name), shape) for name, shape in _comfy_shapes(component)}


def _quantise(tensors: dict, data: dict, fmt: str, layers: dict) -> None:
    """Replace each `P.weight` of `layers` (name -> options) by its quantised family, in place."""
    for name, options in sorted(layers.items()):
        prefix = name[: -len(".weight")]
        stored, marker = quantised_header(fmt, tensors[name][1], options)
        del tensors[name]
        for suffix, entry in stored.items():
            tensors[f"{prefix}.{suffix}"] = entry
        raw = markers.encode(marker).numpy().tobytes()
        tensors[f"{prefix}.{markers.MARKER_SUFFIX}"] = ("U8", (len(raw),))
        data[f"{prefix}.{markers.MARKER_SUFFIX}"] = raw


def _prune(tensors: dict) -> None:
    """The AdaLN-curve layout: no time embedder, a [1025, 8] table, F16 AdaLN projections of width 8."""
    for name in [n for n in tensors if n.startswith("time_embedder.")]:
        del tensors[name]
    tensors["adaln_t_table"] = ("F32", (PRUNED_GRID, PRUNED_RANK))
    for name, (_, shape) in list(tensors.items()):
        if _ADALN.fullmatch(name):
            tensors[name] = ("F16", (shape[0], PRUNED_RANK) if name.endswith(".weight") else shape)


def _dit(variant: str) -> tuple[dict, dict]:
    tensors = _dense("transformer", lambda n: "F32" if n.startswith(DIT_FP32_PREFIXES) else "BF16")
    data: dict = {}
    blocks = sorted(n for n in tensors if DIT_BLOCK_LINEARS.fullmatch(n))
    if variant == "int8_convrot":
        # The file's size only adds up with the block AdaLN projections int8 too; their width (2688) is not a
        # multiple of 256, so (as the exporter does) they are not rotated. Inferred from the byte count.
        _quantise(tensors, data, "int8_convrot", dict.fromkeys(blocks, {}))
        adaln = [n for n in tensors if n.startswith("blocks.") and _ADALN.fullmatch(n) and n.endswith(".weight")]
        _quantise(tensors, data, "int8", dict.fromkeys(adaln, {}))
    elif variant.startswith("pruned"):
        _prune(tensors)
        if variant == "pruned_int8_convrot":
            _quantise(tensors, data, "int8_convrot", dict.fromkeys(blocks, {}))
        elif variant == "pruned_fp8_scaled":
            # qkv/out/fc1 carry a static input_scale; fc2 asks for full-precision matmul (third-party header read).
            _quantise(tensors, data, "fp8_scaled", {n: ({"full_precision_matrix_mult": True} if n.endswith("fc2.weight")
                                                         else {"input_scale": 1.0}) for n in blocks})
        elif variant == "pruned_w6a8":
            # Unconfirmed (no real header read): 6-bit g16 on the 200 block linears alone gives 17.3 GB, not the
            # listed 15.98 GB; the refiner's linears at 6 bits too and scale groups of 32 reproduce the listing.
            refiner = sorted(n for n in tensors if _REFINER_LINEAR.fullmatch(n))
            _quantise(tensors, data, "w6a8", dict.fromkeys(blocks + refiner, {"group_size": 32}))
    return tensors, data


def _text_encoder(variant: str) -> tuple[dict, dict]:
    tensors, data = _dense("text_encoder", lambda n: "BF16"), {}
    linears = sorted(n for n in tensors if TE_LINEARS.fullmatch(n))
    if variant == "int8_convrot":
        _quantise(tensors, data, "int8_convrot", dict.fromkeys(linears, {}))
    elif variant == "nvfp4_awq":
        # pre_quant_scale (BF16) on o_proj / down_proj, the layers with no norm to fold AWQ into: with it there the
        # byte count matches the published file to within its header's size.
        _quantise(tensors, data, "nvfp4", {n: ({"pre_quant_scale": "BF16"} if TE_AWQ.fullmatch(n) else {})
                                           for n in linears})
        _quantise(tensors, data, "int8", {"model.embed_tokens.weight": {}})
    return tensors, data


def _video_vae(variant: str) -> tuple[dict, dict]:
    int8 = variant == "int8_convrot"
    # The int8 file keeps the decoder's other tensors (biases, norms, proj_out, ...) in F32: with that the byte
    # count matches the published file to within its header's size (inferred; without it, 0.55 % short).
    tensors = _dense("vae", lambda n: "F32" if n.startswith("latents_") or (int8 and n.startswith("decoder."))
                     else "F16")
    data: dict = {}
    if int8:  # the decoder ViT linears (attention and MLP of every decoder block)
        linears = sorted(n for n in tensors if VAE_DECODER_LINEARS.fullmatch(n))
        _quantise(tensors, data, "int8_convrot", dict.fromkeys(linears, {}))
    return tensors, data


def release_header(name: str) -> tuple[dict, dict]:
    """({tensor: (dtype tag, shape)}, {marker tensor: bytes}) of published file `name` (a key of `PUBLISHED`)."""
    if name not in PUBLISHED:
        raise H3WeightsError(f"not a published MiniMax-H3 file: {name!r}; one of {sorted(PUBLISHED)}")
    published = PUBLISHED[name]
    if published.component == "transformer":
        return _dit(published.variant)
    if published.component == "text_encoder":
        return _text_encoder(published.variant)
    if published.component == "vae":
        return _video_vae(published.variant)
    return _dense("audio_vae", lambda n: "F32"), {}


def parameter_bytes(tensors: dict) -> int:
    total = 0
    for tag, shape in tensors.values():
        numel = 1
        for size in shape:
            numel *= size
        total += numel * DTYPES[tag].itemsize
    return total


def write_sparse(path: str, tensors: dict, data: dict | None = None, metadata: dict | None = None) -> int:
    """A safetensors file of `tensors` whose data is a hole except the bytes in `data` (the markers).
    Returns the file size. Only worth it on filesystems with sparse files (release sizes are 5-66 GB)."""
    data = data or {}
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offsets, offset = {}, 0
    for name in sorted(tensors):
        tag, shape = tensors[name]
        nbytes = parameter_bytes({name: (tag, shape)})
        if name in data and len(data[name]) != nbytes:
            raise H3WeightsError(f"{name}: {len(data[name])} data bytes for a {nbytes}-byte tensor")
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name] = offset
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(data):
            handle.seek(start + offsets[name])
            handle.write(data[name])
    os.truncate(path, start + offset)
    return start + offset


__all__ = ["PUBLISHED", "PublishedFile", "parameter_bytes", "release_header", "write_sparse"]
