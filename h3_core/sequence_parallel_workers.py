"""The sequence-parallel engine: warm DiT workers for `generate --sp N` (cli.py) and the ComfyUI Sampler's `gpus`.

Both run one `WorkerPool`: N ranks, one per GPU, joined in one process group (sequence_parallel.init_rank: gloo on
the CPU, NCCL on CUDA), each holding the DiT loaded from the file the host read (`DiTRecipe`) and parallelised with
diffusers' context-parallel plan. Each job runs the very `DiffusionStage.sample` a single process runs, on every rank;
rank 0 sends the latents back and the host decodes. `generate --sp` runs one job and stops its pool; a host that
samples prompt after prompt (ComfyUI) keeps one warm (`warm_pool`, `sample`).

* **Engine.** The pool starts one plain interpreter of the host's Python, the launcher
  (`python -m h3_core.sequence_parallel_workers --ranks N`): it imports `RANK_PRELOAD` (torch, diffusers, the pack)
  once, touching no device, and forks the N ranks, so no rank imports them again. Not `multiprocessing`: a spawned
  or forkserver child re-runs the host's `__main__` (ComfyUI's main.py) and must import the target by the host's
  module name, which ComfyUI gives custom nodes from their path; and the host (ComfyUI, with CUDA up) is never
  forked itself. The launcher tells the host each rank's pid (on a private pipe, before the rank may connect) and
  each rank's exit code; it is its own process group, stopped with its ranks. Ray is not needed on one machine.
* **Messages.** JSON headers and safetensors bytes over a token-checked loopback socket (sequence_parallel_channel):
  the conditioning goes out as its wire bytes, progress / preview / cache counts and the latents come back from
  rank 0. Nothing is unpickled.
* **Start.** The host's port is on the launcher's command line, so any local process can connect while the pool
  starts: connections are read side by side (`sequence_parallel_channel.accept_hellos`), token first, each within one
  hello deadline, with nothing allocated before the token matched, and a hello is admitted only with the pid the
  launcher reported for its rank; the cancel flag and the start limit are checked at every poll. The token reaches
  the launcher in its environment (never its command line) and the ranks in memory. The ranks' own rendezvous store
  and gloo / NCCL sockets listen on loopback (`sequence_parallel.init_rank`).
* **Interrupt.** The host sends `stop`; rank 0 reads it before each step and broadcasts the flag, so every rank
  stops before the same step (a rank leaving a collective alone would hang the others). The pool stays warm.
* **A dead worker** (its process gone, its socket closed) or a rank error ends the job with a `WorkerError` naming
  the rank and pid; the whole pool is stopped, and the next job starts a fresh one.
* **Warm.** One pool per host, keyed by (recipe, layout): another DiT file, dtype or rank count replaces it.
* **Stop.** A pool holds N copies of the DiT (a whole GPU each on real weights), so it lives only while the user
  wants it: `close_pool` stops it (the ComfyUI Sampler calls it when it runs with `gpus` 1, and when ComfyUI unloads
  its models); a pool idle for H3_SP_IDLE_S seconds (default 600; 0: never) stops itself (`stop_if_idle`, decided
  on the pool's clock: tests inject one); and the host stops it at exit (atexit). A worker whose host is gone, closed
  or killed, exits 0 without a traceback (then its launcher, having reaped every rank): that is how a pool ends,
  not an error. Workers ignore SIGINT, and run in their launcher's own session: Ctrl-C in the host's terminal does
  not reach them; the host, not the signal, ends them.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import sequence_parallel, step_cache
from .sequence_parallel_channel import (
    POLL_S,
    TOKEN_BYTES,
    TOKEN_ENV,
    Channel,
    ChannelClosed,
    accept_hellos,
    tensors_from_bytes,
    tensors_to_bytes,
)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds h3_core/: the workers' import root
TASK_OF_COMPONENT = {"transformer": "t2va", "transformer_ref": "ref2va"}
START_TIMEOUT_S = 1800.0  # connecting and loading a 33B DiT per rank from disk
IDLE_ENV = "H3_SP_IDLE_S"
DEFAULT_IDLE_S = 600.0  # ten minutes between prompts keeps a session warm; a forgotten pool gives its GPUs back
IDLE_CHECK_MAX_S = 60.0  # how often (real time) an idle pool looks at its clock: stopped within a minute of its limit
LOG = logging.getLogger(__name__)


def idle_limit(environ=None) -> float | None:
    """H3_SP_IDLE_S as seconds a warm pool may stay idle before it stops itself; None: never (0)."""
    raw = (os.environ if environ is None else environ).get(IDLE_ENV, "").strip()
    if not raw:
        return DEFAULT_IDLE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{IDLE_ENV}={raw[:40]!r}: give the seconds a warm sequence-parallel worker pool may stay "
                         f"idle before it stops (a number >= 0, e.g. {DEFAULT_IDLE_S:.0f}; 0 keeps it until unloaded)")
    return None if value == 0 else value


def _gb(count: int) -> str:
    return f"{count / 1e9:.1f} GB"


class WorkerError(RuntimeError):
    """A sequence-parallel worker died or failed; its pool was stopped (the next job starts a fresh one)."""


@dataclass(frozen=True)
class DiTRecipe:
    """How a worker loads the host's DiT: the same file (or model folder), partition, dtype and pipeline settings."""

    component: str  # transformer / transformer_ref
    path: str  # absolute file or folder of that partition
    root: str
    weights_layout: str
    tiny: bool
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16"
    pipeline_config: str  # JSON, sorted keys (hashable: part of the pool's key)
    fingerprint: str  # the file's identity when the host loaded it: a replaced file starts a new pool
    offload: str = "none"  # DiT placement on each rank: none / block / auto (h3_core.offload)

    @classmethod
    def of(cls, source, component: str, dtype: torch.dtype, fingerprint: str = "", offload: str = "none") -> DiTRecipe:
        source.require(component)
        return cls(component=component, path=str(Path(source.paths[component]).resolve()),
                   root=str(source.root), weights_layout=source.layout, tiny=bool(source.tiny),
                   dtype=str(dtype).removeprefix("torch."),
                   pipeline_config=json.dumps(source.pipeline_config, sort_keys=True), fingerprint=fingerprint,
                   offload=offload)

    def source(self):
        from .models import ModelSource

        return ModelSource(root=Path(self.root), layout=self.weights_layout, paths={self.component: Path(self.path)},
                           pipeline_config=json.loads(self.pipeline_config), tiny=self.tiny)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dtype


