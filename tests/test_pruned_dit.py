"""The pruned "AdaLN curve" DiT: written from the tiny full DiT, loaded into diffusers' model, compared with it.

The pruned file built here keeps the full tiny DiT's float32 weights (only the AdaLN projections are stored F16,
as the published files store them), so against the full model with F16-rounded AdaLN weights the one difference
is the t-embedding: a lerp between grid samples of the curve instead of the timestep MLP itself.
"""

import copy

import pytest
import torch

from h3_core import weights
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.testing import CASES, STEPS
from h3_core.weights import pruned
from h3_core.weights.curve_model import CurveAdaLayerNormModulation, MiniMaxH3CurveTransformer3DModel
from h3_core.weights.headers import read_header
from h3_core.weights.safetensors_io import load_tensors, write_file

FULL = "comfyui/diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors"
GRID = pruned.RELEASE_GRID

# Bounds (measured on the tiny model, 2 threads; see each test for why they hold).
EMBED_GRID_ULPS = 8  # t-embedding at grid points: same fp32 maths up to GEMM blocking, in ulps of max|component|
LATENT_INTERP_BOUND = 5e-6  # interpolation only, latents |x| <= ~5 after 3 steps (measured 5.4e-7)
LATENT_F16_BOUND = 1e-3  # plus the F16 storage of the AdaLN weights (measured 7.3e-5)


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise-sensitive comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """The tiny full DiT file and a pruned file written from it (float32 weights, F16 AdaLN, F32 table)."""
    full = tiny_dir / FULL
    header = read_header([str(full)])
    path = tmp_path_factory.mktemp("pruned") / "minimax_h3_tiny_fl2va_pruned_fp32.safetensors"
    write_file(str(path), pruned.prune_comfy_state_dict(load_tensors(header), grid=GRID), header.metadata)
    return full, path


@pytest.fixture(scope="module")
def models(files):
    full_path, pruned_path = files
    full = weights.load_transformer(full_path)
    rounded = copy.deepcopy(full)  # the full model with the AdaLN weights the pruned file stores
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if "adaln_proj" in name or name.startswith("norm_out.linear"):
                param.copy_(param.to(torch.float16).to(torch.float32))
    return full, rounded, weights.load_transformer(pruned_path)


def test_the_pruned_file_has_the_published_layout(files):
    _, path = files
    header = read_header([str(path)])
    tensors = header.tensors
    assert not [key for key in tensors if key.startswith("time_embedder.")]
    assert tensors[pruned.TABLE_KEY].dtype == "F32" and tensors[pruned.TABLE_KEY].shape[0] == GRID
    adaln = [key for key in tensors if pruned.is_adaln_key(key)]
    assert adaln and {tensors[key].dtype for key in adaln} == {"F16"}
    assert any(key.startswith("final_layer.adaln_proj") for key in adaln)
    det = weights.detect(path)
    assert (det.key_format, det.format, det.partition) == ("pruned", "dense", "fl2va")
    assert weights.check(path).ok


def test_the_curve_model_is_diffusers_model_with_swapped_modules(models):
    _, _, curve = models
    assert isinstance(curve, MiniMaxH3CurveTransformer3DModel)
    assert isinstance(curve.time_proj, torch.nn.Identity)
    assert all(isinstance(block.adaln_proj, CurveAdaLayerNormModulation) for block in curve.transformer_blocks)
    # forward is diffusers' own: nothing but the AdaLN modules and the time embedding is replaced.
    assert type(curve).forward is type(curve).__mro__[1].forward
    assert pruned.MODEL_TABLE_KEY in curve.state_dict()


def test_t_embedding_at_grid_points_equals_the_full_models(models):
    """At t = j / 1024 the lerp weight is exactly 0, so the curve returns the stored row, which is the full model's
    SiLU(time_embedder(time_proj(t))) computed once for the whole grid. The full model computes it for the 1-4
    distinct t of a step: the same float32 operations, whose GEMM can block rows differently by batch size."""
    full, _, curve = models
    grid = pruned.grid_timesteps(GRID)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for size in (1, 2, 3, 4, 64):
        t = grid[torch.randperm(GRID, generator=generator)[:size]]
        with torch.no_grad():
            expected = torch.nn.functional.silu(full.time_embedder(full.time_proj(t)))
            got = curve.time_embedder(curve.time_proj(t))
        ulp = torch.finfo(torch.float32).eps * expected.abs().amax(dim=1, keepdim=True)  # per embedding vector
        worst = max(worst, float(((got - expected).abs() / ulp).max()))
    assert worst <= EMBED_GRID_ULPS, f"{worst} ulp of the vector's largest component"
    row = grid[[0, 512, 1024]]
    assert torch.equal(curve.time_embedder(row), curve.adaln_t_table[[0, 512, 1024]])  # the stored rows, bitwise


