"""Low VRAM inside a real ComfyUI (core 0.33, CPU, loopback): the H3 DiT and text encoder stream their layers under
ComfyUI's own partial loading and give the fully loaded run's results bit for bit.

On CPU, ComfyUI always loads a model whole; tests/support/comfy_lowvram_probe.py (a test-only extension in this server's
custom_nodes/) hands `LoadedModel.model_load` the budget a GPU short of VRAM would get, so ComfyUI's ModelPatcher
runs its partial load (`load(lowvram_model_memory=...)`) and marks the layers that do not fit `comfy_cast_weights`;
the probe records what stays resident, what is fetched through `comfy.ops.cast_bias_weight` during each forward,
and the memory each node asks `load_models_gpu` for. On a GPU the same code moves the streamed weights from the
offload device per call (waits for a GPU: bench/gpu_check.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.comfy_harness import comfy_available, start_comfy
from support.lora_support import comfy_lora as _comfy_lora

from h3_core import configs
from h3_core.planning import planner

HERE = Path(__file__).resolve().parent
TINY = "[embedded] tiny H3 (random weights, outputs are noise)"
DIT, TE = "MiniMaxH3Transformer3DModel", "Qwen3VLForConditionalGeneration"
BF16_TE = "qwen3vl_minimax_h3_tiny_bf16.safetensors"
INT8_TE = "qwen3vl_minimax_h3_tiny_int8_convrot.safetensors"
NVFP4_TE = "qwen3vl_minimax_h3_tiny_nvfp4_awq.safetensors"
INT8_DIT = "minimax_h3_tiny_fl2va_int8_convrot.safetensors"
PROMPT = "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps."
CANVAS, FRAMES = (128, 64), 124  # the tiny H3's own t2va canvas (given: single files do not say they are tiny)
# ComfyUI's minimum_inference_memory() (0.3.75, 0.33) on Linux without --reserve-vram: 0.8 GiB + 400 MiB reserve
COMFY_INFERENCE_MINIMUM = 0.8 * 1024**3 + 400 * 1024**2


@pytest.fixture(scope="module")
def lowvram(tiny_dir, tmp_path_factory):
    ok, reason = comfy_available()
    if not ok:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("lowvram")
    base = tmp / "base"
    (base / "custom_nodes").mkdir(parents=True)
    shutil.copyfile(HERE / "support" / "comfy_lowvram_probe.py", base / "custom_nodes" / "h3_lowvram_probe.py")
    budgets = tmp / "budgets.json"
    budgets.write_text("{}")
    env = {
        "H3_TINY_DIR": str(tiny_dir),
        "H3_PROBE_BUDGETS": str(budgets),
        **{k: os.environ.get(k, "2") for k in ("OMP_NUM_THREADS", "H3_THREADS")},
    }
    server = start_comfy(base, models_src=_models_with_twins(Path(tiny_dir), tmp), env=env)
    server.add_model("minimax_h3", tiny_dir, "tiny")
    yield server, budgets
    server.stop()


def _models_with_twins(tiny_dir: Path, tmp: Path) -> Path:
    """The tiny H3's ComfyUI models with the twins of the published precisions (bf16, int8_convrot, nvfp4_awq):
    a fresh tiny build has them; an older prebuilt one ($H3_TINY_DIR) gets them written into a copy."""
    models = tiny_dir / "comfyui"
    if all((models / "text_encoders" / name).is_file() for name in (BF16_TE, INT8_TE, NVFP4_TE)):
        return models
    from h3_core.tiny import twins as tiny_twins

    copy = tmp / "comfyui"
    shutil.copytree(models, copy)
    tiny_twins.write_twins(copy)
    return copy


def graph(te: str = TINY, te_dtype: str = "default", dit: str = TINY, steps: int = 3, lora: str = "none") -> dict:
    return {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": te, "weight_dtype": te_dtype}},
        "2": {"class_type": "H3ProbeArmTextEncoder", "inputs": {"text_encoder": ["1", 0]}},
        "3": {"class_type": "H3SplitTextEncode", "inputs": {"text_encoder": ["2", 0], "prompt": PROMPT, "task": "t2va",
                                                           "width": CANVAS[0], "height": CANVAS[1], "length": FRAMES}},
        "4": {"class_type": "H3ProbeReportConditioning", "inputs": {"conditioning": ["3", 0]}},
        "5": {"class_type": "H3SplitDiTLoader", "inputs": {"dit": dit, "partition": "fl2va (t2va, first/last frame)",
                                                          "weight_dtype": "default"}},
        "6": {"class_type": "H3ProbeArmDiT", "inputs": {"dit": ["5", 0]}},
        "7": {"class_type": "H3SplitSampler", "inputs": {"dit": ["6", 0], "conditioning": ["3", 0], "seed": 0,
                                                        "steps": steps, "video_shift": 12.0, "audio_shift": 3.0,
                                                        "lora": lora, "lora_strength": 1.0}},
        "8": {"class_type": "H3ProbeReportLatent", "inputs": {"latent": ["7", 0]}},
    }


def run(server, budgets: Path, budget: dict, g: dict | None = None, only_text: bool = False):
    budgets.write_text(json.dumps(budget))
    g = dict(g or graph())
    if only_text:
        g = {k: v for k, v in g.items() if k in ("1", "2", "3", "4")}
    result = server.run_prompt(g, timeout=300)
    reports = {key: json.loads(result.outputs[key]["h3_probe"][0]) for key in ("4", "8") if key in result.outputs}
    return result, reports


def forward_stats(report: dict) -> list[dict]:
    assert report["forwards"], "the armed model never ran"
    return report["forwards"]


def module_bytes(report: dict) -> int:
    return report["forwards"][0]["at_start"]["bytes"]


@pytest.fixture(scope="module")
def full_run(lowvram):
    """The fully loaded run every streamed run is compared with (the server's first prompt: loaders run in it)."""
    server, budgets = lowvram
    return run(server, budgets, {})


def test_full_load_streams_nothing_and_asks_for_the_jobs_activations(full_run):
    result, reports = full_run
    cond, latent = reports["4"], reports["8"]
    for report in (cond, latent):
        for forward in forward_stats(report):
            assert forward["at_start"]["resident_fraction"] == 1.0 and forward["cast_layers"] == 0
            # Every parameter-holding layer speaks the protocol (none the patcher could strand on the offload device).
            assert forward["at_start"]["layers"] == forward["at_start"]["all_layers"]
    assert len(forward_stats(latent)) == 2  # steps - 1 DiT forwards
    # The Sampler's request: the planner's activations for this canvas, frames and prompt, +20 %, + ComfyUI's minimum.
    tokens = cond["shape"][1]
    activations = planner.activation_bytes(
        width=CANVAS[0], height=CANVAS[1], frames=FRAMES, text_tokens=tokens, dtype=torch.float32,
        component="transformer", config=configs.get("transformer", tiny=True),
    )
    requests = {entry["models"][0]: entry["memory_required"] for entry in latent["loads"] if len(entry["models"]) == 1}
    assert requests[DIT] == int(activations * 1.2) + int(COMFY_INFERENCE_MINIMUM)
    text = planner.activation_bytes(
        width=CANVAS[0], height=CANVAS[1], frames=FRAMES, text_tokens=tokens, dtype=torch.float32,
        component="text_encoder", config=configs.get("text_encoder", tiny=True),
    )
    assert requests[TE] >= int(text * 1.2) + int(COMFY_INFERENCE_MINIMUM)  # the token count is estimated from above
    # Reading the weights drives each loader node's own progress bar up to the file's bytes.
    for loader in ("1", "5"):
        bars = [m for m in result.of_type("progress") if m.get("node") == loader]
        assert bars and bars[-1]["value"] == bars[-1]["max"] > 100_000, (loader, bars[-1:])


@pytest.mark.parametrize("fraction", [0.6, 0.0], ids=["partial", "novram"])
def test_forced_low_vram_streams_and_gives_the_same_bits(lowvram, full_run, fraction):
    server, budgets = lowvram
    full = full_run[1]
    sizes = {DIT: module_bytes(full["8"]), TE: module_bytes(full["4"])}
    _, low = run(server, budgets, {name: int(size * fraction) for name, size in sizes.items()})
    check_streamed(full, low, fraction)
    print({key: forward_stats(low[key])[0]["at_start"] for key in ("4", "8")})


def check_streamed(full: dict, low: dict, fraction: float) -> None:
    """`low` gave `full`'s bits while ComfyUI kept only part (fraction 0: none) of each model's layers resident."""
    for key in low:
        assert low[key]["digest"] == full[key]["digest"], f"streamed run differs ({key})"
        for forward in forward_stats(low[key]):
            start = forward["at_start"]
            assert start["layers"] == start["all_layers"]
            assert 0 < start["layers_streamed"] and start["streamed_bytes"] > 0
            # The layers ComfyUI left on the offload device were fetched per call, and only those (a t2va prompt
            # leaves the text encoder's vision tower unused: its streamed layers are never fetched).
            assert 0 < forward["cast_layers"] <= start["layers_streamed"]
            assert 0 < forward["cast_bytes"] <= start["streamed_bytes"]
            if key == "8":
                assert (forward["cast_layers"], forward["cast_bytes"]) == (start["layers_streamed"],
                                                                         start["streamed_bytes"])
            if fraction == 0.0:
                assert start["resident_fraction"] == 0.0 and start["layers_streamed"] == start["layers"]
            else:
                assert 0.0 < start["resident_fraction"] < 1.0, start


def test_bf16_text_encoder_keeps_bf16_and_streams_bitwise(lowvram):
    server, budgets = lowvram
    _, full = run(server, budgets, {}, graph(te=BF16_TE, te_dtype="bf16"), only_text=True)
    forward = forward_stats(full["4"])[0]
    assert forward["param_dtypes"] == ["torch.bfloat16"] and full["4"]["dtype"] == "torch.bfloat16"
    _, low = run(server, budgets, {TE: 0}, graph(te=BF16_TE, te_dtype="bf16"), only_text=True)
    check_streamed(full, low, 0.0)
    # "default" on CPU is the float32 rule: the bf16 file is widened.
    _, widened = run(server, budgets, {}, graph(te=BF16_TE, te_dtype="default"), only_text=True)
    assert forward_stats(widened["4"])[0]["param_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("te", [INT8_TE, NVFP4_TE], ids=["int8_convrot", "nvfp4_awq"])
def test_quantised_layers_stream_at_their_stored_size(lowvram, te):
    """QuantLinear (and the nvfp4 file's int8 token table) speak the protocol too: a novram run fetches the quantised
    storage per call and dequantises it there, bit for bit the resident run."""
    server, budgets = lowvram
    text_only = te == NVFP4_TE  # one quantised DiT is enough; the nvfp4 file differs in its text encoder
    g = graph(te=te, dit=INT8_DIT)
    _, full = run(server, budgets, {}, g, only_text=text_only)
    _, low = run(server, budgets, {TE: 0, DIT: 0}, g, only_text=text_only)
    check_streamed(full, low, 0.0)
    for report in low.values():
        dtypes = forward_stats(report)[0]["param_dtypes"]
        assert {"torch.int8", "torch.uint8"} & set(dtypes), dtypes  # stored quantised, streamed as stored


def test_lora_hooks_run_on_streamed_layers(lowvram, full_run, tmp_path):
    """The Sampler's LoRA (forward hooks beside each targeted Linear) composes with streaming: same bits."""
    server, budgets = lowvram
    transformer = SimpleNamespace(config=SimpleNamespace(**configs.get("transformer", tiny=True)))
    _comfy_lora(tmp_path / "lora.safetensors", transformer)
    server.add_model("loras", tmp_path / "lora.safetensors", "h3_lowvram_test_lora.safetensors")
    g = graph(lora="h3_lowvram_test_lora.safetensors")
    _, full = run(server, budgets, {}, g)
    _, low = run(server, budgets, {DIT: 0}, g)
    assert full["8"]["digest"] != full_run[1]["8"]["digest"]  # the LoRA took part
    check_streamed({"8": full["8"]}, {"8": low["8"]}, 0.0)
