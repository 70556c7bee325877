"""The H3 Sampler's `gpus` widget in a real ComfyUI (CPU, so the workers are gloo ranks on the CPU): gpus=2 gives the
latents of gpus=1 within 1e-6 relative, with the same progress and previews; an interrupt stops the workers and
leaves them warm; a worker killed mid-prompt fails that prompt with an error naming it, and the next prompt samples
on fresh workers. One server for the module; tests/support/comfy_latent_probe.py saves the latents."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.comfy_harness import comfy_available, start_comfy

HERE = Path(__file__).resolve().parent
TINY = "[embedded] tiny H3 (random weights, outputs are noise)"
PREVIEW_IMAGE = 1  # ComfyUI's binary websocket event type for a preview picture
WORKER_MODULE = b"h3_core.sequence_parallel_workers"
LONG = 40  # steps of a prompt that is interrupted or loses a worker after its first step: ends well before the last


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    ok, reason = comfy_available()
    if not ok:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    base = tmp_path_factory.mktemp("sp_comfy") / "base"
    (base / "custom_nodes").mkdir(parents=True)
    shutil.copyfile(HERE / "support" / "comfy_latent_probe.py", base / "custom_nodes" / "h3_latent_probe.py")
    env = {"H3_TINY_DIR": str(tiny_dir), "OMP_NUM_THREADS": "1", "H3_THREADS": "1"}  # two ranks on shared cores
    server = start_comfy(base, models_src=Path(tiny_dir) / "comfyui", env=env,
                         extra_args=("--preview-method", "auto"))
    server.add_model("minimax_h3", tiny_dir, "tiny")
    yield server
    workers = worker_pids(server).values()
    server.stop()  # SIGTERM: ComfyUI exits without closing the pool; its workers see the socket close and exit
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_running(pid) for pid in workers), "sequence-parallel workers outlived their ComfyUI"


def graph(seed: int, steps: int, gpus: tuple[int, ...]) -> dict:
    """One t2va prompt encoded once, sampled by one Sampler per entry of `gpus` (node 1<gpus>), each latent saved
    as output/seed<seed>_gpus<gpus>.safetensors (node 2<gpus>)."""
    nodes = {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": TINY}},
        "2": {"class_type": "H3SplitTextEncode", "inputs": {
            "text_encoder": ["1", 0], "prompt": "A red fox trots through fresh snow.", "width": 0, "height": 0,
            "length": 124, "task": "t2va"}},
        "3": {"class_type": "H3SplitDiTLoader", "inputs": {"dit": TINY, "partition": "fl2va (t2va, first/last frame)"}},
    }
    for n in gpus:
        nodes[f"1{n}"] = {"class_type": "H3SplitSampler", "inputs": {
            "dit": ["3", 0], "conditioning": ["2", 0], "seed": seed, "steps": steps, "video_shift": 12.0,
            "audio_shift": 3.0, "gpus": n}}
        nodes[f"2{n}"] = {"class_type": "H3ProbeSaveAVLatent",
                          "inputs": {"latent": [f"1{n}", 0], "name": f"seed{seed}_gpus{n}"}}
    return nodes


def worker_pids(server) -> dict[int, int]:
    """rank -> pid of the sequence-parallel workers started by this server (descendants of its process)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if WORKER_MODULE in argv and _descends(int(entry.name), server.proc.pid):
            found[int(argv[argv.index(b"--rank") + 1])] = int(entry.name)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def assert_same_latents(server, seed: int) -> None:
    one = load_file(str(server.output_dir / f"seed{seed}_gpus1.safetensors"))
    two = load_file(str(server.output_dir / f"seed{seed}_gpus2.safetensors"))
    for name in ("video", "audio"):
        assert two[name].shape == one[name].shape
        deviation = float((two[name].double() - one[name].double()).norm() / one[name].double().norm())
        assert deviation <= 1e-6, f"{name}: {deviation:.2e} relative"
    assert torch.isfinite(one["video"]).all() and one["video"].std() > 0.1  # a sampled latent, not zeros


def on_sampler_step(node: str, action):
    """An on_message callback calling `action()` once, at the Sampler's first finished step."""
    done = []

    def watch(message):
        data = message.get("data") or {}
        if message.get("type") == "progress" and data.get("node") == node and data.get("value", 0) >= 1 and not done:
            done.append(action())

    return watch


def test_gpus2_equals_gpus1_with_the_same_progress_and_previews(server):
    result = server.run_prompt(graph(seed=101, steps=4, gpus=(1, 2)), timeout=900)
    assert_same_latents(server, 101)
    progress = {node: [(m["value"], m["max"]) for m in result.of_type("progress") if m["node"] == node]
                for node in ("11", "12")}
    assert progress["12"] == progress["11"] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    previews = [frame for frame in result.binary if struct.unpack(">I", frame[:4])[0] == PREVIEW_IMAGE]
    assert len(previews) == 2 * 3  # one per step, from each Sampler
    assert sorted(worker_pids(server)) == [0, 1]  # warm after the prompt


def test_interrupt_stops_the_workers_and_leaves_them_warm(server):
    seen = {}

    def interrupt():
        seen.update(worker_pids(server))
        server.interrupt()

    result = server.run_prompt(graph(seed=102, steps=LONG, gpus=(2,)), timeout=900, check=False,
                               on_message=on_sampler_step("12", interrupt))
    assert result.status == "interrupted", result.error
    steps = [m["value"] for m in result.of_type("progress") if m["node"] == "12"]
    assert steps[-1] < LONG - 1, steps  # stopped inside the loop, not after it
    assert len(seen) == 2 and worker_pids(server) == seen  # the same processes: none hung, none restarted


def test_a_killed_worker_fails_the_prompt_by_name_and_the_next_prompt_works(server):
    killed = {}

    def kill():
        killed.update(worker_pids(server))
        os.kill(killed[1], signal.SIGKILL)

    result = server.run_prompt(graph(seed=103, steps=LONG, gpus=(2,)), timeout=900, check=False,
                               on_message=on_sampler_step("12", kill))
    assert result.status == "error" and result.error["node_type"] == "H3SplitSampler", result.error
    message = result.error["exception_message"]
    assert f"sequence-parallel worker rank 1 (pid {killed[1]}) was killed by SIGKILL" in message, message
    assert "the next run starts new ones" in message
    assert worker_pids(server) == {}  # the whole pool was stopped: no rank left waiting in a collective

    server.run_prompt(graph(seed=104, steps=4, gpus=(1, 2)), timeout=900)
    assert_same_latents(server, 104)
    fresh = worker_pids(server)
    assert sorted(fresh) == [0, 1] and not set(fresh.values()) & set(killed.values())


def test_gpus_the_dit_cannot_split_over_is_refused_by_name(server):
    result = server.run_prompt(graph(seed=105, steps=4, gpus=(4,)), timeout=900, check=False)
    assert result.status == "error" and result.error["node_type"] == "H3SplitSampler", result.error
    assert "2 attention heads do not divide into 4 ranks" in result.error["exception_message"]

