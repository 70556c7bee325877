"""Media-decode sandbox processes and their RAM die with the server.

A real server (`python -m h3_core serve`) is caught with a decode in flight (a worker whose input carries the
`H3_SANDBOX_TEST_HANG` marker hangs until killed), then killed with SIGKILL or the documented two SIGTERMs. Unguarded,
the decoder processes ran on for 10-23 s and each kill left its scratch folder in /dev/shm for good; none of them
may be left 2 s later.
"""

from __future__ import annotations

import glob
import os
import secrets
import signal
import threading
import time

import numpy as np
import pytest
from support.encoder_process import ServerProcess, post_parts, server_env

from h3_core import media
from h3_core.media import sandbox as media_sandbox


def _children(pid: int) -> dict[int, str]:
    """Every live descendant of `pid`: pid -> its start time (so a reused pid is not mistaken for it)."""
    parents: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
        starts[int(entry)] = fields[19]
    found, todo = {}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def _alive(pid: int, start: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] != "Z"


def _scratch(pid: int) -> list[str]:
    root = media_sandbox._scratch_root() or "/tmp"
    return glob.glob(os.path.join(root, f"{media_sandbox.SCRATCH_PREFIX}{pid}-*"))


@pytest.mark.parametrize("how", ["SIGKILL", "two SIGTERMs"])
def test_no_decoder_or_scratch_outlives_a_killed_server(tiny_dir, how):
    marker = "h3-test-hang-" + secrets.token_hex(8)
    server = ServerProcess(tiny_dir, env=server_env(H3_SANDBOX_TEST_HANG=marker))
    try:
        server.wait_listening()
        pid = server.proc.pid
        image = media.encode_png_bytes(np.full((64, 96, 3), 120, np.uint8)) + marker.encode()
        body = {"protocol": 2, "prompt": "<Picture 1> waves.", "num_frames": 124, "ref_images": [{"part": "i"}]}
        threading.Thread(target=lambda: _safe(server.url, body, image), daemon=True).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the host, the call's waiter and its (hanging) worker
            children = _children(pid)
            if set(media_sandbox.PROCESS_NAMES) <= {_comm(child) for child in children} and _scratch(pid):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"no named decoder in flight: children {[_comm(c) for c in _children(pid)]}, "
                        f"scratch {_scratch(pid)}")
        if how == "SIGKILL":
            server.proc.kill()
        else:
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        killed = time.monotonic()
        time.sleep(2.0)
        left = [child for child, start in children.items() if _alive(child, start)]
        print(f"{how}: {len(children)} decoder processes, {len(left)} left and {len(_scratch(pid))} scratch "
              f"folders left {time.monotonic() - killed:.1f} s after the server died")
        assert not left, {child: _comm(child) for child in left}
        assert not _scratch(pid)
    finally:
        server.close()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def _safe(url, body, image):
    try:
        post_parts(url, body, [("i", "image/png", "i.png", image)], timeout=60)
    except OSError:
        pass


def test_stale_scratch_of_dead_processes_is_cleaned_and_live_ones_kept(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max: no such process
    mine = tmp_path / f"{media_sandbox.SCRATCH_PREFIX}{os.getpid()}-abc"
    stale = tmp_path / f"{media_sandbox.SCRATCH_PREFIX}{dead}-def"
    other = tmp_path / "h3-something-else"
    for folder in (mine, stale, other):
        folder.mkdir()
        (folder / "input").write_bytes(b"x" * 1000)
    assert media_sandbox.clean_stale_scratch(str(tmp_path)) == [str(stale)]
    assert mine.exists() and other.exists() and not stale.exists()
