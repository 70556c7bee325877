"""The H3 Sampler's `gpus` widget in a real ComfyUI (CPU, so the workers are gloo ranks on the CPU): gpus=2 gives the
latents of gpus=1 within 1e-6 relative, with the same progress and previews, and the workers' cold start and memory
as the node's progress text; an interrupt stops the workers and leaves them warm; a Sampler with gpus 1 and
ComfyUI's "Unload Models" commands (POST /free) stop them; a worker killed mid-prompt fails that prompt with an error
naming it, and the next prompt samples on fresh workers; ComfyUI's exit ends them without a traceback. One server for
the module; tests/support/comfy_latent_probe.py saves the latents."""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.comfy_harness import comfy_available, start_comfy
from support.sp_engine import WORKER_MODULE, cmdline, comm, parent_of

HERE = Path(__file__).resolve().parent
TINY = "[embedded] tiny H3 (random weights, outputs are noise)"
PREVIEW_IMAGE = 1  # ComfyUI's binary websocket event type for a preview picture
PROGRESS_TEXT = 3  # ... and for a node's progress-text line
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
    server = start_comfy(base, models_src=Path(tiny_dir) / "comfyui", env=env, extra_args=("--preview-method", "auto"))
    server.add_model("minimax_h3", tiny_dir, "tiny")
    yield server
    workers = worker_pids(server).values()  # the last tests leave warm workers: their exit is checked here
    logged = len(server.log_text())
    server.stop()  # SIGTERM: ComfyUI exits without closing the pool; its workers see the socket close and exit
    _wait_until(lambda: not any(_running(pid) for pid in workers), "sequence-parallel workers outlived their ComfyUI")
    after = server.log_text()[logged:]  # the workers' stderr is ComfyUI's log: quiet, as a pool ends
    assert "Traceback" not in after and "ConnectionResetError" not in after, after


def _wait_until(condition, message: str, timeout_s: float = 60.0) -> None:
    """Wait for something ComfyUI does after answering (its prompt worker applies /free when idle)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert condition(), message


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
    """rank -> pid of the sequence-parallel workers started by this server (descendants of its process): the one
    engine's ranks, each forked by the pool's launcher (`python -m h3_core.sequence_parallel_workers --ranks N`) and
    named h3-sp-rank<R>, with the launcher's command line (never exec'd: no interpreter of its own)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv, name = cmdline(pid), comm(pid)
            launcher = parent_of(pid)
        except (OSError, IndexError, ValueError):
            continue
        if WORKER_MODULE in argv and name.startswith("h3-sp-rank") and _descends(pid, server.proc.pid):
            try:
                forked_warm = comm(launcher) == "h3-sp-launcher" and cmdline(launcher) == argv
            except OSError:
                continue
            assert forked_warm, f"rank pid {pid} was not forked by its pool's launcher"
            found[int(name.removeprefix("h3-sp-rank"))] = pid
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


def progress_texts(result, node: str) -> list[str]:
    """The progress-text lines ComfyUI sent for `node` (binary frames: type, node id length, id, text)."""
    texts = []
    for frame in result.binary:
        if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != PROGRESS_TEXT:
            continue
        length = struct.unpack(">I", frame[4:8])[0]
        if frame[8:8 + length].decode() == node:
            texts.append(frame[8 + length:].decode())
    return texts


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
    # Two prompts (the encode is cached for the second): a gpus 1 Sampler stops the workers, so it runs first.
    results = {n: server.run_prompt(graph(seed=101, steps=4, gpus=(n,)), timeout=900) for n in (1, 2)}
    assert_same_latents(server, 101)
    progress = {n: [(m["value"], m["max"]) for m in results[n].of_type("progress") if m["node"] == f"1{n}"]
                for n in (1, 2)}
    assert progress[2] == progress[1] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    for n in (1, 2):
        previews = [frame for frame in results[n].binary if struct.unpack(">I", frame[:4])[0] == PREVIEW_IMAGE]
        assert len(previews) == 3  # one per step
    assert sorted(worker_pids(server)) == [0, 1]  # warm after the prompt

    # The cold start said what it did, in order, then the steps, then what the warm workers hold.
    texts = [re.sub(r" - \d+ s$", "", text) for text in progress_texts(results[2], "12")]  # the heartbeat's age
    said = list(dict.fromkeys(texts))
    start = ["starting 2 DiT workers: 0/2", "starting 2 DiT workers: 1/2", "starting 2 DiT workers: 2/2",
             "loading the DiT in 2 workers"]
    assert said[:4] == start, said
    assert said[4] == "DiT forward 0/3" and said[-2] == "DiT forward 3/3", said
    assert re.fullmatch(r"2 DiT workers warm: \d+\.\d GB", said[-1]), said


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


