"""A request body from any async chunk source as aiohttp's `StreamReader`, for engines other than aiohttp.

`body.read_body` parses multipart with aiohttp's `MultipartReader`, which reads a `StreamReader`. aiohttp's server
feeds one from the socket and undoes `Content-Encoding` itself; another engine (Ray Serve's ASGI receive) hands
over raw chunks, so `fed_stream` pumps them into a real `StreamReader`, un-gzipping on the way. Flow control is
aiohttp's own: the pump waits while the reader holds more than its high-water mark, so a client's body is pulled
only as fast as the handler consumes it, and a small compressed body cannot inflate into memory all at once.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import AsyncIterator

from aiohttp import StreamReader
from aiohttp.http_exceptions import ContentEncodingError

LIMIT = 2**16  # aiohttp's default read buffer: the reader pauses its feeder beyond twice this
_INFLATE_STEP = 256 * 1024  # most bytes one decompress call may produce before the pump checks flow control


class _Valve:
    """Stands in for aiohttp's protocol: the reader pauses and resumes reading through it."""

    def __init__(self):
        self._reading_paused = False
        self.connected = True  # the reader refuses to wait on a closed connection
        self.open = asyncio.Event()
        self.open.set()

    def pause_reading(self) -> None:
        self._reading_paused = True
        self.open.clear()

    def resume_reading(self, *args, **kwargs) -> None:
        self._reading_paused = False
        self.open.set()


def _decoder(encoding: str | None):
    """A zlib decompressor for a Content-Encoding, None for identity; ContentEncodingError for anything else."""
    name = (encoding or "").strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if name == "deflate":
        return zlib.decompressobj(zlib.MAX_WBITS)
    raise ContentEncodingError(f"Can not decode content-encoding: {name[:40]}")


class FedStream:
    """A `StreamReader` (`.reader`) and the task that feeds it from `chunks`; `close()` stops the pump."""

    def __init__(self, chunks: AsyncIterator[bytes], content_encoding: str | None = None):
        loop = asyncio.get_running_loop()
        self._valve = _Valve()
        self.reader = StreamReader(self._valve, LIMIT, loop=loop)
        self._chunks, self._encoding = chunks, content_encoding
        self._task = loop.create_task(self._pump(), name="h3-body-pump")

    async def _feed(self, data: bytes) -> None:
        await self._valve.open.wait()
        self.reader.feed_data(data)

    async def _pump(self) -> None:
        try:
            decoder = _decoder(self._encoding)
            async for chunk in self._chunks:
                if not chunk:
                    continue
                if decoder is None:
                    await self._feed(chunk)
                    continue
                pending = chunk
                while pending:
                    try:
                        out = decoder.decompress(pending, _INFLATE_STEP)
                    except zlib.error as error:
                        raise ContentEncodingError(f"Can not decode content-encoding: {error}") from None
                    pending = decoder.unconsumed_tail
                    if out:
                        await self._feed(out)
            if decoder is not None:
                if not decoder.eof:
                    raise ContentEncodingError("Can not decode content-encoding: the compressed body is truncated")
                tail = decoder.flush()
                if tail:
                    await self._feed(tail)
            self.reader.feed_eof()
        except asyncio.CancelledError:
            self._valve.connected = False
            self.reader.set_exception(ConnectionResetError("the request was cancelled"))
            raise
        except Exception as error:  # noqa: BLE001 - the reader raises it to the handler, which maps it
            self.reader.set_exception(error)

    async def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