def _layout_json(layout: sequence_parallel.Layout) -> dict:
    return {"degree": layout.degree, "mode": layout.mode, "base_device": str(layout.base_device)}


def _layout_from(data: dict) -> sequence_parallel.Layout:
    return sequence_parallel.Layout(int(data["degree"]), str(data["mode"]), torch.device(data["base_device"]))


# --- the host side -------------------------------------------------------------------------------------------------


class _Launcher:
    """The one process a pool starts (`python -m h3_core.sequence_parallel_workers --ranks N`): it imports
    `RANK_PRELOAD` once, touching no device, then forks the N ranks, so no rank imports torch or diffusers again.
    It says on a private pipe (inherited, never a socket) which pid each rank has, before that rank may connect, and
    each rank's exit code when it reaps it; it exits when every rank has. It is its own process group (a new
    session), so a rank the pool must stop is stopped with it, whatever became of its pid."""

    def __init__(self, proc: subprocess.Popen, status_fd: int):
        self.proc, self.fd, self.buffer, self.stopped = proc, status_fd, b"", False
        self.pids: dict[int, int] = {}  # rank -> pid, as the launcher forked it
        self.codes: dict[int, int] = {}  # pid -> exit code (Popen's convention: -N killed by signal N)
        self.preloaded: list[str] = []  # what the launcher imported before it forked the ranks
        os.set_blocking(status_fd, False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def drain(self, timeout_s: float = 0.0) -> None:
        """Read what the launcher has said (waiting up to `timeout_s` for something)."""
        import select

        if self.fd is None:
            return
        if timeout_s > 0 and not select.select([self.fd], [], [], timeout_s)[0]:
            return
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:  # the launcher and every rank closed it: nothing more will come
                os.close(self.fd)
                self.fd = None
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            kind = record.get("kind") if isinstance(record, dict) else None
            if kind == "forked" and isinstance(record.get("rank"), int) and isinstance(record.get("pid"), int):
                self.pids[record["rank"]] = record["pid"]
            elif kind == "exited" and isinstance(record.get("pid"), int) and isinstance(record.get("code"), int):
                self.codes[record["pid"]] = record["code"]
            elif kind == "preloaded" and isinstance(record.get("modules"), list):
                self.preloaded = [str(name) for name in record["modules"]]

    def signal_group(self, signum: int) -> None:
        """`signum` to the launcher and every rank it forked (its process group)."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """Wait for the launcher to end (its ranks exit when their host connections close, then it does); terminate,
        then kill, the whole group when it does not in time."""
        if self.stopped:
            return
        self.stopped = True
        for signum in (None, signal.SIGTERM, signal.SIGKILL):
            if signum is not None:
                self.signal_group(signum)
            try:
                self.proc.wait(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            self.proc.wait()
        self.drain()
        if any(rank.poll() is None for rank in (_ForkedRank(self, r) for r in self.pids)):
            self.signal_group(signal.SIGKILL)  # orphans of a launcher that was killed: still its group
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _ForkedRank:
    """One rank of a pool, forked by its `_Launcher`: what the pool asks of a process (pid, poll, wait, returncode,
    terminate, kill), answered from the launcher's reports."""

    def __init__(self, launcher: _Launcher, rank: int):
        self.launcher, self.rank = launcher, rank

    @property
    def pid(self) -> int | None:
        return self.launcher.pids.get(self.rank)

    @property
    def returncode(self) -> int | None:
        launcher = self.launcher
        launcher.drain()
        pid = self.pid
        if pid is not None and pid in launcher.codes:
            return launcher.codes[pid]
        if launcher.proc.poll() is None:
            return None
        launcher.drain()  # the launcher is gone: its last reports are in the pipe
        if pid is not None and pid in launcher.codes:
            return launcher.codes[pid]
        if pid is not None and _exists(pid):
            return None  # orphaned by a launcher that was killed; still running
        # Never forked, or gone unreported with its launcher: the launcher's own end says what happened.
        return launcher.proc.returncode or 1

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"sequence-parallel rank {self.rank}", timeout)
            if self.launcher.fd is not None:
                self.launcher.drain(left)
            else:
                time.sleep(left)
        return code

    def _signal(self, signum: int) -> None:
        if self.pid is not None and self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


