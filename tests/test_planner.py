"""The header-only memory planner: parameter bytes, activation arithmetic, verdicts, the plan command."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from h3_core import cli
from h3_core.planning import planner
from h3_core.planning import report as plan_report
from h3_core.planning import tables as plan_tables

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


def test_sequence_parallel_plan_is_per_gpu():
    """--sp N: weights replicated on every GPU, activations split N ways; the smallest N that fits resident."""
    plan = planner.plan_component("transformer", plan_tables.dit_table("pruned_bf16"), name="minimax_h3_fl2va_pruned",
                                  width=1344, height=768, frames=345)
    assert plan.heads == 56 and plan.ranks == 1
    two = plan.per_rank(2)
    assert two.device_bytes == plan.device_bytes and two.largest_block == plan.largest_block
    assert two.activation == -(-plan.activation // 2)
    assert plan.resident_peak - two.resident_peak == plan.activation - two.activation
    assert two.per_rank(1).activation == plan.activation  # back to one GPU
    assert plan.per_rank(7).activation < plan.per_rank(4).activation < two.activation
    with pytest.raises(ValueError, match="only the DiT"):
        planner.plan_component("vae", plan_tables.vae_table("vae"), width=64, height=64, frames=124).per_rank(2)

    # 48 GB GPUs at 345 frames: 40.3 GB of weights + 11.2 GB of activations stream on one GPU, fit resident on two
    one_gpu, two_gpus = (plan_report.verdicts([plan], vram=int(48 * GB), ram=None, ranks=n)[0] for n in (1, 2))
    assert one_gpu.offload == "block" and two_gpus.offload == "none"
    assert two_gpus.peak == two.resident_peak and two_gpus.ranks == 2
    assert one_gpu.resident_from == two_gpus.resident_from == 2
    # the weights alone exceed a 40 GB GPU: splitting activations never makes them resident
    assert plan_report.verdicts([plan], vram=int(40 * GB), ram=None)[0].resident_from is None
    with pytest.raises(ValueError, match="56 attention heads do not divide into 3"):
        plan_report.verdicts([plan], vram=int(48 * GB), ram=None, ranks=3)


def test_offload_auto_counts_one_rank_of_the_sequence():
    """`--offload auto` on a sequence-parallel rank decides from that rank's share of the activations."""
    from h3_core import offload
    from h3_core.configs import get as model_config

    class Dit(torch.nn.Module):
        config = model_config("transformer", tiny=False)

    job = {"width": 1344, "height": 768, "frames": 345}
    full = offload.activation_estimate("transformer", Dit(), torch.bfloat16, **job)
    half = offload.activation_estimate("transformer", Dit(), torch.bfloat16, ranks=2, **job)
    assert full == planner.activation_bytes(**job) and half == -(-full // 2)
    weights = int(40.3 * GB)
    free = int(48 * GB)
    assert offload.choose(weights, full, "cuda", free_bytes=free) == "block"
    assert offload.choose(weights, half, "cuda", free_bytes=free) == "none"
    with pytest.raises(ValueError, match="only the DiT"):
        offload.activation_estimate("text_encoder", Dit(), torch.bfloat16, ranks=2, **job)


def test_plan_command_with_sp(tiny_dir, capsys):
    base = ["plan", "--models", str(tiny_dir), "--layout", "comfyui", "--vram", "24", "--width", "64", "--height",
            "64"]
    assert cli.main([*base, "--sp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    dits = [v for v in report["verdicts"] if v["role"].startswith("diffusion")]
    assert dits and all(v["ranks"] == 2 and v["resident_from_ranks"] == 1 for v in dits)
    assert cli.main([*base, "--sp", "2"]) == 0
    out = capsys.readouterr().out
    assert "per GPU of 2" in out and "resident from --sp 1" in out
    assert cli.main([*base, "--sp", "4"]) == 1  # the tiny DiT has 2 heads
    assert "2 attention heads do not divide into 4" in capsys.readouterr().err


def test_lengths_beyond_the_trained_range_are_planned_for_the_machine():
    """The lengths ComfyUI core allows (up to 3592 frames) are planned like any job: the memory grows with the
    length (the DiT's tokens, the decoded video), and the verdict says whether this machine runs it; the report
    warns outside the trained 124-345 frames (tests/test_lengths.py runs `plan` on the tiny files)."""
    job = {"width": 1344, "height": 768}
    tokens = [planner.dit_tokens(frames=f, **job) for f in (5, 124, 481, 3592)]
    assert tokens == sorted(tokens) and len(set(tokens)) == 4
    acts = [planner.activation_bytes(frames=f, **job) for f in (124, 481)]
    assert acts[1] > 3 * acts[0]
    table = plan_tables.dit_table("pruned_int8_convrot")
    short, long = (planner.plan_component("transformer", table, width=1344, height=768, frames=f) for f in (481, 3592))
    assert plan_report.verdicts([short], vram=int(80 * GB), ram=int(128 * GB))[0].offload is not None
    assert long.activation > 40e9  # ~150 s at 1344x768: more than a 24 GB GPU holds, whatever streams
    assert plan_report.verdicts([long], vram=int(24 * GB), ram=int(64 * GB))[0].offload is None
