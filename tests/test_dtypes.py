"""The one dtype rule (h3_core.dtypes) and loading without upcasts or copies."""

import os

import pytest
import torch

from h3_core import dtypes, weights
from h3_core.devices import DeviceError, Placement, parse_device


def test_rule_cpu_fp32_cuda_bf16_vaes_official():
    for component in ("transformer", "transformer_ref", "text_encoder", "vae", "audio_vae"):
        assert dtypes.compute_dtype(component, "cpu") == torch.float32
    assert dtypes.compute_dtype("transformer", "cuda") == torch.bfloat16
    assert dtypes.compute_dtype("text_encoder", torch.device("cuda", 1)) == torch.bfloat16
    assert dtypes.compute_dtype("vae", "cuda") == torch.float32  # encoder fp32; decode under fp16 autocast
    assert dtypes.compute_dtype("audio_vae", "cuda") == torch.float32


def test_override_and_refusals():
    assert dtypes.compute_dtype("transformer", "cpu", "bf16") == torch.bfloat16
    assert dtypes.compute_dtype("text_encoder", "cuda", "float32") == torch.float32
    assert dtypes.compute_dtype("transformer", "cuda", "auto") == torch.bfloat16
    assert dtypes.compute_dtype("dit", "cuda", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="float32 only"):
        dtypes.compute_dtype("audio_vae", "cuda", "bf16")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.compute_dtype("transformer", "cpu", "int4")
    with pytest.raises(ValueError, match="unknown H3 component"):
        dtypes.compute_dtype("unet", "cpu")
    # the autocast context is a no-op off CUDA (CPU runs stay bit-exact)
    with dtypes.vae_decode_autocast("cpu"):
        assert not torch.is_autocast_enabled()


def test_placement_flags():
    assert Placement().dtype_of("transformer") == torch.float32
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="cpu, cuda or cuda:N"):
        parse_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA"):
            parse_device("cuda:0")
    with pytest.raises(ValueError, match="offload must be"):
        Placement(offload="disk")


def _write_bf16_text_encoder(path):
    from support.weights_support import tiny_text_encoder

    model = tiny_text_encoder(seed=3).to(torch.bfloat16)
    weights.save_comfy_text_encoder(model, str(path))
    return model


# Loads a checkpoint three times (the first warms imports) and prints how much anonymous memory (a private copy of
# the weights would be anonymous) and file-backed memory (the safetensors mapping) a warm load added.
_RSS_PROBE = """
import json, sys, torch
from h3_core import weights
def rss():
    rows = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(rows[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}
growths = []
for path, component, dtype in zip(*[iter(sys.argv[1:])] * 3):
    weights.load(path, component, dtype=getattr(torch, dtype))
    tries = []
    for _ in range(2):  # a private copy shows every time; a one-off lazy init of the process shows once
        before = rss()
        model = weights.load(path, component, dtype=getattr(torch, dtype))
        with torch.no_grad():
            # read every weight's pages once, in place: a .float() here would itself add an anonymous copy
            # of the largest tensor, which glibc may keep, and that is not what this probe measures
            touched = sum(int(p.detach().reshape(-1).view(torch.uint8).max()) for p in model.parameters())
        after = rss()
        tries.append({key: after[key] - before[key] for key in after})
        del model
    growths.append({"RssAnon": min(t["RssAnon"] for t in tries), "RssFile": max(t["RssFile"] for t in tries)})
print(json.dumps(growths))
"""


def _load_growth(*triples):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    args = [str(item) for triple in triples for item in triple]
    done = subprocess.run([sys.executable, "-c", _RSS_PROBE, *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loads_keep_stored_bf16_and_map_files_instead_of_copying(tmp_path, tiny_dir):
    """A bf16 text encoder loaded in bf16 keeps bf16 parameters, and no load makes a private copy of
    the weights: the anonymous memory a load adds stays a small fraction of the file (the tiny fp32 text
    encoder is 47 MB), the file's pages are what the parameters are."""
    path = tmp_path / "te_bf16.safetensors"
    _write_bf16_text_encoder(path)
    model = weights.load_text_encoder(str(path), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32 = next((tiny_dir / "comfyui" / "text_encoders").glob("*_fp32.safetensors"))
    bf16_growth, fp32_growth = _load_growth((path, "text_encoder", "bfloat16"), (fp32, "text_encoder", "float32"))
    for file, growth in ((path, bf16_growth), (fp32, fp32_growth)):
        size = os.path.getsize(file)
        assert growth["RssAnon"] < 0.1 * size and growth["RssFile"] > 0.5 * size, (file.name, size, growth)
    # a CPU float32 run widens them (the only upcast the rule allows)
    wide = weights.load_text_encoder(str(path), dtype=torch.float32)
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
