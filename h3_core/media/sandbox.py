"""Decode untrusted media in a child process, so a native crash or runaway memory costs one request.

FFmpeg and PyAV are native code: a hostile file can crash them (SIGSEGV) or make them allocate without bound, and
in-process either one takes every other request of a server down with it. :func:`decode_isolated` runs one of
:mod:`media`'s decode functions in a short-lived child process under an address-space cap (``RLIMIT_AS``) and a
wall-clock timeout. Whatever happens to the child, the caller gets the decoded arrays or a
:class:`media.MediaError` that says what went wrong::

    the media decoder crashed (signal 11: SIGSEGV) (read_video, 4123 bytes)
    the media decoder exceeded its memory cap of 2048 MiB (read_video, 30211 bytes)
    the media decoder timed out after 60 s (read_video, 30211 bytes)

How: a *decoder host* (one helper interpreter per parent process, started on first use with numpy, PyAV and
Pillow imported, and nothing of the parent: no model weights, no threads, no CUDA) forks one worker per call. The
worker decodes and exits; an intermediate fork waits for it and reports its pid and exit status on a pipe that
belongs to that call alone, so a crash, a kill or a timeout touches that call only. A call costs two forks of a
small process, not an interpreter start. The host loads this package from its directory under a private name,
so it works however the parent imported the package (as ``h3_core`` or inside a ComfyUI custom-node folder).

Nothing is pickled in either direction: the call goes to the host as JSON (plus the pipe's file descriptor),
the media bytes and results go through files in a private directory (tmpfs where there is one), arrays as
safetensors and everything else as JSON (`sandbox_files.py`). Calls may run concurrently from threads. This
isolates failures, not privileges: the worker runs as the same user with the same filesystem access.

Usage::

    clip = decode_isolated("read_video", data, max_pixels=..., max_frames=..., target=media.VideoTarget(...))
    waveform, rate = decode_isolated("read_audio", data, max_seconds=17.0)
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from .. import media
from . import sandbox_files

__all__ = ["decode_isolated", "DECODERS", "DecoderStopped", "default_memory_cap", "BASE_BYTES"]

DECODERS = ("read_image", "read_video", "read_audio", "probe")
"""The media functions a worker may run. ``selftest_*`` (crash, hang, allocate) exist to test the sandbox."""
_SELFTESTS = ("selftest_crash", "selftest_hang", "selftest_allocate")

BASE_BYTES = 768 << 20  # headroom over the worker's own mappings: FFmpeg's buffers, threads, numpy temporaries
SCRATCH_PREFIX = "h3-decode-"  # + the calling process's pid: `clean_stale_scratch` knows whose a directory was
# Process names (`/proc/<pid>/comm`, what ps and top show) of the host, a call's waiter and its worker.
PROCESS_NAMES = ("h3-media-host", "h3-media-wait", "h3-media-work")
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1  # linux/prctl.h
# The worker's MediaErrors by type name: the caller raises the same type (a TooManyFrames stays one).
_MEDIA_ERRORS = {cls.__name__: cls for cls in (media.MediaError, media.TooManyFrames)}
PARENT_POLL_S = 0.5  # how often the host checks that the process it serves still exists


def default_memory_cap(fn_name: str, size: int, kwargs: dict[str, Any]) -> int:
    """Bytes of address space a decode may add to the worker's starting mappings, from the caps it runs with.

    Video with a :class:`media.VideoTarget`: the output (``num_frames`` x canvas x 3, the canvas bounded by
    ``canvas_max_pixels`` with rounding slack) plus 48 decoded frames at ``max_pixels`` (decoder reference frames,
    frame threads, the RGB conversion, the resize). Without a target: ``max_frames`` frames at ``max_pixels``.
    Images: 16 bytes per ``max_pixels``. Audio: 8 channels x 384 kHz x ``max_seconds`` float32, three times
    (chunks, joined, transposed); a video's soundtrack counts as 16 s of that. A missing cap stands for 4 GiB in
    its term.
    """
    unknown = 4 << 30
    max_pixels = kwargs.get("max_pixels")
    if fn_name == "read_video":
        frame = 3 * max_pixels if max_pixels else unknown // 64
        target = kwargs.get("target")
        if target is not None:
            canvas = int(target.canvas_max_pixels * 1.5) + 4 * target.canvas_multiple**2
            frames = target.num_frames * canvas * 3
        elif kwargs.get("max_frames"):
            frames = int(kwargs["max_frames"]) * frame
        else:
            frames = unknown
        # The soundtrack: the caller has checked its duration from the headers; 16 s of 7.1 at 384 kHz fits.
        return BASE_BYTES + min(frames, unknown) + 48 * frame + 3 * _audio_bytes(16.0)
    if fn_name == "read_image":
        return BASE_BYTES + (16 * max_pixels if max_pixels else unknown)
    if fn_name == "read_audio":
        return BASE_BYTES + 3 * _audio_bytes(kwargs.get("max_seconds"))
    return BASE_BYTES + 4 * size


def _audio_bytes(max_seconds: float | None) -> int:
    if max_seconds is None:
        return 1 << 30
    return int(max_seconds + 1) * media.MAX_SAMPLE_RATE * media.MAX_AUDIO_CHANNELS * 4


def decode_isolated(
    fn_name: str,
    data: bytes,
    *,
    timeout_s: float = 120.0,
    memory_cap: int | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``media.<fn_name>(data, **kwargs)`` in a worker process and return what it returns.

    ``fn_name`` is one of :data:`DECODERS`; ``kwargs`` are numbers, strings, ``None`` or a
    :class:`media.VideoTarget`. ``memory_cap``: bytes of address space the decode may add to the worker's starting
    mappings (default :func:`default_memory_cap` from the caps in ``kwargs``). Raises :class:`media.MediaError`
    for anything the input causes: the function's own refusals (same message), a crash (signal), the memory cap,
    the timeout. The caller's process, the decoder host and other calls are unaffected by any of them.
    """
    if fn_name not in DECODERS + _SELFTESTS:
        raise ValueError(f"decode_isolated runs one of {', '.join(DECODERS)}, got {fn_name!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_isolated takes the media's bytes, got {type(data).__name__}")
    if memory_cap is None:
        memory_cap = default_memory_cap(fn_name, len(data), kwargs)
    request = {"fn": fn_name, "kwargs": sandbox_files.encode_kwargs(kwargs), "memory_cap": int(memory_cap)}
    what = f"({fn_name}, {len(data)} bytes)"
    workdir = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=_scratch_root())
    try:
        with open(os.path.join(workdir, "input"), "wb") as file:
            file.write(data)
        request["workdir"] = workdir
        status = _HOST.run(request, timeout_s)
        if status is None:
            raise media.MediaError(f"the media decoder timed out after {timeout_s:g} s {what}")
        return _collect(workdir, status, memory_cap, what)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _scratch_root() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean after
        return True
    return True


