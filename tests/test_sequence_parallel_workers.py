"""Warm sequence-parallel workers (h3_core/sequence_parallel_workers.py): a pool of two gloo ranks, real processes on
the CPU loading the tiny DiT from its file, gives the single-process latents within 1e-6 relative, with progress and
previews from rank 0; stays warm between jobs; stops every rank before the same step on cancel and stays usable; and
when a worker is killed mid-job the job fails naming it, and the next job runs on fresh workers."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from support.listening import is_loopback, listening

from h3_core import sequence_parallel
from h3_core import sequence_parallel_workers as workers
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.progress import Cancelled
from h3_core.request import EncodeRequest

STEPS = 4  # three DiT forwards: room to stop or kill after the first one


@pytest.fixture(scope="module", autouse=True)
def two_threads_per_rank():
    before = os.environ.get("H3_THREADS")
    os.environ["H3_THREADS"] = "1"  # the workers inherit it: two ranks share the machine's cores
    yield
    workers.close_pool()
    if before is None:
        os.environ.pop("H3_THREADS")
    else:
        os.environ["H3_THREADS"] = before


@pytest.fixture(scope="module")
def setup(tiny_dir, parity_threads):
    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    cond = EncoderStage(source).encode(EncodeRequest(prompt="A red fox in the snow.", width=64, height=64,
                                                     num_frames=124))
    reference = DiffusionStage(source).sample(cond, SamplingOptions(steps=STEPS, seed=3))
    recipe = workers.DiTRecipe.of(source, "transformer", torch.float32, source.fingerprint())
    return recipe, sequence_parallel.check(2, "ulysses", "cpu", heads=2), cond, reference


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _assert_equal(latents, reference) -> None:
    for got, expected in ((latents.video, reference.video), (latents.audio, reference.audio)):
        assert got.shape == expected.shape
        assert _relative(got, expected) <= 1e-6


def test_pool_equals_one_process_and_stays_warm(setup):
    recipe, layout, cond, reference = setup
    events, previews = [], []
    options = SamplingOptions(steps=STEPS, seed=3, progress=lambda done, total: events.append((done, total)),
                              preview=lambda done, total, video: previews.append((done, video.shape)))
    pool = workers.warm_pool(recipe, layout)
    latents = workers.sample(recipe, layout, cond, options)
    _assert_equal(latents, reference)
    assert events == [(0, STEPS - 1)]  # then each step's preview carries its count
    assert [done for done, _ in previews] == [1, 2, 3] and previews[0][1][1] == 24
    again = workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3))
    assert workers.warm_pool(recipe, layout) is pool and pool.alive()  # the same processes, the DiT still loaded
    _assert_equal(again, reference)


def test_a_warm_pool_listens_on_loopback_only(setup):
    """Rank 0's rendezvous store and every rank's gloo sockets live as long as the pool: none beyond loopback (the
    store listened on every interface before, unauthenticated)."""
    recipe, layout, _, _ = setup
    pool = workers.warm_pool(recipe, layout)
    found = {pid: listening(pid) for pid in pool.pids}
    assert all(found.values()), f"a rank without its process group's sockets: {found}"
    assert not [a for addresses in found.values() for a in addresses if not is_loopback(a[0])], found


@pytest.mark.parametrize("cache", ["every:2", "dbcache:warmup=0,threshold=0.99,bn=0"], ids=["every2", "dbcache"])
def test_pool_with_a_step_cache_equals_the_cached_single_process(setup, cache):
    """The Sampler's gpus > 1 with its cache: the ranks reuse the stack on the same forwards as one process (the
    decision is identical on every rank) and each reuses its own shard's residual. every:K raised a raw size
    mismatch in the workers before."""
    recipe, layout, cond, _ = setup
    reference = DiffusionStage(recipe.source()).sample(cond, SamplingOptions(steps=STEPS, seed=3, cache=cache))
    assert 0 < reference.passes.computed < reference.passes.total
    counts = []
    latents = workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3, cache=cache,
                                                                   on_cache=counts.append))
    _assert_equal(latents, reference)
    assert latents.passes == reference.passes and counts[-1] == reference.passes


def test_cancel_stops_every_rank_at_one_step_and_the_pool_stays_warm(setup):
    recipe, layout, cond, reference = setup
    pool = workers.warm_pool(recipe, layout)
    pids = pool.pids
    cancel = threading.Event()

    def progress(done, total):
        if done >= 1:
            cancel.set()  # what ComfyUI's interrupt does, seen by the host between its polls

    options = SamplingOptions(steps=STEPS, seed=3, progress=progress, cancel=cancel)
    with pytest.raises(Cancelled, match=r"cancelled after [12] of 3 denoising steps"):
        workers.sample(recipe, layout, cond, options)
    assert pool.alive() and workers.warm_pool(recipe, layout).pids == pids  # no rank left behind in a collective
    _assert_equal(workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3)), reference)


def test_a_killed_worker_fails_the_job_by_name_and_the_next_job_runs(setup):
    recipe, layout, cond, reference = setup
    pool = workers.warm_pool(recipe, layout)
    victim = pool.pids[1]

    def progress(done, total):
        if done == 1:
            os.kill(victim, signal.SIGKILL)

    with pytest.raises(workers.WorkerError, match=rf"rank 1 \(pid {victim}\) was killed by SIGKILL while sampling"):
        workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3, progress=progress))
    assert not pool.alive() and not any(os.path.exists(f"/proc/{pid}") for pid in pool.pids)  # all stopped
    fresh = workers.warm_pool(recipe, layout)
    assert fresh is not pool and victim not in fresh.pids
    _assert_equal(workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3)), reference)


def test_a_rank_error_is_reported_with_its_message(setup, tmp_path):
    recipe, layout, cond, _ = setup
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(workers.WorkerError, match=r"rank \d failed while sampling: .*gone\.safetensors"):
        workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3), [(str(missing), 1.0)])


def test_the_channel_carries_json_and_safetensors_only():
    import socket
    import struct

    from h3_core.sequence_parallel_channel import (
        Channel,
        ChannelClosed,
        tensors_from_bytes,
        tensors_to_bytes,
        token_matches,
    )

    left, right = socket.socketpair()
    a, b = Channel(left), Channel(right)
    video = torch.randn(1, 24, 2, 4, 4)
    a.send({"kind": "preview", "done": 1}, tensors_to_bytes({"video": video}))
    assert b.readable(1.0)
    header, payload = b.recv()
    assert header == {"kind": "preview", "done": 1} and torch.equal(tensors_from_bytes(payload)["video"], video)
    left.sendall(struct.pack(">IQ", 5, 0) + b"[1,2]")  # not a JSON object with a kind: refused, never evaluated
    with pytest.raises(ChannelClosed, match="not this protocol"):
        b.recv()
    left.sendall(struct.pack(">IQ", 1 << 30, 0))
    with pytest.raises(ChannelClosed, match="not this protocol"):
        b.recv()
    a.close()
    with pytest.raises(ChannelClosed):
        b.recv()
    assert token_matches("abc", "abc") and not token_matches("abc", "abd") and not token_matches("abc", None)
    b.close()


def test_stacked_loras_without_their_audio_run_on_the_pool_as_in_one_process(setup, tmp_path, tiny_dir):
    """Several LoRAs at their own strengths, their audio-branch weights left out, cross to the ranks as files
    (SamplingOptions.to_wire) and give the single-process result: gpus > 1 no longer refuses them."""
    from support import lora_support

    from h3_core.lora import stack_for_run

    recipe, layout, cond, _ = setup
    source = ModelSource.from_path(tiny_dir, layout="comfyui")
    dit = DiffusionStage(source)
    transformer = source.load("transformer")  # the LoRA writers read its Linears' shapes
    loras = [(tmp_path / "a.safetensors", 0.7), (tmp_path / "b.safetensors", -0.4)]
    lora_support.comfy_lora(loras[0][0], transformer, seed=1)
    lora_support.musubi_lora(loras[1][0], transformer, seed=2)
    stack = stack_for_run(loras, steps=STEPS, audio=False)
    want = dit.sample(cond, SamplingOptions(steps=STEPS, seed=3, lora=stack))
    got = workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3), loras, lora_audio=False)
    _assert_equal(got, want)
    plain = dit.sample(cond, SamplingOptions(steps=STEPS, seed=3))
    assert _relative(got.video, plain.video) > 1e-4  # the LoRAs changed the result
