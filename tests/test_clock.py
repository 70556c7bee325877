"""The injectable clock of the server's scheduling rules (h3_core/remote/server/clock.py).

`ManualClock` itself, then the rules outside the fair queue decided on it: the upload-rate rule of an admitted
request (408), a request's deadline (504), the drain on shutdown, the connection reaper (slow headers / idle
keep-alive) and the rate limit of accept() error reports. Each asserts
the exact decision at the exact clock reading, so none depends on the machine's speed; the fair queue's own rules
are in tests/test_fair_queue_sharing.py. Where a real socket is involved, only *waiting for it to happen* uses real
time, with a limit (30 s) far above the few milliseconds it takes.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from aiohttp import web

from h3_core.remote.engines.connections import AcceptErrorLimiter, ConnectionReaper
from h3_core.remote.protocol import ProtocolError
from h3_core.remote.server.admission import Admission
from h3_core.remote.server.clock import SYSTEM_CLOCK, ManualClock
from h3_core.remote.server.config import ServerConfig
from h3_core.remote.server.handler import _wait
from h3_core.remote.server.service import EncoderService

REAL_LIMIT_S = 30.0  # real seconds allowed for loopback I/O that takes milliseconds (load average 8 on 2 cores)


def test_production_reads_real_time():
    config = ServerConfig()
    assert config.clock is SYSTEM_CLOCK and EncoderService(None, config).clock is SYSTEM_CLOCK
    assert ServerConfig(clock=ManualClock()) == config  # the clock is not part of a configuration's identity


def test_manual_clock_moves_only_when_advanced():
    clock = ManualClock(start=50.0)

    async def body():
        sleeper = asyncio.ensure_future(clock.sleep(2.0))
        slow = asyncio.ensure_future(clock.wait_for(asyncio.Event().wait(), 1.0))
        arrived = asyncio.Event()
        quick = asyncio.ensure_future(clock.wait_for(arrived.wait(), 1.0))
        await clock.until_waiting(3)
        await asyncio.sleep(0.05)  # real time passes; the clock does not
        assert clock.monotonic() == 50.0 and not (sleeper.done() or slow.done() or quick.done())
        arrived.set()
        assert await quick is True and clock.waiting == 2
        clock.advance(1.0)
        with pytest.raises(asyncio.TimeoutError):
            await slow
        assert not sleeper.done() and clock.waiting == 1
        clock.advance(1.0)
        await sleeper
        assert clock.waiting == 0 and clock.monotonic() == 52.0
        await clock.sleep(0)  # no time to wait: returns at once

    asyncio.run(body())
    with pytest.raises(ValueError, match="never goes back"):
        clock.advance(-1)


def test_the_upload_rate_rule_decides_on_the_clock():
    clock = ManualClock()
    service = EncoderService(None, ServerConfig(upload_grace_s=5.0, min_upload_bytes_per_s=1000, clock=clock))

    async def body():
        slot = Admission(service, "client")
        never = asyncio.get_running_loop().create_future
        assert slot.read_timeout() == 5.0  # nothing received yet: the grace period
        slot.budget.take(8000)  # 8000 bytes at 1000 B/s may take 8 s in all
        clock.advance(3.0)
        assert slot.read_timeout() == 5.0
        reading = asyncio.ensure_future(slot.read(never()))
        await clock.until_waiting()
        clock.advance(4.5)
        await asyncio.sleep(0)
        assert not reading.done()  # 7.5 s: the average rate is still over 1000 B/s
        clock.advance(0.5)  # 8 s: under it from now on
        with pytest.raises(ProtocolError) as refused:
            await reading
        assert (refused.value.status, refused.value.code) == (408, "upload_too_slow")
        assert service.counters["slow_upload"] == 1
        slot.budget.release()

    asyncio.run(body())


def test_a_request_deadline_is_read_on_the_clock():
    clock = ManualClock()

    async def body():
        job = SimpleNamespace(future=asyncio.get_running_loop().create_future())
        waiting = asyncio.ensure_future(_wait(job, clock.monotonic() + 30.0, lambda: False, clock))
        await asyncio.sleep(0.3)  # real time: three polls of the connection
        assert not waiting.done()
        clock.advance(30.0)
        return await asyncio.wait_for(waiting, REAL_LIMIT_S)  # the next poll (100 ms) sees the deadline

    assert asyncio.run(body()) == "deadline"


def test_the_reaper_closes_a_silent_connection_after_header_timeout_s_on_the_clock():
    clock = ManualClock()
    service = EncoderService(None, ServerConfig(header_timeout_s=2.0, clock=clock))

    async def answer(request):
        return web.Response(text="ok")

    async def body():
        runner = web.ServerRunner(web.Server(answer))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        reaper = asyncio.ensure_future(ConnectionReaper(runner.server, service, interval_s=0.25).run())
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # connects, never sends a header
            await asyncio.wait_for(_until(lambda: runner.server.connections), REAL_LIMIT_S)
            # the reaper's first look (at +0.25 s) starts the silence; it is over the limit once > 2 s later
            for _ in range(9):
                await clock.until_waiting()
                clock.advance(0.25)
            await clock.until_waiting()
            assert service.counters["connections_reaped"] == 0 and runner.server.connections  # 2.0 s: not over
            clock.advance(0.25)
            await clock.until_waiting()
            assert service.counters["connections_reaped"] == 1
            assert await asyncio.wait_for(reader.read(), REAL_LIMIT_S) == b""  # the server closed it
            writer.close()
        finally:
            reaper.cancel()
            await runner.cleanup()

    asyncio.run(body())


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)



def test_drain_waits_for_answers_until_its_timeout_on_the_clock():
    async def drain_beside_one_request(answered_after_s: float) -> bool:
        """drain(timeout=10 s) while one admitted request is answered `answered_after_s` later on the clock."""
        clock = ManualClock()
        service = EncoderService(None, ServerConfig(clock=clock))
        await service.start()
        try:
            async with service.admit(0, client="a"):
                draining = asyncio.ensure_future(service.drain(timeout=10.0))
                await clock.until_waiting()
                clock.advance(min(answered_after_s, 10.0))
                if answered_after_s >= 10.0:
                    return await draining  # decided while the request is still in progress
                await asyncio.sleep(0)
                assert not draining.done() and service.draining  # still waiting for the answer
            return await draining
        finally:
            await service.stop()

    assert asyncio.run(drain_beside_one_request(9.5)) is True  # answered within the timeout: a clean drain
    assert asyncio.run(drain_beside_one_request(10.0)) is False  # still in progress at the timeout


def test_accept_errors_are_reported_once_per_window_of_the_clock(caplog):
    clock = ManualClock()
    limiter = AcceptErrorLimiter(every_s=30.0, clock=clock)
    storm = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR, logger="h3_core.remote.server"):
        for _ in range(5):
            limiter(None, storm)
            clock.advance(7.0)  # 5 failures over 35 s: logged at 0 s, the next due at 30 s
        limiter(None, storm)
    reports = [record.getMessage() for record in caplog.records if "accepting connections fails" in record.getMessage()]
    assert len(reports) == 2 and "(4 more since the last report)" in reports[1], reports
