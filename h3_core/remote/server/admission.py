"""Admission: one request's lifetime in the server and the bytes its body holds, counted against three caps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol import ProtocolError

if TYPE_CHECKING:
    from .service import EncoderService


class BodyBudget:
    """The bytes one request body holds in memory, counted as they arrive, against three caps.

    Per request (`max_body_bytes`, 413), per client (`max_client_bytes`, 429) and server-wide
    (`max_buffered_bytes`, 429). Everything taken is given back when the request ends.
    """

    def __init__(self, service: "EncoderService", client: str):
        self.service, self.client = service, client
        self.bytes = 0

    def take(self, n: int) -> None:
        service, config = self.service, self.service.config
        self.bytes += n
        service.buffered_bytes += n
        service.client_bytes[self.client] += n
        limit = config.limits.max_body_bytes
        if self.bytes > limit:
            raise ProtocolError(413, "too_large", f"the request body is over the limit of max_body_bytes={limit}",
                                "body")
        if service.client_bytes[self.client] > config.max_client_bytes:
            service.counters["rejected_client_busy"] += 1
            raise ProtocolError(429, "client_busy", f"this client has too many request bytes in flight "
                                                    f"(max_client_bytes={config.max_client_bytes}); retry later")
        if service.buffered_bytes > config.max_buffered_bytes:
            service.counters["rejected_buffer_full"] += 1
            raise ProtocolError(429, "busy", f"too many request bytes in flight (max_buffered_bytes="
                                             f"{config.max_buffered_bytes}); retry later")

    def release(self) -> None:
        service = self.service
        service.buffered_bytes -= self.bytes
        left = service.client_bytes[self.client] - self.bytes
        if left > 0:
            service.client_bytes[self.client] = left
        else:
            service.client_bytes.pop(self.client, None)
        self.bytes = 0


class Admission:
    """An admitted request: its body budget and its upload clock (the minimum-rate rule, on `service.clock`)."""

    def __init__(self, service: "EncoderService", client: str):
        self.service = service
        self.budget = BodyBudget(service, client)
        self.started = service.clock.monotonic()

    def read_timeout(self) -> float:
        """Seconds the next read may wait before the upload's average rate is under `min_upload_bytes_per_s`."""
        config = self.service.config
        due = config.upload_grace_s
        if config.min_upload_bytes_per_s > 0:
            due = max(due, self.budget.bytes / config.min_upload_bytes_per_s)
        else:
            due = max(due, config.upload_timeout_s)
        return self.started + due - self.service.clock.monotonic()

    async def read(self, awaitable):
        """Await one read of the body; 408 once the upload's average rate is under the minimum."""
        try:
            return await self.service.clock.wait_for(awaitable, max(0.0, self.read_timeout()))
        except TimeoutError:
            pass
        config = self.service.config
        self.service.counters["slow_upload"] += 1
        raise ProtocolError(408, "upload_too_slow",
                            f"the request body arrived slower than min_upload_bytes_per_s="
                            f"{config.min_upload_bytes_per_s} (averaged after upload_grace_s="
                            f"{config.upload_grace_s:g} s)", "body")
