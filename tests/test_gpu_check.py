"""bench/gpu_check.py --small: the GPU check's code path (the quantised twins loaded by the package's loaders
and filled with random values, block streaming of the DiT and the text encoder, the planner's predictions beside
the measurements) on the tiny H3 on CPU, so the script cannot rot."""

import json

import pytest

from bench import gpu_check


def test_gpu_check_small_runs_on_cpu(tiny_dir, tmp_path, capsys):
    twins = all((tiny_dir / path).is_file() for path in gpu_check.TINY_TWINS.values())
    out = tmp_path / "gpu_check.json"
    weights = ["--models", str(tiny_dir)] if twins else ["--weights", "bf16"]
    assert gpu_check.main(["--small", *weights, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    if twins:
        assert result["weights"] == {"transformer": "minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors",
                                     "text_encoder": "qwen3vl_minimax_h3_tiny_int8_convrot.safetensors"}
    checks = {check["check"]: check for check in result["checks"]}
    assert set(checks) == {"text_encoder_streamed", "dit_streamed", "dit_resident"}
    for check in checks.values():
        assert check["seconds_per_forward"] > 0
        assert check["planned_peak_bytes"] > check["planned_activation_bytes"] > 0
        assert check["measured_peak_bytes"] is None  # no CUDA allocator to ask on CPU
        # the planner, from the header alone, predicts the bytes the loaders build (computed buffers aside)
        assert check["weights_bytes"] == pytest.approx(check["loaded_bytes"], rel=1e-3)
    # streaming moves every weight once per forward; the resident run moves nothing
    assert checks["dit_streamed"]["bytes_moved_per_step"] == checks["dit_streamed"]["loaded_bytes"]
    assert checks["text_encoder_streamed"]["bytes_moved_per_step"] == checks["text_encoder_streamed"]["loaded_bytes"]
    assert checks["dit_resident"]["bytes_moved_per_step"] == 0
    assert checks["dit_streamed"]["tokens"] == 37 * 2 * 2 + 414 + 16


def test_release_files_are_sparse_and_planned_from_their_headers(tmp_path):
    """The full-size check's input: a sparse release-size file (no disk use) whose header plans as published."""
    import os

    from support.weights_support import sparse_files_supported

    from h3_core.planning import planner

    if not sparse_files_supported(tmp_path):
        pytest.skip("this filesystem stores holes: a 21 GB release-size fixture would use the disk")
    path = gpu_check.release_path("transformer", str(tmp_path), None)
    size = os.path.getsize(path)
    assert size == pytest.approx(20_970_379_616, rel=0.001)
    assert os.stat(path).st_blocks * 512 < 1 << 20
    plan = planner.plan_file(path, width=1344, height=768, frames=124)
    assert plan.blocks == 50 and plan.streamed_peak < 10e9 < plan.resident_peak


def test_gpu_check_sp_scaling_runs_on_cpu(tiny_dir, tmp_path, monkeypatch, capsys):
    """`--sp 1,2 --small`: the scaling check's code path (one process per rank, the DiT sequence-parallel, rank 0's
    record) on two gloo ranks; per rank the planned activations halve and the weights stay."""
    if not (tiny_dir / gpu_check.TINY_TWINS["transformer"]).is_file():
        pytest.skip("needs the tiny build's quantised twins")
    monkeypatch.setenv("H3_THREADS", "1")  # each rank one thread: two ranks on the shared cores
    out = tmp_path / "sp.json"
    assert gpu_check.main(["--small", "--models", str(tiny_dir), "--sp", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    capsys.readouterr()
    one, two = result["checks"]
    assert (one["check"], one["ranks"], two["check"], two["ranks"]) == ("dit_sp1", 1, "dit_sp2", 2)
    assert one["speedup"] == 1.0 and two["speedup"] > 0 and two["seconds_per_forward"] > 0
    assert two["weights_bytes"] == one["weights_bytes"]
    assert two["planned_activation_bytes"] == -(-one["planned_activation_bytes"] // 2)


def test_gpu_check_cache_small_runs_on_cpu_and_says_tiny(tiny_dir, tmp_path, capsys):
    """`--cache`: the step-cache presets against the lossless run (bench/step_cache.py), here on the tiny H3 on CPU;
    the result says the folder only held the tiny model."""
    out = tmp_path / "cache.json"
    assert gpu_check.main(["--cache", "--small", "--models", str(tiny_dir), "--steps", "3", "--presets", "every:2",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["tiny_model"] is True and result["note"].startswith("only the tiny H3 (2 blocks")
    assert result["job"] == {"width": 64, "height": 64, "frames": 124} and result["device"] == "cpu"
    off, every2 = result["presets"]["off"], result["presets"]["every:2"]
    assert off["passes"] == "4/4 block passes computed" and every2["passes"] == "2/4 block passes computed"
    assert every2["wall_ratio"] > 0 and 0 < every2["video_ssim"] <= 1 and every2["video_psnr_db"] > 20
