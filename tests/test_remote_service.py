"""The encoder service without HTTP: admission, body budget, component check, queue, join, traceback-free errors.

Drives `h3_core.remote.server.service.EncoderService` directly on an asyncio loop around the tiny model's real
`EncoderStage`; no aiohttp, no sockets.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from support.service_support import run_service

from h3_core.remote import protocol
from h3_core.remote.protocol import ProtocolError
from h3_core.remote.server import request_schema
from h3_core.remote.server.config import ServerConfig
from h3_core.remote.server.service import EncoderService


@pytest.fixture(scope="module")
def stage(encoder_stage):
    return encoder_stage  # conftest: loaded once per session


def _spec(**fields):
    body = {"protocol": protocol.PROTOCOL_VERSION, "prompt": "A red fox in the snow.", "width": 64, "height": 64,
            "num_frames": 124, **fields}
    return request_schema.parse_request(body)




def test_service_encodes_joins_and_caches_without_http(stage, one_thread):

    async def body(service: EncoderService):
        spec = _spec()
        key = request_schema.cache_key(spec, {}, service.fingerprint)
        async with service.admit(0, client="a") as slot:
            assert service.active_requests == 1
            slot.budget.take(10)
            assert service.buffered_bytes == 10 and service.client_bytes["a"] == 10
            job, joined = service.submit(key, spec, {})
            twin, twin_joined = service.submit(key, spec, {})
            assert not joined and twin_joined and twin is job
            data, digest = await job.future
        assert service.active_requests == 0 and service.buffered_bytes == 0 and not service.client_bytes
        assert service.cache.get(key) == (data, digest)
        assert service.counters["computed"] == 1
        return data

    data = asyncio.run(run_service(stage, ServerConfig(threads=1), body))
    assert data.tobytes() == stage.encode(protocol_request()).to_bytes()  # the wire form, unjoined


def protocol_request():
    from h3_core.request import EncodeRequest

    return EncodeRequest(prompt="A red fox in the snow.", width=64, height=64, num_frames=124)


def test_admission_budget_and_draining(stage):
    config = ServerConfig(threads=1, max_client_bytes=100, max_buffered_bytes=150)

    async def body(service: EncoderService):
        async with service.admit(50, client="a") as first:
            first.budget.take(60)
            with pytest.raises(ProtocolError) as info:
                first.budget.take(41)  # client "a" over 100
            assert info.value.status == 429 and info.value.code == "client_busy"
            async with service.admit(10, client="b") as second:
                with pytest.raises(ProtocolError) as info:
                    second.budget.take(60)  # all clients over 150
                assert info.value.code == "busy"
        assert service.buffered_bytes == 0 and not service.client_bytes
        with pytest.raises(ProtocolError) as info:
            async with service.admit(200, client="c"):
                pass
        assert info.value.status == 429  # declared bytes that cannot fit are refused up front
        service.draining = True
        with pytest.raises(ProtocolError) as info:
            async with service.admit(0, client="a"):
                pass
        assert info.value.status == 503 and service.active_requests == 0

    asyncio.run(run_service(stage, config, body))


def test_missing_component_refused_before_queueing(stage):
    class TextOnly:
        fingerprint, components = stage.fingerprint, ("text",)

        def encode(self, request, cancel=None, metadata=None, progress=None):  # never reached
            raise AssertionError("queued a request this server cannot serve")

    async def body(service: EncoderService):
        service.check_components(_spec())
        with pytest.raises(ProtocolError) as info:
            service.check_components(_spec(ref_images=[{"part": "i"}], ref_audios=[{"part": "a"}],
                                           prompt="<Picture 1> hums <Audio 2>."))
        assert info.value.status == 422 and info.value.code == "component_not_loaded"
        assert "['video', 'audio']" in info.value.message and service.queued == 0

    asyncio.run(run_service(TextOnly(), ServerConfig(threads=1), body))


def test_failed_job_keeps_no_traceback(stage):
    """A refused job's exception reaches its waiter without frames (they would pin the decoded media)."""

    class Refusing:
        fingerprint, components = stage.fingerprint, stage.components

        def encode(self, request, cancel=None, metadata=None, progress=None):
            big = bytearray(64 << 20)  # noqa: F841 - a local the traceback would keep alive
            raise protocol.ProtocolError(422, "invalid_request", "refused")

    async def body(service: EncoderService):
        spec = _spec()
        job, _ = service.submit(request_schema.cache_key(spec, {}, service.fingerprint), spec, {})
        await asyncio.wait({job.future})
        error = job.future.exception()
        assert isinstance(error, ProtocolError) and error.__traceback__ is None
        assert job.parts is None and not service._inflight and not service._pending
        return error.status

    assert asyncio.run(run_service(Refusing(), ServerConfig(threads=1), body)) == 422
    gc.collect()


def test_serve_flags_reach_the_config():
    from h3_core.cli import build_parser
    from h3_core.remote.engines.aiohttp_server import config_from_args

    args = build_parser().parse_args(["serve", "--models", "x", "--decode-timeout", "5", "--deadline", "60"])
    config = config_from_args(args, None)
    assert (config.decode_timeout_s, config.isolate_media) == (5.0, True)  # the sandbox is the default
    assert config.default_deadline_s == config.max_deadline_s == 60.0  # the operator's deadline caps the client's
    args = build_parser().parse_args(["serve", "--models", "x", "--decode-in-process"])
    assert config_from_args(args, None).isolate_media is False


def test_jobs_record_the_encoders_fine_phases(stage, one_thread):
    """A job's phase log (what progress polls answer from) holds the text encoder's layers, not only one step."""

    async def body(service: EncoderService):
        spec = _spec()
        job, _ = service.submit(request_schema.cache_key(spec, {}, service.fingerprint), spec, {})
        await job.future
        return job.phases.entries

    entries = asyncio.run(run_service(stage, ServerConfig(threads=1), body))
    text = [e for e in entries if e["phase"] == "text" and "total" in e]
    layers = stage.text_encoder.config.text_config.num_hidden_layers
    assert text and text[-1]["done"] == text[-1]["total"] == layers
    assert [e["phase"] for e in entries][-1] == "serialise"
