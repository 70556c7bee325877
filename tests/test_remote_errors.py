"""A failed remote encode is a `RemoteEncodeError` whose fields say what happened (status, code, field, the server's
own message, the endpoint), against a real encoder server on loopback and a closed port; and a video over the
decoder's frame cap is a typed `TooManyFrames`, in process and through the sandbox, never a message to match."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from h3_core import media
from h3_core.encoder import EncoderStage
from h3_core.media import sandbox as media_sandbox
from h3_core.models import ModelSource
from h3_core.remote.client import transport
from h3_core.remote.client.encoder_client import (
    EncoderClient,
    RemoteAuthError,
    RemoteRequestError,
    RemoteUnavailableError,
)
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.protocol import Limits
from h3_core.remote.server.config import ServerConfig
from h3_core.request import EncodeRequest
from h3_core.testing import SERVER_THREADS

TOKEN = "t" * 40


@pytest.fixture(scope="module")
def stage(tiny_dir):
    return EncoderStage(ModelSource.from_path(tiny_dir))


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def test_connection_refused_is_a_code_not_a_phrase():
    url = f"http://127.0.0.1:{closed_port()}"
    client = EncoderClient(url, token="", retries=1, backoff_s=0.01)
    with pytest.raises(RemoteUnavailableError) as caught:
        client.encode(EncodeRequest(prompt="A fox."))
    error = caught.value
    assert (error.status, error.code, error.url, error.message) == (None, transport.CONNECTION_REFUSED, url, None)


def test_401_keeps_the_servers_code_and_message(stage):
    with ServerThread(stage, ServerConfig(token=TOKEN, threads=SERVER_THREADS)) as srv:
        with pytest.raises(RemoteAuthError) as caught:
            EncoderClient(srv.url, token="").encode(EncodeRequest(prompt="A fox."))
    error = caught.value
    assert (error.status, error.code, error.url) == (401, "unauthorized", srv.url)
    assert "bearer token" in error.message and "H3_ENCODER_TOKEN" not in error.message  # the server's words only
    assert "H3_ENCODER_TOKEN" in str(error)  # the client's hint stays in the sentence for the CLI


def test_a_refused_field_is_a_field(stage):
    config = ServerConfig(limits=Limits(max_prompt_chars=20), threads=SERVER_THREADS)
    with ServerThread(stage, config) as srv:
        with pytest.raises(RemoteRequestError) as caught:
            EncoderClient(srv.url, token="").encode(EncodeRequest(prompt="A fox walks through deep snow."))
    error = caught.value
    assert 400 <= error.status < 500 and error.field == "prompt" and error.url == srv.url
    assert "max_prompt_chars=20" in error.message and srv.url not in error.message


def test_too_many_frames_is_typed_in_process_and_through_the_sandbox():
    frames = np.zeros((20, 32, 48, 3), np.uint8)
    data = media.encode_mp4_bytes(frames, np.zeros((2, 32000), np.float32))
    with pytest.raises(media.TooManyFrames, match="max_frames=10"):
        media.read_video(data, max_frames=10)
    with pytest.raises(media.TooManyFrames, match="max_frames=10"):
        media_sandbox.decode_isolated("read_video", data, max_frames=10)
    with pytest.raises(media.MediaError) as caught:  # any other refusal stays a plain MediaError
        media_sandbox.decode_isolated("read_video", data, max_pixels=100)
    assert type(caught.value) is media.MediaError
