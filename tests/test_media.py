"""h3_core.media: decode/encode round trips, resampling, limits and errors. All media is synthesised here."""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image, ImageFile

from h3_core import media
from h3_core.media import MediaError

RNG = np.random.default_rng(1234)


def _reference_to_uint8(x: np.ndarray) -> np.ndarray:
    # diffusers 0.42.1 MiniMaxH3Ref2VASetupStep._normalize_video_condition, verbatim formula.
    return (x * 255.0).round().clip(0, 255).astype(np.uint8)


def _quadrants(height: int, width: int) -> np.ndarray:
    """Four flat colour blocks: survives H.264 well and shows orientation unambiguously."""
    image = np.zeros((height, width, 3), np.uint8)
    h, w = height // 2, width // 2
    image[:h, :w] = (230, 40, 40)
    image[:h, w:] = (40, 230, 40)
    image[h:, :w] = (40, 40, 230)
    image[h:, w:] = (230, 230, 40)
    return image


def _clip_frames(count: int, height: int, width: int) -> np.ndarray:
    base = _quadrants(height, width).astype(np.int16)
    frames = np.stack([np.roll(base, 2 * i, axis=1) for i in range(count)])
    return frames.astype(np.uint8)


def _write_audio_file(path, waveform: np.ndarray, rate: int, codec: str, fmt: str) -> None:
    """Encode float waveform [C, S] with PyAV (the codec's own sample format; AAC/MP3 chunked to their frames)."""
    layout = "mono" if waveform.shape[0] == 1 else "stereo"
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        sample_format = stream.codec_context.format.name
        step = 1152 if codec == "libmp3lame" else 1024
        for start in range(0, waveform.shape[1], step):
            chunk = np.ascontiguousarray(waveform[:, start : start + step], dtype=np.float32)
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
            frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
            if sample_format != "fltp":
                frame = av.AudioResampler(format=sample_format, layout=layout, rate=rate).resample(frame)[0]
                frame.pts = start
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def _peak_hz(signal: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(signal * np.hanning(len(signal))))
    return float(np.fft.rfftfreq(len(signal), 1.0 / rate)[np.argmax(spectrum)])


# ---------------------------------------------------------------------------------------------------- images


def test_png_round_trip_bytes_path_and_file_object(tmp_path):
    image = RNG.integers(0, 256, (37, 54, 3), dtype=np.uint8)
    data = media.encode_png_bytes(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(media.read_image(data), image)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    for source in (path, str(path), bytearray(data), memoryview(data), io.BytesIO(data)):
        out = media.read_image(source)
        assert out.dtype == np.uint8 and out.shape == (37, 54, 3)
        np.testing.assert_array_equal(out, image)
    # Float input goes through the reference rounding first.
    floats = RNG.random((8, 6, 3)).astype(np.float32)
    np.testing.assert_array_equal(media.read_image(media.encode_png_bytes(floats)), _reference_to_uint8(floats))


def test_image_modes_become_rgb(tmp_path):
    rgba = RNG.integers(0, 256, (10, 12, 4), dtype=np.uint8)
    grey = RNG.integers(0, 256, (10, 12), dtype=np.uint8)
    cases = {
        "rgba.png": (Image.fromarray(rgba), rgba[..., :3]),  # alpha dropped, as convert("RGB") does
        "grey.png": (Image.fromarray(grey), np.repeat(grey[..., None], 3, axis=2)),
        "grey16.png": (Image.fromarray(grey.astype(np.uint16) * 257), np.repeat(grey[..., None], 3, 2)),
        "lossless.webp": (Image.fromarray(np.ascontiguousarray(rgba[..., :3])), rgba[..., :3]),
    }
    palette = Image.fromarray(grey).convert("P")
    cases["palette.png"] = (palette, np.asarray(palette.convert("RGB")))
    for name, (image, expected) in cases.items():
        path = tmp_path / name
        image.save(path, lossless=True) if name.endswith(".webp") else image.save(path)
        out = media.read_image(path)
        assert out.shape == (10, 12, 3) and out.dtype == np.uint8, name
        np.testing.assert_array_equal(out, expected, err_msg=name)
    # JPEG is lossy (chroma subsampling blurs the block edges): block interiors come back close.
    buffer = io.BytesIO()
    Image.fromarray(_quadrants(32, 32)).save(buffer, "JPEG", quality=95)
    decoded = media.read_image(buffer.getvalue()).astype(int)
    assert np.abs(decoded - _quadrants(32, 32))[[4, 4, 27, 27], [4, 27, 4, 27]].max() <= 3


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose valid IHDR claims width x height but which holds almost no pixel data."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(
        b"IEND", b""
    )


