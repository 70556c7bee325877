"""The disaggregated encoder endpoint: run H3's encoders on another machine, shared by several ComfyUIs.

Three rooms around what both sides share, laid out as vLLM's entrypoints are:

    protocol.py    what both sides share: the version, paths, headers, limits, error model, the loopback rule
    tracking.py    progress of a pending encode (phase names, progress ids, the poll's answer), both sides
    client/        the client: encoder_client.py (EncoderClient: handshake, one deadline per call, retries with
                   backoff, failover, cancel), transport.py (one HTTP exchange, the errors), packing.py
                   (EncodeRequest -> multipart body, lossless media, no pickle), polling.py (progress polls),
                   credentials.py (which endpoints get the token)
    server/        the engine-neutral server: handler.py (routes, auth, errors, encode flow; body.py reads bodies),
                   request_schema.py (the request JSON, its strict reader, the cache key), ingest.py (received
                   parts -> EncodeRequest), service.py (admission, fair queue, one model thread, cache; pure
                   asyncio) with config.py, admission.py, fair_queue.py, cache.py, disk_cache.py, clock.py, and
                   metrics.py (Prometheus, `GET /metrics`)
    engines/       the engines around server/: aiohttp_app.py (create_app, the aiohttp adapter), aiohttp_server.py
                   (ServerThread for tests and embedding, main: CLI, signals, graceful drain), connections.py and
                   sending.py (aiohttp's connection guards and answer body); ray_serve.py (Ray Serve, optional:
                   ingress + encoder replicas), ray_run.py (`serve --engine ray`), streams.py (ASGI bodies for
                   handler.py), sharding.py (a text encoder over a replica's GPUs); options.py (`serve --engine`
                   flags, importing no Ray)
    ray_engine.py  the old import path of saved Ray Serve configs (`h3_core.remote.ray_engine:build`)

`python -m h3_core serve --models DIR` starts the server; `python -m h3_core encode --server URL ...` and the
ComfyUI remote-encode node use the client. The protocol is documented in docs/PROTOCOL.md, deployment (two
machines, TLS proxy, token) in docs/DEPLOY.md.
"""

from .protocol import DEFAULT_TOKEN_ENV, PROTOCOL_VERSION, Limits, ProtocolError

__all__ = ["DEFAULT_TOKEN_ENV", "PROTOCOL_VERSION", "Limits", "ProtocolError", "EncoderClient", "RemoteEncodeError"]


def __getattr__(name):  # the client pulls in torch (the contract); import it only when asked for
    if name in ("EncoderClient", "RemoteEncodeError"):
        from .client import encoder_client

        return getattr(encoder_client, name)
    raise AttributeError(name)