def clean_stale_scratch(root: str | None = None, dead: tuple[int, ...] = ()) -> list[str]:
    """Remove the scratch directories (``h3-decode-<pid>-*``, in RAM on tmpfs) of processes that no longer exist
    (or are known to be `dead`, as a zombie still answers a signal): a process killed mid-call (SIGKILL, a second
    SIGTERM, the OOM killer) never ran its ``finally``. Run when a decoder host starts and when the process it
    served dies; returns what was removed."""
    root = root or _scratch_root() or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if not name.startswith(SCRATCH_PREFIX) or not pid.isdigit():
            continue
        if int(pid) not in dead and _pid_alive(int(pid)):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class DecoderStopped(RuntimeError):
    """The decode was stopped from outside, not by its media: the worker got a service manager's stop signal (a
    `systemctl stop` that signals the whole control group) or the decoder host died. Not the request's fault: the
    server answers 503 and the client retries (a MediaError would be a final 422)."""


# Signals the sandbox never sends (it kills with SIGKILL) and a decoder never raises on itself: someone stopping us.
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def _collect(workdir: str, exitcode: int, memory_cap: int, what: str) -> Any:
    """The worker's result, or the :class:`media.MediaError` its exit stands for."""
    meta_path = os.path.join(workdir, "result.json")
    meta = None
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as file:
            meta = json.load(file)
    cap_mib = memory_cap >> 20
    if meta is not None and "error" in meta:
        if meta["error"] == "memory":
            raise media.MediaError(f"the media decoder exceeded its memory cap of {cap_mib} MiB {what}")
        if meta["error"] in _MEDIA_ERRORS:  # the worker's own MediaError, its type kept
            raise _MEDIA_ERRORS[meta["error"]](meta["message"])
        raise media.MediaError(f"the media decoder failed {what}: {meta['error']}: {meta['message']}")
    if -exitcode in _STOP_SIGNALS:
        raise DecoderStopped(f"the media decoder was stopped by signal {-exitcode} {what}")
    if exitcode < 0:
        number = -exitcode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        hint = ""
        if number in (signal.SIGKILL, signal.SIGABRT):
            hint = f"; it may have run out of memory (cap {cap_mib} MiB)"
        raise media.MediaError(f"the media decoder crashed (signal {number}: {name}) {what}{hint}")
    if exitcode != 0 or meta is None:
        raise media.MediaError(f"the media decoder failed (exit code {exitcode}) {what}")
    tensors = {}
    if meta.get("tensors"):
        tensors = sandbox_files.read_arrays(os.path.join(workdir, "result.safetensors"))
    return sandbox_files.rebuild(meta, tensors)


