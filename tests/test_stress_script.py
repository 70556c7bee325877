"""scripts/stress_tests.sh: the opt-in stress run (timing-sensitive tests beside CPU hogs), run as README.md shows it.

The full run (3 runs of the timing-sensitive subset) takes many minutes and is not part of the suite; here the
README's quick form runs one fast file once, and a failing run shows that failures are counted and reported. Both
check that the hogs the script started are gone when it ends.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _run(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(shlex.split(command), cwd=REPO, capture_output=True, text=True, timeout=600)


def _hogs(output: str) -> list[int]:
    match = re.search(r"pids: ([0-9 ]+)\)", output)
    assert match, output
    return [int(pid) for pid in match.group(1).split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_readme_command_runs_the_tests_beside_the_hogs_and_stops_them():
    commands = re.findall(r"`(bash scripts/stress_tests\.sh[^`]*)`", README)
    assert commands, "README.md shows no scripts/stress_tests.sh command"
    for command in commands:
        done = _run(command)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        hogs = _hogs(done.stdout)
        assert len(hogs) >= 1 and not any(_alive(pid) for pid in hogs), done.stdout
        assert re.search(r"stress run 1/1: passed in [0-9.]+ s \(load average ", done.stdout), done.stdout
        assert "stress: 1/1 run(s) passed" in done.stdout


def test_failing_runs_are_reported_and_the_hogs_still_stopped():
    done = _run("bash scripts/stress_tests.sh --runs 1 --hogs 1 tests/test_no_such_module.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "stress run 1/1: FAILED (pytest exit" in done.stdout and "stress: 0/1 run(s) passed" in done.stdout
    assert not any(_alive(pid) for pid in _hogs(done.stdout))
    refused = _run("bash scripts/stress_tests.sh --runs 0")
    assert refused.returncode == 2 and "--runs must be a positive integer" in refused.stderr
