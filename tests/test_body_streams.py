"""`engines/streams.ChunkReader`, the Ray engine's body reader, against aiohttp's own `StreamReader` (what the
aiohttp engine hands the shared body reader): under aiohttp's `MultipartReader` the same parts, bytes and errors for
every chunking and Content-Encoding; a compressed body inflates a bounded step at a time; a source's error reaches
every later read."""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc
import zlib

import pytest
from aiohttp import MultipartReader, MultipartWriter, StreamReader
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import ContentEncodingError, LineTooLong

from h3_core.remote.engines.streams import LIMIT, ChunkReader

BOUNDARY = "h3-test-boundary"


def body(media: bytes) -> tuple[dict, bytes]:
    """A request body as the client packs one: the JSON part, then a binary part holding CRLFs and
    boundary-looking bytes."""
    writer = MultipartWriter("form-data", boundary=BOUNDARY)
    writer.append_json({"prompt": "A red fox trots through fresh snow.", "num_frames": 124}).set_content_disposition(
        "form-data", name="request")
    writer.append(media, {"Content-Type": "application/octet-stream"}).set_content_disposition(
        "form-data", name="first_frame", filename="f.png")

    class Sink:
        def __init__(self):
            self.data = bytearray()

        async def write(self, chunk):
            self.data += chunk

    sink = Sink()
    asyncio.run(writer.write(sink))
    return {"Content-Type": writer.headers["Content-Type"]}, bytes(sink.data)


MEDIA = (b"\x89PNG\r\n" + b"--h3-test-boundar\r\n" + bytes(range(256)) * 300 + b"\r\n--h3-test-bound\r\n"
         + b"\n" * 70000)


async def chunks(data: bytes, size: int, error: BaseException | None = None):
    for start in range(0, len(data), size):
        await asyncio.sleep(0)
        yield data[start:start + size]
    if error is not None:
        raise error


async def parts(headers: dict, content) -> list[tuple[str, bytes]]:
    found = []
    async for part in MultipartReader(headers, content):
        data = bytearray()
        while chunk := await part.read_chunk(8192):
            data += chunk
        found.append((part.name, bytes(data)))
    return found


def aiohttp_reader(data: bytes) -> StreamReader:
    """aiohttp's own reader, as its server fills one (what the aiohttp engine's handler reads), given the whole body
    at once: its limit is raised to the body's size so it never asks its protocol to pause (the lines the multipart
    reader reads with a limit of their own, a part's headers, keep it)."""
    loop = asyncio.get_running_loop()
    reader = StreamReader(BaseProtocol(loop), max(LIMIT, len(data)), loop=loop)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


@pytest.mark.parametrize("size", [1, 7, 4096, 65536, 1 << 30])
@pytest.mark.parametrize("encoding", [None, "gzip", "deflate"])
def test_the_same_parts_as_aiohttps_reader_for_every_chunking(size, encoding):
    if size == 1 and encoding is None:
        size = 3  # one byte a chunk is a slow loop; 3 still splits every boundary and CRLF
    headers, raw = body(MEDIA)
    sent = {None: raw, "gzip": gzip.compress(raw), "deflate": zlib.compress(raw)}[encoding]

    async def both():
        ours = ChunkReader(chunks(sent, size), encoding)
        return await parts(headers, aiohttp_reader(raw)), await parts(headers, ours)

    expected, got = asyncio.run(both())
    assert got == expected
    assert [name for name, _ in got] == ["request", "first_frame"] and got[1][1] == MEDIA
    assert json.loads(got[0][1])["num_frames"] == 124


def test_a_line_over_the_limit_is_refused_as_aiohttp_refuses_it():
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    raw = f"--{BOUNDARY}\r\nX-Long: {'a' * (3 * LIMIT)}\r\n\r\nx\r\n--{BOUNDARY}--\r\n".encode()

    async def refusal(content):
        with pytest.raises(LineTooLong) as caught:
            await parts(headers, content)
        return str(caught.value)

    async def both():
        return await refusal(aiohttp_reader(raw)), await refusal(ChunkReader(chunks(raw, 1000)))

    expected, got = asyncio.run(both())
    assert got == expected


def test_a_compressed_body_inflates_a_bounded_step_at_a_time():
    bomb = gzip.compress(b"\0" * (256 << 20), compresslevel=9)  # 256 MiB of zeros in ~250 KiB

    async def drain():
        reader, total = ChunkReader(chunks(bomb, 65536), "gzip"), 0
        tracemalloc.start()
        while piece := await reader.read(65536):
            total += len(piece)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return total, peak

    total, peak = asyncio.run(drain())
    assert total == 256 << 20
    assert peak < 4 << 20, f"{peak} bytes held while inflating"  # one step (256 KiB) and one chunk, not the body


@pytest.mark.parametrize("case", ["unknown", "truncated", "corrupt"])
def test_a_broken_encoding_is_a_content_encoding_error_on_every_read(case):
    raw = gzip.compress(b"x" * 100000)
    source, encoding = {"unknown": (raw, "br"), "truncated": (raw[:len(raw) // 2], "gzip"),
                        "corrupt": (raw[:20] + b"\xff" * 200 + raw[220:], "gzip")}[case]

    async def read_all():
        reader = ChunkReader(chunks(source, 4096), encoding)
        with pytest.raises(ContentEncodingError) as first:
            while await reader.read(65536):
                pass
        with pytest.raises(ContentEncodingError) as again:
            await reader.readline()
        return str(first.value), again.value is first.value

    message, same = asyncio.run(read_all())
    assert "Can not decode content-encoding" in message, message
    assert same


def test_a_client_that_left_is_a_connection_error_and_close_ends_the_source():
    closed = []

    async def source():
        try:
            yield b"--" + BOUNDARY.encode() + b"\r\n"
            raise ConnectionResetError("the client disconnected while sending the body")
        finally:
            closed.append(True)

    async def run():
        reader = ChunkReader(source())
        assert await reader.readline() == b"--" + BOUNDARY.encode() + b"\r\n"
        with pytest.raises(ConnectionResetError, match="disconnected"):
            await reader.read(10)
        with pytest.raises(ConnectionResetError):
            await reader.read(10)
        await reader.close()

    asyncio.run(run())
    assert closed == [True]