# --------------------------------------------------------------------------------------------------------------
# the decoder host, seen from the caller


_BOOT = """
import importlib, importlib.util, os, sys
directory, fd = sys.argv[1], int(sys.argv[2])
spec = importlib.util.spec_from_file_location(
    "_h3_media_host", os.path.join(directory, "__init__.py"), submodule_search_locations=[directory])
package = importlib.util.module_from_spec(spec)
sys.modules["_h3_media_host"] = package
spec.loader.exec_module(package)
importlib.import_module("_h3_media_host.media.sandbox")._serve(fd)
"""


class _Host:
    """The decoder host process of this (parent) process: started on first use, restarted if it dies."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = _spawn_environment()
        # the h3_core folder, loaded under another name so its torch-importing modules stay unimported
        directory = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, directory, str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env, close_fds=True,
        )
        child.close()
        self.sock = parent

    def _send(self, payload: bytes, fd: int) -> None:
        with self.lock:
            for attempt in (0, 1):
                if self.process is None or self.process.poll() is not None:
                    self._start()
                try:
                    socket.send_fds(self.sock, [payload], [fd])
                    return
                except OSError:
                    if attempt:
                        raise
                    self.process = None  # the host died between calls: start a fresh one and resend

    def run(self, request: dict[str, Any], timeout_s: float) -> int | None:
        """Exit code of the worker (negative: killed by that signal), or ``None`` if it was killed on timeout."""
        read_end, write_end = os.pipe()
        try:
            try:
                self._send(json.dumps(request).encode("utf-8"), write_end)
            finally:
                os.close(write_end)
            deadline = time.monotonic() + timeout_s
            lines, buffer, pid, timed_out = [], b"", None, False
            while True:
                left = deadline - time.monotonic()
                if left <= 0 and not timed_out:
                    timed_out = True
                    if pid is not None:
                        _kill(pid)
                ready, _, _ = select.select([read_end], [], [], max(left, 0) if not timed_out else 5.0)
                if not ready:
                    if timed_out:
                        return None  # the host did not answer even after the kill: give up on this call
                    continue
                chunk = os.read(read_end, 256)
                if not chunk:  # the waiter vanished without a status (the host was killed)
                    raise DecoderStopped("the media decoder host died during the call")
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    key, value = line.decode().split()
                    if key == "pid":
                        pid = int(value)
                        if timed_out:
                            _kill(pid)
                    elif key == "exit":
                        return None if timed_out else int(value)
        finally:
            os.close(read_end)


# What the decoder host (and every worker it forks) inherits of the parent's environment: what an interpreter,
# FFmpeg and the tests' crash hook need, nothing else. The workers parse untrusted bytes: never hand them the
# server's bearer token (H3_ENCODER_TOKEN), cloud credentials or anything else the parent was given.
_ENV_KEPT = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "SYSTEMROOT", "MALLOC_ARENA_MAX")


def _spawn_environment() -> dict[str, str]:
    """The decoder host's environment: the kept variables, `LC_*`, this interpreter's import path, the test hooks."""
    env = {key: value for key, value in os.environ.items()
           if key in _ENV_KEPT or key.startswith("LC_") or key in (TEST_CRASH_ENV, TEST_HANG_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path and os.path.isdir(path))
    env.setdefault("MALLOC_ARENA_MAX", "2")  # see _limit_memory
    return env


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_HOST = _Host()


# --------------------------------------------------------------------------------------------------------------
# the decoder host, inside


def _prctl(option: int, value: int | bytes) -> None:
    """Linux's prctl(2) through libc (no-op elsewhere, or if libc refuses)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become(name: str, parent: int) -> None:
    """Name this process, and have the kernel SIGKILL it when its parent dies (`PR_SET_PDEATHSIG`). Called in the
    waiter and the worker, whose parents are single-threaded (the host, the waiter): the death signal follows the
    parent *thread*, so it is safe there. If the parent died before the signal was armed, exit now."""
    _prctl(_PR_SET_NAME, name.encode()[:15])
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _serve(fd: int) -> None:
    """The host's loop: per call, fork a waiter that forks the worker and reports its pid and exit on the call's
    pipe. The host never waits on anyone (waiters are reaped by the kernel), so calls run side by side.

    Lifetime: the host leaves when the process it serves is gone: its end of the socket closed, or (checked every
    `PARENT_POLL_S`, as another child may hold a copy of that socket) it is no longer the host's parent. Waiters and
    workers die with their parent (`_become`), so a killed server leaves no decoder running; the host then removes
    the scratch directories of the calls it was serving."""
    parent = os.getppid()
    _prctl(_PR_SET_NAME, PROCESS_NAMES[0].encode())
    sock = socket.socket(fileno=fd)
    sock.settimeout(PARENT_POLL_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the parent's terminal is the parent's to handle
    # The stop signals end a decode (a 503 the client retries) whatever this host inherited: a mask or an ignore
    # from the thread or shell that started it (exec keeps both) would leave a worker deaf to `systemctl stop`.
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(stop, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
    clean_stale_scratch()
    me, waiters = os.getpid(), []
    try:
        while os.getppid() == parent:
            try:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
            except socket.timeout:
                continue
            except OSError:
                break
            if not message:  # the parent closed its end (or exited): so does the host
                break
            if not fds:
                continue
            waiter = os.fork()
            if waiter == 0:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _become(PROCESS_NAMES[1], me)
                os._exit(_wait_for_worker(json.loads(message), fds[0]))
            waiters = [pid for pid in waiters if _is_waiter(pid)] + [waiter]
            os.close(fds[0])
    finally:
        deadline = time.monotonic() + 2.0  # the socket closes as the parent exits; the re-parenting follows
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.getppid() != parent:  # the served process died without its `finally`: end its calls, free their RAM
            for pid in waiters:
                if _is_waiter(pid):
                    _kill(pid)  # its worker follows (death signal)
            time.sleep(0.1)
            clean_stale_scratch(dead=(parent,))


def _is_waiter(pid: int) -> bool:
    """Whether `pid` is still one of this host's waiters (waiters are reaped by the kernel, so pids get reused)."""
    try:
        with open(f"/proc/{pid}/comm", encoding="ascii", errors="replace") as file:
            return file.read().strip() == PROCESS_NAMES[1]
    except OSError:
        return False


def _wait_for_worker(request: dict[str, Any], fd: int) -> int:
    try:
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(fd)
            code = 1
            try:
                _become(PROCESS_NAMES[2], me)
                _worker(request["fn"], request["workdir"], sandbox_files.decode_kwargs(request["kwargs"]),
                        request["memory_cap"])
                code = 0
            finally:
                os._exit(code)
        os.write(fd, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(fd, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        return 0
    except BaseException:  # noqa: BLE001 - the waiter must never run on into the host's loop
        return 1


# --------------------------------------------------------------------------------------------------------------
# the worker


def _limit_memory(extra: int) -> None:
    """Cap the address space at what the worker has mapped now plus ``extra`` bytes. The host runs with
    ``MALLOC_ARENA_MAX=2``: glibc would otherwise reserve a 64 MiB arena per decoder thread, address space the cap
    counts though it is never touched."""
    with open("/proc/self/status", encoding="ascii") as file:
        mapped = next(int(line.split()[1]) * 1024 for line in file if line.startswith("VmSize:"))
    limit = mapped + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


TEST_CRASH_ENV = "H3_SANDBOX_TEST_CRASH"
"""Tests only: a worker whose input contains this variable's value (at least 16 characters) crashes with SIGSEGV,
so a test can make a real server's decode crash for one marked request. Unset in production."""


TEST_HANG_ENV = "H3_SANDBOX_TEST_HANG"
"""Tests only: likewise, a worker whose input contains this variable's value hangs (until killed), so a test can
catch a real server with a decode in flight. Unset in production."""


def _marked(env: str, data: bytes) -> bool:
    marker = os.environ.get(env, "").encode()
    return len(marker) >= 16 and marker in data


def _run(fn_name: str, data: bytes, kwargs: dict[str, Any]) -> Any:
    if fn_name == "selftest_crash" or _marked(TEST_CRASH_ENV, data):
        os.kill(os.getpid(), signal.SIGSEGV)
    if fn_name == "selftest_hang" or _marked(TEST_HANG_ENV, data):
        threading.Event().wait()
    if fn_name == "selftest_allocate":
        return np.ones(int(kwargs["nbytes"]), dtype=np.uint8)
    return getattr(media, fn_name)(data, **kwargs)


def _worker(fn_name: str, workdir: str, kwargs: dict[str, Any], memory_cap: int) -> None:
    try:
        with open(os.path.join(workdir, "input"), "rb") as file:
            data = file.read()
        _limit_memory(memory_cap)
        result = _run(fn_name, data, kwargs)
        del data
        meta, tensors = sandbox_files.flatten(fn_name, result)
        del result
        meta["tensors"] = sorted(tensors)
        if tensors:
            sandbox_files.write_arrays(os.path.join(workdir, "result.safetensors"), tensors)
    except media.MediaError as error:
        memory = isinstance(error.__cause__, MemoryError)  # FFmpeg's ENOMEM under the cap
        name = type(error).__name__ if type(error) in _MEDIA_ERRORS.values() else "MediaError"
        meta = {"error": "memory"} if memory else {"error": name, "message": str(error)}
    except MemoryError:
        meta = {"error": "memory"}
    except Exception as error:  # noqa: BLE001 - reported to the caller as a media failure, with its type
        meta = {"error": type(error).__name__, "message": str(error)[:500]}
    with open(os.path.join(workdir, "result.json"), "w", encoding="utf-8") as file:
        json.dump(meta, file)
