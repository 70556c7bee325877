"""The encoder server as a process of its own (`python -m h3_core serve`, forked warm by support/warm_cli.py) on
loopback, for tests that kill, restart, limit or measure it.

`ServerProcess` starts one and reads its URL from its "listening on" line; `spawn_serve` + `wait_healthy` start one
on a given port for tests that only need it up (ComfyUI graphs); `server_env` is the environment they run in:
H3_THREADS at the servers' thread count, the pack importable, no token inherited from the caller.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from h3_core.remote import protocol
from h3_core.remote.client import packing
from h3_core.testing import SERVER_THREADS, wait_until

from . import warm_cli

REPO = Path(__file__).resolve().parents[2]


def server_env(**extra) -> dict[str, str]:
    """The caller's environment without its token, with H3_THREADS=SERVER_THREADS and the pack on PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != protocol.DEFAULT_TOKEN_ENV}
    env.update(H3_THREADS=str(SERVER_THREADS), PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
               **extra)
    return env


class ServerProcess:
    """`python -m h3_core serve --models DIR` as a real process; `wait_listening` reads its URL off stdout."""

    def __init__(self, tiny_dir, port=0, args=(), env=None, preexec_fn=None):
        self.log = tempfile.NamedTemporaryFile(prefix="h3-serve-", suffix=".log", delete=False)
        command = ["serve", "--models", str(tiny_dir), "--port", str(port), *args]
        if preexec_fn is None:  # forked warm (support/warm_cli.py): the same command without the imports
            self.proc = warm_cli.popen(command, cwd=REPO, env=env or server_env(), stdout=subprocess.PIPE,
                                       stderr=self.log)
        else:  # limits set in the child before exec: a real interpreter
            self.proc = subprocess.Popen([sys.executable, "-m", "h3_core", *command], cwd=REPO,
                                         env=env or server_env(), stdout=subprocess.PIPE, stderr=self.log,
                                         preexec_fn=preexec_fn)
        self.url = None

    def wait_listening(self, timeout=120.0) -> str:
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}: {self.stderr()[-2000:]}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if b"listening on " in line:
                    self.url = line.decode().strip().rsplit(" ", 1)[1]
                    return self.url
        raise AssertionError(f"server did not start within {timeout} s: {self.stderr()[-2000:]}")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.proc.stdout.close()
        self.log.close()
        os.unlink(self.log.name)


def post_parts(url: str, body: dict, parts: list, timeout: float = 120) -> tuple[int, dict]:
    """POST a request JSON and its media parts; (status, the JSON error or {} on 200)."""
    content_type, buffers = packing.encode_multipart(body, parts)
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", protocol.ENCODE_PATH, body=b"".join(buffers), headers={"Content-Type": content_type})
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    return reply.status, (json.loads(data) if reply.status != 200 else {})


def spawn_serve(models, port: int, log, env: dict | None = None) -> warm_cli.WarmProcess:
    """`serve --models DIR --port PORT` in its own session, output to `log` (an open file); forked warm."""
    return warm_cli.popen(["serve", "--models", str(models), "--port", str(port)], cwd=REPO, stdout=log,
                          stderr=subprocess.STDOUT, env=env, start_new_session=True)


def healthy(url: str) -> bool:
    """True when GET /v1/health answers at all (the server is listening)."""
    try:
        urllib.request.urlopen(f"{url}{protocol.HEALTH_PATH}", timeout=2).read()
        return True
    except OSError:
        return False


def wait_healthy(url: str, proc: "subprocess.Popen | warm_cli.WarmProcess", timeout: float = 300.0) -> None:
    """Wait until `url` answers /v1/health; fail at once if `proc` dies. Real time: a model load takes seconds
    idle, minutes at load average 8 on 2 cores."""
    def up() -> bool:
        assert proc.poll() is None, f"encoder server died with {proc.returncode}"
        return healthy(url)

    assert wait_until(up, timeout=timeout, step=0.5), f"encoder server did not answer /v1/health within {timeout} s"
