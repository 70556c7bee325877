"""Deterministic synthetic media (test cards, tones, a moving clip with a soundtrack).

One recipe shared by the tests, the benchmarks and anything else that needs real-shaped media
without shipping files; the arrays are exactly what `h3_core.media` would decode.
"""

from __future__ import annotations

import numpy as np

from .facts import AUDIO_SAMPLE_RATE
from .request import VideoInput


def image(seed: int, height: int, width: int) -> np.ndarray:
    """uint8 RGB [H, W, 3]: gradients plus seeded noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def tone(seconds: float, rate: int = AUDIO_SAMPLE_RATE, freq: float = 440.0) -> np.ndarray:
    """float32 stereo [2, S]: `freq` left, 1.5 x `freq` right."""
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * freq * t), 0.3 * np.sin(2 * np.pi * freq * 1.5 * t)]).astype(np.float32)


def video(seconds: float, height: int = 64, width: int = 64, fps: float = 24.0, audio: bool = True) -> VideoInput:
    """A scrolling test card at `fps`, with a 220 Hz stereo soundtrack at 32 kHz unless `audio` is False."""
    frames = np.stack([np.roll(image(7, height, width), 3 * i, axis=1) for i in range(int(seconds * fps))])
    return VideoInput(frames=frames, fps=fps, audio=tone(seconds, freq=220.0) if audio else None,
                      sample_rate=AUDIO_SAMPLE_RATE if audio else None)
