"""Warm sequence-parallel DiT workers for a long-lived host process (the ComfyUI Sampler's `gpus` widget).

`generate --sp N` (cli.py) starts N ranks for one job and lets them exit. A host that samples prompt after prompt
instead keeps one `WorkerPool`: N worker processes (`python -m h3_core.sequence_parallel_workers`), one per GPU,
joined in one process group (sequence_parallel.init_rank: gloo on the CPU, NCCL on CUDA), each holding the DiT
loaded from the file the host's loader read (`DiTRecipe`) and parallelised with diffusers' context-parallel plan.
Each job runs the very `DiffusionStage.sample` a single process runs, on every rank; rank 0 sends the latents back.

* **Engine.** Plain subprocesses of the host's Python, not `multiprocessing` spawn: a spawned child re-runs the
  host's `__main__` (ComfyUI's main.py) and must import the target by the host's module name, which ComfyUI gives
  custom nodes from their path. Ray is not needed for processes on one machine.
* **Messages.** JSON headers and safetensors bytes over a token-checked loopback socket (sequence_parallel_channel):
  the conditioning goes out as its wire bytes, progress / preview / cache counts and the latents come back from
  rank 0. Nothing is unpickled.
* **Start.** The host's port is on every worker's command line, so any local process can connect while the pool
  starts: connections are read side by side (`sequence_parallel_channel.accept_hellos`), token first, each within one
  hello deadline, with nothing allocated before the token matched; the cancel flag and the start limit are checked
  at every poll. The ranks' own rendezvous store and gloo / NCCL sockets listen on loopback
  (`sequence_parallel.init_rank`).
* **Interrupt.** The host sends `stop`; rank 0 reads it before each step and broadcasts the flag, so every rank
  stops before the same step (a rank leaving a collective alone would hang the others). The pool stays warm.
* **A dead worker** (its process gone, its socket closed) or a rank error ends the job with a `WorkerError` naming
  the rank and pid; the whole pool is stopped, and the next job starts a fresh one.
* **Warm.** One pool per host, keyed by (recipe, layout): another DiT file, dtype or rank count replaces it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
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

    @classmethod
    def of(cls, source, component: str, dtype: torch.dtype, fingerprint: str = "") -> DiTRecipe:
        source.require(component)
        return cls(component=component, path=str(Path(source.paths[component]).resolve()),
                   root=str(source.root), weights_layout=source.layout, tiny=bool(source.tiny),
                   dtype=str(dtype).removeprefix("torch."),
                   pipeline_config=json.dumps(source.pipeline_config, sort_keys=True), fingerprint=fingerprint)

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


class WorkerPool:
    """N warm worker processes holding one DiT, sequence-parallel over them. Not thread-safe: one job at a time."""

    def __init__(self, recipe: DiTRecipe, layout: sequence_parallel.Layout, clock=time.monotonic):
        if layout.degree < 2:
            raise ValueError("a worker pool runs 2 or more ranks; one rank samples in the host process")
        self.recipe, self.layout = recipe, layout
        self.procs: list[subprocess.Popen] = []
        self.channels: dict[int, Channel] = {}
        self._jobs = 0
        self.closed = False
        self.clock = clock  # the start deadline's clock (tests inject one)

    @property
    def key(self) -> tuple:
        return self.recipe, self.layout

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def alive(self) -> bool:
        return not self.closed and bool(self.procs) and all(proc.poll() is None for proc in self.procs)

    # start ------------------------------------------------------------------------------------------------------

    def start(self, cancel=None, timeout_s: float = START_TIMEOUT_S) -> WorkerPool:
        """Start the workers and wait until each has loaded and parallelised the DiT."""
        try:
            self._spawn_and_connect(cancel, timeout_s)
            setup = {"kind": "setup", "recipe": asdict(self.recipe), "layout": _layout_json(self.layout),
                     "dist_port": sequence_parallel.free_port()}
            for channel in self.channels.values():
                channel.send(setup)
            self._gather(lambda rank, header, payload: header["kind"] == "ready", cancel,
                         self.clock() + timeout_s, "loading the DiT")
        except BaseException:
            self.close()
            raise
        return self

    def _spawn_and_connect(self, cancel, timeout_s: float) -> None:
        token = secrets.token_hex(TOKEN_BYTES)
        listener = socket.create_server(("127.0.0.1", 0))
        env = {**os.environ, TOKEN_ENV: token,
               "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)}
        port = listener.getsockname()[1]
        deadline = self.clock() + timeout_s

        def admit(hello: dict):  # the token was checked before this JSON was read; the pid ties it to our process
            rank = hello.get("rank")
            if (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < self.layout.degree
                    and hello.get("pid") == self.procs[rank].pid):
                return rank
            return None

        try:
            for rank in range(self.layout.degree):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "h3_core.sequence_parallel_workers", "--host", f"127.0.0.1:{port}",
                     "--rank", str(rank)], env=env, cwd=PACKAGE_ROOT, stdin=subprocess.DEVNULL))
            # Connections are read side by side, each with one deadline for its whole hello, while this loop keeps
            # checking the workers, the cancel flag and the start deadline: no peer can hold the start.
            self.channels = accept_hellos(listener, token, self.layout.degree, admit,
                                          lambda: self._check_running(cancel, deadline, "starting"), clock=self.clock)
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
        self.close()
        raise WorkerError(f"sequence-parallel worker rank {rank} (pid {proc.pid}) {how} while {doing}; all "
                          f"{self.layout.degree} workers were stopped, and the next run starts new ones")

    # stop -------------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (they exit when their host connection closes; stragglers are terminated, then killed)."""
        self.closed = True
        for channel in self.channels.values():
            channel.close()
        self.channels = {}
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# One warm pool per host process: a DiT replicated on N devices is too big to keep two of.
_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def warm_pool(recipe: DiTRecipe, layout: sequence_parallel.Layout, cancel=None) -> WorkerPool:
    """The running pool for (recipe, layout), or a new one (stopping another)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and (_POOL.key != (recipe, layout) or not _POOL.alive()):
            if _POOL.key == (recipe, layout):  # a worker died between jobs: say so, then start afresh
                gone = [f"rank {r} (pid {p.pid}, exit code {p.returncode})" for r, p in enumerate(_POOL.procs)
                        if p.poll() is not None]
                logging.getLogger(__name__).warning("sequence-parallel worker %s died while idle; starting %d new "
                                                    "workers", ", ".join(gone) or "pool", layout.degree)
            _POOL.close()
            _POOL = None
        if _POOL is None:
            _POOL = WorkerPool(recipe, layout).start(cancel)
        return _POOL


def sample(recipe: DiTRecipe, layout: sequence_parallel.Layout, cond, options, loras=(), lora_audio: bool = True):
    """Sample on the warm pool for (recipe, layout): `DiffusionStage.sample`'s latents, from N ranks."""
    return warm_pool(recipe, layout, options.cancel).sample(cond, options, loras, lora_audio)


