"""Video VAE keys: diffusers `AutoencoderKLMiniMaxH3` <-> Comfy-Org file / native `video_vae/`.

The Comfy file and the native `video_vae/source` weights use the reference (CompVis-style)
names: `encoder.down.{i}.block.{j}`, `nin_shortcut`, `downsample`, `decoder.x_embedder`, fused
`attn.to_qkv` (per-head interleaved: ComfyUI views it as `[.., heads, 3 * head_dim]` and chunks,
diffusers' conversion script de-interleaves it the same way), `attn.to_out`, `ff.w1` stored
`[gate; value]` for weight and bias, `ff.w2`. They also carry `decoder.mask_token`, a training-only
all-zero buffer the decoder never reads (dropped on load, written as zeros). The Comfy file adds
`latents_mean` / `latents_std` buffers; diffusers keeps those 24 numbers in its config.
"""

from __future__ import annotations

import re

import torch

from .. import configs
from . import config_merge
from .errors import H3WeightsError
from .fused import fuse_qkv, split_qkv, swap_halves
from .keymap import ComponentHandler, KeyFamily, count_indices, rename

LATENT_STAT_KEYS = ("latents_mean", "latents_std")
MASK_TOKEN_KEY = "decoder.mask_token"

# (reference regex, diffusers template) for pure renames; evaluated in order, first full match wins.
_RENAMES = [
    (
        r"encoder\.down\.(\d+)\.block\.(\d+)\.nin_shortcut\.(weight|bias)",
        r"encoder.down_blocks.\1.resnets.\2.conv_shortcut.\3",
    ),
    (
        r"encoder\.down\.(\d+)\.block\.(\d+)\.(norm1|conv1|norm2|conv2)\.(weight|bias)",
        r"encoder.down_blocks.\1.resnets.\2.\3.\4",
    ),
    (r"encoder\.down\.(\d+)\.downsample\.conv\.(weight|bias)", r"encoder.down_blocks.\1.downsamplers.0.conv.\2"),
    (r"encoder\.(conv_in|norm_out|conv_out)\.(weight|bias)", r"encoder.\1.\2"),
    (r"(quant_conv|post_quant_conv)\.(weight|bias)", r"\1.\2"),
    (r"decoder\.x_embedder\.(weight|bias)", r"decoder.proj_in.\1"),
    (r"decoder\.register_tokens", r"decoder.register_tokens"),
    (r"decoder\.(norm_out|proj_out)\.(weight|bias)", r"decoder.\1.\2"),
    (r"decoder\.transformer_blocks\.(\d+)\.(norm1|norm2)\.weight", r"decoder.transformer_blocks.\1.\2.weight"),
    (r"decoder\.transformer_blocks\.(\d+)\.(scale1|scale2)", r"decoder.transformer_blocks.\1.\2"),
    (
        r"decoder\.transformer_blocks\.(\d+)\.attn\.to_out\.(weight|bias)",
        r"decoder.transformer_blocks.\1.attn.to_out.0.\2",
    ),
    (r"decoder\.transformer_blocks\.(\d+)\.ff\.w1\.(weight|bias)", r"decoder.transformer_blocks.\1.ff.net.0.proj.\2"),
    (r"decoder\.transformer_blocks\.(\d+)\.ff\.w2\.(weight|bias)", r"decoder.transformer_blocks.\1.ff.net.2.\2"),
]
_RENAMES = [(re.compile(a), b) for a, b in _RENAMES]

