"""The registry of component handlers, and the steps every component goes through with its handler.

`HANDLERS` maps each component's name (its folder name in a diffusers root: what the pipeline
receives) to the handler its `*_keys.py` module exports. Detection, `check`, the loaders and
`ModelSource` look components up here and never branch on a component's name, so `check` (meta
tensors from headers) and the loaders (real tensors) share one conversion path. The DiT is one
handler serving two pipeline slots: `transformer` (FL2VA, also t2va) and `transformer_ref` (Ref2VA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import audio_vae_keys, config_merge, pruned, text_encoder_keys, transformer_keys, video_vae_keys
from .errors import H3WeightsError, UnrecognisedCheckpointError
from .keymap import ComponentHandler, KeyFamily

HANDLERS: dict[str, ComponentHandler] = {
    handler.name: handler
    for handler in (
        pruned.with_curve_family(transformer_keys.HANDLER),  # the DiT, pruned "AdaLN curve" files included
        video_vae_keys.HANDLER,
        audio_vae_keys.HANDLER,
        text_encoder_keys.HANDLER,
    )
}

# Pipeline slots: a partitioned handler's second partition gets its own slot.
PARTITION_SLOTS = {"fl2va": "transformer", "ref2va": "transformer_ref"}
SLOTS = ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder")
SLOT_LABELS = {
    "transformer": "FL2VA DiT partition",
    "transformer_ref": "Ref2VA DiT partition",
    **{name: handler.label for name, handler in HANDLERS.items() if not handler.partitioned},
}


def handler_of_slot(slot: str) -> ComponentHandler:
    return HANDLERS["transformer" if slot in PARTITION_SLOTS.values() else slot]


def slot_of(component: str, partition: str | None) -> str:
    """The pipeline slot of a detected component (a DiT of unknown partition takes `transformer`)."""
    return PARTITION_SLOTS.get(partition, component) if HANDLERS[component].partitioned else component


def classify(keys, where: str) -> tuple[ComponentHandler, KeyFamily]:
    """The handler and key family whose marker keys `keys` hold (handlers in registry order)."""
    for handler in HANDLERS.values():
        family = handler.family(keys)
        if family is not None:
            return handler, family
    labels = " / ".join(handler.label for handler in HANDLERS.values())
    raise UnrecognisedCheckpointError(
        f"{where}: not a MiniMax-H3 component: none of the {labels} marker keys are present "
        f"(first keys: {sorted(keys)[:3]})"
    )


def resolve_config(det) -> dict:
    """The component's config (diffusers / transformers argument names) for this checkpoint."""
    handler = HANDLERS[det.component]
    own = {k: v for k, v in (det.source.config or {}).items() if not k.startswith("_")}  # no `_class_name`...
    stated = handler.stated_config({**own, **config_merge.metadata_config(det.header.metadata)}, det.source)
    return handler.derive_config(det.dense_shapes, det.key_format, stated, det.path)


def to_model_names(det, tensors: dict, config: dict) -> tuple[dict, list[str]]:
    """File tensors -> the model's own state-dict names. Returns (converted, unexpected keys)."""
    return HANDLERS[det.component].to_model(tensors, config, det.key_format, det.layout)


def empty_model(det, config: dict) -> torch.nn.Module:
    """The target model with meta parameters (real non-persistent buffers), ready to be assigned."""
    from accelerate import init_empty_weights

    handler = HANDLERS[det.component]
    cls = handler.model_type()
    if handler.build is not None:
        return handler.build(cls, det, config)
    with init_empty_weights(include_buffers=False):
        return cls.from_config(config)


@dataclass(frozen=True)
class ExpectedKeys:
    """What a model's state dict needs: required names with shapes, plus tolerated aliases."""

    shapes: dict
    aliases: dict  # alias name -> the required name it shares storage with (tied weights)


def expected_keys(model: torch.nn.Module) -> ExpectedKeys:
    shapes, aliases, first_name = {}, {}, {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        owner = first_name.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
        else:
            shapes[name] = tuple(tensor.shape)
    return ExpectedKeys(shapes=shapes, aliases=aliases)


def require_handler(name: str) -> ComponentHandler:
    if name not in HANDLERS:
        raise H3WeightsError(f"unknown component {name!r}; one of {sorted(HANDLERS)}")
    return HANDLERS[name]