def close_pool() -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


atexit.register(close_pool)


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
    channel.send({"kind": "done", "passes": passes}, data)


def _serve(channel: Channel, rank: int) -> int:
    from .diffusion import DiffusionStage

    setup, _ = channel.recv()
    recipe = DiTRecipe(**setup["recipe"])
    layout = _layout_from(setup["layout"])
    torch.set_num_threads(sequence_parallel.worker_threads(layout))
    device = sequence_parallel.init_rank(layout, rank, int(setup["dist_port"]))
    stage = DiffusionStage(recipe.source(), dtype=recipe.torch_dtype, device=device, parallel=layout)
    stage.transformer(TASK_OF_COMPONENT[recipe.component])  # load and parallelise now: warm for the first job
    channel.send({"kind": "ready"})
    while True:
        try:
            message, payload = channel.recv()
        except ChannelClosed:
            return 0  # the host closed the pool (or went away)
        if message["kind"] == "sample":
            _run_job(channel, stage, rank, message, payload)
        # a `stop` that arrives after its job ended is stale: nothing to do


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of a warm sequence-parallel DiT (started by its host)")
    parser.add_argument("--host", required=True, help="the host's loopback address, 127.0.0.1:PORT")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    address, port = args.host.rsplit(":", 1)
    channel = Channel(socket.create_connection((address, int(port))))
    channel.send_hello(os.environ.pop(TOKEN_ENV, ""), {"kind": "hello", "rank": args.rank, "pid": os.getpid()})
    try:
        code = _serve(channel, args.rank)
    except ChannelClosed:
        code = 0
    except BaseException as error:  # tell the host what went wrong; it stops the whole pool
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


if __name__ == "__main__":
    sys.exit(main())
