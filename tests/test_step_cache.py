"""Step caching (h3_core/step_cache.py) on the embedded tiny H3: `off` is diffusers' result bit for bit, `every:K`
computes exactly the forwards it names, cached runs are reproducible, and skipped blocks are never streamed in."""

import pytest
import torch
from diffusers.hooks import group_offloading
from support.h3_reference import monolithic
from support.lora_support import comfy_lora as _comfy_lora

from h3_core import cli, step_cache
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.lora import LoRA
from h3_core.models import ModelSource
from h3_core.rules import H3InputError
from h3_core.testing import CASES

STEPS = 9  # 8 DiT forwards: every:2 runs the stack on forwards 0, 2, 4, 6
CASE = "t2va-64x64-seed0"


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture(scope="module")
def source(tiny_dir):
    return ModelSource.from_path(tiny_dir)  # the layout diffusers' own pipeline loads (bitwise comparison)


@pytest.fixture(scope="module")
def cond(source):
    return EncoderStage(source, components=("text",)).encode(CASES[CASE][0])


@pytest.fixture(scope="module")
def stage(source):
    return DiffusionStage(source)


@pytest.fixture
def onloads(monkeypatch):
    """Group onloads, by the module that leads the group (the streamed block)."""
    seen = []
    original = group_offloading.ModuleGroup.onload_

    def counting(self):
        seen.append(self.onload_leader)
        return original(self)

    monkeypatch.setattr(group_offloading.ModuleGroup, "onload_", counting)
    return seen


def _sample(stage, cond, cache, steps=STEPS, **kwargs):
    return stage.sample(cond, SamplingOptions(steps=steps, seed=CASES[CASE][2], cache=cache, **kwargs))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_parse_presets_and_expert_form():
    assert step_cache.parse("off") is None and step_cache.parse(None) is None
    assert step_cache.parse("every:3") == step_cache.EveryK(3)
    assert step_cache.parse(" Balanced ") == step_cache.PRESETS["balanced"]
    expert = step_cache.parse("dbcache:fn=2,bn=0,warmup=2,threshold=0.3,max_continuous=-1,taylorseer=2")
    assert expert == step_cache.DBCache(fn=2, bn=0, warmup=2, threshold=0.3, max_continuous=-1, taylorseer=2)
    assert set(step_cache.CHOICES) >= {"off", "quality", "balanced", "fast", "every:2"}
    for bad, says in [("every:1", "K >= 2"), ("every:x", "K >= 2"), ("turbo", "cache must be"),
                      ("dbcache:fn=0", "fn >= 1"), ("dbcache:speed=3", "known key"), ("dbcache:taylorseer=3", "order")]:
        with pytest.raises(H3InputError, match=says):
            step_cache.parse(bad)
    with pytest.raises(H3InputError, match="cache must be"):
        SamplingOptions(steps=4, cache="sometimes")  # refused before any weights load
    # A stack shorter than fn + bn + 1 keeps one skippable block (the tiny H3 has 2).
    assert step_cache.PRESETS["quality"].for_blocks(2) == step_cache.DBCache(fn=1, bn=0, warmup=8, threshold=0.08,
                                                                             max_continuous=2)
    assert step_cache.PRESETS["quality"].for_blocks(50).bn == 1


def test_off_is_diffusers_bit_for_bit_and_counts_every_pass(stage, cond, tiny_dir):
    request, task, seed = CASES[CASE]
    latents = _sample(stage, cond, "off", steps=4)
    ref = monolithic(tiny_dir / "diffusers", request, task, seed, 4)
    assert torch.equal(latents.video, ref["latents"]) and torch.equal(latents.audio, ref["audio_latents"])
    assert (latents.passes.computed, latents.passes.total) == (3 * 2, 3 * 2)
    # After a cached run on the same DiT, nothing of it is left behind.
    _sample(stage, cond, "every:2", steps=4)
    again = _sample(stage, cond, "off", steps=4)
    assert torch.equal(again.video, latents.video) and torch.equal(again.audio, latents.audio)
    dit = stage.transformer("t2va")
    assert "forward" not in dit.__dict__ and not any(block._forward_pre_hooks for block in dit.transformer_blocks)


