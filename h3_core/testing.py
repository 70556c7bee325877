"""Test and benchmark helpers shipped with the pack (like diffusers' testing utilities).

Deterministic synthetic media (test cards, tones, a moving clip with a soundtrack) and the canonical
requests every parity test, node test and benchmark uses: one recipe, so a test and a benchmark that
say "the ref2va case" mean the same bytes. The arrays are exactly what `h3_core.media` would decode;
nothing here is downloaded or read from disk.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Callable

import numpy as np

from . import facts
from .request import AudioInput, EncodeRequest, VideoInput


def image(seed: int, height: int, width: int) -> np.ndarray:
    """uint8 RGB [H, W, 3]: gradients plus seeded noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def tone(seconds: float, rate: int = facts.AUDIO_SAMPLE_RATE, freq: float = 440.0) -> np.ndarray:
    """float32 stereo [2, S]: `freq` left, 1.5 x `freq` right."""
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * freq * t), 0.3 * np.sin(2 * np.pi * freq * 1.5 * t)]).astype(np.float32)


def video(seconds: float, height: int = 64, width: int = 64, fps: float = 24.0, audio: bool = True) -> VideoInput:
    """A scrolling test card at `fps`, with a 220 Hz stereo soundtrack at 32 kHz unless `audio` is False."""
    frames = np.stack([np.roll(image(7, height, width), 3 * i, axis=1) for i in range(int(seconds * fps))])
    return VideoInput(frames=frames, fps=fps, audio=tone(seconds, freq=220.0) if audio else None,
                      sample_rate=facts.AUDIO_SAMPLE_RATE if audio else None)


def ref2va_request(num_frames: int = 124) -> EncodeRequest:
    """The canonical ref2va request: an image, a 2 s video with a soundtrack and a 3 s audio reference."""
    return EncodeRequest(
        prompt="<Picture 1> walks in, <Video 1> moves, <Audio 2> plays.",
        ref_images=[image(3, 64, 96)],
        ref_videos=[video(2.0)],
        ref_audios=[AudioInput(tone(3.0), facts.AUDIO_SAMPLE_RATE)],
        num_frames=num_frames,
    )


#: Torch threads of the encoder-server tests and benchmarks: the servers they start run with H3_THREADS=1, and
#: local reference encodes must use the same count for bitwise equality (docs/ARCHITECTURE.md §2.1, trap 5).
SERVER_THREADS = 1

#: Sigma points of the parity cases (3 DiT forwards: fast, and enough to exercise the scheduler).
STEPS = 4

#: name -> (request, the task it infers, seed): the parity cases of the stage split, reused by the assembly,
#: LoRA and node tests.
CASES = {
    "t2va-64x64-seed0": (
        EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124), "t2va", 0),
    "t2va-default-canvas-seed5": (
        EncodeRequest(prompt="Rain on a tin roof, distant thunder.", num_frames=141), "t2va", 5),
    "fl2va-first-last-seed1": (
        EncodeRequest(prompt="The door opens.", first_frame=image(1, 64, 96), last_frame=image(2, 80, 96),
                      num_frames=124),
        "fl2va",
        1,
    ),
    "ref2va-image-video-audio-seed2": (ref2va_request(), "ref2va", 2),
}


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height grey pixels, followed by a few rows of data: tiny on the wire,
    gigabytes once decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, step: float = 0.01) -> bool:
    """Poll `predicate` until it is true (True) or `timeout` seconds pass (False): for tests that watch a server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


class PromptPaced:
    """A stage that waits (cancellably) before encoding a prompt that starts with `[wait S]` (S seconds) or with
    `[until PATH]` (until the file PATH exists, at most UNTIL_CAP_S: the test releases every held request at once).

    For servers that load their own stage in another process (Ray Serve replicas, `RaySettings.stage_wrapper =
    "h3_core.testing:PromptPaced"`): makes queueing, deadlines and backpressure deterministic in tests.
    """

    UNTIL_CAP_S = 300.0

    def __init__(self, stage):
        self.stage = stage
        self.fingerprint, self.components = stage.fingerprint, stage.components
        self.pipeline_config = getattr(stage, "pipeline_config", None)

    def encode(self, request, metadata=None, cancel=None, progress=None):
        import re
        import time
        from pathlib import Path

        wait = re.match(r"\[wait ([0-9.]+)\]", request.prompt)
        until = re.match(r"\[until (\S+)\]", request.prompt)
        if wait or until:
            end = time.monotonic() + (float(wait.group(1)) if wait else self.UNTIL_CAP_S)
            while time.monotonic() < end and not (until and Path(until.group(1)).exists()):
                if cancel is not None and cancel.is_set():
                    from .progress import Cancelled

                    raise Cancelled("cancelled while pacing")
                time.sleep(0.005)
        return self.stage.encode(request, metadata=metadata, cancel=cancel, progress=progress)
