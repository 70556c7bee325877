"""Audio VAE keys: diffusers `AutoencoderKLMiniMaxH3Audio` <-> Comfy-Org file.

The module tree and names are identical on both sides (diffusers kept the reference names); the
differences are that diffusers keeps `torch.nn.utils.weight_norm` (`X.weight_g` / `X.weight_v`)
while the Comfy file holds the folded `X.weight`, and that the Comfy file carries the 32
`latents_mean` / `latents_std` as buffers where diffusers keeps them in its config.

Folding is done with `torch._weight_norm(v, g, dim)`, the very op weight norm's pre-forward hook
evaluates, so a folded weight is bit-identical to the weight the diffusers model convolves with.
A folded file is loaded into a model whose weight norm has been removed (never re-split into g/v,
which would round), giving bit-exact outputs.
"""

from __future__ import annotations

import torch

from .. import configs
from . import config_merge
from .errors import H3WeightsError
from .keymap import ComponentHandler, KeyFamily, count_indices

LATENT_STAT_KEYS = ("latents_mean", "latents_std")
_G, _V = ".weight_g", ".weight_v"


def weight_norm_dim(g: torch.Tensor) -> int:
    """The `dim` weight norm was applied over, read off `weight_g`'s shape (size 1 elsewhere)."""
    non_unit = [axis for axis, size in enumerate(g.shape) if size != 1]
    if len(non_unit) > 1:
        raise H3WeightsError(f"weight_g of shape {list(g.shape)} is not a weight-norm magnitude")
    return non_unit[0] if non_unit else 0