def test_a_gpus1_sampler_stops_the_workers(server):
    """Back to one process: the workers' DiT copies go (on a GPU box, whole GPUs of VRAM)."""
    running = worker_pids(server)
    assert sorted(running) == [0, 1]
    result = server.run_prompt(graph(seed=106, steps=3, gpus=(1,)), timeout=900)
    assert worker_pids(server) == {} and not any(_running(pid) for pid in running.values())
    assert not any("workers warm" in text for text in progress_texts(result, "11"))
    assert "stopping the sequence-parallel workers (2 DiT workers warm: " in server.log_text()


@pytest.mark.parametrize("free_memory", [False, True], ids=["unload_models", "unload_models_and_execution_cache"])
def test_unload_models_stops_the_workers(server, free_memory):
    """The menu's "Unload Models" (POST /free {"unload_models": true}) and "Unload Models and Execution Cache"
    (and "free_memory": true) stop the workers with ComfyUI's own models."""
    server.run_prompt(graph(seed=107 + free_memory, steps=3, gpus=(2,)), timeout=900)  # not cached: it runs
    running = worker_pids(server)
    assert sorted(running) == [0, 1]
    logged = len(server.log_text())
    clicks = click_unload_models(server, free_memory, lambda: not any(_running(pid) for pid in running.values()))
    assert worker_pids(server) == {}
    said = server.log_text()[logged:]
    assert said.count("stopping the sequence-parallel workers (2 DiT workers warm: ") == 1, (clicks, said)
    assert "): ComfyUI unloaded models" in said, said


def click_unload_models(server, free_memory: bool, done, every_s: float = 5.0, timeout_s: float = 60.0) -> int:
    """Post /free as the menu's Unload Models does until `done()` (returns the clicks). Clicked again every `every_s`:
    ComfyUI's prompt worker (0.3.75 and core 0.33 alike) can miss one /free. Its flag is set and the worker's
    condition notified, but when that lands while the worker collects garbage after a prompt, nobody waits on the
    condition, and the flag is read only at the worker's next wake: the next prompt, or up to 1000 s later. A user
    clicks seconds after a prompt and rarely hits it; a test clicking at once did, on a busy machine (CI, 3 of 4
    runs). A second click notifies again and the waiting flag is applied; the pack's hook runs once per unload."""
    deadline = time.monotonic() + timeout_s
    clicks = 0
    while not done() and time.monotonic() < deadline:
        server.free(unload_models=True, free_memory=free_memory)
        clicks += 1
        click_deadline = min(deadline, time.monotonic() + every_s)
        while not done() and time.monotonic() < click_deadline:
            time.sleep(0.2)
    assert done(), f"Unload Models left the workers running ({clicks} clicks in {timeout_s:.0f} s)"
    return clicks


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

    for n in (1, 2):  # gpus 1 first: it would stop the new workers
        server.run_prompt(graph(seed=104, steps=4, gpus=(n,)), timeout=900)
    assert_same_latents(server, 104)
    fresh = worker_pids(server)
    assert sorted(fresh) == [0, 1] and not set(fresh.values()) & set(killed.values())


def test_gpus_the_dit_cannot_split_over_is_refused_by_name(server):
    """Refused when queued (the heads are in the DiT's header), on the Sampler's `gpus`; the warm workers stay."""
    running = worker_pids(server)
    status, answer = server.post_prompt_expect_error(graph(seed=105, steps=4, gpus=(4,)))
    assert status == 400, answer
    [error] = answer["node_errors"]["14"]["errors"]
    assert error["extra_info"]["input_name"] == "gpus"
    assert "2 attention heads do not divide into 4 ranks" in error["details"], error
    assert worker_pids(server) == running
