"""The pruned "AdaLN curve" DiT, run inside diffusers' `MiniMaxH3Transformer3DModel` without copying its forward.

The published pruned DiTs drop the timestep MLP (`time_proj` -> `time_embedder` -> SiLU) and ship instead a
float32 table `adaln_t_table [G, K]`: the post-SiLU time embedding sampled on a uniform grid of G points over
t in [0, 1] (a K-dim basis of it; the AdaLN projections are K wide). ComfyUI core computes the embedding of a
timestep by linear interpolation on that grid, clamped at both ends, and feeds it to every AdaLN projection
without a SiLU. Here that is three small swaps on an otherwise unchanged diffusers model:

- `time_proj` becomes the identity and `time_embedder` a `CurveTimeEmbedding` holding the table. diffusers'
  forward calls `time_embedder(time_proj(t).to(get_parameter_dtype(time_embedder)))`; with no parameter that
  dtype is the table's (float32), so `t` arrives as float32 and the lerp runs in float32, as in core;
- every block's `adaln_proj` and `norm_out` become SiLU-free subclasses. The AdaLN projections are float32
  (the file stores them F16, so the widening is exact); the six block modulations are cast to the dtype of the
  hidden states entering the block (recorded by a forward pre-hook), because the block multiplies them straight
  into the stream and float32 ones would promote a bf16 stream to float32 in front of bf16 linears. That is core's
  per-use cast. `norm_out` stays float32 end to end (core keeps the final modulation in float32 too; the output
  heads are float32).
"""

from __future__ import annotations

import torch
from diffusers import MiniMaxH3Transformer3DModel
from torch import nn

from ..diffusers_adapter import adaln_modulation_class, adaln_out_class
from ..diffusers_adapter import parameter_dtype as get_parameter_dtype

TABLE_BUFFER = "adaln_t_table"


def curve_embedding(table: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """Core's lookup: lerp between the two grid rows around each t (float32; t = 1.0 uses the last interval)."""
    grid = table.shape[0]
    pos = timestep.to(torch.float32).clamp(0.0, 1.0) * (grid - 1)
    low = pos.floor().long().clamp(max=grid - 2)
    weight = (pos - low.to(torch.float32)).unsqueeze(1)
    return torch.lerp(table[low], table[low + 1], weight.to(table.dtype))


class CurveTimeEmbedding(nn.Module):
    """`time_embedder` of the curve model: its only tensor is the persistent float32 table."""

    def __init__(self, grid: int, dim: int, device=None):
        super().__init__()
        if grid < 2:
            raise ValueError(f"an AdaLN curve needs at least 2 grid points, got {grid}")
        self.register_buffer(TABLE_BUFFER, torch.empty(grid, dim, dtype=torch.float32, device=device))

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return curve_embedding(getattr(self, TABLE_BUFFER), timestep)


class CurveAdaLayerNormModulation(adaln_modulation_class()):
    """The parent's projection without the SiLU, its outputs cast to the stream dtype (`stream_dtype`)."""

    stream_dtype: torch.dtype | None = None

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        modulation = self.linear(temb.to(get_parameter_dtype(self.linear))).view(-1, 6 * self.hidden_size)
        if self.stream_dtype is not None:
            modulation = modulation.to(self.stream_dtype)
        return modulation.chunk(6, dim=-1)


class CurveAdaLayerNormOut(adaln_out_class()):
    """The parent's final modulation without the SiLU, norm and modulation at the module's own (float32) dtype."""

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        shift, scale = self.linear(temb.to(get_parameter_dtype(self.linear))).chunk(2, dim=-1)
        hidden_states = self.norm(hidden_states.to(get_parameter_dtype(self.norm)))
        return hidden_states * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(
            0, timestep_indices
        )


def _record_stream_dtype(block: nn.Module, args: tuple, kwargs: dict) -> None:
    hidden_states = args[0] if args else kwargs["hidden_states"]
    block.adaln_proj.stream_dtype = hidden_states.dtype


class MiniMaxH3CurveTransformer3DModel(MiniMaxH3Transformer3DModel):
    """`MiniMaxH3Transformer3DModel` with the curve swaps installed (`from_curve_config`); same config, same forward.

    Built with `time_embed_dim = K`, so every AdaLN projection is K wide, as in the file. The dtype rule keeps the
    AdaLN projections (`adaln_proj`, `norm_out`) float32 besides the parent's float32 modules.
    """

    _keep_in_fp32_modules = [*MiniMaxH3Transformer3DModel._keep_in_fp32_modules, "adaln_proj", "norm_out"]

    @classmethod
    def from_curve_config(cls, config: dict, grid: int, device=None) -> "MiniMaxH3CurveTransformer3DModel":
        model = cls.from_config(config)
        model.time_proj = nn.Identity()
        model.time_embedder = CurveTimeEmbedding(grid, model.config.time_embed_dim, device=device)
        for block in model.transformer_blocks:
            block.adaln_proj.__class__ = CurveAdaLayerNormModulation
            block.register_forward_pre_hook(_record_stream_dtype, with_kwargs=True)
        model.norm_out.__class__ = CurveAdaLayerNormOut
        return model

    @property
    def adaln_t_table(self) -> torch.Tensor:
        return getattr(self.time_embedder, TABLE_BUFFER)
