"""The header-only memory planner: parameter bytes, activation arithmetic, verdicts, the plan command."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from h3_core import cli, plan_report, plan_tables, planner

GB = 1e9


def _tiny_files(tiny_dir: Path):
    return sorted((tiny_dir / "comfyui").rglob("*.safetensors"))


def test_parameter_bytes_equal_the_sum_of_tensor_bytes(tiny_dir):
    files = _tiny_files(tiny_dir)
    assert len(files) >= 5  # the fp32 single files (+ precision and quantised twins)
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            total = sum(handle.get_tensor(k).numel() * handle.get_tensor(k).element_size() for k in handle.keys())
        assert planner.parameter_bytes(path) == total, path.name
    # a sharded diffusers folder: all shards together
    folder = tiny_dir / "diffusers" / "text_encoder"
    expected = sum(planner.parameter_bytes(p) for p in folder.glob("*.safetensors"))
    assert planner.parameter_bytes(folder) == expected


def _published():
    from h3_core.weights.release_headers import PUBLISHED

    return PUBLISHED


@pytest.mark.parametrize("name", sorted(_published()))
def test_release_tables_match_published_sizes(name):
    """Planned from the synthetic release headers: the published byte counts within 1 % (the w6a8 DiT, whose
    real header nobody has read yet, within 1.5 % of its listed, rounded 15.98 GB)."""
    published = _published()[name]
    planned = planner.parameter_bytes(plan_tables.published_table(name))
    assert planned == pytest.approx(published.bytes, rel=0.01 if "w6a8" not in name else 0.015)


def test_activation_arithmetic_matches_the_note():
    # S = 37 latent frames x 24 x 42 patches + 414 audio + 512 text = 38,222 tokens
    assert planner.dit_tokens(width=1344, height=768, frames=124) == 37 * 24 * 42 + 414 + 512
    short = planner.activation_bytes(width=1344, height=768, frames=124)
    assert short == pytest.approx(4.1e9, rel=0.10)
    long = planner.activation_bytes(width=1344, height=768, frames=345)
    assert long == pytest.approx(11.2e9, rel=0.10)
    assert planner.activation_bytes(width=1344, height=768, frames=124, dtype=torch.float32) == 2 * short
    assert 0 < planner.activation_bytes(width=0, height=0, frames=124, component="text_encoder") < 1e9
    with pytest.raises(ValueError, match="unknown component"):
        planner.activation_bytes(width=64, height=64, frames=124, component="unet")


def test_streamed_peak_is_blocks_not_the_file():
    plan = planner.plan_component("transformer", plan_tables.dit_table("pruned_int8_convrot"),
                                  width=1344, height=768, frames=124)
    assert plan.blocks == 50
    assert plan.largest_block == pytest.approx(0.385e9, rel=0.05)  # 385 M int8 weights per block
    assert plan.resident_peak == pytest.approx(26e9, rel=0.05)  # note: ~26 GB resident at S ~ 38k
    assert plan.streamed_peak < 10e9
    verdicts = plan_report.verdicts([plan], vram=int(24 * GB), ram=int(64 * GB))
    assert verdicts[0].offload == "block"


def test_a_refused_job_says_what_would_fit():
    plan = planner.plan_component("transformer", plan_tables.dit_table("bf16"), name="minimax_h3_fl2va_bf16",
                                  width=1344, height=768, frames=124)
    verdict = plan_report.verdicts([plan], vram=int(24 * GB), ram=int(32 * GB))[0]
    assert verdict.offload is None
    assert "pruned" in verdict.advice and "--offload block" in verdict.advice


def test_plan_command_on_the_tiny_files(tiny_dir, capsys):
    code = cli.main(["plan", "--models", str(tiny_dir), "--layout", "comfyui", "--vram", "24",
                     "--width", "64", "--height", "64", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    components = {item["component"] for item in report["components"]}
    assert {"transformer", "text_encoder", "vae", "audio_vae"} <= components
    assert all(v["verdict"] == "fits resident" for v in report["verdicts"])
    code = cli.main(["plan", str(_tiny_files(tiny_dir)[0]), "--vram", "0.5"])
    assert code == 3  # does not fit: exit code says so
    assert "does not fit" in capsys.readouterr().out
