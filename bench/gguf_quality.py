"""GGUF quality and memory on the tiny twins, side by side in one run, plus release-size file estimates.

    python bench/gguf_quality.py --models TINY/comfyui [--out bench/results/gguf_quality.json]

`--models` is a tiny build's `comfyui/` folder holding the GGUF twins (`python -m h3_core tiny --out TINY --twins
gguf`) and the bf16 twin (the reference row). Per GGML type, on the fl2va DiT twin against the tiny fp32 DiT:

- weight error: max |W_hat - W| / max |W| over the quantised layers (the `gguf` package's own quantiser);
- forward error: relative max difference of one DiT forward (video and audio outputs) against the fp32 model;
- resident bytes of the quantised layers once loaded at bf16 (stored blocks) against the same layers in bf16.

The K-quant twins hold valid random blocks (the `gguf` package cannot write K-quants), so their weight and forward
errors are not measured ("random"); their memory is. The release column applies each type to the layers a GGUF
converter quantises (block and AdaLN linears) of the published fl2va bf16 DiT's header, the rest as published.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from h3_core import weights  # noqa: E402
from h3_core.tiny import gguf_twins as tiny_gguf  # noqa: E402
from h3_core.weights import gguf_file, release_headers  # noqa: E402
from h3_core.weights.headers import read_header  # noqa: E402
from h3_core.weights.quant import ggml  # noqa: E402
from h3_core.weights.quant.linear import QuantLinear  # noqa: E402


def dit_forward(model, tokens: int = 16, seed: int = 0):
    """One packed sequence (4 text, `tokens` video, 4 audio rows) through the DiT, float32 inputs."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    video_dim = config.in_channels * config.patch_size[0] * config.patch_size[1] * config.patch_size[2]
    text, audio = 4, 4
    length = text + tokens + audio
    positions = torch.stack([torch.arange(length, dtype=torch.float64), torch.zeros(length, dtype=torch.float64),
                             torch.arange(length) % 4.0], dim=-1)
    with torch.no_grad():
        out = model(
            hidden_states=torch.randn(1, tokens, video_dim, generator=generator),
            audio_hidden_states=torch.randn(1, audio, config.audio_in_channels, generator=generator),
            encoder_hidden_states=torch.randn(1, text, config.text_dim, generator=generator),
            timestep=torch.tensor([0.3, 0.8]),
            timestep_indices=torch.tensor([0] * (text + tokens) + [1] * audio),
            token_tags=torch.tensor([1] * text + [0] * tokens + [2] * audio),
            position_ids=positions,
            video_indices=torch.arange(text, text + tokens),
            audio_indices=torch.arange(text + tokens, length),
            text_indices=torch.arange(text),
        )
    return out.sample, out.audio_sample


def _relative(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float() - reference).abs().max() / reference.abs().max())


def weight_error(path: Path, dense: dict) -> float:
    header = read_header([str(path)])
    worst = 0.0
    for name, info in header.tensors.items():
        if info.ggml_type in ggml.DENSE_TYPES:
            continue
        approx = torch.from_numpy(gguf_file.numpy_dequantise(info))
        worst = max(worst, _relative(approx, dense[name].float()))
    return worst


def quantised_bytes(model) -> tuple[int, int]:
    """(stored bytes of the quantised layers' weights, the same layers' weights in bf16)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return sum(m.weight.numel() for m in layers), sum(m.in_features * m.out_features * 2 for m in layers)


def release_bytes(ggml_type: str) -> tuple[int, int]:
    """(file bytes of the published fl2va bf16 DiT with its GGUF-quantised layers in `ggml_type`, bf16 bytes)."""
    tensors, _ = release_headers.release_header("diffusion_models/minimax_h3_fl2va_bf16.safetensors")
    block, size = ggml.block_sizes(ggml_type)
    total = bf16 = 0
    for name, (tag, shape) in tensors.items():
        numel = 1
        for dim in shape:
            numel *= dim
        stored = numel * {"F32": 4, "BF16": 2, "F16": 2}.get(tag, 1)
        bf16 += stored
        if tiny_gguf.DIT_BLOCK_LINEARS.fullmatch(name) or tiny_gguf._ADALN.fullmatch(name):
            stored = numel // block * size
        total += stored
    return total, bf16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="a tiny build's comfyui/ folder with the GGUF twins")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    models = Path(args.models)
    torch.manual_seed(0)
    fp32_path = models / tiny_gguf.SOURCES["fl2va"]
    dense = _fp32_tensors(fp32_path)
    reference = dit_forward(weights.load_transformer(fp32_path))
    # bf16 storage computed in float32, as the GGUF twins are: the published precision's own error
    bf16_twin = models / "diffusion_models/minimax_h3_tiny_fl2va_bf16.safetensors"
    bf16_outputs = dit_forward(weights.load_transformer(bf16_twin))
    rows = [{"type": "bf16 (reference)", "weight_error": 2**-9, "forward_error": max(
        _relative(g, r) for g, r in zip(bf16_outputs, reference, strict=True)), "quantised_vs_bf16": 1.0,
        "release_gb": release_bytes("Q8_0")[1] / 1e9, "release_vs_bf16": 1.0}]
    for ggml_type in tiny_gguf.QUANT_TYPES:
        path = models / tiny_gguf.gguf_path("fl2va", ggml_type)
        model = weights.load_transformer(path)
        random = ggml_type in tiny_gguf.K_QUANTS
        outputs = dit_forward(model)
        stored, bf16 = quantised_bytes(weights.load_transformer(path, dtype=torch.bfloat16))
        release, release_bf16 = release_bytes(ggml_type)
        rows.append({
            "type": ggml_type,
            "weight_error": None if random else weight_error(path, dense),
            "forward_error": None if random else max(_relative(g, r) for g, r in zip(outputs, reference, strict=True)),
            "finite": all(bool(torch.isfinite(o).all()) for o in outputs),
            # every release layer fits the type's blocks; the tiny K-quant twins keep qkv / fc1 in Q8_0 (measured)
            "quantised_vs_bf16": ggml.block_sizes(ggml_type)[1] / ggml.block_sizes(ggml_type)[0] / 2,
            "tiny_quantised_vs_bf16": stored / bf16,
            "release_gb": release / 1e9,
            "release_vs_bf16": release / release_bf16,
        })
    print("| GGML type | weight error (tiny DiT, vs fp32) | DiT forward vs fp32 (relative max) | quantised layers vs "
          "bf16 (measured on the tiny) | fl2va DiT file at release size |")
    print("|---|---|---|---|---|")
    for row in rows:
        def fmt(value, spec):
            return "random blocks" if value is None else format(value, spec)
        print(f"| {row['type']} | {fmt(row['weight_error'], '.4f')} | {fmt(row['forward_error'], '.1e')} | "
              f"{row['quantised_vs_bf16']:.3f} ({row.get('tiny_quantised_vs_bf16', 1.0):.3f}) | "
              f"{row['release_gb']:.2f} GB ({row['release_vs_bf16']:.2f}x) |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _fp32_tensors(path: Path) -> dict:
    """The fp32 source file's tensors (safetensors)."""
    from h3_core.weights.safetensors_io import load_tensors

    return load_tensors(read_header([str(path)]))


if __name__ == "__main__":
    sys.exit(main())