# The inverse direction, written out rather than derived so each rule stays readable.
_RENAMES_INV = [
    (
        r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.conv_shortcut\.(weight|bias)",
        r"encoder.down.\1.block.\2.nin_shortcut.\3",
    ),
    (
        r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(norm1|conv1|norm2|conv2)\.(weight|bias)",
        r"encoder.down.\1.block.\2.\3.\4",
    ),
    (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(weight|bias)", r"encoder.down.\1.downsample.conv.\2"),
    (r"encoder\.(conv_in|norm_out|conv_out)\.(weight|bias)", r"encoder.\1.\2"),
    (r"(quant_conv|post_quant_conv)\.(weight|bias)", r"\1.\2"),
    (r"decoder\.proj_in\.(weight|bias)", r"decoder.x_embedder.\1"),
    (r"decoder\.register_tokens", r"decoder.register_tokens"),
    (r"decoder\.(norm_out|proj_out)\.(weight|bias)", r"decoder.\1.\2"),
    (r"decoder\.transformer_blocks\.(\d+)\.(norm1|norm2)\.weight", r"decoder.transformer_blocks.\1.\2.weight"),
    (r"decoder\.transformer_blocks\.(\d+)\.(scale1|scale2)", r"decoder.transformer_blocks.\1.\2"),
    (
        r"decoder\.transformer_blocks\.(\d+)\.attn\.to_out\.0\.(weight|bias)",
        r"decoder.transformer_blocks.\1.attn.to_out.\2",
    ),
    (r"decoder\.transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.(weight|bias)", r"decoder.transformer_blocks.\1.ff.w1.\2"),
    (r"decoder\.transformer_blocks\.(\d+)\.ff\.net\.2\.(weight|bias)", r"decoder.transformer_blocks.\1.ff.w2.\2"),
]
_RENAMES_INV = [(re.compile(a), b) for a, b in _RENAMES_INV]

_QKV = re.compile(r"decoder\.transformer_blocks\.(\d+)\.attn\.to_qkv\.(weight|bias)")
_SPLIT = re.compile(r"decoder\.transformer_blocks\.(\d+)\.attn\.to_(q|k|v)\.(weight|bias)")


def to_diffusers(state: dict, config: dict) -> tuple[dict, list[str]]:
    """Reference-named video VAE -> diffusers names. `latents_*` and `mask_token` are not weights
    of the diffusers model: the caller moves the former into the config; the latter is dropped."""
    heads, head_dim = config["decoder_num_attention_heads"], config["decoder_attention_head_dim"]
    out, unexpected = {}, []
    for key, tensor in state.items():
        if key in LATENT_STAT_KEYS or key == MASK_TOKEN_KEY:
            continue
        match = _QKV.fullmatch(key)
        if match:
            block, kind = match.groups()
            for name, part in zip("qkv", split_qkv(tensor, heads, head_dim, "interleaved", key)):
                out[f"decoder.transformer_blocks.{block}.attn.to_{name}.{kind}"] = part
            continue
        new_key = rename(key, _RENAMES)
        if new_key is None:
            unexpected.append(key)
        elif ".ff.w1." in key:
            out[new_key] = swap_halves(tensor, key)
        else:
            out[new_key] = tensor
    return out, unexpected


def from_diffusers(state: dict, config: dict, with_latent_stats: bool = True) -> dict:
    """Diffusers video VAE -> reference names (+ zero `mask_token`, + `latents_*` buffers if asked)."""
    heads, head_dim = config["decoder_num_attention_heads"], config["decoder_attention_head_dim"]
    out, pending, unexpected = {}, {}, []
    for key, tensor in state.items():
        match = _SPLIT.fullmatch(key)
        if match:
            block, name, kind = match.groups()
            pending.setdefault((block, kind), {})[name] = tensor
            continue
        new_key = rename(key, _RENAMES_INV)
        if new_key is None:
            unexpected.append(key)
        elif ".ff.net.0.proj." in key:
            out[new_key] = swap_halves(tensor, key)
        else:
            out[new_key] = tensor
    if unexpected:
        raise H3WeightsError(f"not AutoencoderKLMiniMaxH3 weights: {sorted(unexpected)[:5]}")
    for (block, kind), parts in pending.items():
        if set(parts) != set("qkv"):
            raise H3WeightsError(f"decoder block {block}: to_q/to_k/to_v {kind} incomplete, cannot fuse to_qkv")
        out[f"decoder.transformer_blocks.{block}.attn.to_qkv.{kind}"] = fuse_qkv(
            parts["q"], parts["k"], parts["v"], heads, head_dim, "interleaved"
        )
    proj_in = state["decoder.proj_in.weight"]
    out[MASK_TOKEN_KEY] = torch.zeros(1, 1, proj_in.shape[0], dtype=proj_in.dtype, device=proj_in.device)
    if with_latent_stats:
        for key in LATENT_STAT_KEYS:
            out[key] = torch.tensor(config[key], dtype=torch.float32)
    return out


def derive_config(shapes: dict, naming: str, stated: dict | None, source: str) -> dict:
    """Config from shapes. Downsample strides, GroupNorm groups and the decoder's head split are
    invisible in shapes; they come from the stated config or the release values."""
    stated = dict(stated or {})
    ref = naming != "diffusers"
    block_re = r"encoder\.down\.(\d+)\." if ref else r"encoder\.down_blocks\.(\d+)\."
    levels = count_indices(shapes, block_re)
    if levels == 0:
        raise H3WeightsError(f"{source}: no encoder levels found, not a MiniMax-H3 video VAE")
    resnet = "encoder.down.{i}.block.{j}.conv1.weight" if ref else "encoder.down_blocks.{i}.resnets.{j}.conv1.weight"
    embed = "decoder.x_embedder.weight" if ref else "decoder.proj_in.weight"
    w1 = "decoder.transformer_blocks.0.ff.w1.weight" if ref else "decoder.transformer_blocks.0.ff.net.0.proj.weight"
    for needed in (resnet.format(i=0, j=0), embed, w1, "post_quant_conv.weight", "encoder.conv_in.weight"):
        if needed not in shapes:
            raise H3WeightsError(f"{source}: not a complete MiniMax-H3 video VAE, missing {needed}")
    block_out = [shapes[resnet.format(i=i, j=0)][0] for i in range(levels)]
    per_level = count_indices(
        shapes, (r"encoder\.down\.0\.block\.(\d+)\." if ref else r"encoder\.down_blocks\.0\.resnets\.(\d+)\.")
    )
    dim, latent = shapes[embed]
    derived = {
        "in_channels": shapes["encoder.conv_in.weight"][1],
        "latent_channels": shapes["post_quant_conv.weight"][0],
        "block_out_channels": block_out,
        "layers_per_block": per_level,
        "decoder_num_layers": count_indices(shapes, r"decoder\.transformer_blocks\.(\d+)\."),
        "decoder_num_register_tokens": shapes["decoder.register_tokens"][1],
        "decoder_ffn_mult": shapes[w1][0] // (2 * dim),
    }
    defaults = configs.get("vae", tiny=False)
    # Head split: stated, else the release head width (64) if it divides the decoder width.
    head_dim = stated.get("decoder_attention_head_dim", defaults["decoder_attention_head_dim"])
    heads = stated.get("decoder_num_attention_heads", dim // head_dim if dim % head_dim == 0 else None)
    if heads is None or heads * head_dim != dim:
        raise H3WeightsError(
            f"{source}: decoder width {dim} does not split into heads of {head_dim}; the checkpoint must state "
            "decoder_num_attention_heads / decoder_attention_head_dim (config.json or h3.config metadata)"
        )
    derived["decoder_num_attention_heads"] = heads
    derived["decoder_attention_head_dim"] = head_dim
    if len(block_out) != len(stated.get("spatial_downsample_factors", defaults["spatial_downsample_factors"])):
        raise H3WeightsError(
            f"{source}: {len(block_out)} encoder levels but no stated spatial/temporal downsample factors "
            "for that many levels (release has 6)"
        )
    config = config_merge.merge(defaults, stated, derived, source)
    # Cross-check the strides we could not read against the decoder's patch, which we can.
    ps = 1
    for f in config["spatial_downsample_factors"]:
        ps *= f
    pt = 1
    for f in config["temporal_downsample_factors"]:
        pt *= f
    proj_rows = shapes["decoder.proj_out.weight"][0]
    if proj_rows != config["out_channels"] * pt * ps * ps:
        raise H3WeightsError(
            f"{source}: decoder.proj_out has {proj_rows} rows but {config['out_channels']} x {pt} x {ps} x {ps} "
            "follows from the downsample factors; state the factors in the config"
        )
    if latent != config["latent_channels"]:
        raise H3WeightsError(f"{source}: decoder input {latent} != latent channels {config['latent_channels']}")
    return config


# --- the handler ---------------------------------------------------------------------------------

REFERENCE_MARKERS = (
    "decoder.transformer_blocks.0.scale1",
    "encoder.down.0.block.0.conv1.weight",
    "decoder.x_embedder.weight",
)
DIFFUSERS_MARKERS = (
    "decoder.transformer_blocks.0.scale1",
    "encoder.down_blocks.0.resnets.0.conv1.weight",
    "decoder.proj_in.weight",
)


def _to_model(tensors: dict, config: dict, family: str, layout: str):
    return (dict(tensors), []) if family == "diffusers" else to_diffusers(tensors, config)


def _from_model(state: dict, config: dict, family: str, layout: str) -> dict:
    if family == "diffusers":
        return dict(state)
    # Native folders keep the latent statistics in config.json; Comfy files carry them as buffers.
    return from_diffusers(state, config, with_latent_stats=layout == "comfyui")


def _derive(shapes: dict, family: str, stated: dict, where: str) -> dict:
    return derive_config(shapes, "diffusers" if family == "diffusers" else "reference", stated, where)


HANDLER = ComponentHandler(
    name="vae",
    label="video VAE",
    model_class="AutoencoderKLMiniMaxH3",
    library="diffusers",
    folders=("vae", "video_vae"),
    families=(
        KeyFamily("reference", REFERENCE_MARKERS, comfy=True, native=True),
        KeyFamily("diffusers", DIFFUSERS_MARKERS),
    ),
    derive_config=_derive,
    to_model=_to_model,
    from_model=_from_model,
    latent_stat_keys=LATENT_STAT_KEYS,
    # The int8_convrot file quantises only decoder ViT linears (2.8 GB vs 5.2 GB fp16): dequantised once at
    # load it is the fp16 model's size and maths, and the VAE's real memory control is its tiling.
    quantised_layers="dequantise",
)
