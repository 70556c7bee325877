"""Warm sequence-parallel workers (h3_core/sequence_parallel_workers.py): a pool of two gloo ranks, real processes on
the CPU loading the tiny DiT from its file, gives the single-process latents within 1e-6 relative, with progress and
previews from rank 0; stays warm between jobs; stops every rank before the same step on cancel and stays usable;
when a worker is killed mid-job the job fails naming it, and the next job runs on fresh workers. The ranks are forked
by one launcher that imported torch and diffusers first (tests/support/sp_engine.py). Its life: the start
reports each rank's hello and load, an idle pool stops itself on its (injected) clock, and a host that exits (Ctrl-C)
or is killed leaves no worker behind and no traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from support.listening import is_loopback, listening
from support.sp_engine import assert_forked_from_a_warm_launcher

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
    assert_forked_from_a_warm_launcher(pool)  # the Sampler's pool: ranks forked warm, as generate --sp's
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
    cancel, seen = threading.Event(), []

    def progress(done, total):
        seen.append(done)
        if done >= 1:
            cancel.set()  # what ComfyUI's interrupt does, seen by the host between its polls

    # 40 steps (39 forwards): the host sees the ranks' progress between its polls, so on a busy machine a 3-forward
    # job could end before the cancel reached the ranks (seen in CI); they stop at the step boundary after it arrives.
    options = SamplingOptions(steps=40, seed=3, progress=progress, cancel=cancel)
    with pytest.raises(Cancelled, match=r"cancelled after \d+ of 39 denoising steps") as stopped:
        workers.sample(recipe, layout, cond, options)
    at = int(str(stopped.value).split("after ", 1)[1].split(" ", 1)[0])
    assert 1 <= at < 39 and at >= max(seen), (at, seen)
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


# --- the pool's life ------------------------------------------------------------------------------------------------


class _Clock:
    """An injected clock: the idle stop's decisions are made on it, never on the wall clock."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_limit_reads_h3_sp_idle_s():
    assert workers.idle_limit({}) == workers.DEFAULT_IDLE_S == 600.0
    assert workers.idle_limit({"H3_SP_IDLE_S": " 30 "}) == 30.0
    assert workers.idle_limit({"H3_SP_IDLE_S": "0"}) is None  # never
    for bad in ("ten", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=r"H3_SP_IDLE_S=.*a number >= 0.*0 keeps it until unloaded"):
            workers.idle_limit({"H3_SP_IDLE_S": bad})


def test_the_start_reports_each_rank_and_an_idle_pool_stops_on_its_clock(setup, monkeypatch):
    recipe, layout, cond, reference = setup
    monkeypatch.setenv(workers.IDLE_ENV, "600")
    workers.close_pool()
    clock, started = _Clock(), []
    pool = workers.warm_pool(recipe, layout, clock=clock, on_start=lambda *event: started.append(event))
    assert started == [("connect", 0, 2), ("connect", 1, 2), ("connect", 2, 2),
                       ("load", 0, 2), ("load", 1, 2), ("load", 2, 2)]
    assert re.fullmatch(r"2 DiT workers warm: \d+\.\d GB", workers.warm_summary())
    assert pool.resident_bytes() > 100 * 2**20  # each rank holds torch and the DiT

    clock.now += 500
    _assert_equal(workers.sample(recipe, layout, cond, SamplingOptions(steps=STEPS, seed=3)), reference)
    clock.now += 599  # idle since the job ended, not since the start
    assert not workers.stop_if_idle() and pool.alive()
    pool.busy = True  # a job running for longer than the limit is not idle
    clock.now += 10_000
    assert not workers.stop_if_idle() and pool.alive()
    pool.busy = False
    workers.stop_if_idle()  # (or the pool's own watcher did it first: it decides on the same clock)
    assert not pool.alive() and [proc.returncode for proc in pool.procs] == [0, 0]
    assert workers.warm_summary() is None  # the next job starts a new pool


_HOST = textwrap.dedent("""
    import atexit, json, sys
    state = {}
    # Registered before the pool module's own atexit handler, so it runs after it: the workers' exit codes.
    atexit.register(lambda: print(json.dumps([p.returncode for p in state["pool"].procs]), flush=True))
    import torch
    from h3_core import sequence_parallel, sequence_parallel_workers as workers
    from h3_core.models import ModelSource
    source = ModelSource.from_path(sys.argv[1], layout="comfyui")
    recipe = workers.DiTRecipe.of(source, "transformer", torch.float32, source.fingerprint())
    state["pool"] = workers.warm_pool(recipe, sequence_parallel.check(2, "ulysses", "cpu", heads=2))
    try:
        print(json.dumps(state["pool"].pids), flush=True)
        sys.stdin.read()  # until the test ends this host
    except KeyboardInterrupt:  # Ctrl-C: a host such as ComfyUI catches it and exits normally
        pass
""")


def _host(tiny_dir) -> tuple[subprocess.Popen, list[int]]:
    """A host process (its own session, as a terminal's foreground job) with a warm pool; its workers' pids."""
    root = Path(__file__).resolve().parents[1]
    host = subprocess.Popen([sys.executable, "-c", _HOST, str(tiny_dir)], cwd=root, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    line = host.stdout.readline()
    assert line, f"the host did not start its pool: {host.stderr.read()[-3000:]}"
    return host, json.loads(line)


@pytest.mark.parametrize("how", ["ctrl_c", "killed"])
def test_a_host_that_ends_leaves_no_worker_and_no_traceback(tiny_dir, how):
    """Ctrl-C reaches the host's whole process group: the workers ignore it, the host exits and stops them at exit
    (each exits 0). A host killed outright never runs that: its workers see the connection close (or reset) and exit,
    as quietly. Their stderr is the host's (the test reads it to its end, when every writer has exited)."""
    host, pids = _host(tiny_dir)
    if how == "ctrl_c":
        os.killpg(host.pid, signal.SIGINT)  # what a terminal does: to the host and its workers
    else:
        os.kill(host.pid, signal.SIGKILL)  # the host alone, with no chance to stop its workers
    out, err = host.communicate(timeout=120)
    assert not any(Path(f"/proc/{pid}").exists() and _zombie_or_running(pid) for pid in pids)
    if how == "ctrl_c":
        assert host.returncode == 0 and json.loads(out) == [0, 0], (out, err)
    assert "Traceback" not in err and "ConnectionResetError" not in err, err


def _zombie_or_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().count(b"sequence_parallel_workers") > 0
    except OSError:
        return False


def test_a_reset_connection_is_a_closed_channel():
    """A host killed with unread bytes resets its workers' connections: that is the host going away (the worker
    exits 0), not an error with a ConnectionResetError traceback."""
    from h3_core.sequence_parallel_channel import Channel, ChannelClosed

    listener = socket.create_server(("127.0.0.1", 0))
    worker = Channel(socket.create_connection(listener.getsockname()))
    host_sock, _ = listener.accept()
    listener.close()
    worker.send({"kind": "progress", "done": 1, "total": 3})  # unread by the host when it goes
    host_sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    host_sock.close()  # an RST, as a killed process with unread bytes sends
    assert worker.readable(5.0)
    with pytest.raises(ChannelClosed, match=r"went away \(\[Errno 104\] Connection reset by peer\)"):
        worker.recv()
    assert worker.peer_closed()
    with pytest.raises(ChannelClosed):
        for _ in range(100):  # the first writes may land in the kernel's buffer before it sees the reset
            worker.send({"kind": "progress", "done": 2, "total": 3})
    worker.close()
