"""A cancel during the audio decode stops it within one decoder layer, and the decode is unchanged without one
(UX issue 38 item 8: "decoding audio (one pass)" used to run to its end, 22 s on a busy CPU, after a cancel).

The audio VAE's BigVGAN decoder runs in one pass (chunked decoding would not be bitwise: h3_core.diffusion.AudioCancel
says why); the cancel is checked before each of its layers by forward pre-hooks. These tests count layers, not
seconds: the test's own hooks number every decoder layer that starts and every one that finishes.
"""

from __future__ import annotations

import threading

import pytest
import torch

from h3_core import progress
from h3_core.diffusion import AudioCancel, AVLatents, DiffusionStage
from h3_core.models import ModelSource
from h3_core.progress import Cancelled

FRAMES = 12  # half a second of video: 20 audio latents, 16000 samples a channel
AUDIO_LATENTS = 20


@pytest.fixture(scope="module")
def stage(tiny_dir, parity_threads):
    return DiffusionStage(ModelSource.from_path(tiny_dir))


@pytest.fixture(scope="module")
def latents():
    audio = torch.randn(2, 32, AUDIO_LATENTS, generator=torch.Generator().manual_seed(3))
    return AVLatents(video=torch.zeros(1, 24, 1, 1, 1), audio=audio)  # decode_audio reads only the audio


class LayerCount:
    """Numbers the decoder's layers as they start and finish; `cancel_at` sets `cancel` when that layer starts.

    Registered before the decode's own hooks, so on the layer that sets the flag, this hook runs first."""

    def __init__(self, decoder: torch.nn.Module, cancel: threading.Event | None = None, cancel_at: int = -1):
        self.started = self.finished = self.finished_after_cancel = 0
        self.cancel, self.cancel_at = cancel, cancel_at
        self.handles = []
        for module in decoder.modules():
            self.handles.append(module.register_forward_pre_hook(self._start))
            self.handles.append(module.register_forward_hook(self._finish))

    def _start(self, *_):
        self.started += 1
        if self.started == self.cancel_at:
            self.cancel.set()

    def _finish(self, *_):
        self.finished += 1
        if self.cancel is not None and self.cancel.is_set():
            self.finished_after_cancel += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _pre_hooks(module: torch.nn.Module) -> int:
    return sum(len(layer._forward_pre_hooks) for layer in module.modules())  # weight_norm's own included


def test_the_decode_is_bitwise_unchanged_with_the_cancel_hooks(stage, latents):
    before = _pre_hooks(stage.audio_vae)
    plain = stage.decode_audio(latents, FRAMES)  # no cancel: no hooks, diffusers' decode step as before
    events = []
    with progress.reporting(lambda *event: events.append(event)):
        hooked = stage.decode_audio(latents, FRAMES, cancel=threading.Event())
    assert torch.equal(plain, hooked) and plain.shape == (2, 16000) and plain.dtype == torch.float32
    assert [event for event in events if event[0] == "decode_audio"] == [("decode_audio", 0, 1),
                                                                          ("decode_audio", 1, 1)]
    assert _pre_hooks(stage.audio_vae) == before  # the cancel hooks are gone afterwards


def test_a_cancel_stops_the_audio_decode_at_the_next_layer(stage, latents):
    decoder = stage.audio_vae.decoder
    whole = LayerCount(decoder)
    try:
        stage.decode_audio(latents, FRAMES)
    finally:
        whole.remove()
    layers = whole.started
    assert layers >= 200, layers  # checkpoints in one pass: a cancel waits for a small part of it

    cancel = threading.Event()
    count = LayerCount(decoder, cancel, cancel_at=layers // 3)
    try:
        with pytest.raises(Cancelled, match="in the audio decode"):
            stage.decode_audio(latents, FRAMES, cancel=cancel)
    finally:
        count.remove()
    assert count.started == layers // 3  # the layer that saw the cancel never ran, nor any after it
    assert count.finished_after_cancel == 0
    print(f"\n[audio cancel] {layers} checkpoints in one audio decode pass; cancelled at layer {layers // 3}, "
          f"{count.finished} layers finished, none after the cancel")


def test_a_cancel_set_before_the_decode_runs_no_layer(stage, latents):
    cancel = threading.Event()
    cancel.set()
    count = LayerCount(stage.audio_vae.decoder)
    try:
        with pytest.raises(Cancelled, match="before the audio decode"):
            stage.decode_audio(latents, FRAMES, cancel=cancel)
    finally:
        count.remove()
    assert count.started == 0


def test_hooks_are_removed_after_a_cancel(stage):
    before = _pre_hooks(stage.audio_vae)
    with pytest.raises(Cancelled), AudioCancel(stage.audio_vae, threading.Event()) as hooks:
        assert len(hooks.handles) == len(list(stage.audio_vae.decoder.modules()))
        raise Cancelled("as a hook would")
    assert hooks.handles == [] and _pre_hooks(stage.audio_vae) == before
