"""The encoder protocol without a server: JSON validation, part checks, lossless wire round trip, cache keys."""

import json

import numpy as np
import pytest

from h3_core import facts, media, rules
from h3_core.remote import protocol
from h3_core.remote.client import packing
from h3_core.remote.protocol import Limits, ProtocolError, is_loopback
from h3_core.remote.server import ingest, request_schema
from h3_core.remote.server.config import ServerConfigError, check_bind
from h3_core.remote.server.ingest import Part
from h3_core.request import AudioInput, EncodeRequest, VideoInput
from h3_core.testing import png_bomb


def _image(seed, height, width):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _tone(seconds, rate=32000, freq=440.0, channels=2):
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * freq * (1 + c / 2) * t) for c in range(channels)]).astype(np.float32)


def _parse(**fields):
    body = {"protocol": 2, "prompt": "a fox", **fields}
    return request_schema.parse_request(body, Limits(), max_deadline_s=600)


def _error(**fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        _parse(**fields)
    return info.value


def test_minimal_request_defaults():
    spec = _parse()
    assert spec.resolved_task == "t2va" and spec.num_frames == facts.DEFAULT_FRAMES and spec.media() == []


def test_output_length_is_an_operator_setting_with_todays_default():
    """The server takes H3's lengths up to its `max_num_frames` (`serve --max-frames`): 345 frames (H3's trained
    15 s) unless the operator raises it, at most to facts.MAX_FRAMES; beyond the setting a 422 names it."""
    assert Limits().max_num_frames == facts.TRAINED_MAX_FRAMES == 345
    assert _parse(num_frames=5).num_frames == 5  # the shortest clip (text to image) needs no setting
    error = _error(num_frames=481)
    assert (error.status, error.code, error.field) == (422, "invalid_request", "num_frames")
    assert "max_num_frames=345" in error.message and "--max-frames" in error.message and "3592" in error.message
    raised = Limits(max_num_frames=facts.MAX_FRAMES)
    body = {"protocol": 2, "prompt": "a fox", "num_frames": 481}
    assert request_schema.parse_request(body, raised, max_deadline_s=600).num_frames == 481
    with pytest.raises(ProtocolError, match="within 5-3592 frames"):  # beyond H3's own lengths: H3's message
        request_schema.parse_request({**body, "num_frames": 3609}, raised, max_deadline_s=600)
    lowered = Limits(max_num_frames=124)
    with pytest.raises(ProtocolError, match="max_num_frames=124"):
        request_schema.parse_request({**body, "num_frames": 141}, lowered, max_deadline_s=600)
    caps = raised.to_json()
    assert caps["num_frames"] == [5, 3592] and caps["trained_num_frames"] == [124, 345]
    assert Limits().to_json()["num_frames"] == [5, 345]
    for bad_setting in (4, 3609, 1.5e3):
        with pytest.raises(ValueError, match="max_num_frames must be an integer within 5-3592"):
            Limits(max_num_frames=bad_setting)


def test_serve_max_frames_flag():
    from h3_core.cli import build_parser
    from h3_core.remote.engines.aiohttp_server import config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--models", "m", "--max-frames", "481"])
    assert config_from_args(args, None).limits.max_num_frames == 481
    assert config_from_args(parser.parse_args(["serve", "--models", "m"]), None).limits.max_num_frames == 345
    with pytest.raises(ServerConfigError, match="--max-frames must be within 5-3592"):
        config_from_args(parser.parse_args(["serve", "--models", "m", "--max-frames", "9999"]), None)
    # the canvas caps: today's values by default, an operator may lower them (never beyond what the contract holds)
    lowered = config_from_args(parser.parse_args(["serve", "--models", "m", "--max-canvas-edge", "1024",
                                                  "--max-canvas-pixels", "524288"]), None).limits
    assert (lowered.max_canvas_edge, lowered.max_canvas_pixels) == (1024, 524288)
    body = {"protocol": 2, "prompt": "a fox", "width": 1344, "height": 768}
    with pytest.raises(ProtocolError, match="max_canvas_edge=1024") as info:
        request_schema.parse_request(body, lowered, max_deadline_s=600)
    assert info.value.status == 413
    assert (config_from_args(parser.parse_args(["serve", "--models", "m"]), None).limits.max_canvas_edge == 2016)
    # ... or raise them up to the bound the contract holds (4096 px, 4096x2304), as ComfyUI core allows large canvases
    raised = config_from_args(parser.parse_args(["serve", "--models", "m", "--max-canvas-edge", "4096",
                                                 "--max-canvas-pixels", str(4096 * 2304)]), None).limits
    large = {"protocol": 2, "prompt": "a fox", "width": 3840, "height": 2176}
    assert request_schema.parse_request(large, raised, max_deadline_s=600).width == 3840
    with pytest.raises(ProtocolError, match="serve --max-canvas-edge / --max-canvas-pixels up to 4096"):
        request_schema.parse_request(large, config_from_args(parser.parse_args(["serve", "--models", "m"]),
                                                             None).limits, max_deadline_s=600)
    with pytest.raises(ServerConfigError, match="--max-canvas-edge must be within 32-4096"):
        config_from_args(parser.parse_args(["serve", "--models", "m", "--max-canvas-edge", "8192"]), None)


@pytest.mark.parametrize(
    "fields, status, code, field",
    [
        ({"num_frames": 125}, 422, "invalid_request", "num_frames"),
        ({"num_frames": 362}, 422, "invalid_request", "num_frames"),
        ({"num_frames": 124.0}, 400, "bad_request", "num_frames"),
        ({"num_frames": True}, 400, "bad_request", "num_frames"),
        ({"width": 64}, 422, "invalid_request", "height"),
        ({"width": 65, "height": 64}, 422, "invalid_request", "width"),
        ({"width": 64 * 5, "height": 64}, 422, "invalid_request", "width"),
        ({"width": 8192, "height": 4096}, 413, "too_large", "width"),
        ({"task": "i2v"}, 422, "invalid_request", "task"),
        ({"task": "fl2va"}, 422, "invalid_request", "task"),
        ({"protocol": 1}, 400, "protocol_mismatch", "protocol"),
        ({"protocol": "2"}, 400, "bad_request", "protocol"),
        ({"prompt": "   "}, 422, "invalid_request", "prompt"),
        ({"prompt": 5}, 400, "bad_request", "prompt"),
        ({"prompt": "x" * 20000}, 413, "too_large", "prompt"),
        ({"prompt": "a\ud800b"}, 400, "bad_request", "prompt"),
        ({"num_frame": 124}, 400, "bad_request", "the request"),
        ({"deadline_s": 0}, 422, "invalid_request", "deadline_s"),
        ({"deadline_s": 10_000}, 422, "invalid_request", "deadline_s"),
        ({"model": "not hex!"}, 400, "bad_request", "model"),
        ({"ref_images": [{"part": f"i{i}"} for i in range(10)]}, 422, "invalid_request", None),
        ({"ref_images": [{"part": "../etc/passwd"}]}, 400, "bad_request", "ref_images[0].part"),
        ({"ref_images": [{"part": "a"}, {"part": "a"}]}, 400, "bad_request", "ref_images[1].part"),
        ({"ref_images": [{"part": "request"}]}, 400, "bad_request", "ref_images[0].part"),
        ({"ref_images": [{"part": "a", "path": "/x"}]}, 400, "bad_request", "ref_images[0]"),
        ({"ref_images": "a.png"}, 400, "bad_request", "ref_images"),
        ({"ref_videos": [{"part": "v", "fps": -1}]}, 422, "invalid_request", "ref_videos[0].fps"),
        ({"ref_videos": [{"part": "v", "soundtrack": True}]}, 400, "bad_request", "ref_videos[0].soundtrack"),
        ({"ref_audios": [{"part": "a"}]}, 422, "invalid_request", None),  # audio cannot be the only reference
        ({"first_frame": {"part": "k"}, "ref_images": [{"part": "i"}]}, 422, "invalid_request", None),
    ],
)
def test_request_errors_name_the_constraint(fields, status, code, field):
    error = _error(**fields)
    assert (error.status, error.code, error.field) == (status, code, field), error.message
    assert error.message and len(error.message) < 600
    body = error.body("rid")
    assert set(body["error"]) == {"code", "message", "field", "request_id"}


# A request with two faults gets the error of the field read first. parse_request reads: the keys, protocol,
# prompt, task, num_frames, the canvas (size caps before H3's canvas rules), first/last frame, the reference lists,
# model, deadline_s, H3's rules on the counts, then the part names. Each case pins one step of that order.
@pytest.mark.parametrize(
    "fields, status, field",
    [
        ({"num_frame": 124, "protocol": 1}, 400, "the request"),
        ({"protocol": 1, "prompt": 5}, 400, "protocol"),
        ({"prompt": 5, "task": "i2v"}, 400, "prompt"),
        ({"task": "i2v", "num_frames": 125}, 422, "task"),
        ({"num_frames": 125, "width": 65, "height": 64}, 422, "num_frames"),
        ({"width": 8200, "height": 4100}, 413, "width"),  # too large and off the grid: the size is named
        ({"width": 65, "height": 64, "first_frame": {"part": 1}}, 422, "width"),
        ({"first_frame": {"part": 1}, "last_frame": "x"}, 400, "first_frame.part"),
        ({"last_frame": "x", "ref_images": "x"}, 400, "last_frame"),
        ({"ref_images": "x", "ref_videos": "x"}, 400, "ref_images"),
        ({"ref_videos": [{"part": "v", "fps": 0, "soundtrack": True}]}, 422, "ref_videos[0].fps"),
        ({"ref_videos": [{"part": "v", "soundtrack": True}], "ref_audios": "x"}, 400, "ref_videos[0].soundtrack"),
        ({"ref_audios": "x", "model": "not hex!"}, 400, "ref_audios"),
        ({"model": "not hex!", "deadline_s": 0}, 400, "model"),
        ({"deadline_s": 0, "task": "fl2va"}, 422, "deadline_s"),
        ({"first_frame": {"part": "k"}, "ref_images": [{"part": "k"}]}, 422, None),  # H3's rules before part names
        ({"ref_images": [{"part": "a"}, {"part": "a"}, {"part": "b"}, {"part": "b"}]}, 400, "ref_images[1].part"),
    ],
)
def test_request_field_order_decides_which_fault_is_named(fields, status, field):
    error = _error(**fields)
    assert (error.status, error.field) == (status, field), error.message


def test_too_many_parts_is_checked_after_their_names():
    limits = Limits(max_parts=2)
    body = {"protocol": 2, "prompt": "a fox", "ref_images": [{"part": "a"}, {"part": "b"}, {"part": "a"}]}
    with pytest.raises(ProtocolError) as info:
        request_schema.parse_request(body, limits)
    assert (info.value.status, info.value.field) == (400, "ref_images[2].part")
    body["ref_images"][2]["part"] = "c"
    with pytest.raises(ProtocolError) as info:
        request_schema.parse_request(body, limits)
    assert (info.value.status, info.value.field) == (413, "request")


def test_strict_json():
    for raw in (b'{"protocol": 2, "prompt": NaN}', b'{"a": 1, "a": 2}', b"[" * 5000, b"\xff\xfe", b'{"x": 1e999}'):
        with pytest.raises(ProtocolError) as info:
            request_schema.parse_request_json(raw)
        assert info.value.status == 400
    with pytest.raises(ProtocolError) as info:
        request_schema.parse_request_json(b" " * (Limits().max_json_bytes + 1))
    assert info.value.status == 413


@pytest.mark.parametrize("fields, status, field", [
    ({"deadline_s": 10**400}, 422, "deadline_s"),  # was a 500: math.isfinite(10**400) raises OverflowError
    ({"deadline_s": -10**400}, 422, "deadline_s"),
    ({"deadline_s": 1e300}, 422, "deadline_s"),
    ({"deadline_s": float("nan")}, 400, "deadline_s"),
    ({"ref_videos": [{"part": "v", "fps": 10**400}]}, 422, "ref_videos[0].fps"),  # was a 500 too
    ({"ref_videos": [{"part": "v", "fps": float("inf")}]}, 400, "ref_videos[0].fps"),
    ({"ref_videos": [{"part": "v", "fps": True}]}, 400, "ref_videos[0].fps"),
    ({"width": 10**400, "height": 64}, 422, "width"),
    ({"width": 64, "height": -64}, 422, "height"),  # a rule on the height alone names the height
    ({"protocol": 10**400}, 400, "protocol"),
])
def test_huge_and_non_finite_numbers_name_their_field(fields, status, field):
    error = _error(**fields)
    assert (error.status, error.field) == (status, field), error.message
    assert len(error.message) < 400, error.message  # a 401-digit number is not echoed whole


@pytest.mark.parametrize("literal, field", [
    ("1e400", "deadline_s"), ("-1e400", "deadline_s"), ("NaN", "num_frames"), ("Infinity", "width"),
    ("1" + "0" * 400, "deadline_s"), ("-" + "9" * 5000, "num_frames"),
])
def test_numbers_json_cannot_hold_are_refused_naming_their_field(literal, field):
    raw = '{"protocol": 2, "prompt": "a fox", "%s": %s}' % (field, literal)
    with pytest.raises(ProtocolError) as info:
        request_schema.parse_request_json(raw.encode())
    assert (info.value.status, info.value.code, info.value.field) == (400, "bad_request", field), info.value.message
    assert len(info.value.message) < 300
    nested = '{"protocol": 2, "ref_videos": [{"part": "v", "fps": %s}]}' % literal
    with pytest.raises(ProtocolError) as info:
        request_schema.parse_request_json(nested.encode())
    assert info.value.field == "ref_videos[0].fps", info.value.message


def test_part_checks_and_sniffing():
    png = media.encode_png_bytes(_image(0, 8, 8))
    wav = media.encode_wav_bytes(_tone(0.1), 32000)
    assert ingest.sniff(png) == "png" and ingest.sniff(wav) == "wav"
    ingest.check_part(Part("a", "image/png", png, ""), "image", "first_frame")
    for content_type, data, status in (
        ("image/jpeg", png, 415),  # declared type disagrees with the bytes
        ("text/plain", png, 415),
        ("image/png", b"GIF89a....", 415),
        ("image/png", b"", 422),
        ("audio/wav", png, 415),
    ):
        with pytest.raises(ProtocolError) as info:
            ingest.check_part(Part("a", content_type, data, ""), "audio" if "audio" in content_type else "image",
                                "x")
        assert info.value.status == status
    with pytest.raises(ProtocolError) as info:
        ingest.check_part(Part("a", "image/png", png, ""), "image", "x", Limits(max_image_bytes=10))
    assert info.value.status == 413
    for name in ("../x.png", "a/b.png", "a\\b", "x\x00.png", "..", ".hidden", "a" * 300):
        with pytest.raises(ProtocolError):
            ingest.check_filename(name, "x")
    ingest.check_filename("image0.png", "x")


@pytest.mark.parametrize("size", [(20000, 20000), (60000, 60000), (5000, 4000)])
def test_decompression_bomb_refused_before_decoding(size):
    spec = _parse(first_frame={"part": "k"})
    data = png_bomb(*size)
    assert len(data) < 100_000
    with pytest.raises(ProtocolError) as info:
        ingest.build_request(spec, {"k": Part("k", "image/png", data, "")}, Limits(max_image_pixels=4096 * 4096))
    assert info.value.status == 413 and info.value.code == "too_many_pixels"


def test_audio_over_the_cap_refused():
    spec = _parse(ref_images=[{"part": "i"}], ref_audios=[{"part": "a"}])
    parts = {
        "i": Part("i", "image/png", media.encode_png_bytes(_image(0, 8, 8)), ""),
        "a": Part("a", "audio/wav", media.encode_wav_bytes(_tone(40.0, 8000), 8000), ""),
    }
    with pytest.raises(ProtocolError) as info:
        ingest.build_request(spec, parts)
    assert info.value.status == 413 and info.value.code == "too_long"


def _wire_round_trip(request: EncodeRequest) -> EncodeRequest:
    body, raw_parts = packing.request_to_wire(request)
    content_type, buffers = packing.encode_multipart(body, raw_parts)
    payload = b"".join(buffers)
    assert content_type.startswith("multipart/form-data; boundary=") and payload.startswith(b"--")
    body = request_schema.parse_request_json(json.dumps(body).encode())
    spec = request_schema.parse_request(body)
    parts = {name: Part(name, ct, data, "") for name, ct, _, data in raw_parts}
    for name, (kind, where) in spec.part_kinds().items():
        ingest.check_part(parts[name], kind, where)
    return ingest.build_request(spec, parts)


def test_wire_round_trip_is_lossless():
    frames = np.stack([np.roll(_image(7, 30, 46), 2 * i, axis=1) for i in range(50)])  # odd-free but not /16
    request = EncodeRequest(
        prompt="<Picture 1> <Video 1> <Video 2> <Audio 3>",
        ref_images=[_image(3, 37, 53)],
        ref_videos=[
            VideoInput(frames=frames, fps=30000 / 1001, audio=_tone(2.1, 44100, channels=1), sample_rate=44100),
            VideoInput(frames=frames[:48], fps=23.5),
        ],
        ref_audios=[AudioInput(_tone(2.5, 22050), 22050)],
        num_frames=141,
    )
    back = _wire_round_trip(request)
    assert back.prompt == request.prompt and back.num_frames == 141 and back.task is None
    assert np.array_equal(back.ref_images[0], request.ref_images[0])
    for got, sent in zip(back.ref_videos, request.ref_videos):
        assert np.array_equal(got.frames, sent.frames) and got.fps == sent.fps
        assert got.sample_rate == sent.sample_rate
        assert (got.audio is None) == (sent.audio is None)
        if sent.audio is not None:
            assert got.audio.dtype == np.float32 and np.array_equal(got.audio, sent.audio)
    assert np.array_equal(back.ref_audios[0].waveform, request.ref_audios[0].waveform)
    assert back.ref_audios[0].sample_rate == 22050

    keyframes = EncodeRequest(prompt="door", first_frame=_image(1, 64, 96), last_frame=_image(2, 80, 96),
                              width=96, height=64)
    back = _wire_round_trip(keyframes)
    assert np.array_equal(back.first_frame, keyframes.first_frame)
    assert np.array_equal(back.last_frame, keyframes.last_frame) and (back.width, back.height) == (96, 64)


def test_cache_key_covers_what_changes_the_output():
    digests = {"k": "a" * 64}
    base = _parse(first_frame={"part": "k"})
    key = request_schema.cache_key(base, digests, "m1")
    assert key == request_schema.cache_key(_parse(first_frame={"part": "k"}, deadline_s=5), digests, "m1")
    assert key == request_schema.cache_key(_parse(first_frame={"part": "k"}, task="fl2va"), digests, "m1")
    assert key != request_schema.cache_key(base, digests, "m2")
    assert key != request_schema.cache_key(base, {"k": "b" * 64}, "m1")
    assert key != request_schema.cache_key(_parse(first_frame={"part": "k"}, num_frames=141), digests, "m1")
    assert key != request_schema.cache_key(_parse(first_frame={"part": "k"}, prompt="a fox."), digests, "m1")
    assert key != request_schema.cache_key(_parse(last_frame={"part": "k"}), digests, "m1")


def test_bind_rules():
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, None)
    for host in ("0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.com", "localhost.example.com"):
        assert not is_loopback(host)
        with pytest.raises(ServerConfigError, match="H3_ENCODER_TOKEN"):
            check_bind(host, None)
        check_bind(host, "t" * 32)
    with pytest.raises(ServerConfigError, match="at least 16"):
        check_bind("0.0.0.0", "short")


def test_error_mapping():
    from h3_core.contract import ContractError

    assert protocol.error_from_exception(rules.H3InputError("x")).status == 422
    assert protocol.error_from_exception(media.MediaError("x")).code == "invalid_media"
    assert protocol.error_from_exception(ContractError("x", field="f")).field == "f"
    assert protocol.error_from_exception(RuntimeError("boom")) is None
