"""A request body from any async chunk source, with the reading interface the shared body reader uses.

`server/body.py` reads a body through four calls of aiohttp's `StreamReader` interface: `read(n)`,
`readline(max_line_length=)`, `at_eof()` and `unread_data()` (the last three are what aiohttp's `MultipartReader`
calls). aiohttp's own server hands over its request payload; another engine (Ray Serve's ASGI receive) has only an
async iterator of raw chunks, and `ChunkReader` answers those four calls from it, un-gzipping on the way. It is a
reader of its own, not aiohttp's `StreamReader` fed through an imitation of aiohttp's protocol object.

Pull, not push: a chunk is taken from the source only when the buffer cannot answer a read, so a client's body is
pulled only as fast as the handler consumes it (no pump task, no flow-control flags), and a compressed body is
inflated `_INFLATE_STEP` bytes at a time: the buffer never holds more than one line's limit plus one chunk or step.
The limits and errors are aiohttp's, so both engines answer a body the same: a line over the limit is `LineTooLong`
(limit `2 * LIMIT`, aiohttp's server default), an unknown or broken Content-Encoding `ContentEncodingError`.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import AsyncIterator

from aiohttp.http_exceptions import ContentEncodingError, LineTooLong

LIMIT = 2**16  # aiohttp's default read buffer; its readline refuses lines over twice this
_INFLATE_STEP = 256 * 1024  # most bytes one decompress call may produce


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


class ChunkReader:
    """`read` / `readline` / `at_eof` / `unread_data` over `chunks` (raw body bytes, in `content_encoding`).

    An error of the source (a client that left: the engine raises ConnectionResetError) or of the decoding is raised
    by the read that met it and by every later one. `close()` closes the source."""

    def __init__(self, chunks: AsyncIterator[bytes], content_encoding: str | None = None, limit: int = LIMIT):
        self._chunks = chunks
        self._encoding = content_encoding
        self._decoder = None
        self._started = False
        self._pending = b""  # compressed bytes not yet inflated (the decoder's unconsumed tail)
        self._buffer = bytearray()
        self._eof = False
        self._error: BaseException | None = None
        self._line_limit = 2 * limit

    # --- the reading interface --------------------------------------------------------------------------------

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes (at least one unless the body has ended: then b"")."""
        if n < 0:
            raise ValueError("ChunkReader.read needs a size: a body is read in bounded pieces")
        if self._error is not None:
            raise self._error
        if n == 0:
            return b""
        if not self._buffer:
            await self._fill()
        if n >= len(self._buffer):  # the usual case: the whole buffer, one copy and no move of a remainder
            data = bytes(self._buffer)
            self._buffer.clear()
            return data
        with memoryview(self._buffer) as view:
            data = bytes(view[:n])
        del self._buffer[:n]
        return data

    async def readline(self, *, max_line_length: int | None = None) -> bytes:
        """Up to and including the next b"\\n" (or what is left at the end); LineTooLong past the limit."""
        if self._error is not None:
            raise self._error
        limit = max_line_length or self._line_limit
        searched = 0
        while True:
            end = self._buffer.find(b"\n", searched)
            if end >= 0:
                if end + 1 > limit:
                    raise LineTooLong(bytes(self._buffer[:100]) + b"...", limit)
                line = bytes(self._buffer[:end + 1])
                del self._buffer[:end + 1]
                return line
            if len(self._buffer) > limit:
                raise LineTooLong(bytes(self._buffer[:100]) + b"...", limit)
            searched = len(self._buffer)
            if not await self._fill():
                line = bytes(self._buffer)
                self._buffer.clear()
                return line

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    def unread_data(self, data: bytes) -> None:
        """Put `data` back in front: the multipart reader hands back what it read past a boundary."""
        if data:
            self._buffer[:0] = data

    async def close(self) -> None:
        close = getattr(self._chunks, "aclose", None)
        if close is not None:
            await close()

    # --- the source -------------------------------------------------------------------------------------------

    async def _fill(self) -> bool:
        """Append the body's next bytes to the buffer: False when it has ended (nothing appended)."""
        if self._eof:
            return False
        try:
            if not self._started:
                self._started = True
                self._decoder = _decoder(self._encoding)
            while True:
                if self._pending:
                    out = self._inflate()
                    if out:
                        self._buffer += out
                        return True
                    continue
                try:
                    chunk = await self._chunks.__anext__()
                except StopAsyncIteration:
                    tail = self._finish()
                    self._eof = True
                    self._buffer += tail
                    return bool(tail)
                if not chunk:
                    continue
                if self._decoder is None:
                    self._buffer += chunk
                    return True
                self._pending = chunk
        except asyncio.CancelledError:  # the source was interrupted mid-chunk: what is left of the body is lost
            self._error = ConnectionResetError("the request was cancelled")
            raise
        except Exception as error:  # the handler maps it (a 4xx, or a disconnect); every later read sees it too
            self._error = error
            raise

    def _inflate(self) -> bytes:
        try:
            out = self._decoder.decompress(self._pending, _INFLATE_STEP)
        except zlib.error as error:
            raise ContentEncodingError(f"Can not decode content-encoding: {error}") from None
        self._pending = self._decoder.unconsumed_tail
        return out

    def _finish(self) -> bytes:
        if self._decoder is None:
            return b""
        if not self._decoder.eof:
            raise ContentEncodingError("Can not decode content-encoding: the compressed body is truncated")
        return self._decoder.flush()
