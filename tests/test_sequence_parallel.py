"""The DiT sequence-parallel over N ranks (h3_core/sequence_parallel.py): `generate --sp 2` on two gloo ranks gives
the latents of the single-process run within 1e-6 relative, for t2va, fl2va and ref2va (whose packed sequence is
odd), with the dense DiT, block streaming, and the pruned int8 + ConvRot twin; and what cannot run is refused with
the constraint named, before any rank starts. The ranks are real processes on the CPU, running the code path NCCL runs
on CUDA, started by the one sequence-parallel engine the Sampler's `gpus` uses too (sequence_parallel_workers.py:
ranks forked warm by one launcher)."""

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import warm_cli

from h3_core import cli, sequence_parallel
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.request import EncodeRequest
from h3_core.testing import image, ref2va_request

REPO = Path(__file__).resolve().parents[1]
STEPS = 3  # two DiT forwards: enough to carry a rank's error into the next step's input
QUANTISED = "diffusion_models/minimax_h3_tiny_ref2va_pruned_int8_convrot.safetensors"

REQUESTS = {
    "t2va": EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124),
    "fl2va": EncodeRequest(prompt="The door opens.", first_frame=image(1, 64, 64), last_frame=image(2, 64, 64),
                           width=64, height=64, num_frames=124),
    # One word more than the canonical ref2va prompt: 77 text tokens make the packed sequence odd (1241 rows).
    "ref2va": dataclasses.replace(ref2va_request(), prompt="<Picture 1> walks in, <Video 1> moves, <Audio 2> plays "
                                  "softly."),
}


@pytest.fixture(scope="module")
def conds(tiny_dir, tmp_path_factory, parity_threads):
    folder = tmp_path_factory.mktemp("sp_conds")
    stage = EncoderStage(ModelSource.from_path(tiny_dir, layout="comfyui"))
    paths = {}
    for task, request in REQUESTS.items():
        paths[task] = folder / f"{task}.safetensors"
        stage.encode(request).save(paths[task])
    return paths


def _reference(tiny_dir, cond_path, dit: str | None):
    """The single-process latents (`--sp 1` runs exactly this) and the packed sequence length the DiT saw."""
    from h3_core.contract import H3Conditioning

    cond = H3Conditioning.load(cond_path)
    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    if dit:
        source.paths["transformer_ref"] = tiny_dir / "comfyui" / dit
    stage = DiffusionStage(source)
    lengths = []
    block = stage.transformer(cond.task).transformer_blocks[0]
    handle = block.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True)
    try:
        latents = stage.sample(cond, SamplingOptions(steps=STEPS, seed=3))
    finally:
        handle.remove()
    return latents, lengths[0]


