"""The server's side of the answer: a conditioning's wire form (`contract.wire.Encoded`) as an aiohttp body.

The header and each tensor's storage go to the socket one after the other, in 1 MiB pieces with a drain after
each, so the event loop's transport only ever holds the rest of one piece. A plain `bytes` body would be copied
whole into the transport's buffer on Python < 3.12 (or joined first), and the wire form is never joined. In form 3
(`Encoded.pieces`) each piece is hashed just before it is written and the digest goes last.
"""

from __future__ import annotations

from aiohttp import payload

PIECE_BYTES = 1 << 20


class EncodedPayload(payload.Payload):
    """An `Encoded` wire form as a response body; Content-Length is its exact size. Re-sendable (cache hits)."""

    _autoclose = True  # memory only: nothing to release

    def __init__(self, encoded, content_type: str = "application/octet-stream"):
        super().__init__(encoded, content_type=content_type)
        self._size = len(encoded)
        self._encoded = encoded

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a conditioning body is binary")

    async def write(self, writer) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer, content_length: int | None) -> None:
        left = self._size if content_length is None else min(content_length, self._size)
        for piece in self._encoded.pieces(PIECE_BYTES):
            if left <= 0:
                return
            piece = memoryview(piece).cast("B")[:left]
            await writer.write(piece)
            left -= piece.nbytes