def test_image_pixel_cap_refused_from_header(monkeypatch):
    bomb = _png_claiming(12000, 12000)  # 144 Mpx: decoding would allocate 432 MB (and fail on the data)
    loads = []

    def spy(self):
        loads.append(self.size)
        raise RuntimeError("pixel data decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    with pytest.raises(MediaError, match=r"12000x12000 .*max_pixels=1000000"):
        media.read_image(bomb, max_pixels=1_000_000)
    assert loads == []  # refused before any pixel was decoded
    with pytest.raises(RuntimeError, match="pixel data decoded"):  # the spy does see a decode under the cap
        media.read_image(bomb, max_pixels=200_000_000)
    assert loads == [(12000, 12000)]
    monkeypatch.undo()
    small = media.encode_png_bytes(np.zeros((20, 50, 3), np.uint8))
    assert media.read_image(small, max_pixels=1000).shape == (20, 50, 3)
    with pytest.raises(MediaError, match="max_pixels=999"):
        media.read_image(small, max_pixels=999)


# ---------------------------------------------------------------------------------------------------- garbage


def test_garbage_missing_and_empty_inputs(tmp_path):
    garbage = bytes(RNG.integers(0, 256, 4096, dtype=np.uint8))
    for reader, kind in ((media.read_image, "image"), (media.read_video, "video"), (media.read_audio, "audio")):
        with pytest.raises(MediaError, match=kind):
            reader(garbage)
        with pytest.raises(MediaError, match="zero-length"):
            reader(b"")
        with pytest.raises(MediaError, match="not found"):
            reader(tmp_path / "missing.bin")
    with pytest.raises(MediaError, match="unreadable"):
        media.probe(garbage)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(MediaError, match="zero-length"):
        media.read_video(empty)
    # Right container, wrong content.
    wav = media.encode_wav_bytes(np.zeros((1, 1000), np.float32), 16000)
    with pytest.raises(MediaError, match="no video stream"):
        media.read_video(wav)
    silent = media.encode_mp4_bytes(np.zeros((3, 16, 16, 3), np.uint8))
    with pytest.raises(MediaError, match="no audio stream"):
        media.read_audio(silent)
    assert isinstance(MediaError("x"), ValueError)


# ---------------------------------------------------------------------------------------------------- float -> uint8


def test_frames_to_uint8_is_the_reference_formula():
    # Every exact half step k/510 hits the round-half-to-even boundary; plus out-of-range values.
    edges = np.concatenate([np.arange(511) / 510.0, [-0.3, -0.0, 1.0, 1.2, 0.5 / 255, 1.5 / 255, 254.5 / 255]])
    noise = RNG.random(4 * 8 * 8 * 3)
    for dtype in (np.float16, np.float32, np.float64):
        values = np.concatenate([edges, noise]).astype(dtype)
        values = np.resize(values, (values.size // 48 + 1) * 48).reshape(-1, 4, 4, 3)
        out = media.frames_to_uint8(values)
        assert out.dtype == np.uint8 and out.shape == values.shape
        np.testing.assert_array_equal(out, _reference_to_uint8(values), err_msg=str(dtype))
    uint8 = RNG.integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    np.testing.assert_array_equal(media.frames_to_uint8(uint8), uint8)
    frame = RNG.random((1, 5, 7, 3)).astype(np.float32)
    np.testing.assert_array_equal(media.image_to_uint8(frame), _reference_to_uint8(frame[0]))
    with pytest.raises(MediaError, match="NaN"):
        media.frames_to_uint8(np.full((1, 2, 2, 3), np.nan, np.float32))
    with pytest.raises(MediaError, match=r"\[frames, height, width, 3\]"):
        media.frames_to_uint8(np.zeros((2, 4, 4, 4), np.float32))


def test_frames_to_uint8_accepts_torch_like_comfy_images():
    torch = pytest.importorskip("torch")
    images = torch.rand(3, 6, 5, 3, generator=torch.Generator().manual_seed(0))  # ComfyUI IMAGE: [B, H, W, C]
    np.testing.assert_array_equal(media.frames_to_uint8(images), _reference_to_uint8(images.numpy()))
    bf16 = images.to(torch.bfloat16)
    np.testing.assert_array_equal(media.frames_to_uint8(bf16), _reference_to_uint8(bf16.float().numpy()))
    np.testing.assert_array_equal(media.image_to_uint8(images[:1]), _reference_to_uint8(images[0].numpy()))


# ---------------------------------------------------------------------------------------------------- mp4


def test_write_mp4_probe_and_read_back(tmp_path):
    count, height, width, rate = 31, 48, 64, 32000  # 31 frames: F/24 s is not a whole number of samples
    frames = _clip_frames(count, height, width)
    seconds = np.arange(rate * 2) / rate
    audio = np.stack([0.4 * np.sin(2 * np.pi * 440 * seconds), 0.3 * np.sin(2 * np.pi * 1000 * seconds)])
    path = media.write_mp4(tmp_path / "clip.mp4", frames, audio.astype(np.float32))
    assert path == str(tmp_path / "clip.mp4") and not list(tmp_path.glob(".partial-*"))

    info = media.probe(path)
    assert (info["width"], info["height"], info["fps"], info["frames"]) == (width, height, 24.0, count)
    assert (info["sample_rate"], info["channels"]) == (32000, 2)
    video, sound = (next(s for s in info["streams"] if s["type"] == kind) for kind in ("video", "audio"))
    assert video["codec"] == "h264" and sound["codec"] == "aac" and sound["layout"] == "stereo"
    assert abs(sound["duration"] - count / 24) <= 1024 / 32000  # within one AAC frame of F/24
    assert abs(video["duration"] - count / 24) < 1e-6

    clip = media.read_video(path)
    assert clip.frames.shape == (count, height, width, 3) and clip.frames.dtype == np.uint8
    assert clip.fps == 24.0 and clip.num_frames == count
    assert np.abs(clip.frames.astype(int) - frames).mean() < 4  # lossy, but colours land where they were
    assert clip.sample_rate == 32000 and clip.audio.dtype == np.float32 and clip.audio.shape[0] == 2
    expected = round(count * 32000 / 24)  # 41333
    assert expected <= clip.audio.shape[1] <= expected + 1024  # AAC's last-frame padding is kept, as FFmpeg does
    middle = slice(4000, 36000)
    for channel, hz in ((0, 440), (1, 1000)):
        assert abs(_peak_hz(clip.audio[channel, middle], 32000) - hz) < 2
        np.testing.assert_allclose(clip.audio[channel, middle], audio[channel, middle], atol=0.05)
    # The soundtrack is exactly what read_audio decodes.
    waveform, sample_rate = media.read_audio(path)
    assert sample_rate == 32000
    np.testing.assert_array_equal(waveform, clip.audio)


def test_write_mp4_audio_fits_video_duration_and_bytes_match_file(tmp_path):
    frames = RNG.random((12, 32, 32, 3)).astype(np.float32)  # float frames: rounded like the reference
    mono_short = np.full((1, 1000), 0.25, np.float32)  # 1000 of 16000 samples: zero-padded; mono -> stereo
    info = media.probe(media.encode_mp4_bytes(frames, mono_short))
    assert info["channels"] == 2 and abs(info["duration"] - 0.5) <= 1024 / 32000
    surround = np.full((6, 96000), 0.1, np.float32)  # 3 s of 6 channels: trimmed to 0.5 s, first two kept
    path = media.write_mp4(tmp_path / "a.mp4", frames, surround)
    assert media.probe(path)["channels"] == 2
    assert abs(media.probe(path)["streams"][1]["duration"] - 0.5) <= 1024 / 32000
    # The bytes helper writes exactly what the file path gets.
    assert media.encode_mp4_bytes(frames, surround) == open(path, "rb").read()
    no_audio = media.read_video(media.encode_mp4_bytes(frames))
    assert no_audio.audio is None and no_audio.sample_rate is None
    np.testing.assert_array_equal(media.frames_to_uint8(frames).shape, no_audio.frames.shape)


def test_write_mp4_rejects_odd_size_and_empty(tmp_path):
    with pytest.raises(MediaError, match="even"):
        media.write_mp4(tmp_path / "odd.mp4", np.zeros((2, 33, 32, 3), np.uint8))
    with pytest.raises(MediaError, match="zero-length"):
        media.write_mp4(tmp_path / "none.mp4", np.zeros((0, 32, 32, 3), np.uint8))
    assert not list(tmp_path.iterdir())  # nothing partial left behind


def test_read_video_limits():
    data = media.encode_mp4_bytes(_clip_frames(20, 32, 48), np.zeros((2, 32000), np.float32))
    with pytest.raises(MediaError, match=r"48x32 = 1536 pixels, over the limit of max_pixels=1000"):
        media.read_video(data, max_pixels=1000)
    with pytest.raises(MediaError, match="max_frames=10"):
        media.read_video(data, max_frames=10)
    clip = media.read_video(data, max_frames=10, truncate=True)
    assert clip.num_frames == 10 and clip.audio.shape == (2, int(10 / 24 * 32000))
    full = media.read_video(data, max_frames=20, max_pixels=1536)
    assert full.num_frames == 20
    np.testing.assert_array_equal(full.frames[:10], clip.frames)


def test_display_rotation_is_applied_upright():
    upright = _quadrants(64, 32)  # portrait
    coded = np.ascontiguousarray(np.rot90(upright, k=1))  # stored turned a quarter counter-clockwise (landscape)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        # The display transform turns the picture by -90 degrees counter-clockwise (= a clockwise quarter turn):
        # what an iPhone portrait clip carries ("rotate: 90"; ffprobe "rotation of -90.00 degrees").
        stream.set_display_rotation(-90)
        for index in range(3):
            frame = av.VideoFrame.from_ndarray(coded, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    clip = media.read_video(buffer.getvalue())
    assert clip.frames.shape == (3, 64, 32, 3)
    assert np.abs(clip.frames[0].astype(int) - upright).mean() < 4
    assert media.probe(buffer.getvalue())["width"] == 64  # headers give the coded size


# ---------------------------------------------------------------------------------------------------- audio


def test_wav_44k_read_and_resample_keeps_frequencies(tmp_path):
    rate, seconds = 44100, 1.0
    t = np.arange(int(rate * seconds)) / rate
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 1000 * t), 0.5 * np.sin(2 * np.pi * 3000 * t)]).astype(np.float32)
    path = tmp_path / "tone.wav"
    _write_audio_file(path, stereo, rate, "pcm_s16le", "wav")
    waveform, sample_rate = media.read_audio(path)
    assert sample_rate == 44100 and waveform.shape == (2, 44100) and waveform.dtype == np.float32
    np.testing.assert_allclose(waveform, stereo, atol=1 / 32768 + 1e-7)

    out = media.resample_audio(waveform, sample_rate)
    assert out.shape == (2, 32000) and out.dtype == np.float32 and out.flags.c_contiguous
    assert abs(_peak_hz(out[0], 32000) - 1000) < 1.5 and abs(_peak_hz(out[1], 32000) - 3000) < 1.5
    # Time-aligned with the input: it matches the analytic tone away from the edges.
    t32 = np.arange(32000) / 32000
    np.testing.assert_allclose(out[0, 500:-500], 0.5 * np.sin(2 * np.pi * 1000 * t32[500:-500]), atol=2e-3)
    np.testing.assert_array_equal(out, media.resample_audio(waveform, sample_rate))  # deterministic
    # Truncated decoding stops at int(max_seconds * rate).
    assert media.read_audio(path, max_seconds=0.25)[0].shape == (2, 11025)


@pytest.mark.parametrize(
    "samples, rate",
    [(44101, 44100), (1000, 44100), (66157, 22050), (100, 48000), (7, 48000), (1, 48000), (24001, 8000)],
)
def test_resample_length_contract(samples, rate):
    waveform = RNG.standard_normal((2, samples)).astype(np.float32) * 0.1
    out = media.resample_audio(waveform, rate)
    expected = -(-samples * 32000 // rate)  # ceil(S * 32000 / rate), torchaudio's Resample length
    assert out.shape == (2, expected) == (2, media.resampled_length(samples, rate))


def test_resample_length_follows_torchaudio_rounding():
    # torchaudio.functional's _apply_sinc_resample_kernel: ceil(torch.as_tensor(new * length / orig)) with the rates
    # reduced by their gcd; as_tensor makes the quotient float32 first, which can move the ceiling by one sample.
    samples = 219341  # 44.1 kHz -> 32 kHz: 159159.0023 exactly, ceil 159160; float32 rounds to 159159.0
    torchaudio_length = int(np.ceil(np.float32(320 * samples / 441)))
    assert torchaudio_length == -(-samples * 32000 // 44100) - 1 == 159159
    assert media.resampled_length(samples, 44100) == torchaudio_length
    assert media.resample_audio(np.zeros((1, samples), np.float32), 44100).shape == (2, torchaudio_length)


def test_resample_channels_and_identity():
    mono = RNG.standard_normal((1, 4410)).astype(np.float32)
    out = media.resample_audio(mono, 44100)
    assert out.shape == (2, 3200)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(media.resample_audio(mono[0], 44100), out)  # 1-D is mono
    # At the target rate nothing is resampled: a copy, identical values.
    stereo = RNG.standard_normal((2, 500)).astype(np.float32)
    same = media.resample_audio(stereo, 32000)
    assert same is not stereo and not np.shares_memory(same, stereo)
    np.testing.assert_array_equal(same, stereo)
    np.testing.assert_array_equal(media.resample_audio(mono, 32000), np.repeat(mono, 2, axis=0))
    # Channels beyond two are dropped, not mixed.
    surround = RNG.standard_normal((6, 500)).astype(np.float64)
    np.testing.assert_array_equal(media.resample_audio(surround, 32000), surround[:2].astype(np.float32))
    with pytest.raises(MediaError, match="zero-length"):
        media.resample_audio(np.zeros((2, 0), np.float32), 44100)
    with pytest.raises(MediaError, match="sample_rate"):
        media.resample_audio(stereo, 0)


def test_compressed_audio_formats(tmp_path):
    rate = 44100
    t = np.arange(rate // 2) / rate
    tone = (0.5 * np.sin(2 * np.pi * 660 * t)).astype(np.float32)[None]
    for name, codec, fmt, exact in (
        ("tone.flac", "flac", "flac", True),
        ("tone.mp3", "libmp3lame", "mp3", False),
        ("tone.m4a", "aac", "ipod", False),
        ("tone.aac", "aac", "adts", False),
    ):
        path = tmp_path / name
        _write_audio_file(path, tone, rate, codec, fmt)
        waveform, sample_rate = media.read_audio(path)
        assert sample_rate == rate and waveform.shape[0] == 1, name
        if exact:
            np.testing.assert_allclose(waveform, tone, atol=1 / 32768 + 1e-7)
        else:
            assert tone.shape[1] <= waveform.shape[1] <= tone.shape[1] + 2 * 1152, (name, waveform.shape)
            assert abs(_peak_hz(waveform[0, 2000:20000], rate) - 660) < 4, name
        assert media.resample_audio(waveform, sample_rate).shape == (2, media.resampled_length(waveform.shape[1], rate))


def test_wav_bytes_round_trip():
    waveform = (RNG.standard_normal((2, 3000)) * 0.3).astype(np.float32)
    back, rate = media.read_audio(media.encode_wav_bytes(waveform, 32000))
    assert rate == 32000
    np.testing.assert_array_equal(back, waveform)  # float WAV is lossless
    back16, _ = media.read_audio(media.encode_wav_bytes(waveform, 32000, sample_format="s16"))
    expected16 = np.clip(np.round(waveform.astype(np.float64) * 32768), -32768, 32767) / 32768
    np.testing.assert_array_equal(back16, expected16.astype(np.float32))
    info = media.probe(media.encode_wav_bytes(waveform[:1], 16000))
    assert (info["sample_rate"], info["channels"], info["width"]) == (16000, 1, None)
    assert abs(info["duration"] - 3000 / 16000) < 1e-3


# ---------------------------------------------------------------------------------------------------- diffusers parity


@pytest.fixture(scope="module")
def diffusers_h3():
    try:
        from diffusers.modular_pipelines.minimax_h3 import before_encoder, references
    except ImportError as error:  # pragma: no cover - diffusers is a runtime requirement
        pytest.skip(f"diffusers MiniMax-H3 not importable: {error}")
    return references, before_encoder


def test_decoding_matches_diffusers_reference(tmp_path, diffusers_h3):
    references, before_encoder = diffusers_h3
    path = media.write_mp4(
        tmp_path / "ref.mp4", _clip_frames(10, 32, 64), (RNG.standard_normal((2, 20000)) * 0.1).astype(np.float32)
    )
    frames, fps, audio, sample_rate = references._decode_video_file(str(path))
    clip = media.read_video(path)
    np.testing.assert_array_equal(clip.frames, frames)
    assert clip.fps == fps and clip.sample_rate == sample_rate
    np.testing.assert_array_equal(clip.audio, audio.numpy())
    # A display rotation: diffusers 0.42.1 turns a quarter-turn clip the other way from FFmpeg (np.rot90(k=-turns)
    # where FFmpeg's autorotate, and this module, use k=+turns), so the two differ by exactly a half turn.
    rotated = tmp_path / "rotated.mp4"
    with av.open(str(rotated), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.set_display_rotation(-90)
        for index, picture in enumerate(_clip_frames(2, 32, 64)):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    theirs_rotated = references._decode_video_file(str(rotated))[0]
    np.testing.assert_array_equal(media.read_video(rotated).frames, np.rot90(theirs_rotated, 2, axes=(1, 2)))
    waveform, rate = references._decode_audio_file(str(path))
    np.testing.assert_array_equal(media.read_audio(path)[0], waveform.numpy())
    # The float -> uint8 step is the setup step's own (frames at 24 fps, already on their canvas: no resize).
    floats = RNG.random((3, 64, 64, 3)).astype(np.float32)
    ours = media.frames_to_uint8(floats)
    theirs = before_encoder.MiniMaxH3Ref2VASetupStep._normalize_video_condition(
        floats, 24.0, 3, 32, 64, 64 * 64, 24.0
    )
    np.testing.assert_array_equal(ours, theirs)


# ---------------------------------------------------------------------------------------------------- targets


def _encoded_clip(count: int, height: int, width: int, fps: float, rotation: int = 0) -> bytes:
    """Noisy frames (every pixel matters to a resize) at ``fps``, optionally with a display rotation."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(RNG.integers(0, 256, (height, width, 3), dtype=np.uint8), "rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "count, height, width, fps, rotation",
    [(20, 48, 64, 9, 0), (30, 64, 64, 30, 0), (24, 72, 128, 24, 0), (50, 40, 96, 60, -90), (13, 64, 112, 23.976, 0),
     (10, 32, 64, 24, 180), (40, 36, 64, 12.5, 90)],
)
def test_video_target_is_diffusers_normalisation_frame_by_frame(diffusers_h3, count, height, width, fps, rotation):
    _, before_encoder = diffusers_h3
    normalise = before_encoder.MiniMaxH3Ref2VASetupStep._normalize_video_condition
    data = _encoded_clip(count, height, width, fps, rotation)
    plain = media.read_video(data)
    for num_frames, short_edge, max_pixels in [(22, 64, 64 * 112), (124, 64, 64 * 112), (5, 32, 32 * 64),
                                               (39, 48, 48 * 80)]:
        expected = normalise(plain.frames, float(plain.fps), num_frames, 32, short_edge, max_pixels, 24.0)
        clip = media.read_video(data, target=media.VideoTarget(num_frames, short_edge, max_pixels))
        np.testing.assert_array_equal(clip.frames, expected)
        assert clip.fps == 24.0 and clip.source_frames == count and clip.source_fps == plain.fps
        assert clip.source_seconds == plain.duration  # what the rules' 2-15 s check reads
        # diffusers leaves a normalised clip untouched, so the conditioning is what it always was.
        np.testing.assert_array_equal(normalise(clip.frames, clip.fps, num_frames, 32, short_edge, max_pixels, 24.0),
                                      expected)
        np.testing.assert_array_equal(clip.audio, plain.audio)
    # An fps override (the protocol's per-reference fps) is the rate the frames are taken to run at.
    clip = media.read_video(data, target=media.VideoTarget(124, 64, 64 * 112), fps=10.0)
    np.testing.assert_array_equal(clip.frames, normalise(plain.frames, 10.0, 124, 32, 64, 64 * 112, 24.0))
    assert clip.source_seconds == count / 10.0


def test_canvas_size_is_diffusers_rule(diffusers_h3):
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    for short_edge, max_pixels in ((768, 768 * 1344), (64, 64 * 112), (48, 48 * 80)):
        for width in range(60, 4000, 37):
            for height in (width // 4, width // 3 + 1, width // 2, (width * 9) // 16, width - 7, width, 2 * width,
                           4 * width):
                if height <= 0 or not 0.25 <= width / height <= 4:
                    continue
                theirs = resolve_canvas_size(width, height, 32, short_edge, max_pixels)[::-1]
                assert media.canvas_size(width, height, short_edge, max_pixels) == theirs, (width, height)
    with pytest.raises(MediaError, match="within 1:4 and 4:1"):
        media.canvas_size(500, 100, 768, 768 * 1344)


def test_video_target_refusals_come_before_decoding():
    data = _encoded_clip(3, 32, 160, 24)  # 5:1
    with pytest.raises(MediaError, match="within 1:4 and 4:1, got 160x32"):
        media.read_video(data, target=media.VideoTarget(124, 64, 64 * 112))
    with pytest.raises(MediaError, match="num_frames must be at least 1"):
        media.read_video(data, target=media.VideoTarget(0, 64, 64 * 112))
    with pytest.raises(MediaError, match="fps must be positive"):
        media.read_video(_encoded_clip(3, 32, 64, 24), fps=0.0)


def test_video_target_of_an_extreme_aspect_keeps_the_decoded_size():
    """A 4:1 clip on the tiny canvas rule rounds to 160x32 (5:1), outside the rule's own limits: the frames are kept
    at their decoded size (diffusers resizes them once, as always) instead of the decode failing."""
    from h3_core.media.video import _target_size

    target = media.VideoTarget(124, 64, 64 * 112)
    assert _target_size((64, 256), target) == (64, 256)
