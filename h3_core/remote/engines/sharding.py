"""A text encoder too big for one GPU, spread over several GPUs of one host (`serve --gpus-per-replica G`).

The Qwen3-VL text encoder is a stack of decoder layers behind a token embedding (and a vision tower for the
images of fl2va/ref2va). `text_encoder_device_map` cuts the stack into G contiguous runs of about equal bytes:
GPU 0 also holds the embedding, the vision tower and the rotary tables (the inputs start there), the last GPU the
final norm. Layers are never split, tied weights stay together. accelerate's `dispatch_model` then places each
module and adds hooks that move the activations from one GPU to the next, so the encoder's forward is unchanged;
only one GPU computes at a time (a pipeline of one request), which is the point: memory, not speed.

The VAEs are small and stay whole on GPU 0. The map is built from parameter sizes alone, so it is tested on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

FIRST = ("model.visual", "model.language_model.embed_tokens", "model.language_model.rotary_emb")
LAST = ("model.language_model.norm",)
LAYERS = "model.language_model.layers"


def _bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def text_encoder_device_map(model: torch.nn.Module, gpus: int) -> dict[str, int]:
    """Module name -> GPU index, covering every parameter of `model` once, decoder layers in G contiguous runs.

    The split minimises the largest GPU's share: GPU 0 starts with the embedding and vision tower, so it takes fewer
    layers (none when they alone outweigh a fair share).
    """
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    layers = model.get_submodule(LAYERS)
    names = [f"{LAYERS}.{i}" for i in range(len(layers))]
    sizes = [_bytes(layer) for layer in layers]
    head = sum(_bytes(model.get_submodule(name)) for name in FIRST if _has(model, name))
    tail = sum(_bytes(model.get_submodule(name)) for name in LAST if _has(model, name))
    device_map: dict[str, int] = {name: 0 for name in FIRST if _has(model, name)}
    # The smallest largest-GPU load that fits (binary search, filling GPUs in order), then, with GPU 0 held to it,
    # the smallest load of the others: layers spread over every GPU even when GPU 0's modules dominate.
    first = _smallest(lambda cap: _fill(sizes, head, tail, gpus, cap, cap), max(sizes + [head, tail]),
                      head + sum(sizes) + tail)
    rest = _smallest(lambda cap: _fill(sizes, head, tail, gpus, first, cap), max(sizes + [tail]), first)
    for name, gpu in zip(names, _fill(sizes, head, tail, gpus, first, rest)):
        device_map[name] = gpu
    last = max([device_map.get(name, 0) for name in names] or [0])
    for name in LAST:
        if _has(model, name):
            device_map[name] = last
    # Whatever else holds weights (lm_head, tied to the embedding) goes with the embedding.
    covered = tuple(device_map)
    names_with_weights = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names_with_weights += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    for name in names_with_weights:
        if not any(name == c or name.startswith(c + ".") for c in covered):
            module = name.rsplit(".", 1)[0]
            device_map[module] = device_map.get("model.language_model.embed_tokens", 0)
    return device_map


def _smallest(fits, low: int, high: int) -> int:
    """The smallest capacity in [low, high] for which `fits(capacity)` places every layer (it does at `high`)."""
    while low < high:
        middle = (low + high) // 2
        if fits(middle) is None:
            low = middle + 1
        else:
            high = middle
    return high


def _fill(sizes: list[int], head: int, tail: int, gpus: int, first: int, capacity: int) -> list[int] | None:
    """GPU of each layer when GPUs take layers in order, GPU 0 up to `first` bytes (it starts with `head`), the
    others up to `capacity` (the last one used ends with `tail`); None when `gpus` GPUs are not enough."""
    placed, gpu, used, cap = [], 0, head, first
    for size in sizes:
        while used + size > cap:
            gpu, used, cap = gpu + 1, 0, capacity
            if gpu >= gpus:
                return None
        placed.append(gpu)
        used += size
    return placed if used + tail <= cap else None


def _has(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def per_gpu_bytes(model: torch.nn.Module, device_map: dict[str, int]) -> dict[int, int]:
    """Bytes of weights each GPU receives under `device_map` (shared tensors counted once)."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    for name, device in device_map.items():
        for tensor in list(model.get_submodule(name).parameters()) + list(model.get_submodule(name).buffers()):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out[device] = out.get(device, 0) + tensor.numel() * tensor.element_size()
    return out


def sharded_stage(source: Any, components: tuple[str, ...], dtype: torch.dtype, gpus: int):
    """An `EncoderStage` whose text encoder spans GPUs 0..gpus-1 (the VAEs on GPU 0). Needs `gpus` CUDA devices."""
    from accelerate import dispatch_model

    from ...encoder import EncoderStage

    if torch.cuda.device_count() < gpus:
        raise RuntimeError(f"--gpus-per-replica {gpus}: this replica sees {torch.cuda.device_count()} GPU(s)")
    modules: dict[str, Any] = {}
    if "text" in components:
        model = source.load("text_encoder", dtype=dtype)  # on the CPU first; each GPU receives only its share
        device_map = text_encoder_device_map(model, gpus)
        modules["text_encoder"] = dispatch_model(model, device_map=device_map, main_device=0)
        modules["tokenizer"], modules["processor"] = source.load_tokenizer(), source.load_processor()
    first = torch.device("cuda", 0)
    if "video" in components:
        modules["vae"] = source.load("vae", dtype=torch.float32).to(first)
    if "audio" in components:
        modules["audio_vae"] = source.load("audio_vae", dtype=torch.float32).to(first)
    return EncoderStage(modules=modules, pipeline_config=source.pipeline_config, fingerprint=source.fingerprint(),
                        device=first)
