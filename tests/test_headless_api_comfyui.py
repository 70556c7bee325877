"""README "Headless use: ComfyUI's API": its block runs as written against the suite's ComfyUI, and `comfy-run` says
the node and input when ComfyUI refuses the graph (tests/test_comfy_run.py: what it refuses before posting)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import av
import pytest
from support import warm_cli
from support.comfy_harness import comfy  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parents[1]
FIRST_LINE = "python -m h3_core comfy-run workflows/api/t2va.json"


def _readme_block() -> str:
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)
    found = [block for block in blocks if FIRST_LINE in block]
    assert len(found) == 1, "README's headless block (comfy-run) is missing or doubled"
    return found[0]


def _workdir(tmp_path: Path) -> Path:
    """A folder where the block's relative paths mean what they mean in a checkout (.venv, workflows/)."""
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    (tmp_path / "workflows").symlink_to(REPO / "workflows")
    return tmp_path


def _comfy_run(*args: str, cwd: Path, url: str) -> subprocess.CompletedProcess:
    return warm_cli.run(["comfy-run", *args, "--server", url], cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)},
                        capture_output=True, text=True, timeout=600)


def test_the_readme_block_runs_a_shipped_workflow_and_downloads_its_mp4(comfy, tmp_path):  # noqa: F811
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("the README block activates the checkout's .venv, which scripts/setup_env.sh makes")
    work = _workdir(tmp_path)
    run = subprocess.run(["bash", "-e", "-c", _readme_block()], cwd=work, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "COMFY_URL": comfy.url, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    saved = [Path(line) for line in run.stdout.splitlines() if line.endswith(".mp4")]
    assert len(saved) == 1 and saved[0].parts[:3] == ("output", "headless", "h3"), run.stdout
    # followed over the websocket: each node, the sampler's steps
    assert "queued prompt" in run.stdout and re.search(r"node 6 \(H3SplitSampler\): DiT forward (\d+)/\1", run.stdout)
    with av.open(str(work / saved[0])) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.codec_context.name == "h264" and audio.codec_context.name == "aac"
        assert audio.channels == 2
        assert sum(1 for _ in container.decode(video=0)) == 124  # t2va.json's length


def test_refusals_name_the_node_and_input_and_the_exit_code_says_why(comfy, tmp_path):  # noqa: F811
    # a graph ComfyUI refuses at queue time: exit 1, the node and its input named
    empty = _comfy_run("workflows/api/t2va.json", "--set", "5.prompt=", cwd=_workdir(tmp_path), url=comfy.url)
    assert empty.returncode == 1, empty.stdout + empty.stderr
    assert "node 5 (H3SplitTextEncode) input prompt:" in empty.stderr, empty.stderr
