"""`python -m h3_core ARGS` forked from a warm interpreter: the suite's CLI runs and servers without the imports.

Why: the suite starts `python -m h3_core` some fifty times (encoder servers, encodes, generates, tiny builds), and a
fresh interpreter spends 6-9 CPU-seconds importing torch, diffusers, transformers and the pack before its first line
of work: several CPU-minutes a run for nothing the tests prove. A fork server per test process imports them once
(touching no tensor, so no thread pool exists yet) and forks one child per command. The child is the command line as
`python -m h3_core` runs it: `h3_core/__main__.py` through runpy with `sys.argv` set, in the caller's cwd, environment
and stdio (the descriptors travel over a Unix socket), its exit status the child's own (negative for a signal, as
subprocess reports it).

What keeps real interpreters: tests about the command line as an operator types it (tests/test_docs_commands.py, the
fresh-venv deploy tests), and runs that need a `preexec_fn` (resource limits set in the child before exec).

The wire, one Unix socket connection per command: the client sends one JSON line (argv, cwd, env, new session) with
its three descriptors attached (SCM_RIGHTS); the server answers `{"pid": N}` when forked and `{"exit": CODE}` when it
reaped the child, then closes the connection. The server listens in a private 0700 directory, forks only from its
single-threaded loop, and kills what it forked when it ends (its parent, the test process, gone or closed).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What the children would import anyway: loaded once here. Nothing optional (ray) and nothing that starts a thread.
PRELOAD = (
    "numpy", "torch", "safetensors.torch", "transformers", "diffusers", "aiohttp", "av", "PIL.Image",
    "h3_core.cli", "h3_core.tiny", "h3_core.guides", "h3_core.media", "h3_core.request", "h3_core.encoder",
    "h3_core.contract", "h3_core.diffusion", "h3_core.lora", "h3_core.step_cache", "h3_core.models",
    "h3_core.weights.check", "h3_core.remote.client.encoder_client", "h3_core.remote.engines.options",
    "h3_core.remote.engines.aiohttp_server", "h3_core.sequence_parallel", "h3_core.sequence_parallel_workers",
)


# --- the server (its own process) ------------------------------------------------------------------------------------


def _child(request: dict, fds: list[int], server_fds: list[int]) -> None:
    """In the forked child: become `python -m h3_core ARGS` and never return."""
    code = 1
    try:
        # Nothing of the server's: its listener, wake-up pipe and the other commands' connections (a copy held here
        # would keep another command's connection open after the server ended).
        signal.set_wakeup_fd(-1)
        for fd in server_fds:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGPIPE stays ignored, as Python starts
        if request.get("new_session"):
            os.setsid()
        try:  # what ps and top show: the children share the fork server's command line
            with open("/proc/self/comm", "w") as comm:
                comm.write(("h3 " + " ".join(request["args"][:1]))[:15])
        except OSError:
            pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # libgomp read OMP_NUM_THREADS when the server loaded it: give torch the count a fresh interpreter would read.
        import torch

        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else (os.cpu_count() or 1))
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), write_through=unbuffered,
                                      line_buffering=os.isatty(1))
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), write_through=True,
                                      errors="backslashreplace")
        sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
        import runpy

        main_file = str(REPO / "h3_core" / "__main__.py")
        sys.argv = [main_file, *request["args"]]
        runpy.run_module("h3_core", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code < 0:  # like an interpreter killed by SIGINT
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _end(*_) -> None:
    raise SystemExit(0)


def serve(socket_path: str) -> None:
    """The fork server's loop: accept, fork, report pid and exit; end with the parent."""
    parent = os.getppid()
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    # A Python thread at fork could leave a child holding a lock nobody frees. (numpy's OpenBLAS starts a native pool
    # at import; it shuts it down around fork itself, pthread_atfork, as the sequence-parallel launcher relies on.)
    if threading.active_count() != 1:
        raise SystemExit(f"warm_cli: {threading.enumerate()} after the preload; forking is unsafe")
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, _end)
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
            if wake_r in ready:
                os.read(wake_r, 4096)
            while children:
                try:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    cpu = usage.ru_utime + usage.ru_stime  # the child's and what it reaped: the suite's CPU table
                    try:
                        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status), "cpu": cpu}).encode()
                                     + b"\n")
                    except OSError:
                        pass
                    conn.close()
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    line, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    request = json.loads(line)
                    if len(fds) != 3:
                        raise ValueError("three descriptors (stdin, stdout, stderr) expected")
                except (OSError, ValueError) as error:
                    conn.sendall(json.dumps({"error": str(error)}).encode() + b"\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    own = [listener.fileno(), wake_r, wake_w, conn.fileno(), *(c.fileno() for c in children.values())]
                    _child(request, fds, own)
                for fd in set(fds):
                    os.close(fd)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- the client (in the test process) -------------------------------------------------------------------------------

_REAPED = [0.0]
_REAPED_LOCK = threading.Lock()


def _reaped_cpu(seconds: float) -> None:
    with _REAPED_LOCK:
        _REAPED[0] += seconds


def reaped_cpu_seconds() -> float:
    """CPU-seconds of the commands this process ran warm and saw end: they are the fork server's children, not
    ours, so os.times() does not count them (support/cpu_report.py adds this)."""
    return _REAPED[0]



class _Server:
    """The test process's fork server, started on first use and stopped at exit."""

    _lock = threading.Lock()
    _proc: subprocess.Popen | None = None
    _path: str | None = None

    @classmethod
    def path(cls) -> str:
        with cls._lock:
            if cls._proc is None or cls._proc.poll() is not None:
                directory = tempfile.mkdtemp(prefix="h3-warm-cli-")  # 0700: only this user may connect
                cls._path = os.path.join(directory, "s")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                               os.environ.get("PYTHONPATH")])))
                cls._proc = subprocess.Popen([sys.executable, "-m", "tests.support.warm_cli", cls._path], cwd=REPO,
                                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
                ready = cls._proc.stdout.readline()
                if ready.strip() != b"ready":
                    raise RuntimeError(f"warm_cli: the fork server did not start (exit {cls._proc.wait()})")
            return cls._path

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            if cls._proc is not None and cls._proc.poll() is None:
                cls._proc.terminate()
                try:
                    cls._proc.wait(10)
                except subprocess.TimeoutExpired:
                    cls._proc.kill()
                    cls._proc.wait()
            cls._proc = None


# Registered at import, so it runs after the exit handlers of the fixtures that use it (atexit runs last-in first-out):
# those stop their servers while the fork server can still report how they ended.
atexit.register(_Server.stop)


def _fd_for(spec, default: int, own: list[int], keep: list) -> int:
    """The descriptor a child's stream gets for a subprocess-style spec (None, DEVNULL, PIPE, a file, an fd)."""
    if spec is None:
        return default
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        own.append(fd)
        return fd
    if spec == subprocess.PIPE:
        read_fd, write_fd = os.pipe()
        own.append(write_fd)
        keep.append(read_fd)
        return write_fd
    return spec if isinstance(spec, int) else spec.fileno()


class WarmProcess:
    """A forked `python -m h3_core ARGS`, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False,
                 start_new_session=False):
        self.args = [sys.executable, "-m", "h3_core", *map(str, args)]
        self.returncode: int | None = None
        own: list[int] = []
        ends: list = []
        stdin_fd = _fd_for(subprocess.DEVNULL if stdin is None else stdin, 0, own, [])
        out_fd = _fd_for(stdout, 1, own, ends)
        self.stdout = os.fdopen(ends.pop(), "r" if text else "rb") if ends else None
        err_fd = out_fd if stderr == subprocess.STDOUT else _fd_for(stderr, 2, own, ends)
        self.stderr = os.fdopen(ends.pop(), "r" if text else "rb") if ends else None
        self.stdin = None
        request = {"args": [str(a) for a in args], "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), "new_session": bool(start_new_session)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_Server.path())
            socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [stdin_fd, out_fd, err_fd])
        finally:
            for fd in own:
                os.close(fd)
        self._buffer = b""
        self._readers: list[threading.Thread] | None = None
        self._read: dict[str, object] = {}
        answer = self._message(None)
        if "pid" not in answer:
            raise OSError(f"warm_cli: the fork server refused: {answer}")
        self.pid: int = answer["pid"]

    def _message(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:  # the fork server ended without reporting: it kills its children as it ends
                if self._buffer == b"" and getattr(self, "pid", None):
                    try:
                        os.kill(self.pid, signal.SIGKILL)  # in case it could not (killed itself)
                    except ProcessLookupError:
                        pass
                    return {"exit": -signal.SIGKILL, "cpu": 0.0}
                raise OSError("warm_cli: the fork server closed the connection before it forked the command")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            message = self._message(timeout)
            if message is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["exit"]
            _reaped_cpu(message.get("cpu", 0.0))
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple:
        """Read stdout and stderr to their ends, then wait (threads, as subprocess does where it cannot poll); after a
        timeout, a second call goes on with the same readers."""
        if self._readers is None:
            self._readers = [threading.Thread(target=self._drain, args=(name, stream), daemon=True)
                             for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._read.get("out"), self._read.get("err")

    def _drain(self, name: str, stream) -> None:
        self._read[name] = stream.read()
        stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        if self.returncode is None:
            self.wait()


def popen(args, **kwargs) -> WarmProcess:
    """`subprocess.Popen([sys.executable, "-m", "h3_core", *args], ...)`, forked warm."""
    return WarmProcess(args, **kwargs)


def run(args, *, cwd=None, env=None, capture_output=False, text=False, timeout=None, check=False, stdout=None,
        stderr=None) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", "h3_core", *args], ...)`, forked warm."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = WarmProcess(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(sys.argv[1])
