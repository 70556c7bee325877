"""Peak memory of loading a GGUF DiT: tensors mapped from the file (what `gguf_file.read_tensor` does) vs copied into
private buffers (what it did before, a plain read into a buffer of its own per tensor).

    python -m bench.gguf_load [--gb 1.3] [--dtype bf16] [--keep DIR] [--tiny FILE]

Writes a synthetic Q8_0 DiT GGUF of about `--gb` GB into a temporary folder with the `gguf` package's writer
(ComfyUI-GGUF's layout: the block and AdaLN linears Q8_0, every other tensor F32; valid random blocks, finite scales;
the release's head width and text width, fewer and narrower blocks so the file is the size asked for), then loads it
with `weights.load` in a fresh process per arm, mapped and copied, and prints one JSON object per arm:

- `peak_rss_mb`: VmHWM minus the RSS after the imports (what `ru_maxrss` and most monitors report);
- `peak_anon_mb`: the highest RssAnon seen (sampled every 10 ms) minus the same baseline: memory only the process
  holds, which the kernel can only swap, never drop;
- `file_mb` / `anon_mb` after the load, over the same baseline: RssFile (clean pages of mapped files, the weight
  file's among them: shared with the page cache, dropped under pressure and read again on demand) and RssAnon.

Loading tests every block scale for NaN and infinity, so every byte of the file is read once either way: copied, into
anonymous buffers the model then keeps; mapped, through a bounded read buffer (the pages stay the page cache's and
enter this process's RSS only as a forward touches them). What the mapped load still holds privately is what the
DiT's converter makes anew: the fc1 half swap (`torch.cat`) and the dtype casts of the F32 tensors.
`--tiny FILE` runs the same two arms on an existing GGUF DiT (the tiny build's Q8_0) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASE = r"""
import json, sys, threading, time
path, arm, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
torch.set_num_threads(1)
from h3_core import weights
from h3_core.weights import gguf_file

def status():
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("Vm", "Rss"))}

if arm == "copied":  # the reading before mapping: every tensor read into a buffer of its own, tested there
    from h3_core.weights.quant import ggml
    def copied(info):
        raw = gguf_file._copied(info)
        assert not ggml.non_finite(raw, info.ggml_type)
        return raw
    gguf_file._mapped, gguf_file._non_finite_read = copied, lambda info: False
import diffusers, gguf  # what the load imports, imported before the baseline
from diffusers.quantizers.gguf.utils import dequantize_functions
diffusers.MiniMaxH3Transformer3DModel
before = status()
base, base_anon = before["VmRSS"], before["RssAnon"]
peak_anon, done = [status()["RssAnon"]], threading.Event()
def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"]); time.sleep(0.01)
thread = threading.Thread(target=sample, daemon=True); thread.start()
start = time.perf_counter()
model = weights.load(path, "transformer", dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
seconds = time.perf_counter() - start
done.set(); thread.join()
now = status()
peak_anon[0] = max(peak_anon[0], now["RssAnon"])
print(json.dumps({"arm": arm, "seconds": round(seconds, 2), "peak_rss_mb": round((now["VmHWM"] - base) / 1024),
                  "peak_anon_mb": round((peak_anon[0] - base_anon) / 1024),
                  "anon_mb": round((now["RssAnon"] - base_anon) / 1024),
                  "file_mb": round((now["RssFile"] - before["RssFile"]) / 1024),
                  "baseline_rss_mb": round(base / 1024)}))
"""


def _config(layers: int) -> dict:
    """The release DiT config with `layers` 2048-wide blocks (16 heads of the release's 128)."""
    from h3_core import configs

    config = configs.get("transformer", tiny=False)
    hidden = 2048
    config.update(num_attention_heads=hidden // 128, hidden_size=hidden, time_embed_hidden_dim=hidden,
                  time_embed_dim=hidden // 2, ffn_dim=5632, num_refiner_layers=1, num_layers=layers)
    return config


def _layout(config: dict) -> tuple[dict, set]:
    """(Comfy tensor names -> shapes, the names stored Q8_0) of a DiT of `config`, as ComfyUI-GGUF lays it out."""
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel

    from h3_core.tiny.gguf_twins import _ADALN
    from h3_core.weights import transformer_keys
    from h3_core.weights.release_headers import DIT_BLOCK_LINEARS

    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in
              transformer_keys.from_diffusers(model.state_dict(), config, "comfy").items()}
    quantised = {n for n, s in shapes.items() if (DIT_BLOCK_LINEARS.fullmatch(n) or _ADALN.fullmatch(n))
                 and len(s) == 2 and s[1] % 32 == 0}
    return shapes, quantised


def _bytes(shapes: dict, quantised: set) -> int:
    total = 0
    for name, shape in shapes.items():
        numel = 1
        for dim in shape:
            numel *= dim
        total += numel // 32 * 34 if name in quantised else numel * 4
    return total


def write_dit(path: Path, gb: float) -> Path:
    """A Q8_0 DiT GGUF of about `gb` GB (as many blocks as fit), written tensor by tensor (the writer holds one
    tensor at a time)."""
    import gguf
    import numpy as np
    import torch

    from h3_core.weights import transformer_keys

    one, two = (_bytes(*_layout(_config(n))) for n in (1, 2))
    config = _config(max(1, round((gb * 1e9 - (2 * one - two)) / (two - one))))
    shapes, quantised = _layout(config)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(path), "minimax_h3")
    writer.add_string("h3.component", "transformer")
    writer.add_string("h3.config", json.dumps(config, sort_keys=True, separators=(",", ":")))
    for name in sorted(shapes):
        shape = shapes[name]
        numel = int(np.prod(shape))
        if name in quantised:
            writer.add_tensor_info(name, (shape[0], shape[1] // 32 * 34), np.dtype(np.uint8), numel // 32 * 34, q8)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), numel * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    for name in sorted(shapes):
        shape = shapes[name]
        if name in quantised:
            blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // 32, 34), dtype=np.uint8)
            blocks[:, :2] = scale  # a finite fp16 scale; the int8 codes stay random
            writer.write_tensor_data(blocks.reshape(shape[0], -1))
        elif name == "rope.inv_freq":  # checked against the config at load: the real table
            writer.write_tensor_data(transformer_keys.rope_inv_freq(config).to(torch.float32).numpy())
        else:
            writer.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * 0.02))
    writer.close()
    return path


def run_arm(path: Path, arm: str, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CASE, str(path), arm, dtype], capture_output=True, text=True,
                         env=env, cwd=REPO, check=False)
    if out.returncode:
        raise RuntimeError(f"{arm}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.3, help="size of the synthetic GGUF DiT")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--keep", help="write the synthetic file here and keep it (default: a temporary folder)")
    parser.add_argument("--tiny", help="measure this GGUF DiT instead of writing one")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="h3_gguf_load_") as tmp:
        if args.tiny:
            path = Path(args.tiny)
        else:
            path = Path(args.keep or tmp) / "minimax_h3_synthetic_fl2va_Q8_0.gguf"
            if not path.is_file():
                write_dit(path, args.gb)
        result = {"file": str(path), "file_mb": round(path.stat().st_size / 2**20), "dtype": args.dtype}
        for arm in ("copied", "mapped", "copied", "mapped"):  # ABAB: the second round runs on a warm page cache
            result.setdefault(arm, []).append(run_arm(path, arm, args.dtype))
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
