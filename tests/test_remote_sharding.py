"""`--gpus-per-replica G`: the text encoder's device map over G GPUs, built and checked on CPU.

Placing the modules needs G GPUs (`sharding.sharded_stage`, waits for a GPU); the map itself is computed from the
parameter sizes, so its properties are checked here on the tiny model's real text encoder.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import check_device_map

from h3_core.models import ModelSource
from h3_core.remote.engines import sharding


@pytest.fixture(scope="module")
def text_encoder(tiny_dir):
    return ModelSource.from_path(tiny_dir).load("text_encoder", dtype=torch.float32)


@pytest.mark.parametrize("gpus", [1, 2, 3, 4])
def test_device_map_spreads_the_layers_over_the_gpus(text_encoder, gpus):
    device_map = sharding.text_encoder_device_map(text_encoder, gpus)
    check_device_map(text_encoder, device_map)  # accelerate's own check: every weight placed
    layers = [device_map[f"{sharding.LAYERS}.{i}"] for i in range(len(text_encoder.get_submodule(sharding.LAYERS)))]
    assert layers == sorted(layers) and set(layers) <= set(range(gpus))  # contiguous runs in GPU order
    assert device_map["model.language_model.embed_tokens"] == 0 and device_map["model.visual"] == 0
    assert device_map["model.language_model.norm"] == layers[-1]
    sizes = sharding.per_gpu_bytes(text_encoder, device_map)
    total = sum(sizes.values())
    assert total == sharding._bytes(text_encoder)  # every weight once (the tied lm_head is the embedding)
    layer_bytes = sharding._bytes(text_encoder.get_submodule(f"{sharding.LAYERS}.0"))
    head = sizes[0]
    for gpu, size in sizes.items():  # no GPU over its share by more than one layer (GPU 0: its fixed modules)
        assert size <= max(total / gpus, head if gpu == 0 else 0) + layer_bytes, (gpu, sizes)
    print(f"\n[device map] {gpus} GPU(s): layers per GPU {[layers.count(g) for g in range(gpus)]}, "
          f"MiB per GPU {[round(sizes[g] / 2**20, 1) for g in range(gpus)]}")


def test_device_map_refuses_zero_gpus(text_encoder):
    with pytest.raises(ValueError, match="at least 1"):
        sharding.text_encoder_device_map(text_encoder, 0)


def test_sharded_stage_needs_the_gpus(tiny_dir):
    if torch.cuda.device_count() >= 2:
        pytest.skip("runs for real on a multi-GPU host (bench/gpu_check.py)")
    with pytest.raises(RuntimeError, match="sees"):
        sharding.sharded_stage(ModelSource.from_path(tiny_dir), ("text",), torch.float32, 2)


def _shaped_like_the_real_encoder(layers: int = 36) -> torch.nn.Module:
    """Module names of Qwen3-VL with the real proportions (layers outweigh the embedding), a few KiB in all."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.visual = torch.nn.Linear(64, 64)
    root.model.language_model = torch.nn.Module()
    root.model.language_model.embed_tokens = torch.nn.Embedding(300, 64)
    root.model.language_model.layers = torch.nn.ModuleList(torch.nn.Linear(64, 128) for _ in range(layers))
    root.model.language_model.norm = torch.nn.LayerNorm(64)
    return root


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_device_map_balances_a_layer_heavy_encoder(gpus):
    model = _shaped_like_the_real_encoder()
    device_map = sharding.text_encoder_device_map(model, gpus)
    check_device_map(model, device_map)
    sizes = sharding.per_gpu_bytes(model, device_map)
    layer = sharding._bytes(model.model.language_model.layers[0])
    assert set(sizes) == set(range(gpus))  # every GPU holds a share
    assert max(sizes.values()) - min(sizes.values()) <= 2 * layer, sizes  # within a couple of layers of even
    counts = [sum(1 for name, gpu in device_map.items() if ".layers." in name and gpu == g) for g in range(gpus)]
    assert counts[0] < max(counts[1:])  # GPU 0 carries the embedding and vision tower, so fewer layers
