"""Shared by the encoder-service tests: run a coroutine against a started `EncoderService`, stopped afterwards."""

from h3_core.remote.server.service import EncoderService


async def run_service(stage, config, body):
    """`await body(service)` with a started service around `stage`; the service is stopped even if `body` fails."""
    service = EncoderService(stage, config)
    await service.start()
    try:
        return await body(service)
    finally:
        await service.stop()
