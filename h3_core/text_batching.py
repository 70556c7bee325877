"""Text encodes of several text-only requests in one forward of the text encoder, only where no bit changes.

The encoder server answers queued requests one at a time; for the tiny model (and for short prompts on a GPU) the
text encoder's forward is dominated by per-call overhead, so running B prompts as one `[B, L]` forward costs little
more than one. The answer of every request must stay exactly what `EncoderStage.encode` gives it alone, so:

* Only `t2va` requests (a prompt, no media) are batched: their text encode is the prompt's tokens alone, with no
  chat template and no vision block, and their conditioning is the text encoder's output and nothing else.
* Only prompts with the *same token count* share a forward. Padding shorter prompts to a common length changes
  their results in the last bits (measured on CPU float32: up to 4e-7 off; the masked attention takes another
  kernel), so it is not done.
* Bitwise equality of a batched forward with B single forwards is a property of the kernels the device picks for
  that shape, not of the values: matrix-multiply kernels may block their sums differently when B x L rows are
  computed at once. So the first time a shape (B, L) is met, the batch is run both ways and compared; the answers
  are the single forwards' results, and the shape is batched from then on only if every bit was equal. A shape that
  differed is never batched again. (On CPU float32 with one thread every shape measured so far is equal.)

The single forward is diffusers' own text-encoder block (`EncoderStage.encode_text`); the batched one reproduces
that block's steps (tokens without special tokens, the processor's token type ids, an all-ones attention mask, the
hidden state after `text_encoder_layer`) for B rows at once.
"""

from __future__ import annotations

import collections
import copy
import threading
from typing import Any

import torch

from . import diffusers_adapter, progress
from .blocks import pipeline_for, workflow_blocks
from .contract import H3Conditioning
from .encoder import EncoderStage, LayerCounter, Prepared, assemble

MAX_BATCH = 8
MAX_SHAPES = 1024  # verdicts kept (LRU); a forgotten shape is simply checked again


class TextBatcher:
    """Groups `t2va` requests by token count and encodes each group in one forward where that is bitwise safe."""

    def __init__(self, stage: EncoderStage, max_batch: int = MAX_BATCH):
        self.stage = stage
        self.max_batch = max(1, int(max_batch))
        # The event loop computes batch keys while the model thread may be tokenizing: a fast tokenizer must not
        # be used from two threads at once, so the keys get their own copy.
        self._key_tokenizer = copy.deepcopy(stage.tokenizer)
        self._key_lock = threading.Lock()
        self._pipe = None
        self.verdicts: collections.OrderedDict[tuple[int, int], bool] = collections.OrderedDict()
        self.stats = collections.Counter()  # forwards, batched_forwards, batched_requests, shapes_equal/_differ
        self.on_forward = None  # called with the number of requests each answering forward served (metrics)

    @classmethod
    def for_stage(cls, stage: Any, max_batch: int) -> "TextBatcher | None":
        """A batcher for a real `EncoderStage` with the text encoder loaded; None where batching cannot apply."""
        if max_batch < 2 or not isinstance(stage, EncoderStage) or "text" not in stage.components:
            return None
        if stage.tokenizer is None or stage.processor is None:
            return None
        return cls(stage, max_batch)

    # --- keys (event loop) -----------------------------------------------------------------------

    def key(self, task: str, prompt: str, has_media: bool) -> tuple[str, int] | None:
        """("t2va", token count) for a request that may share a forward; None for any other."""
        if task != "t2va" or has_media:
            return None
        with self._key_lock:
            return "t2va", len(self._key_tokenizer(prompt, add_special_tokens=False)["input_ids"])

    # --- encoding (model thread) -----------------------------------------------------------------

    def _components(self):
        if self._pipe is None:
            stage = self.stage
            self._pipe = pipeline_for(
                workflow_blocks("t2va", ("text_encoder",)),
                {"text_encoder": stage.text_encoder, "tokenizer": stage.tokenizer, "processor": stage.processor},
                stage.pipeline_config)
        return self._pipe

    def encode(self, prepared: list[Prepared]) -> list[H3Conditioning]:
        """The conditioning of every prepared `t2va` request, each bitwise what `EncoderStage.encode` gives alone."""
        if any(p.task != "t2va" for p in prepared):
            raise ValueError("only t2va requests are batched")
        tokens = [self.stage.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in prepared]
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for index, ids in enumerate(tokens):
            groups[len(ids)].append(index)
        texts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for members in groups.values():
            for start in range(0, len(members), self.max_batch):
                chunk = members[start:start + self.max_batch]
                results = self._encode_group([prepared[i] for i in chunk], [tokens[i] for i in chunk])
                texts.update(zip(chunk, results))
        stage = self.stage
        metadata = {"model": stage.fingerprint} if stage.fingerprint else {}  # what EncoderStage.encode writes
        return [assemble(p, *texts[i], [], [], metadata=dict(metadata)) for i, p in enumerate(prepared)]

    def _singles(self, prepared: list[Prepared]) -> list[tuple]:
        """Each request through diffusers' own text block, one forward each."""
        out = [self.stage.encode_text(p) for p in prepared]
        self.stats["forwards"] += len(prepared)
        for _ in prepared:
            self._served(1)
        return out

    def _served(self, size: int) -> None:
        if self.on_forward is not None:
            self.on_forward(size)

    def _encode_group(self, prepared: list[Prepared], tokens: list[list[int]]) -> list[tuple]:
        if len(prepared) == 1:
            return self._singles(prepared)
        shape = (len(prepared), len(tokens[0]))
        verdict = self.verdicts.get(shape)
        if verdict is False:
            return self._singles(prepared)
        batched = self._forward(tokens)
        self.stats["forwards"] += 1
        if verdict is None:
            reference = self._singles(prepared)
            equal = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batched, reference))
            self.verdicts[shape] = equal
            self.stats["shapes_equal" if equal else "shapes_differ"] += 1
            while len(self.verdicts) > MAX_SHAPES:
                self.verdicts.popitem(last=False)
            return reference
        self.verdicts.move_to_end(shape)
        self.stats["batched_forwards"] += 1
        self.stats["batched_requests"] += len(prepared)
        self._served(len(prepared))
        return batched

    @torch.no_grad()
    def _forward(self, tokens: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The text block's steps for B prompts of equal token count: [(prompt_embeds [1, L, D], tags [L])]."""
        pipe, stage = self._components(), self.stage
        encoder = stage.text_encoder
        layer, device, dtype = pipe.text_encoder_layer, pipe._execution_device, encoder.dtype
        if encoder.config.text_config.num_hidden_layers <= layer:
            raise ValueError(f"the text encoder has no hidden state {layer}")  # the single block says why
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        token_types = torch.tensor(stage.processor.create_mm_token_type_ids(tokens), dtype=torch.long, device=device)
        diffusers_adapter.run_offload_hook(encoder)  # an offload hook wraps only the top-level forward
        with LayerCounter(encoder, "text"):
            outputs = encoder.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    mm_token_type_ids=token_types, use_cache=False, output_hidden_states=True)
        hidden = outputs.hidden_states[layer]
        length = input_ids.shape[1]
        # clone: each answer owns its rows, not a view keeping the whole batch alive
        return [(hidden[i:i + 1].to(device=device, dtype=dtype).cpu().clone(),
                 torch.full((length,), pipe.text_tag, dtype=torch.long)) for i in range(len(tokens))]


def progress_to_all(sinks: list) -> progress.PhaseFn:
    """One named-phase sink that forwards every report to each job of a batch."""

    def report(phase: str, done: int, total: int) -> None:
        for sink in sinks:
            sink(phase, done, total)

    return report
