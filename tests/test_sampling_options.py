"""SamplingOptions across a process boundary (the sequence-parallel workers): every field is decided in one place,
`to_wire` / `from_wire`, so a new sampler option cannot be dropped silently for `gpus` > 1."""

from __future__ import annotations

import dataclasses
import json
import threading

import torch
from support import lora_support

from h3_core import configs
from h3_core.diffusion import SamplingOptions


def test_every_field_is_decided_for_the_wire():
    fields = {field.name for field in dataclasses.fields(SamplingOptions)}
    decided = [*SamplingOptions.WIRE_FIELDS, *SamplingOptions.CALLBACK_FIELDS, *SamplingOptions.LOADED_FIELDS]
    assert len(decided) == len(set(decided)), "a field is listed twice"
    assert fields == set(decided), (
        f"SamplingOptions fields not decided for the workers' wire: {sorted(fields - set(decided))} (add each to "
        "WIRE_FIELDS, CALLBACK_FIELDS or LOADED_FIELDS); listed but gone: {sorted(set(decided) - fields)}")


def test_the_wire_round_trip_keeps_every_value_and_loads_the_loras(tmp_path):
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):  # shapes only: the LoRA writer draws its own factors
        dit = MiniMaxH3Transformer3DModel(**configs.get("transformer", tiny=True))
    lora_support.comfy_lora(tmp_path / "a.safetensors", dit)
    lora_support.musubi_lora(tmp_path / "b.safetensors", dit)
    host = SamplingOptions(steps=9, seed=7, video_shift=6.0, audio_shift=2.5, cache="every:3", lora_strength=0.5,
                           progress=print, cancel=threading.Event())
    wire = json.loads(json.dumps(host.to_wire([(tmp_path / "a.safetensors", 0.8), (tmp_path / "b.safetensors", 0.3)],
                                              lora_audio=False)))  # what the channel carries: JSON
    relays = {"progress": len, "preview": max, "on_cache": min, "cancel": threading.Event()}
    rank = SamplingOptions.from_wire(wire, **relays)
    for name in SamplingOptions.WIRE_FIELDS:
        assert getattr(rank, name) == getattr(host, name), name
    # only the callbacks the host set get a relay on the other side
    assert rank.progress is len and rank.cancel is relays["cancel"] and rank.preview is None and rank.on_cache is None
    assert [strength for _, strength in rank.lora.entries] == [0.8, 0.3]
    assert rank.lora.entries[1][0].skipped  # lora_audio=False: the musubi LoRA's audio-branch weights left out
    assert (rank.lora.schedule.steps, rank.lora.schedule.video_shift) == (9, 6.0)
    assert SamplingOptions.from_wire(json.loads(json.dumps(SamplingOptions(steps=4).to_wire()))).lora is None