def fold_weight_norm(state: dict) -> dict:
    """`X.weight_g` + `X.weight_v` -> `X.weight` (exactly what the diffusers forward computes)."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(_V):
            continue
        if key.endswith(_G):
            stem = key[: -len(_G)]
            v = state.get(stem + _V)
            if v is None:
                raise H3WeightsError(f"{key} has no matching {stem + _V}")
            out[stem + ".weight"] = torch._weight_norm(v, tensor, weight_norm_dim(tensor))
            continue
        out[key] = tensor
    orphans = [k for k in state if k.endswith(_V) and k[: -len(_V)] + _G not in state]
    if orphans:
        raise H3WeightsError(f"weight_v without weight_g: {sorted(orphans)[:5]}")
    return out


def is_weight_normed(keys) -> bool:
    return any(key.endswith(_G) for key in keys)


def to_diffusers(state: dict) -> tuple[dict, list[str]]:
    """Comfy file -> diffusers names (folded). Only the latent-stat buffers leave; the caller moves
    them into the config."""
    return {k: v for k, v in state.items() if k not in LATENT_STAT_KEYS}, []


def from_diffusers(state: dict, config: dict) -> dict:
    """Diffusers audio VAE (weight-normed or already folded) -> Comfy file tensors."""
    out = fold_weight_norm(state) if is_weight_normed(state) else dict(state)
    for key in LATENT_STAT_KEYS:
        if config.get(key) is None:
            raise H3WeightsError(f"the audio VAE config has no {key}; a Comfy file must carry it")
        out[key] = torch.tensor(config[key], dtype=torch.float32)
    return out


def _weight_shape(shapes: dict, stem: str):
    """Shape of a conv weight whether stored folded (`.weight`) or weight-normed (`.weight_v`)."""
    for suffix in (".weight", _V):
        if stem + suffix in shapes:
            return shapes[stem + suffix]
    return None


def _rate_for_kernel(kernel: int) -> int:
    # The release pairs rate u with kernel 2u (even u) or 2u - 1 (odd u): [5,5,2,...] -> [9,9,4,...].
    return (kernel + 1) // 2 if kernel % 2 else kernel // 2


def derive_config(shapes: dict, stated: dict | None, source: str) -> dict:
    """Config from shapes. Attention heads, dilations and the sample rate are invisible in shapes
    and come from the stated config or the release values."""
    stated = dict(stated or {})
    first = _weight_shape(shapes, "encoder.block.0")
    conv_pre = _weight_shape(shapes, "decoder.conv_pre")
    if first is None or conv_pre is None or "mean_proj.weight" not in shapes or "dec_in_proj.weight" not in shapes:
        raise H3WeightsError(f"{source}: not a complete MiniMax-H3 audio VAE (encoder/decoder convs missing)")
    n_down = count_indices(shapes, r"encoder\.block\.(\d+)\.block\.4\.")
    encoder_rates = [_weight_shape(shapes, f"encoder.block.{i}.block.4")[2] // 2 for i in range(1, n_down + 1)]
    n_up = count_indices(shapes, r"decoder\.ups\.(\d+)\.")
    kernels = [_weight_shape(shapes, f"decoder.ups.{i}.0")[2] for i in range(n_up)]
    n_kernels = count_indices(shapes, r"decoder\.resblocks\.(\d+)\.") // max(n_up, 1)
    derived = {
        "encoder_dim": first[0],
        "encoder_rates": encoder_rates,
        "latent_dim": shapes["dec_in_proj.weight"][0],
        "latent_channels": shapes["mean_proj.weight"][0],
        "decoder_dim": conv_pre[0],
        "decoder_kernel_sizes": kernels,
        "resblock_kernel_sizes": [
            _weight_shape(shapes, f"decoder.resblocks.{j}.convs1.0")[2] for j in range(n_kernels)
        ],
    }
    if "decoder_rates" not in stated:
        derived["decoder_rates"] = [_rate_for_kernel(k) for k in kernels]
    return config_merge.merge(configs.get("audio_vae", tiny=False), stated, derived, source)


# --- the handler ---------------------------------------------------------------------------------

MARKERS = ("pre_block.attn.zero_k_bias", "dec_in_proj.weight")


def native_stated_config(stated: dict, source) -> dict:
    """Native `audio_vae/metadata.json` kwargs + `config.json` -> diffusers argument names (the
    translation diffusers' conversion script applies); what the folder states otherwise wins."""
    if not source.extra_config:
        return stated
    kwargs, config = source.extra_config, source.config
    renames = {"vae_latent_channels": "latent_channels", "sample_rate": "sampling_rate"}
    names = ("encoder_dim", "encoder_rates", "latent_dim", "decoder_dim", "decoder_rates", *renames)
    native = {renames.get(key, key): kwargs[key] for key in names if key in kwargs}
    if "sample_rate" in config:
        native["sampling_rate"] = config["sample_rate"]
    native.update({key: config[key] for key in ("latent_channels", "latents_mean", "latents_std") if key in config})
    return {**native, **stated}


def remove_weight_norm(module: torch.nn.Module) -> None:
    """Turn every weight-normed conv of a module into a plain one (in place)."""
    # `torch.nn.utils.weight_norm` is also the name of a function; import from the module itself.
    from torch.nn.utils.weight_norm import WeightNorm
    from torch.nn.utils.weight_norm import remove_weight_norm as remove

    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if isinstance(hook, WeightNorm):
                remove(sub, hook.name)


def _build(cls, det, config: dict):
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    if det.key_format == "folded":  # a folded file loads into plain convs (bit-exact, see above)
        remove_weight_norm(model)
    return model


def _to_model(tensors: dict, config: dict, family: str, layout: str):
    return to_diffusers(tensors)


def _from_model(state: dict, config: dict, family: str, layout: str) -> dict:
    return from_diffusers(state, config) if family == "folded" else dict(state)


HANDLER = ComponentHandler(
    name="audio_vae",
    label="audio VAE",
    model_class="AutoencoderKLMiniMaxH3Audio",
    library="diffusers",
    folders=("audio_vae",),
    families=(
        KeyFamily("weight_norm", MARKERS, test=is_weight_normed),
        KeyFamily("folded", MARKERS, comfy=True),
    ),
    derive_config=lambda shapes, family, stated, where: derive_config(shapes, stated, where),
    to_model=_to_model,
    from_model=_from_model,
    stated_config=native_stated_config,
    build=_build,
    latent_stat_keys=LATENT_STAT_KEYS,
)
