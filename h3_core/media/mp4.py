"""MP4 out: H.264 + AAC, written frame batch by frame batch, so a long video never has to be in memory at once.

Part of :mod:`h3_core.media` (import from there). :func:`media.write_mp4` writes a whole video through the same
:class:`Mp4Writer`; :func:`streamed_mp4` hands the writer to a producer (the streamed VAE decode, one clip at a
time) and moves the finished file into place. The muxer sees the same calls in the same order either way (every
video frame, then the soundtrack), so both produce the same bytes for the same frames.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from fractions import Fraction
from typing import Any, Iterator

import av
import numpy as np

from .. import facts
from .audio import check_rate, to_stereo, waveform_to_numpy
from .base import MediaError, wrap_errors


def _fps_fraction(fps: Any) -> Fraction:
    rate = Fraction(fps).limit_denominator(1001) if not isinstance(fps, Fraction) else fps
    if rate <= 0:
        raise MediaError(f"fps must be positive, got {fps!r}")
    return rate


class Mp4Writer:
    """An open MP4 file: H.264 (libx264, yuv420p, BT.601 limited range, ``crf``) and, when ``with_audio``, an AAC
    stereo track at ``sample_rate``. :meth:`write` takes uint8 ``[n, H, W, 3]`` frames (any number per call; the
    array is encoded before the call returns, so the caller may reuse it); :meth:`finish` flushes the video, adds
    the soundtrack (trimmed or zero-padded to exactly the video's duration) and closes the file."""

    def __init__(self, target: str, width: int, height: int, *, fps: Any = facts.FPS, with_audio: bool = False,
                 sample_rate: int = facts.AUDIO_SAMPLE_RATE, crf: int = 18, audio_bitrate: int = 192_000):
        if height % 2 or width % 2 or height <= 0 or width <= 0:
            raise MediaError(f"H.264 yuv420p needs an even, non-zero width and height, got {width}x{height}")
        self.rate = _fps_fraction(fps)
        self.sample_rate = check_rate(sample_rate, "sample_rate") if with_audio else None
        self.target, self.width, self.height, self.count = target, int(width), int(height), 0
        self._errors = wrap_errors("mp4", repr(target), "encode")
        codec = "libx264" if "libx264" in av.codecs_available else "h264"
        with self._errors:
            self.container = av.open(target, mode="w", format="mp4", options={"movflags": "+faststart"})
            try:
                self.vstream = self.container.add_stream(codec, rate=self.rate)
                self.vstream.width, self.vstream.height, self.vstream.pix_fmt = width, height, "yuv420p"
                if codec == "libx264":
                    self.vstream.options = {"crf": str(int(crf))}
                # Tag what the conversion below does (BT.601 matrix, limited range), so players do not assume BT.709.
                context = self.vstream.codec_context
                context.colorspace, context.color_range, context.color_primaries, context.color_trc = 6, 1, 6, 6
                self.astream = None
                if with_audio:
                    self.astream = self.container.add_stream("aac", rate=self.sample_rate, layout="stereo")
                    self.astream.bit_rate = int(audio_bitrate)
            except BaseException:
                self.container.close()
                raise

    def write(self, frames: np.ndarray) -> None:
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise MediaError(f"mp4 frames must be uint8 [n, {self.height}, {self.width}, 3], got {frames.dtype} "
                             f"{tuple(frames.shape)}")
        with self._errors:
            for pixels in frames:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
                frame = frame.reformat(format="yuv420p", dst_colorspace="ITU601", dst_color_range="MPEG")
                frame.pts = self.count
                self.count += 1
                self.container.mux(self.vstream.encode(frame))

    def finish(self, audio: Any = None) -> None:
        """Flush and close; ``audio`` ``[C, S]`` float (mono duplicated, channels beyond two dropped) when the
        writer was opened ``with_audio``."""
        if self.count == 0:
            raise MediaError("cannot write a zero-length video (0 frames)")
        stereo = None
        if self.astream is not None:
            if audio is None:
                raise MediaError("this mp4 was opened with an audio track: give finish() the soundtrack")
            stereo = to_stereo(waveform_to_numpy(audio, "soundtrack"))
            wanted = int(round(Fraction(self.count) * self.sample_rate / self.rate))  # exactly F / fps
            if stereo.shape[1] >= wanted:
                stereo = np.ascontiguousarray(stereo[:, :wanted])
            else:
                stereo = np.pad(stereo, ((0, 0), (0, wanted - stereo.shape[1])))
        with self._errors:
            self.container.mux(self.vstream.encode(None))
            if stereo is not None:
                step = 1024  # one AAC frame
                for start in range(0, stereo.shape[1], step):
                    chunk = np.ascontiguousarray(stereo[:, start: start + step])
                    aframe = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                    aframe.sample_rate = self.sample_rate
                    aframe.pts = start
                    aframe.time_base = Fraction(1, self.sample_rate)
                    self.container.mux(self.astream.encode(aframe))
                self.container.mux(self.astream.encode(None))
            self.close()

    def close(self) -> None:
        container, self.container = getattr(self, "container", None), None
        if container is not None:
            with self._errors:
                container.close()


@contextlib.contextmanager
def streamed_mp4(path: str | os.PathLike, width: int, height: int, **options: Any) -> Iterator[Mp4Writer]:
    """An :class:`Mp4Writer` on a temporary file next to ``path``, moved into place when the block ends after the
    caller's ``finish()``; on failure (or without ``finish()``) no file is left behind. ``options``: the writer's."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    handle, partial = tempfile.mkstemp(prefix=".partial-", suffix=".mp4", dir=directory)
    os.close(handle)
    writer = None
    try:
        writer = Mp4Writer(partial, width, height, **options)
        yield writer
        if writer.container is not None:
            raise MediaError(f"mp4 {path!r} was not finished (no finish() call): nothing written")
        os.chmod(partial, 0o644)  # mkstemp made it 0600; an output file is meant to be shared
        os.replace(partial, path)
    finally:
        if writer is not None:
            writer.close()
        if os.path.exists(partial):
            os.remove(partial)


def encode_frames(target: str, frames: np.ndarray, audio: Any, fps: Any, sample_rate: int, crf: int,
                  audio_bitrate: int) -> None:
    """A whole uint8 video ``[F, H, W, 3]`` (and its soundtrack) into ``target``."""
    count, height, width = frames.shape[:3]
    if count == 0:
        raise MediaError("cannot write a zero-length video (0 frames)")
    if audio is not None:  # checked before the file is opened, as before
        check_rate(sample_rate, "sample_rate")
        waveform_to_numpy(audio, "soundtrack")
    writer = Mp4Writer(target, width, height, fps=fps, with_audio=audio is not None, sample_rate=sample_rate,
                       crf=crf, audio_bitrate=audio_bitrate)
    try:
        writer.write(frames)
        writer.finish(audio)
    finally:
        writer.close()
