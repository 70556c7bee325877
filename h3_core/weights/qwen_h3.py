"""The 50-layer Qwen3-VL conditioner as a real `Qwen3VLForConditionalGeneration`.

H3 conditions on the residual stream after decoder layer 50, before any final norm.
diffusers' `get_qwen3vl_prompt_embeds` reads it as `text_encoder.model(...).hidden_states[50]` and
refuses a stack with `num_hidden_layers <= 50`, because in transformers the *last* entry of
`hidden_states` is replaced by the post-norm `last_hidden_state`.

How transformers 5 collects `hidden_states` (utils/output_capturing.py, measured): a forward hook
on every `Qwen3VLTextDecoderLayer` appends the layer's output (the first hook also prepends the
layer-0 input, i.e. the embeddings); DeepStack features are added *after* a layer returns, so they
never alter an entry; finally entry [-1] is overwritten with `last_hidden_state`.

The arrangement built here from a 50-layer file therefore is:
- `text_config.num_hidden_layers = 51`, which passes diffusers' check;
- layers 0..49 are the real layers from the file, so `hidden_states[50]` is layer 49's output,
  the stream H3 wants, captured before anything else runs;
- layer 50 is a `PassThroughDecoderLayer`: a `Qwen3VLTextDecoderLayer` subclass with no weights
  that returns its input, so the hook still fires and `hidden_states` has the 52 entries the
  config promises (negative / int `output_hidden_states` selections keep resolving correctly);
- the final norm is an `IdentityNorm`, so `last_hidden_state` (and `hidden_states[51]`) equal
  `hidden_states[50]` instead of a norm the file does not contain;
- `lm_head` is a `MissingLanguageModelHead` that raises: the file has no head and H3 never uses one;
- `save_pretrained` raises too (see `apply_arrangement`); `save_comfy_text_encoder` writes it back.
A test proves `hidden_states[50]` equals that of a 51-layer stack sharing the first 50 layers,
bit for bit, with an image in the input.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRMSNorm

from .. import facts


class PassThroughDecoderLayer(Qwen3VLTextDecoderLayer):
    """Stands in for a decoder layer beyond the file's last one: no weights, returns its input."""

    def __init__(self, layer_idx: int):
        nn.Module.__init__(self)  # deliberately skip the real layer's weight allocation
        self.layer_idx = layer_idx

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class IdentityNorm(Qwen3VLTextRMSNorm):
    """The final norm of a truncated stack: H3 wants the un-normalised residual stream."""

    def __init__(self):
        nn.Module.__init__(self)

    def forward(self, hidden_states):
        return hidden_states

    def extra_repr(self) -> str:
        return "identity: the H3 conditioner reads the stream before any final norm"


class MissingLanguageModelHead(nn.Module):
    """Occupies `lm_head`; calling it explains why there are no logits."""

    def forward(self, hidden_states):
        raise RuntimeError(
            "this Qwen3-VL is the MiniMax-H3 conditioner truncated to its first "
            f"{facts.TEXT_ENCODER_LAYER} decoder layers: it has no language-model head. Read "
            f"`model.model(..., output_hidden_states=True).hidden_states[{facts.TEXT_ENCODER_LAYER}]` instead."
        )


def _refuse_save_pretrained(*args, **kwargs):
    raise RuntimeError(
        "the truncated MiniMax-H3 conditioner cannot be saved as a transformers folder (it has no final "
        "norm and no head); write it with h3_core.weights.save_comfy_text_encoder instead"
    )


def arrangement_config(config, num_file_layers: int):
    """The config of the H3 arrangement for a file with `num_file_layers` decoder layers."""
    config = copy.deepcopy(config)
    config.text_config.num_hidden_layers = max(num_file_layers, facts.TEXT_ENCODER_LAYER + 1)
    # There is no head to tie: keep transformers from trying to share the embedding with it.
    config.tie_word_embeddings = False
    return config


def apply_arrangement(model, num_file_layers: int) -> None:
    """Swap in the pass-through layers, identity norm and missing head (in place)."""
    language_model = model.model.language_model
    for index in range(num_file_layers, len(language_model.layers)):
        language_model.layers[index] = PassThroughDecoderLayer(index)
    language_model.norm = IdentityNorm()
    model.lm_head = MissingLanguageModelHead()
    model.h3_num_file_layers = num_file_layers
    # A transformers folder of this arrangement would lack layer 50 and the final norm while its
    # config promises both, and from_pretrained would fill them with random weights.
    model.save_pretrained = _refuse_save_pretrained


def real_layer_count(model) -> int:
    """Decoder layers that hold weights (pass-through stand-ins excluded)."""
    return sum(not isinstance(layer, PassThroughDecoderLayer) for layer in model.model.language_model.layers)


def is_arrangement(model) -> bool:
    return isinstance(getattr(model.model.language_model, "norm", None), IdentityNorm)


__all__ = [
    "IdentityNorm",
    "MissingLanguageModelHead",
    "PassThroughDecoderLayer",
    "apply_arrangement",
    "arrangement_config",
    "is_arrangement",
    "real_layer_count",
]