def test_every_2_computes_every_other_forward_and_is_reproducible(stage, cond):
    reports = []
    off = _sample(stage, cond, "off")
    cached = _sample(stage, cond, "every:2", on_cache=lambda p: reports.append((p.forwards, p.computed)))
    blocks = len(stage.transformer("t2va").transformer_blocks)
    assert (cached.passes.computed, cached.passes.total) == (4 * blocks, 8 * blocks)
    assert str(cached.passes) == f"computed {4 * blocks} of {8 * blocks} DiT block runs (50% skipped)"
    assert reports == [(f, ((f + 1) // 2) * blocks) for f in range(1, 9)]  # live, after every forward
    assert not torch.equal(cached.video, off.video)
    assert _rel(cached.video, off.video) < 0.05 and _rel(cached.audio, off.audio) < 0.05  # audio stays in step
    again = _sample(stage, cond, "every:2")
    assert torch.equal(again.video, cached.video) and torch.equal(again.audio, cached.audio)


def test_every_2_with_a_lora_is_reproducible_and_leaves_nothing(stage, cond, tmp_path):
    dit = stage.transformer("t2va")
    _comfy_lora(tmp_path / "turbo.safetensors", dit)
    lora = LoRA.load(tmp_path / "turbo.safetensors")
    plain = _sample(stage, cond, "every:2")
    first = _sample(stage, cond, "every:2", lora=lora)
    second = _sample(stage, cond, "every:2", lora=lora)
    assert torch.equal(first.video, second.video) and torch.equal(first.audio, second.audio)
    assert not torch.equal(first.video, plain.video) and first.passes.computed == 4 * len(dit.transformer_blocks)
    again = _sample(stage, cond, "every:2")
    assert torch.equal(again.video, plain.video) and torch.equal(again.audio, plain.audio)


@pytest.mark.parametrize("preset", ["quality", "fast"])
def test_cache_dit_presets_are_reproducible(stage, cond, preset):
    pytest.importorskip("cache_dit")
    off = _sample(stage, cond, "off")
    first = _sample(stage, cond, preset, steps=20)
    second = _sample(stage, cond, preset, steps=20)
    assert torch.equal(first.video, second.video) and torch.equal(first.audio, second.audio)
    assert first.passes.total == 19 * 2 and first.passes.computed == second.passes.computed
    assert first.passes.computed <= first.passes.total
    assert torch.isfinite(first.video).all() and off.video.shape == first.video.shape
    dit = stage.transformer("t2va")
    assert "forward" not in dit.__dict__ and not hasattr(dit, "_is_cached")  # cache-dit's patch is gone


def test_fast_skips_blocks_on_a_20_step_run(stage, cond):
    pytest.importorskip("cache_dit")
    off = _sample(stage, cond, "off", steps=20)
    fast = _sample(stage, cond, "fast", steps=20)
    assert fast.passes.computed < fast.passes.total
    assert _rel(fast.video, off.video) < 0.05


@pytest.mark.parametrize("preset", ["every:2", "fast"])
def test_quantised_twin_streamed_skips_the_cached_blocks(tiny_dir, cond, onloads, preset):
    """int8 + ConvRot DiT, `--offload block`: a block is onloaded exactly when it runs (never on a step that skips
    it); streamed equals resident bit for bit under the same cache, and the hooked forward is given back."""
    if preset == "fast":
        pytest.importorskip("cache_dit")
    path = tiny_dir / "comfyui" / "diffusion_models" / "minimax_h3_tiny_fl2va_int8_convrot.safetensors"
    if not path.is_file():
        pytest.skip("this tiny build has no quantised twins")
    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    source.paths["transformer"] = path
    resident = _sample(DiffusionStage(source), cond, preset, steps=12)
    assert not onloads
    stage = DiffusionStage(source, offload="block")
    dit = stage.transformer("t2va")
    hooked_forward = dit.forward  # group offloading's own forward (an instance attribute)
    streamed = _sample(stage, cond, preset, steps=12)
    assert torch.equal(streamed.video, resident.video) and torch.equal(streamed.audio, resident.audio)
    assert streamed.passes.computed == resident.passes.computed < streamed.passes.total
    assert any(p.dtype == torch.int8 for p in dit.transformer_blocks[0].parameters())
    runs = [sum(module is block for module in onloads) for block in dit.transformer_blocks]
    assert sum(runs) == streamed.passes.computed
    assert runs[0] == (6 if preset == "every:2" else 11)  # every:2: forwards 0, 2, .. 10; fast: block 0 always runs
    assert dit.forward is hooked_forward


def test_prefetch_links_into_skippable_blocks_are_cut(tiny_dir, cond, monkeypatch):
    """On CUDA, group offloading prefetches the next block from the one running (links made after the first
    forward). A link from an always-run module into a skippable block is cut for the run, so a cached forward
    loads nothing it skips; the links come back afterwards. The links are laid here as diffusers lays them."""
    from h3_core import diffusers_adapter

    stage = DiffusionStage(ModelSource.from_path(tiny_dir, layout="comfyui"), offload="block")
    dit = stage.transformer("t2va")
    hook_cls = diffusers_adapter.group_offloading_hook_class()

    def hook_of(module):
        return next(h for h in module._diffusers_hook.hooks.values() if isinstance(h, hook_cls))

    chain = [hook_of(dit)] + [hook_of(block) for block in dit.transformer_blocks]
    for current, following in zip(chain, chain[1:]):
        current.next_group, following.group.onload_self = following.group, False
    forward, seen = [0], []  # (block index, DiT forward it was onloaded in)
    original = group_offloading.ModuleGroup.onload_
    blocks = list(dit.transformer_blocks)

    def onload(group):
        if group.onload_leader in blocks:
            seen.append((blocks.index(group.onload_leader), forward[0]))
        return original(group)

    monkeypatch.setattr(group_offloading.ModuleGroup, "onload_", onload)
    cached = _sample(stage, cond, "every:2", on_cache=lambda passes: forward.__setitem__(0, passes.forwards))
    assert cached.passes.computed == 4 * len(blocks)
    assert {index for index, _ in seen} == set(range(len(blocks)))
    assert {f for _, f in seen} == {0, 2, 4, 6}  # never during a cached forward (1, 3, 5, 7)
    assert chain[0].next_group is chain[1].group and not chain[1].group.onload_self  # restored


def test_cli_generate_prints_the_block_passes(tiny_dir, cond, tmp_path, capsys):
    cond_path = tmp_path / "cond.safetensors"
    cond.save(cond_path)
    args = ["generate", "--models", str(tiny_dir), "--cond", str(cond_path), "--out", str(tmp_path / "out.mp4"),
            "--steps", "5", "--seed", "1"]
    assert cli.main([*args, "--cache", "every:2"]) == 0
    # forwards 0 and 2 of 4, 2 blocks
    assert "cache: computed 4 of 8 DiT block runs (50% skipped)" in capsys.readouterr().err
    assert cli.main([*args, "--cache", "every:0"]) == 1
    assert "every:K needs an integer K >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("cache", [None, "every:2"])
def test_a_cancel_stops_the_sampler_at_the_next_step(stage, cond, cache):
    """The sampler checks its cancel (ComfyUI's interrupt, in the nodes) at every step boundary, cached or not: set
    from the progress of step 3, no fourth forward starts. Counted in steps, not seconds (the ComfyUI test of the
    same, tests/test_nodes_comfyui.py, sees it through a websocket and an HTTP round trip)."""
    import threading

    from h3_core.progress import Cancelled

    cancel, ticks = threading.Event(), []

    def progress(done, total):
        ticks.append(done)
        if done == 3:
            cancel.set()

    with pytest.raises(Cancelled, match="after 3 of"):
        _sample(stage, cond, cache, steps=30, progress=progress, cancel=cancel)
    assert max(ticks) == 3, ticks
