"""Guides through the encoder server (protocol feature "guides"): the request's optional "guides" list.

A remote encode of a request with guides (an image at a middle frame, a clip with its soundtrack at a negative index,
an audio alone) equals the local encode bit for bit; the strict reader and the ingest refuse hostile guide fields with
a 4xx naming the field; a client refuses, before sending, a guided request to a server that does not announce the
feature, while such a server keeps serving requests without guides; guides are part of the cache key, and a request
without them keeps the key it always had. One in-process server on the tiny H3 (64x64, 124 frames).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.remote_http import raw

from h3_core import facts, media
from h3_core.guides import MAX_GUIDE_FRAMES, GuideMedia
from h3_core.remote import protocol
from h3_core.remote.client import packing
from h3_core.remote.client.encoder_client import EncoderClient, RemoteRequestError
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.protocol import ProtocolError
from h3_core.remote.server import handler as handler_module
from h3_core.remote.server import request_schema
from h3_core.remote.server.config import ServerConfig
from h3_core.request import EncodeRequest
from h3_core.testing import SERVER_THREADS, image, tone, video

BASE = {"protocol": 2, "prompt": "A guided shot.", "width": 64, "height": 64, "num_frames": 124}


def guided_request(**changes) -> EncodeRequest:
    """An image at a middle frame, a 24-frame clip (22 anchored) with its soundtrack at -22, and a 44.1 kHz audio
    alone at frame 10: every kind of guide, on the tiny canvas."""
    clip = video(1.0)
    guides = [
        GuideMedia(frame_index=60, frames=image(4, 64, 96)[None]),
        GuideMedia(frame_index=-22, frames=clip.frames, audio=clip.audio, sample_rate=clip.sample_rate),
        GuideMedia(frame_index=10, audio=tone(2.0, rate=44100), sample_rate=44100),
    ]
    fields = {"prompt": "A guided shot.", "width": 64, "height": 64, "num_frames": 124, "guides": guides}
    return EncodeRequest(**{**fields, **changes})


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Local encodes at the server's thread count (conftest.one_thread): bitwise equality needs it."""


@pytest.fixture(scope="module")
def server(encoder_stage):
    with ServerThread(encoder_stage, ServerConfig(threads=SERVER_THREADS),
                      model_info={"layout": "diffusers", "tiny": True}) as s:
        yield s


# --- parity --------------------------------------------------------------------------------------------------


def test_remote_encode_with_guides_equals_local_bit_for_bit(encoder_stage, server):
    request = guided_request()
    local = encoder_stage.encode(request)
    assert [(g.frame, g.video, g.audio) for g in local.guides] == [(60, True, False), (102, True, True),
                                                                   (10, False, True)]
    remote = EncoderClient(server.url).encode(request)
    assert remote == local
    assert remote.to_bytes() == local.to_bytes()
    assert len(remote.to_bytes()) <= packing.conditioning_bound(request)


def test_capabilities_announce_guides(server):
    caps = EncoderClient(server.url).capabilities()
    assert protocol.FEATURE_GUIDES in caps["protocol"]["features"]
    assert caps["limits"]["max_guides"] == facts.MAX_GUIDES
    assert caps["limits"]["max_parts"] >= 1 + facts.MAX_KEYFRAMES + 2 * facts.MAX_GUIDES


# --- the wire ------------------------------------------------------------------------------------------------


def test_the_wire_sends_what_a_guide_anchors():
    body, parts = packing.request_to_wire(guided_request())
    assert body["guides"] == [
        {"frame_index": 60, "image": {"part": "guide0"}},
        {"frame_index": -22, "video": {"part": "guide1"}, "audio": {"part": "guide1_audio"}},
        {"frame_index": 10, "audio": {"part": "guide2_audio"}},
    ]
    kinds = {name: content_type for name, content_type, _, _ in parts}
    assert kinds == {"guide0": "image/png", "guide1": "video/mp4", "guide1_audio": "audio/wav",
                     "guide2_audio": "audio/wav"}
    clip = media.read_video(dict((p[0], p[3]) for p in parts)["guide1"])
    assert clip.frames.shape[0] == 22  # the frames the guide anchors (17k+5), not the whole 24-frame batch
    # An image batch of under 5 frames anchors its first image: it goes as that one PNG.
    few = guided_request(guides=[GuideMedia(frame_index=3, frames=np.stack([image(s, 64, 64) for s in range(3)]))])
    body, parts = packing.request_to_wire(few)
    assert body["guides"] == [{"frame_index": 3, "image": {"part": "guide0"}}] and len(parts) == 1
    # Without guides the request is what it always was: no "guides" key for an old server to refuse.
    body, _ = packing.request_to_wire(EncodeRequest(prompt="No guides.", width=64, height=64))
    assert "guides" not in body


