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
        workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3), lora_path=str(missing))


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