def test_between_grid_points_it_is_cores_lerp(models):
    """ComfyUI core's formula, written out independently: clamp, fractional index, last interval for t = 1."""
    _, _, curve = models
    table = curve.adaln_t_table
    t = torch.tensor([-0.5, 0.0, 1e-4, 0.3333, 0.5 + 0.5 / 1024, 0.99999, 1.0, 2.0])
    pos = t.clamp(0, 1) * (GRID - 1)
    low = torch.minimum(pos.floor(), torch.tensor(GRID - 2.0)).long()
    frac = (pos - low.float())[:, None]
    expected = table[low] + frac * (table[low + 1] - table[low])
    torch.testing.assert_close(curve.time_embedder(t), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(curve.time_embedder(t[-1:]), table[-1:])  # t = 1 -> weight 1 on the last interval


@pytest.fixture(scope="module")
def t2va(tiny_dir):
    source = ModelSource.from_path(tiny_dir)
    return source, EncoderStage(source, ("text",)).encode(CASES["t2va-64x64-seed0"][0])


def _sample(model, t2va, seed=0):
    source, cond = t2va
    stage = DiffusionStage(modules={"transformer": model}, pipeline_config=source.pipeline_config)
    return stage.sample(cond, SamplingOptions(steps=STEPS, seed=seed))


def test_latents_pruned_vs_full(models, t2va):
    """End to end (t2va, 3 DiT forwards): against the full model with the same F16 AdaLN weights only the
    interpolation differs. Its error is at most h^2/8 * |f''| per component (h = 1/1024), ~1e-7 relative for the
    smooth curve; through the network it stays below LATENT_INTERP_BOUND. Against the unmodified full model the
    F16 rounding of the AdaLN weights (relative 2^-11) dominates."""
    full, rounded, curve = models
    got = _sample(curve, t2va)
    interp = _sample(rounded, t2va)
    exact = _sample(full, t2va)
    scale = float(exact.video.abs().max())
    assert 1.0 < scale < 50.0  # a real signal, not zeros
    for a, b, bound in ((got, interp, LATENT_INTERP_BOUND), (got, exact, LATENT_F16_BOUND)):
        assert float((a.video - b.video).abs().max()) < bound
        assert float((a.audio - b.audio).abs().max()) < bound
    assert not torch.equal(got.video, exact.video)  # it did run the curve, not the MLP


def test_bf16_stream_runs_with_float32_adaln(files, t2va):
    """In bf16 the AdaLN projections stay float32 (F16 widened exactly) and their outputs are cast to the stream's
    dtype per block, as core does; without the cast the bf16 linears would receive float32 inputs and fail."""
    _, path = files
    curve16 = weights.load_transformer(path, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in curve16.named_parameters()}
    assert dtypes["transformer_blocks.0.adaln_proj.linear.weight"] == torch.float32
    assert dtypes["norm_out.linear.weight"] == torch.float32
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == torch.bfloat16
    assert curve16.adaln_t_table.dtype == torch.float32
    reference = _sample(weights.load_transformer(path), t2va)
    got = _sample(curve16, t2va)
    assert curve16.transformer_blocks[0].adaln_proj.stream_dtype == torch.bfloat16
    assert torch.isfinite(got.video).all()
    assert float((got.video.float() - reference.video).abs().max()) < 0.05  # bf16 arithmetic (measured 7e-3)


def test_malformed_pruned_files_are_refused(files, tmp_path):
    full_path, path = files
    tensors = load_tensors(read_header([str(path)]))
    metadata = read_header([str(path)]).metadata
    both = {**tensors, **{k: v for k, v in load_tensors(read_header([str(full_path)])).items() if "time_embedder" in k}}
    write_file(str(tmp_path / "both.safetensors"), both, metadata)
    with pytest.raises(weights.H3WeightsError, match="both adaln_t_table and time_embedder"):
        weights.load_transformer(tmp_path / "both.safetensors")
    flat = {**tensors, pruned.TABLE_KEY: tensors[pruned.TABLE_KEY].reshape(-1)}
    write_file(str(tmp_path / "flat.safetensors"), flat, metadata)
    report = weights.check(tmp_path / "flat.safetensors")
    assert not report.ok and "adaln_t_table must be [grid >= 2, K]" in str(report)
    narrow = {**tensors, pruned.TABLE_KEY: tensors[pruned.TABLE_KEY][:, :4].contiguous()}
    write_file(str(tmp_path / "narrow.safetensors"), narrow, metadata)
    with pytest.raises(weights.H3WeightsError):  # AdaLN projections wider than K: shape mismatches, no weight read
        weights.load_transformer(tmp_path / "narrow.safetensors")


def test_prune_is_deterministic_and_needs_a_full_dit(files):
    full_path, _ = files
    state = load_tensors(read_header([str(full_path)]))
    a = pruned.prune_comfy_state_dict(state, grid=17)
    b = pruned.prune_comfy_state_dict(state, grid=17)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a[pruned.TABLE_KEY].shape == (17, state["time_embedder.proj_out.weight"].shape[0])
    with pytest.raises(weights.H3WeightsError, match="no timestep MLP"):
        pruned.prune_comfy_state_dict(a, grid=17)
    with pytest.raises(ValueError, match="grid"):
        pruned.prune_comfy_state_dict(state, grid=1)