def test_needed_components_and_the_answer_bound_count_guides():
    def spec(*guides):
        return request_schema.parse_request({**BASE, "guides": list(guides)})

    assert spec({"frame_index": 0, "image": {"part": "a"}}).needed_components() == ("text", "video")
    assert spec({"frame_index": 0, "audio": {"part": "a"}}).needed_components() == ("text", "audio")
    assert spec({"frame_index": 0, "video": {"part": "a"}}, {"frame_index": 5, "audio": {"part": "b"}}
                ).needed_components() == ("text", "video", "audio")
    assert spec({"frame_index": 0, "image": {"part": "a"}}).resolved_task == "fl2va"  # guides infer fl2va
    plain = EncodeRequest(prompt="A guided shot.", width=64, height=64, num_frames=124)
    assert packing.conditioning_bound(guided_request()) > packing.conditioning_bound(plain)


# --- hostile and invalid guide fields ------------------------------------------------------------------------


@pytest.mark.parametrize("guides, status, field", [
    ([{"frame_index": facts.MAX_FRAMES + 1, "image": {"part": "g"}}], 422, "guides[0].frame_index"),
    ([{"frame_index": -facts.MAX_FRAMES - 1, "image": {"part": "g"}}], 422, "guides[0].frame_index"),
    ([{"frame_index": 124, "image": {"part": "g"}}], 422, "guides[0].frame_index"),  # past the output's end
    ([{"frame_index": -125, "audio": {"part": "g"}}], 422, "guides[0].frame_index"),
    ([{"frame_index": 1.5, "image": {"part": "g"}}], 400, "guides[0].frame_index"),
    ([{"frame_index": True, "image": {"part": "g"}}], 400, "guides[0].frame_index"),
    ([{"image": {"part": "g"}}], 400, "guides[0].frame_index"),
    ([{"frame_index": 0, "image": {"part": f"g{i}"}} for i in range(facts.MAX_GUIDES + 1)], 422, "guides"),
    ({"frame_index": 0}, 400, "guides"),
    (["g"], 400, "guides[0]"),
    ([{"frame_index": 0}], 422, "guides[0]"),
    ([{"frame_index": 0, "image": {"part": "g"}, "video": {"part": "h"}}], 400, "guides[0].video"),
    ([{"frame_index": 0, "image": {"part": "g"}, "fps": 24}], 400, "guides[0]"),
    ([{"frame_index": 0, "video": {"part": "g", "fps": 24}}], 400, "guides[0].video"),
    ([{"frame_index": 0, "image": "g"}], 400, "guides[0].image"),
    ([{"frame_index": 0, "image": {"part": "../g"}}], 400, "guides[0].image.part"),
    ([{"frame_index": 0, "audio": {"part": "request"}}], 400, "guides[0].audio.part"),
    ([{"frame_index": 0, "image": {"part": "g"}}, {"frame_index": 9, "audio": {"part": "g"}}], 400,
     "guides[1].audio.part"),  # one part for two media
])
def test_the_reader_refuses_bad_guides_by_name(guides, status, field):
    with pytest.raises(ProtocolError) as caught:
        request_schema.parse_request({**BASE, "guides": guides})
    assert (caught.value.status, caught.value.field) == (status, field), caught.value.message


def test_guides_need_fl2va():
    for task in ("t2va", "ref2va"):
        with pytest.raises(ProtocolError) as caught:
            request_schema.parse_request({**BASE, "task": task, "guides": [{"frame_index": 0, "image": {"part": "g"}}]})
        assert caught.value.status == 422 and "guide" in caught.value.message


def _post(url, request_json, media_parts):
    content_type, buffers = packing.encode_multipart(request_json, media_parts)
    status, _, data = raw(url, "POST", protocol.ENCODE_PATH, b"".join(buffers), {"Content-Type": content_type})
    return status, json.loads(data)["error"] if status != 200 else None


def _clip(frames: int, size: int = 16) -> bytes:
    return packing._lossless_mp4(np.stack([image(i % 7, size, size) for i in range(frames)]), 24.0)


