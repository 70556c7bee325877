"""The suite's fork server (tests/support/warm_cli.py) runs `python -m h3_core` as a fresh interpreter would: the same
output and exit status, the caller's cwd, environment, session and stdio, signals reported as subprocess does.

A test of the test tooling: every CLI test and encoder server of the suite goes through it, so what it changes about a
command would change what those tests prove.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from support import warm_cli

REPO = Path(__file__).resolve().parents[1]


def _cold(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3_core", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_output_and_exit_status_equal_a_fresh_interpreters():
    for args in (["--help"], ["encode", "--prompt", "A fox."]):  # 0 with the usage; 2 with argparse's complaint
        cold = _cold(args)
        warm = warm_cli.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr), args
    assert cold.returncode == 2 and "--out" in cold.stderr


def test_cwd_environment_session_stdio_and_signals_are_the_callers(tiny_dir):
    # The token only this call's environment holds: the server reads it at start and says it runs with one.
    env = {**os.environ, "H3_WARM_CLI_TOKEN": "w" * 32, "PYTHONUNBUFFERED": "1"}
    # --models relative to the cwd given: only found if the child runs there.
    proc = warm_cli.popen(["serve", "--models", Path(tiny_dir).name, "--port", "0", "--token-env", "H3_WARM_CLI_TOKEN"],
                          cwd=Path(tiny_dir).parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        lines = [b""]
        while b"listening on" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1], f"serve ended with {proc.wait(60)} before listening: {b''.join(lines)[-2000:]}"
        assert any(b"auth: bearer token;" in line for line in lines), b"".join(lines)[-2000:]
        assert Path(f"/proc/{proc.pid}/cwd").resolve() == Path(tiny_dir).parent.resolve()
        assert os.getsid(proc.pid) == proc.pid and proc.poll() is None
    finally:
        proc.kill()
    assert proc.wait(60) == -signal.SIGKILL  # as subprocess reports a signal
    proc.stdout.close()
