""""Which encoders does this request need" has one definition (`h3_core.request.needed_encoders`), read by the
decoded request, the prepared request, the encoding parts, the server's JSON request and the client's check."""

from __future__ import annotations

import dataclasses

import pytest

from h3_core import assembly, configs, encoder, testing
from h3_core.facts import AUDIO_SAMPLE_RATE
from h3_core.remote.client import packing
from h3_core.remote.server import request_schema
from h3_core.request import AudioInput, EncodeRequest, needed_encoders

SILENT_VIDEO = EncodeRequest(prompt="<Video 1> moves.", ref_videos=[testing.video(2.0, audio=False)], num_frames=124)
IMAGE_AUDIO = EncodeRequest(prompt="<Picture 1> sings <Audio 2>.", ref_images=[testing.image(3, 64, 96)],
                            ref_audios=[AudioInput(testing.tone(3.0), AUDIO_SAMPLE_RATE)], num_frames=124)
CASES = {**{name: (request, needs) for (name, (request, _, _)), needs in zip(testing.CASES.items(), (
    ("text",), ("text",), ("text", "video"), ("text", "video", "audio")))},
    "ref2va-silent-video": (SILENT_VIDEO, ("text", "video")),
    "ref2va-image-audio": (IMAGE_AUDIO, ("text", "video", "audio"))}


@pytest.mark.parametrize("name", CASES)
def test_every_reader_agrees(name):
    request, expected = CASES[name]
    assert request.needed_encoders() == expected
    # the server's reading of the JSON the client sends, before any media is decoded
    body_json, _ = packing.request_to_wire(request)
    assert request_schema.parse_request(body_json).needed_components() == expected
    # after diffusers' media normalisation, and what the encode nodes' parts still miss
    prepared = encoder.prepare(request, configs.get("pipeline", tiny=True))
    assert prepared.encoders == expected
    assert (prepared.needs_video_vae, prepared.needs_audio_vae) == ("video" in expected, "audio" in expected)
    parts = assembly.EncodingParts(request=request, resolved=assembly.Resolved.of(prepared), pipeline_config={})
    assert parts.missing == [assembly.ENCODER_NODES[encoder_name] for encoder_name in expected]
    done = dataclasses.replace(parts, prompt_embeds=object(), condition_latents=(), audio_condition_latents=())
    assert done.missing == []


def test_a_soundtrack_only_decoding_can_tell_counts_as_needed():
    """The server reads soundtrack null (the container's own audio) before decoding: it may need the audio VAE."""
    body_json, _ = packing.request_to_wire(SILENT_VIDEO)
    assert body_json["ref_videos"][0]["soundtrack"] is False
    maybe = dict(body_json, ref_videos=[dict(body_json["ref_videos"][0], soundtrack=None)])
    assert request_schema.parse_request(maybe).needed_components() == ("text", "video", "audio")


def test_the_rule():
    assert needed_encoders() == ("text",)
    assert needed_encoders(keyframes=1) == needed_encoders(images=2) == needed_encoders(videos=1) == ("text", "video")
    assert needed_encoders(audios=1) == ("text", "audio")
    assert needed_encoders(videos=1, soundtracks=1) == ("text", "video", "audio")