class WorkerPool:
    """N warm worker processes holding one DiT, sequence-parallel over them. Not thread-safe: one job at a time."""

    def __init__(self, recipe: DiTRecipe, layout: sequence_parallel.Layout, clock=time.monotonic):
        if layout.degree < 2:
            raise ValueError("a worker pool runs 2 or more ranks; one rank samples in the host process")
        self.recipe, self.layout = recipe, layout
        self.launcher: _Launcher | None = None  # the process that forked the ranks
        self.procs: list[_ForkedRank] = []
        self.channels: dict[int, Channel] = {}
        self._jobs = 0
        self.closed = False
        self.clock = clock  # the start deadline's and the idle stop's clock (tests inject one)
        self.busy = False  # a job is running: never stopped for being idle
        self.idle_since = clock()
        self.gpu_bytes: dict[int, int] = {}  # rank -> its CUDA memory reserved, as it last said (none on the CPU)
        self._stopped = threading.Event()

    @property
    def key(self) -> tuple:
        return self.recipe, self.layout

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def alive(self) -> bool:
        return (not self.closed and self.launcher is not None and self.launcher.proc.poll() is None
                and bool(self.procs) and all(proc.poll() is None for proc in self.procs))

    def resident_bytes(self) -> int | None:
        """The ranks' resident memory (VmRSS of /proc/PID/status, Linux); None where it cannot be read."""
        total = 0
        for proc in self.procs:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                return None
            line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
            if line is None:  # a process that already exited has no resident set
                return None
            total += int(line.split()[1]) * 1024
        return total

    def describe(self) -> str:
        """What the warm pool holds, for the user: "2 DiT workers warm: 2.2 GB" (+ GPU memory on CUDA)."""
        rss, gpu = self.resident_bytes(), sum(self.gpu_bytes.values())
        sizes = [] if rss is None else [_gb(rss) + (" RAM" if gpu else "")]
        if gpu:
            sizes.append(f"{_gb(gpu)} GPU")
        return f"{self.layout.degree} DiT workers warm" + (f": {', '.join(sizes)}" if sizes else "")

    # start ------------------------------------------------------------------------------------------------------

    def start(self, cancel=None, timeout_s: float = START_TIMEOUT_S, on_start=None) -> WorkerPool:
        """Start the workers and wait until each has loaded and parallelised the DiT. `on_start(stage, done, total)`
        hears how far it is: ("connect", k, N) as each rank says hello, then ("load", k, N) as each has the DiT
        (a cold start takes seconds on the tiny model, minutes for a 33B DiT per rank: the user sees it move)."""
        degree = self.layout.degree
        tell = on_start if on_start is not None else (lambda stage, done, total: None)
        try:
            tell("connect", 0, degree)
            self._spawn_and_connect(cancel, timeout_s, lambda count: tell("connect", count, degree))
            setup = {"kind": "setup", "recipe": asdict(self.recipe), "layout": _layout_json(self.layout),
                     "dist_port": sequence_parallel.free_port()}
            for channel in self.channels.values():
                channel.send(setup)
            tell("load", 0, degree)
            ready = set()

            def loaded(rank: int, header: dict, payload: bytes) -> bool:
                if header["kind"] != "ready":
                    return False
                self._note_gpu(rank, header)
                ready.add(rank)
                tell("load", len(ready), degree)
                return True

            self._gather(loaded, cancel, self.clock() + timeout_s, "loading the DiT")
        except BaseException:
            self.close()
            raise
        self.idle_since = self.clock()
        return self

    def _note_gpu(self, rank: int, header: dict) -> None:
        value = header.get("gpu_bytes")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            self.gpu_bytes[rank] = value

    def _spawn_and_connect(self, cancel, timeout_s: float, on_hello=None) -> None:
        token = secrets.token_hex(TOKEN_BYTES)
        listener = socket.create_server(("127.0.0.1", 0))
        env = {**os.environ, TOKEN_ENV: token,
               "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)}
        port = listener.getsockname()[1]
        deadline = self.clock() + timeout_s

        def admit(hello: dict):  # the token was checked before this JSON was read; the pid ties it to our rank
            rank = hello.get("rank")
            if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < self.layout.degree:
                self.launcher.drain()  # the launcher said the rank's pid before the rank could connect
                pid = self.procs[rank].pid
                if pid is not None and hello.get("pid") == pid:
                    return rank
            return None

        try:
            status_fd, status_w = os.pipe()
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "h3_core.sequence_parallel_workers", "--host", f"127.0.0.1:{port}",
                     "--ranks", str(self.layout.degree), "--status-fd", str(status_w)],
                    env=env, cwd=PACKAGE_ROOT, stdin=subprocess.DEVNULL, pass_fds=(status_w,),
                    start_new_session=True)
            except BaseException:
                os.close(status_fd)
                raise
            finally:
                os.close(status_w)
            self.launcher = _Launcher(proc, status_fd)
            self.procs = [_ForkedRank(self.launcher, rank) for rank in range(self.layout.degree)]
            # Connections are read side by side, each with one deadline for its whole hello, while this loop keeps
            # checking the workers, the cancel flag and the start deadline: no peer can hold the start.
            self.channels = accept_hellos(listener, token, self.layout.degree, admit,
                                          lambda: self._check_running(cancel, deadline, "starting"), clock=self.clock,
                                          on_accepted=on_hello)
        finally:
            listener.close()

    # jobs -------------------------------------------------------------------------------------------------------

    def sample(self, cond, options, loras=(), lora_audio: bool = True):
        """`DiffusionStage.sample(cond, options)` on the workers: the same latents, with `options`' progress,
        preview, cache counts and cancel flag served from here. The LoRAs are `loras` [(path, strength)] (each
        rank loads them from their files, with `lora_audio`); `options.lora` is not sent."""
        from .diffusion import AVLatents
        from .progress import Cancelled

        if not self.alive():
            raise WorkerError("this sequence-parallel worker pool was stopped; start a new one")
        self._jobs += 1
        job = self._jobs
        header = {"kind": "sample", "job": job, "options": options.to_wire(loras, lora_audio)}
        payload = cond.to_bytes()
        try:
            for channel in self.channels.values():
                channel.send(header, payload)
        except OSError:
            self._raise_dead("receiving the job")
        results: dict[int, tuple[dict, bytes]] = {}

        def handle(rank: int, message: dict, data: bytes) -> bool:
            kind = message["kind"]
            if kind == "progress" and options.progress is not None:
                options.progress(message["done"], message["total"])
            elif kind == "preview" and options.preview is not None:
                options.preview(message["done"], message["total"], tensors_from_bytes(data)["video"])
            elif kind == "cache" and options.on_cache is not None:
                options.on_cache(step_cache.Passes(**message["passes"]))
            elif kind in ("done", "cancelled"):
                self._note_gpu(rank, message)
                results[rank] = (message, data)
                return True
            return False

        stop = {"sent": False}

        def on_cancel() -> None:  # rank 0 reads it before the next step and tells the others
            if not stop["sent"]:
                stop["sent"] = True
                self.channels[0].send({"kind": "stop", "job": job})

        self._gather(handle, options.cancel, None, "sampling", on_cancel=on_cancel)
        cancelled = [message for message, _ in results.values() if message["kind"] == "cancelled"]
        if cancelled:
            raise Cancelled(cancelled[0]["message"])
        message, data = results[0]
        tensors = tensors_from_bytes(data)
        passes = message.get("passes")
        return AVLatents(video=tensors["video"], audio=tensors["audio"],
                         passes=None if passes is None else step_cache.Passes(**passes))

    # waiting ----------------------------------------------------------------------------------------------------

    def _gather(self, handle, cancel, deadline: float | None, doing: str, on_cancel=None) -> None:
        """Read every rank's messages until each has sent its last one for this phase (`handle` returns True)."""
        import select

        pending = set(self.channels)
        while pending:
            if cancel is not None and cancel.is_set():
                if on_cancel is None:
                    from .progress import Cancelled

                    self.close()
                    raise Cancelled(f"cancelled while {doing} on {self.layout.degree} sequence-parallel workers")
                on_cancel()
            ready = select.select([self.channels[rank] for rank in pending], [], [], POLL_S)[0]
            for channel in ready:
                rank = next(r for r, c in self.channels.items() if c is channel)
                try:
                    message, data = channel.recv()
                except (OSError, ChannelClosed):
                    self._raise_dead(doing, rank)
                if message["kind"] == "error":
                    # A rank whose peer was killed fails in the next collective: name the killed one. A peer that
                    # exited on its own error (code 1, like this one: e.g. both failed to read the same LoRA) is not
                    # the cause, and this rank's message is the one to show.
                    time.sleep(POLL_S)
                    for dead, proc in enumerate(self.procs):
                        if dead != rank and proc.poll() is not None and proc.returncode < 0:
                            self._raise_dead(doing, dead)
                    self.close()
                    raise WorkerError(f"sequence-parallel rank {rank} failed while {doing}: {message['message']} "
                                      f"(all {self.layout.degree} workers were stopped; the next run starts new ones)")
                if handle(rank, message, data):
                    pending.discard(rank)
            if not ready:
                self._check_running(None, deadline, doing)

    def _check_running(self, cancel, deadline: float | None, doing: str) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self._raise_dead(doing, rank)
        if cancel is not None and cancel.is_set():
            from .progress import Cancelled

            self.close()
            raise Cancelled(f"cancelled while {doing} {self.layout.degree} sequence-parallel workers")
        if deadline is not None and self.clock() > deadline:
            self.close()
            raise WorkerError(f"{self.layout.degree} sequence-parallel workers were not done {doing} in time")

    def _raise_dead(self, doing: str, rank: int | None = None):
        if rank is None or self.procs[rank].poll() is None:  # name the one that is gone, if any
            rank = next((r for r, proc in enumerate(self.procs) if proc.poll() is not None), rank)
        proc = self.procs[rank if rank is not None else 0]
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        how = ("closed its connection" if code is None else
               f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
        who = f"worker rank {rank} (pid {proc.pid})"
        if proc.pid is None:  # the launcher ended before it forked this rank
            who = f"worker launcher (pid {self.launcher.pid})"
        self.close()
        raise WorkerError(f"sequence-parallel {who} {how} while {doing}; all "
                          f"{self.layout.degree} workers were stopped, and the next run starts new ones")

    # stop -------------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (they exit when their host connection closes, then their launcher does; stragglers are
        terminated, then killed, with the launcher's process group)."""
        self.closed = True
        self._stopped.set()
        for channel in self.channels.values():
            channel.close()
        self.channels = {}
        if self.launcher is not None:
            self.launcher.stop()


# One warm pool per host process: a DiT replicated on N devices is too big to keep two of.
_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def warm_pool(recipe: DiTRecipe, layout: sequence_parallel.Layout, cancel=None, on_start=None,
              clock=time.monotonic) -> WorkerPool:
    """The running pool for (recipe, layout), or a new one (stopping another; `clock` is the new one's)."""
    with _POOL_LOCK:
        return _warm(recipe, layout, cancel, on_start, clock)


def _warm(recipe, layout, cancel, on_start, clock) -> WorkerPool:
    global _POOL
    if _POOL is not None and (_POOL.key != (recipe, layout) or not _POOL.alive()):
        if _POOL.key == (recipe, layout):  # a worker died between jobs: say so, then start afresh
            gone = [f"rank {r} (pid {p.pid}, exit code {p.returncode})" for r, p in enumerate(_POOL.procs)
                    if p.poll() is not None]
            LOG.warning("sequence-parallel worker %s died while idle; starting %d new workers",
                        ", ".join(gone) or "pool", layout.degree)
        else:  # another DiT file, dtype or rank count: one pool at a time (N DiT copies each)
            LOG.info("MiniMax H3: stopping the sequence-parallel workers (%s): the next run needs another DiT or "
                     "gpus", _POOL.describe())
        _POOL.close()
        _POOL = None
    if _POOL is None:
        idle_s = idle_limit()  # a bad H3_SP_IDLE_S is refused before any process starts
        pool = WorkerPool(recipe, layout, clock=clock)
        _POOL = pool  # visible while it starts, so an exit or an unload stops a half-started pool too
        try:
            pool.start(cancel, on_start=on_start)
        except BaseException:
            if _POOL is pool:
                _POOL = None
            raise
        if idle_s is not None:
            _watch_idle(pool, idle_s)
    return _POOL


def sample(recipe: DiTRecipe, layout: sequence_parallel.Layout, cond, options, loras=(), lora_audio: bool = True):
    """Sample on the warm pool for (recipe, layout): `DiffusionStage.sample`'s latents, from N ranks."""
    with _POOL_LOCK:
        pool = _warm(recipe, layout, options.cancel, None, time.monotonic)
        pool.busy = True  # from here the idle stop leaves it alone
    try:
        return pool.sample(cond, options, loras, lora_audio)
    finally:
        pool.busy = False
        pool.idle_since = pool.clock()


def warm_summary() -> str | None:
    """The running pool's `describe()` ("2 DiT workers warm: 2.2 GB"), or None without one."""
    pool = _POOL
    return pool.describe() if pool is not None and pool.alive() else None


def close_pool(reason: str = "") -> bool:
    """Stop the warm pool, if any (True when one was running). With `reason`, says so in the log."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
        if pool is None:
            return False
        if reason:
            LOG.info("MiniMax H3: stopping the sequence-parallel workers (%s): %s", pool.describe(), reason)
        pool.close()
        return True


def stop_if_idle(idle_s: float | None = None) -> bool:
    """Stop the warm pool when no job has run on it for `idle_s` seconds (default: H3_SP_IDLE_S) on its clock; True
    when it stopped it. A running job, or a pool being started or replaced (the lock is held), is left alone."""
    global _POOL
    if not _POOL_LOCK.acquire(blocking=False):
        return False
    try:
        pool = _POOL
        if pool is None or pool.busy:
            return False
        limit = idle_limit() if idle_s is None else idle_s
        if limit is None or pool.clock() - pool.idle_since < limit:
            return False
        LOG.info("MiniMax H3: stopping the sequence-parallel workers (%s): idle for %.0f s (%s)", pool.describe(),
                 pool.clock() - pool.idle_since, IDLE_ENV)
        _POOL = None
        pool.close()
        return True
    finally:
        _POOL_LOCK.release()


def _watch_idle(pool: WorkerPool, idle_s: float) -> None:
    """A daemon thread asking `stop_if_idle` every so often (real time) while `pool` lives; the decision itself is
    on the pool's clock."""
    every = min(IDLE_CHECK_MAX_S, max(1.0, idle_s / 10))

    def watch() -> None:
        while not pool._stopped.wait(every):
            if _POOL is not pool:
                return
            stop_if_idle(idle_s)

    threading.Thread(target=watch, name="h3-sp-idle-stop", daemon=True).start()


def _close_at_exit() -> None:
    """The host is exiting: stop the pool without waiting for the lock (a job or a start on a daemon thread may
    hold it, and will not finish): the workers see their connections close and exit 0."""
    pool = _POOL
    if pool is not None:
        pool.close()


atexit.register(_close_at_exit)


# --- the worker side -----------------------------------------------------------------------------------------------


class _CollectiveStop:
    """The `cancel` flag of a rank's sampling loop: rank 0 reads the host's `stop` for this job, and every check
    broadcasts rank 0's answer, so all ranks stop before the same step (the loop checks once per DiT forward on
    every rank)."""

    def __init__(self, channel: Channel | None, job: int):
        self.channel, self.job, self.flag = channel, job, False

    def is_set(self) -> bool:
        import torch.distributed as dist

        while self.channel is not None and not self.flag and self.channel.readable(0.0):
            message, _ = self.channel.recv()
            self.flag = message["kind"] == "stop" and message.get("job") == self.job
        flag = torch.tensor([int(self.flag)], dtype=torch.int32)
        dist.broadcast(flag, src=0)  # a CPU tensor: gloo, also in a cpu:gloo,cuda:nccl group
        return bool(flag.item())


def _run_job(channel: Channel, stage, rank: int, job: dict, payload: bytes) -> None:
    from .contract import H3Conditioning
    from .diffusion import SamplingOptions
    from .progress import Cancelled

    lead = rank == 0  # rank 0 speaks for all: every rank ends the loop with the same latents
    cond = H3Conditioning.from_bytes(payload)

    def progress(done: int, total: int) -> None:
        channel.send({"kind": "progress", "done": done, "total": total})

    def preview(done: int, total: int, video: torch.Tensor) -> None:
        channel.send({"kind": "preview", "done": done, "total": total}, tensors_to_bytes({"video": video}))

    def on_cache(passes) -> None:
        channel.send({"kind": "cache", "passes": asdict(passes)})

    relays = {"progress": progress, "preview": preview, "on_cache": on_cache} if lead else {}
    # Every rank stops together, whether or not the host can cancel (the lead relays the host's flag).
    options = replace(SamplingOptions.from_wire(job["options"], **relays),
                      cancel=_CollectiveStop(channel if lead else None, int(job["job"])))
    try:
        latents = stage.sample(cond, options)
    except Cancelled as error:
        channel.send({"kind": "cancelled", "message": str(error)})
        return
    passes = None if latents.passes is None else asdict(latents.passes)
    data = tensors_to_bytes({"video": latents.video, "audio": latents.audio}) if lead else b""
    channel.send({"kind": "done", "passes": passes, **_gpu_memory(stage.device)}, data)


def _gpu_memory(device) -> dict:
    """What this rank holds on its GPU (the host shows the pool's total); nothing on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"gpu_bytes": int(torch.cuda.memory_reserved(device))}


def _serve(channel: Channel, rank: int) -> int:
    from .diffusion import DiffusionStage

    setup, _ = channel.recv()
    recipe = DiTRecipe(**setup["recipe"])
    layout = _layout_from(setup["layout"])
    torch.set_num_threads(sequence_parallel.worker_threads(layout))
    device = sequence_parallel.init_rank(layout, rank, int(setup["dist_port"]))
    stage = DiffusionStage(recipe.source(), dtype=recipe.torch_dtype, device=device, offload=recipe.offload,
                           parallel=layout)
    if recipe.offload != "auto":  # auto decides resident or streamed from the job's size: loaded by the first job
        stage.transformer(TASK_OF_COMPONENT[recipe.component])  # load and parallelise now: warm for the first job
    channel.send({"kind": "ready", **_gpu_memory(device)})
    while True:
        try:
            message, payload = channel.recv()
        except ChannelClosed:
            return 0  # the host closed the pool (or went away)
        if message["kind"] == "sample":
            _run_job(channel, stage, rank, message, payload)
        # a `stop` that arrives after its job ended is stale: nothing to do


def _run_rank(host: str, rank: int, token: str) -> None:
    """One rank, forked by the launcher: connect to the host, say hello with the token, serve; never returns."""
    _name_process(f"h3-sp-rank{rank}")
    address, port = host.rsplit(":", 1)
    try:
        channel = Channel(socket.create_connection((address, int(port))))
        channel.send_hello(token, {"kind": "hello", "rank": rank, "pid": os.getpid()})
    except OSError:  # the host stopped the pool (or exited) while this worker was starting: nothing to do
        os._exit(0)
    try:
        code = _serve(channel, rank)
    except ChannelClosed:
        code = 0  # the host closed the pool or went away (closed, reset or killed): how a pool ends
    except BaseException as error:
        if channel.peer_closed():
            # The host is gone, so this error is its consequence (a peer rank that saw it first has exited and
            # this rank's collective broke): no one to tell, nothing to report.
            code = 0
        else:  # tell the host what went wrong; it stops the whole pool
            traceback.print_exc()
            try:
                channel.send({"kind": "error", "message": f"{type(error).__name__}: {error}"})
            except OSError:
                pass
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown and no destroy_process_group: with a peer gone (killed, or its host closed it first)
    # either can block, and a worker whose host is gone must not linger. The OS closes the sockets.
    os._exit(code)


# What a rank imports before it runs: loaded once in the launcher, so N ranks do not each spend the seconds of CPU that
# importing torch, diffusers and the pack costs (the pack's lazy imports, named here). Importing touches no device.
RANK_PRELOAD = ("torch.distributed", "h3_core.contract", "h3_core.diffusion", "h3_core.lora", "h3_core.models",
                "h3_core.offload", "h3_core.diffusers_adapter", "h3_core.progress", "h3_core.weights",
                "diffusers", "diffusers.models.auto_model", "diffusers.models.autoencoders",
                "diffusers.models.transformers.transformer_minimax_h3", "diffusers.modular_pipelines.minimax_h3",
                "diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3",
                "diffusers.modular_pipelines.minimax_h3.modular_pipeline")


def _name_process(name: str) -> None:
    """What `ps -o comm` and top show for this process (Linux; elsewhere nothing): forked ranks share their
    launcher's command line, so this is how each is told apart."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def _report(fd: int, record: dict) -> None:
    """One line to the host on the launcher's status pipe (nobody to tell when the host is gone)."""
    try:
        os.write(fd, json.dumps(record).encode() + b"\n")
    except OSError:
        pass


def _launch(host: str, ranks: int, status_fd: int) -> int:
    """The launcher: import what the ranks need once, fork them (each waits until its pid was reported), reap them,
    reporting each exit code; exit when every rank has."""
    import importlib

    token = os.environ.pop(TOKEN_ENV, "")  # handed to the ranks in memory only
    _name_process("h3-sp-launcher")
    nvml_check = "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    if nvml_check:  # torch.cuda.is_available() in an import must not initialise CUDA here: the ranks do, after fork
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    preloaded = []
    for name in RANK_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # the rank imports it itself, and fails there with its own message if it must
        preloaded.append(name)
    _report(status_fd, {"kind": "preloaded", "modules": preloaded, "torch": "torch" in sys.modules})
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(ranks):
        gate_r, gate_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            if nvml_check:
                os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
            os.close(gate_w)
            os.close(status_fd)
            released = os.read(gate_r, 1)
            os.close(gate_r)
            if not released:  # the launcher is gone before it said who this rank is: no host will admit it
                os._exit(0)
            _run_rank(host, rank, token)
        os.close(gate_r)
        children[pid] = rank
        _report(status_fd, {"kind": "forked", "rank": rank, "pid": pid})
        os.write(gate_w, b"1")  # the host knows this pid now: the rank may say hello
        os.close(gate_w)
    while children:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if children.pop(pid, None) is not None:
            _report(status_fd, {"kind": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the launcher of a warm sequence-parallel DiT's ranks (started by "
                                     "its host)")
    parser.add_argument("--host", required=True, help="the host's loopback address, 127.0.0.1:PORT")
    parser.add_argument("--ranks", type=int, required=True, help="how many ranks to fork")
    parser.add_argument("--status-fd", type=int, required=True, help="the pipe the host reads pids and exits from")
    args = parser.parse_args(argv)
    # Ctrl-C in the host's terminal reaches this process too; the host decides when its workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = _launch(args.host, args.ranks, args.status_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
