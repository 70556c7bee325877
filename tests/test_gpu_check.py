"""bench/gpu_check.py --small: the GPU check's code path (materialised random weights, block streaming of the
DiT and the text encoder, the planner's predictions beside the measurements) on the tiny H3 on CPU."""

import json

from bench import gpu_check


def test_gpu_check_small_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--small", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    checks = {check["check"]: check for check in result["checks"]}
    assert set(checks) == {"text_encoder_streamed", "dit_streamed", "dit_resident"}
    for check in checks.values():
        assert check["seconds_per_forward"] > 0
        assert check["planned_peak_bytes"] > check["planned_activation_bytes"] > 0
        assert check["measured_peak_bytes"] is None  # no CUDA allocator to ask on CPU
    # streaming moves every weight once per forward; the resident run moves nothing
    assert checks["dit_streamed"]["bytes_moved_per_step"] >= checks["dit_streamed"]["weights_bytes"]
    assert checks["text_encoder_streamed"]["bytes_moved_per_step"] >= checks["text_encoder_streamed"]["weights_bytes"]
    assert checks["dit_resident"]["bytes_moved_per_step"] == 0
    assert checks["dit_streamed"]["tokens"] == 37 * 2 * 2 + 414 + 16