def _generate(tiny_dir, cond_path, out: Path, *extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "H3_THREADS": "1", "OMP_NUM_THREADS": "1"}  # two ranks on the shared cores
    command = ["generate", "--models", str(tiny_dir), "--layout", "comfyui", "--cond", str(cond_path), "--out",
               str(out), "--steps", str(STEPS), "--seed", "3", *extra]
    return warm_cli.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "task,dit,offload",
    [("t2va", None, "none"), ("fl2va", None, "block"), ("ref2va", None, "none"), ("ref2va", QUANTISED, "none")],
    ids=["t2va", "fl2va-streamed", "ref2va", "ref2va-pruned-int8"],
)
def test_sp2_equals_sp1(tiny_dir, conds, tmp_path, task, dit, offload):
    reference, length = _reference(tiny_dir, conds[task], dit)
    if task == "ref2va":
        assert length % 2 == 1, length  # the shards are unequal: ulysses_anything's path, not an even split
    extra = ["--sp", "2", "--offload", offload, "--dump", str(tmp_path / "sp2.safetensors")]
    if dit:
        extra += ["--dit", str(tiny_dir / "comfyui" / dit)]
    done = _generate(tiny_dir, conds[task], tmp_path / "sp2.mp4", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 2 sequence-parallel ranks" in done.stderr
    assert done.stderr.count("generated ") == 1  # rank 0 alone decodes and writes
    dumped = load_file(str(tmp_path / "sp2.safetensors"))
    for name, expected in (("latents", reference.video), ("audio_latents", reference.audio)):
        assert dumped[name].shape == expected.shape
        deviation = _relative(dumped[name], expected)
        assert deviation <= 1e-6, f"{name}: {deviation:.2e} relative"
    assert (tmp_path / "sp2.mp4").stat().st_size > 0


# The second of the two forwards reuses the stack: every:2 by its count, the DBCache form because its threshold
# (0.99 relative L1 change) is met after a warm-up of none.
CACHED = ["every:2", "dbcache:warmup=0,threshold=0.99,bn=0"]


@pytest.mark.parametrize("cache", CACHED, ids=["every2", "dbcache"])
def test_sp2_with_a_step_cache_equals_the_cached_single_process(tiny_dir, conds, tmp_path, cache):
    """Each rank caches the residual of its own shard and every rank takes the same compute-or-reuse decision
    (every:K: the forward's number; DBCache: cache-dit's change all-reduced over the ranks), on ref2va's odd packed
    sequence (unequal shards). Before, every:K failed after the ranks started: "The size of tensor a (621) must
    match the size of tensor b (1241)"."""
    from h3_core.contract import H3Conditioning

    stage = DiffusionStage(ModelSource.from_path(tiny_dir, layout="comfyui"))
    reference = stage.sample(H3Conditioning.load(conds["ref2va"]), SamplingOptions(steps=STEPS, seed=3, cache=cache))
    assert 0 < reference.passes.computed < reference.passes.total  # the run did reuse the stack
    done = _generate(tiny_dir, conds["ref2va"], tmp_path / "sp2.mp4", "--sp", "2", "--cache", cache, "--dump",
                     str(tmp_path / "sp2.safetensors"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(reference.passes) in done.stderr  # the same forwards computed on the ranks as in one process
    dumped = load_file(str(tmp_path / "sp2.safetensors"))
    for name, expected in (("latents", reference.video), ("audio_latents", reference.audio)):
        deviation = _relative(dumped[name], expected)
        assert deviation <= 1e-6, f"{name}: {deviation:.2e} relative"


def test_what_cannot_run_is_refused_before_any_rank_starts(tiny_dir, conds, tmp_path, capsys):
    base = ["generate", "--models", str(tiny_dir), "--layout", "comfyui", "--cond", str(conds["t2va"]),
            "--out", str(tmp_path / "x.mp4")]
    cases = [
        (["--sp", "4"], "2 attention heads do not divide into 4 ranks"),
        (["--sp", "2", "--sp-mode", "ring"], "only on CUDA"),
        (["--sp", "0"], "--sp must be an integer >= 1"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--sp", "2", "--device", "cuda:0"], "no CUDA device"))
    for flags, message in cases:
        assert cli.main([*base, *flags]) == 1, flags
        assert message in capsys.readouterr().err, flags
    assert not (tmp_path / "x.mp4").exists()


def test_layout_and_checks():
    layout = sequence_parallel.check(2, "ulysses", "cpu", heads=56)
    assert layout.backend == "cpu:gloo" and layout.device_of(1) == torch.device("cpu")
    assert sequence_parallel.Layout(2, "ulysses", torch.device("cuda", 1)).device_of(1) == torch.device("cuda", 2)
    assert sequence_parallel.check(1, "ring", "cpu").degree == 1  # one rank: nothing to exchange, nothing refused
    with pytest.raises(sequence_parallel.SequenceParallelError, match="56 attention heads"):
        sequence_parallel.check(3, "ulysses", "cpu", heads=56)
    with pytest.raises(sequence_parallel.SequenceParallelError, match="mode must be one of"):
        sequence_parallel.check(2, "tree", "cpu")


def test_a_rank_that_fails_ends_the_run_with_its_error(tiny_dir, conds, tmp_path):
    """Every rank refuses a LoRA file that is not there: the run ends (no rank left waiting in a collective) with
    the failing rank named and its own message."""
    done = _generate(tiny_dir, conds["t2va"], tmp_path / "x.mp4", "--sp", "2", "--lora",
                     str(tmp_path / "missing.safetensors"))
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sequence-parallel rank ") and "missing.safetensors" in last, last


def test_generate_sp_runs_on_the_samplers_engine_with_ranks_forked_warm(tiny_dir, conds, tmp_path, monkeypatch):
    """One engine: `generate --sp 2` samples on sequence_parallel_workers.WorkerPool, the class the Sampler's `gpus`
    runs on (its warm_pool), whose ranks are forked by one launcher that imported torch and diffusers before it
    forked: no rank starts an interpreter or imports them again. The sampler's options cross to the ranks through
    SamplingOptions.to_wire, the one place (tests/test_sampling_options.py fails when a field is not decided there)."""
    from support.sp_engine import assert_forked_from_a_warm_launcher

    from h3_core import sequence_parallel_workers as workers
    from h3_core.diffusion import SamplingOptions as Options

    started, wired = [], []
    start, to_wire = workers.WorkerPool.start, Options.to_wire

    def spy_start(pool, *args, **kwargs):
        result = start(pool, *args, **kwargs)
        assert_forked_from_a_warm_launcher(pool)  # checked while the ranks live
        started.append(pool)
        return result

    def spy_wire(options, *args, **kwargs):
        wired.append(options)
        return to_wire(options, *args, **kwargs)

    monkeypatch.setattr(workers.WorkerPool, "start", spy_start)
    monkeypatch.setattr(Options, "to_wire", spy_wire)
    monkeypatch.setenv("H3_THREADS", "1")  # the ranks' threads (and, in cli.main, this process's: restored below)
    threads = torch.get_num_threads()
    try:
        code = cli.main(["generate", "--models", str(tiny_dir), "--layout", "comfyui", "--cond", str(conds["t2va"]),
                         "--out", str(tmp_path / "sp2.mp4"), "--steps", str(STEPS), "--seed", "3", "--sp", "2",
                         "--cache", "every:2"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0 and (tmp_path / "sp2.mp4").stat().st_size > 0
    [pool] = started
    assert pool.closed and not pool.alive() and [rank.returncode for rank in pool.procs] == [0, 0]
    [options] = wired
    assert (options.steps, options.seed, options.cache) == (STEPS, 3, "every:2")
