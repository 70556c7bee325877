"""The pruned "AdaLN curve" DiT files (Comfy-Org `minimax_h3_{fl2va,ref2va}_pruned_*`): recognise, check, load, write.

What differs on disk from the full DiT (Comfy single-file names; everything else is unchanged):

    time_embedder.proj_in/proj_out.*          absent
    adaln_t_table                             F32 [G, K]: the post-SiLU time embedding on G uniform t in [0, 1]
    blocks.N.adaln_proj.linear.weight/bias    F16 [6*3*hidden, K] / [6*3*hidden]   (full DiT: K = time_embed_dim)
    final_layer.adaln_proj.linear.weight/bias F16 [2*hidden, K] / [2*hidden]

The file is its own key family of the DiT handler (`with_curve_family` wraps the DiT handler: the family is
recognised by the table, its config takes `time_embed_dim = K`, its tensors go through the DiT's key converter
plus the table, and its meta model is `curve_model.MiniMaxH3CurveTransformer3DModel`). diffusers' single-file
loader refuses these files, so they take the loaders' generic assign path (`KeyFamily.diffusers_single_file`).
A pruned file whose block linears are quantised is the same family in a quantised weight format: its linears
are the quantised route's business, its AdaLN projections and table are dense either way.

`prune_comfy_state_dict` writes a pruned file from a full one (tiny twins, tests): the table is the full DiT's
own time-embedding curve sampled on the grid (K = time_embed_dim: exact, no low-rank basis), the AdaLN
projections unchanged but stored F16, so at grid points the pruned model's embedding equals the full one's.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import configs
from .errors import H3WeightsError
from .keymap import ComponentHandler, KeyFamily

TABLE_KEY = "adaln_t_table"  # file name (top level, as core reads it)
MODEL_TABLE_KEY = "time_embedder.adaln_t_table"  # the curve model's state-dict name of the same tensor
PRUNED = "pruned"  # the key family's name (`Detection.key_format`)
RELEASE_GRID = 1025  # 2**10 + 1 grid points, the published files'
_TIME_EMBEDDER = ("time_embedder.proj_in.weight", "time_embedder.proj_out.weight")
_TIME_EMBEDDER_PREFIX = "time_embedder."
_ADALN_SUFFIXES = ("adaln_proj.linear.weight", "adaln_proj.linear.bias")


def is_adaln_key(key: str) -> bool:
    """A Comfy-name AdaLN projection tensor (blocks and final layer): K wide in the pruned file, stored F16."""
    return key.endswith(_ADALN_SUFFIXES) and (key.startswith("blocks.") or key.startswith("final_layer."))


def _table_shape(shapes: dict, where: str) -> tuple[int, int]:
    shape = tuple(shapes[TABLE_KEY])
    if len(shape) != 2 or shape[0] < 2 or shape[1] < 1:
        raise H3WeightsError(f"{where}: {TABLE_KEY} must be [grid >= 2, K], got {list(shape)}")
    present = [key for key in shapes if key.startswith(_TIME_EMBEDDER_PREFIX)]
    if present:
        raise H3WeightsError(
            f"{where}: holds both {TABLE_KEY} and time_embedder tensors ({present[:2]}); "
            "a pruned DiT has only the table"
        )
    return shape[0], shape[1]


# --- the handler's family functions --------------------------------------------------------------


def derive_config(base: ComponentHandler, shapes: dict, stated: dict, where: str) -> dict:
    """The full DiT's derivation, with `time_embed_dim = K` from the table. The timestep MLP's own sizes
    (freq_dim, time_embed_hidden_dim) are not in the file; they only size modules the curve model replaces."""
    _, dim = _table_shape(shapes, where)
    release = configs.get("transformer", tiny=False)
    freq = int((stated or {}).get("freq_dim", release["freq_dim"]))
    hidden = int((stated or {}).get("time_embed_hidden_dim", release["time_embed_hidden_dim"]))
    stand_in = {**shapes, _TIME_EMBEDDER[0]: (hidden, freq), _TIME_EMBEDDER[1]: (dim, hidden)}
    return base.derive_config(stand_in, "reference", stated, where)


def to_model(base: ComponentHandler, tensors: dict, config: dict, layout: str) -> tuple[dict, list[str]]:
    rest = dict(tensors)
    table = rest.pop(TABLE_KEY, None)
    converted, unexpected = base.to_model(rest, config, "reference", layout)
    if table is not None:
        converted[MODEL_TABLE_KEY] = table
    return converted, unexpected


def from_model(base: ComponentHandler, state: dict, config: dict, family: str, layout: str) -> dict:
    if MODEL_TABLE_KEY not in state:
        return base.from_model(state, config, family, layout)
    rest = dict(state)
    table = rest.pop(MODEL_TABLE_KEY)
    out = base.from_model(rest, config, "reference" if family == PRUNED else family, layout)
    for key in [k for k in out if k.startswith(_TIME_EMBEDDER_PREFIX)]:
        del out[key]
    out[TABLE_KEY] = table
    return out


def build(det, config: dict) -> torch.nn.Module:
    """The curve model on the meta device (its table too, so a strict load must fill it)."""
    from accelerate import init_empty_weights

    from .curve_model import MiniMaxH3CurveTransformer3DModel

    grid, _ = _table_shape(det.header.shapes, det.path)
    with init_empty_weights(include_buffers=False):
        return MiniMaxH3CurveTransformer3DModel.from_curve_config(config, grid, device="meta")


def notes(header_tensors: dict) -> tuple[str, ...]:
    info = header_tensors[TABLE_KEY]
    adaln = sorted({header_tensors[k].dtype for k in header_tensors if is_adaln_key(k)})
    return (
        f"pruned AdaLN-curve DiT: {TABLE_KEY} {list(info.shape)} {info.dtype} (t-embedding by lerp on "
        f"{info.shape[0]} uniform t in [0, 1], no SiLU); AdaLN projections {'/'.join(adaln)} run as float32",
    )


PRUNED_FAMILY_MARKERS = (TABLE_KEY, "token_refiner.blocks.0.attn.qkv_proj.weight", "video_patch_proj.weight")


def with_curve_family(base: ComponentHandler) -> ComponentHandler:
    """The DiT handler extended by the pruned family (checked first: its files also carry the reference markers)."""
    family = KeyFamily(PRUNED, PRUNED_FAMILY_MARKERS, comfy=True, diffusers_single_file=False)

    def _derive(shapes, fam, stated, where):
        if fam != PRUNED:
            return base.derive_config(shapes, fam, stated, where)
        return derive_config(base, shapes, stated, where)

    def _to_model(tensors, config, fam, layout):
        if fam != PRUNED:
            return base.to_model(tensors, config, fam, layout)
        return to_model(base, tensors, config, layout)

    def _build(cls, det, config):
        if det.key_format == PRUNED:
            return build(det, config)
        if base.build is not None:
            return base.build(cls, det, config)
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            return cls.from_config(config)

    def _notes(keys, fam):
        return base.notes(keys, fam) + (notes(keys) if fam == PRUNED else ())

    return dataclasses.replace(
        base,
        families=(family, *base.families),
        derive_config=_derive,
        to_model=_to_model,
        from_model=lambda state, config, fam, layout: from_model(base, state, config, fam, layout),
        build=_build,
        notes=_notes,
    )


# --- writing a pruned file from a full one -------------------------------------------------------


def grid_timesteps(grid: int) -> torch.Tensor:
    """The G uniform t in [0, 1] the table is sampled at, float32 (exact when G - 1 is a power of two)."""
    if grid < 2:
        raise ValueError(f"grid must be >= 2 points, got {grid}")
    return (torch.arange(grid, dtype=torch.float64) / (grid - 1)).to(torch.float32)


def time_embedding_curve(state: dict, timesteps: torch.Tensor) -> torch.Tensor:
    """SiLU(time_embedder(time_proj(t))) of a full DiT in Comfy names, float32, with diffusers' own modules:
    exactly what every AdaLN projection of the full model receives for these t."""
    from diffusers.models.embeddings import TimestepEmbedding, Timesteps

    missing = [key for key in _TIME_EMBEDDER if key not in state]
    if missing:
        raise H3WeightsError(f"not a full MiniMax-H3 DiT (no timestep MLP): missing {missing}")
    hidden, freq = state[_TIME_EMBEDDER[0]].shape
    dim = state[_TIME_EMBEDDER[1]].shape[0]
    proj = Timesteps(num_channels=freq, flip_sin_to_cos=True, downscale_freq_shift=0)
    mlp = TimestepEmbedding(in_channels=freq, time_embed_dim=hidden, out_dim=dim)
    mlp.load_state_dict(
        {
            f"linear_{i}.{part}": state[f"time_embedder.proj_{name}.{part}"].to(torch.float32)
            for i, name in ((1, "in"), (2, "out"))
            for part in ("weight", "bias")
        }
    )
    # Evaluated in float64, then rounded to float32: a float32 GEMM's last bits depend on how many threads split it,
    # and the table must be the same bytes whatever the process's thread count (the tiny build is pinned by bytes).
    mlp = mlp.to(torch.float64)
    with torch.no_grad():
        curve = mlp(proj(timesteps.to(torch.float32)).to(torch.float64))
        return torch.nn.functional.silu(curve).to(torch.float32).contiguous()


def prune_comfy_state_dict(state: dict, *, grid: int = RELEASE_GRID) -> dict:
    """A full DiT in Comfy single-file names -> the pruned file's tensors (table F32 [grid, K], AdaLN F16).

    K is the full model's `time_embed_dim`: the table is the exact curve, not a low-rank basis of it, so the
    AdaLN weights are the full model's (rounded to F16, as the published files store them)."""
    table = time_embedding_curve(state, grid_timesteps(grid))
    out = {}
    for key, tensor in state.items():
        if key.startswith(_TIME_EMBEDDER_PREFIX):
            continue
        out[key] = tensor.to(torch.float16) if is_adaln_key(key) else tensor
    out[TABLE_KEY] = table
    return out
