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
    assert off["passes"] == "computed 4 of 4 DiT block runs (0% skipped)"
    assert every2["passes"] == "computed 2 of 4 DiT block runs (50% skipped)"
    assert every2["wall_ratio"] > 0 and 0 < every2["video_ssim"] <= 1 and every2["video_psnr_db"] > 20


# --- --dynamic-vram: the streamed int8 DiT under core 0.33's model patcher with comfy-aimdo (issue 39.7) -------------


def test_dynamic_vram_refuses_clearly_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the mode runs instead of refusing")
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--dynamic-vram"])
    assert info.value.code == gpu_check.UNAVAILABLE_EXIT
    assert "--dynamic-vram needs CUDA" in capsys.readouterr().err


def test_dynamic_vram_small_reaches_core_033s_patcher_on_cpu(tiny_dir, tmp_path, capsys):
    """`--dynamic-vram --small`: in a child Python with core 0.33 and its pins first, the pack's bridge streams the
    quantised tiny twin under the class core's main.py installs with comfy-aimdo (ModelPatcherDynamic), which core
    reroutes to ModelPatcher for a CPU load device; load_models_gpu and the DiT forwards run under it. The CUDA run
    (aimdo on, VRAM peaks) is the same code with `python bench/gpu_check.py --dynamic-vram`."""
    from support.comfy_harness import CORE_033, unavailable

    ok, reason = CORE_033.available()
    if not ok:
        unavailable(reason)
    if not (tiny_dir / gpu_check.TINY_TWINS["transformer"]).is_file():
        pytest.skip("needs the tiny build's quantised twins")
    out = tmp_path / "dynamic.json"
    assert gpu_check.main(["--dynamic-vram", "--small", "--models", str(tiny_dir), "--dit-steps", "2",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert (result["core"], result["core_has_dynamic_patcher"], result["available"]) == ("0.33.0", True, True)
    assert result["aimdo"] and result["patcher_requested"] == "ModelPatcherDynamic"
    assert (result["patcher"], result["patcher_is_dynamic"], result["aimdo_enabled"]) == ("ModelPatcher", False, False)
    assert result["weights"] == "minimax_h3_tiny_fl2va_pruned_int8_convrot.safetensors"
    assert result["streamable_layers"] > 0 and result["loaded_size_bytes"] == result["model_size_bytes"] > 0
    assert len(result["steps_s"]) == 2 and result["output_finite"] and result["peak_device_used_bytes"] is None


def test_dynamic_vram_is_feature_detected_on_core_0375(tiny_dir, capsys):
    """ComfyUI 0.3.75 has neither ModelPatcherDynamic nor comfy-aimdo: the mode says so and exits 2."""
    from support.comfy_harness import COMFY_0375

    ok, reason = COMFY_0375.available()
    if not ok:
        pytest.skip(reason)
    code = gpu_check.main(["--dynamic-vram", "--small", "--models", str(tiny_dir), "--comfyui",
                           str(COMFY_0375.dir)])
    result = json.loads(capsys.readouterr().out)
    assert code == gpu_check.UNAVAILABLE_EXIT and result["available"] is False
    assert result["core"] == "0.3.75" and "no ModelPatcherDynamic" in result["reason"]