def test_the_server_refuses_bad_guide_media_by_name(server):
    png = media.encode_png_bytes(image(1, 64, 64))
    wav = media.encode_wav_bytes(tone(1.0), facts.AUDIO_SAMPLE_RATE)
    one = {**BASE, "guides": [{"frame_index": 0, "video": {"part": "g"}}]}
    # A clip over the cap: refused from its header, before a frame is decoded.
    status, error = _post(server.url, one, [("g", "video/mp4", "g.mp4", _clip(MAX_GUIDE_FRAMES + 5))])
    assert (status, error["code"], error["field"]) == (413, "too_many_frames", "guides[0].video"), error
    assert str(MAX_GUIDE_FRAMES) in error["message"]
    # A clip that starts inside the output but runs past its end: refused once its length is known.
    late = {**BASE, "guides": [{"frame_index": 110, "video": {"part": "g"}}]}
    status, error = _post(server.url, late, [("g", "video/mp4", "g.mp4", _clip(22))])
    assert (status, error["field"]) == (422, "guides[0].video") and "does not fit" in error["message"], error
    # A part the request names but the body lacks.
    both = {**BASE, "guides": [{"frame_index": 5, "image": {"part": "g"}, "audio": {"part": "a"}}]}
    status, error = _post(server.url, both, [("g", "image/png", "g.png", png)])
    assert (status, error["code"], error["field"]) == (400, "missing_part", "guides[0].audio"), error
    # The wrong kind: declared as the wrong content type for the slot, or lying about its bytes.
    image_slot = {**BASE, "guides": [{"frame_index": 5, "image": {"part": "g"}}]}
    status, error = _post(server.url, image_slot, [("g", "video/mp4", "g.mp4", _clip(5))])
    assert (status, error["field"]) == (415, "guides[0].image"), error
    audio_slot = {**BASE, "guides": [{"frame_index": 5, "audio": {"part": "g"}}]}
    status, error = _post(server.url, audio_slot, [("g", "audio/wav", "g.wav", png)])
    assert (status, error["field"]) == (415, "guides[0].audio"), error
    # Out of range over HTTP too (the reader's refusal, before any media is read).
    far = {**BASE, "guides": [{"frame_index": 10**6, "image": {"part": "g"}}]}
    status, error = _post(server.url, far, [("g", "image/png", "g.png", png)])
    assert (status, error["field"]) == (422, "guides[0].frame_index"), error
    # And a well-formed one is answered.
    status, _ = _post(server.url, both, [("g", "image/png", "g.png", png), ("a", "audio/wav", "a.wav", wav)])
    assert status == 200


# --- an encoder server that predates guides ------------------------------------------------------------------


def test_a_client_refuses_guides_for_a_server_that_predates_them(server, encoder_stage, monkeypatch):
    real = handler_module.capabilities

    def predates(service):
        caps = real(service)
        del caps["protocol"]["features"]
        return caps

    monkeypatch.setattr(handler_module, "capabilities", predates)
    before = dict(server.service.counters)
    client = EncoderClient(server.url, retries=0)
    with pytest.raises(RemoteRequestError) as caught:
        client.encode(guided_request())
    error = caught.value
    assert (error.code, error.field) == ("feature_not_supported", "guides")
    assert "predates guides: update it, or encode the guides locally" in str(error)
    assert server.service.counters == before  # refused before sending: the server saw no encode
    # Requests without guides still go to it.
    plain = EncodeRequest(prompt="No guides for an old server.", width=64, height=64, num_frames=124)
    assert client.encode(plain) == encoder_stage.encode(plain)


# --- the cache key -------------------------------------------------------------------------------------------


def _key(request_json, digests):
    return request_schema.cache_key(request_schema.parse_request(request_json), digests, "f" * 64)


def test_guides_are_part_of_the_cache_key():
    digests = {"g": "1" * 64, "h": "2" * 64, "a": "3" * 64}
    image_at = lambda index, part="g": {"frame_index": index, "image": {"part": part}}  # noqa: E731
    base = _key({**BASE, "guides": [image_at(60)]}, digests)
    assert base == _key({**BASE, "guides": [image_at(60)], "deadline_s": 9}, digests)  # not the deadline
    variants = [
        [image_at(61)],
        [image_at(60, "h")],
        [{"frame_index": 60, "video": {"part": "g"}}],
        [image_at(60), {"frame_index": 9, "audio": {"part": "a"}}],
        [{"frame_index": 60, "image": {"part": "g"}, "audio": {"part": "a"}}],
    ]
    keys = {base} | {_key({**BASE, "guides": guides}, digests) for guides in variants}
    assert len(keys) == len(variants) + 1
    assert _key({**BASE, "guides": []}, digests) == _key(BASE, digests)  # an empty list is no guides


def test_requests_without_guides_keep_their_key():
    """Keys of requests without guides, as the reader before guides made them (pinned from it)."""
    digests = {"kf": "4" * 64, "v": "5" * 64, "s": "6" * 64}
    pinned = {
        "72cb7c67c878ed41ef384c2ea003adb953699f296c45010d59fe9bd9ec66eeef": BASE,
        "c20b229be7955592f6fe28434e274325bdb87e756e05c341f0411647a825956d": {**BASE, "first_frame": {"part": "kf"}},
        "e53b36efb6cd15f148956795d4416a14a720b5d6273d160ccebe93e60ab139f3":
            {**BASE, "ref_videos": [{"part": "v", "fps": 24, "soundtrack": "s"}]},
    }
    for key, request in pinned.items():
        assert _key(request, digests) == key
