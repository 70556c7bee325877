"""The disaggregated encoder endpoint: run H3's encoders on another machine, shared by several ComfyUIs.

    protocol.py  what both sides share: the version, paths, headers, limits, error model, the loopback rule
    request_schema.py  the request JSON: RequestSpec, its strict reader (one reader per field), the cache key
    ingest.py    server side: received parts -> EncodeRequest (content types, header caps, the decoding seam)
    packing.py   client side: EncodeRequest -> multipart body (lossless media, no pickle)
    service.py   the service without HTTP: admission, bounded queue, one model thread, cache (pure asyncio)
                 (config.py settings, admission.py body budgets, fair_queue.py turns per client, cache.py)
    metrics.py   Prometheus metrics of one server (its own registry); handler.py serves `GET /metrics`
    handler.py   the request handling, engine-neutral (routes, auth, errors, encode flow); body.py reads bodies
    http.py      the aiohttp engine: adapter to handler.py, create_app
    server.py    running it: ServerThread (tests, embedding), main (CLI, signals, graceful drain)
    ray_engine.py  the Ray Serve engine (optional): ingress + encoder replicas around handler.py; ray_run.py runs
                 it (`serve --engine ray`, flags in engines.py); streams.py feeds ASGI bodies to handler.py;
                 sharding.py spreads a text encoder over a replica's GPUs
    client.py    EncoderClient: handshake, one deadline per call, retries with backoff, failover, cancel

`python -m h3_core serve --models DIR` starts the server; `python -m h3_core encode --server URL ...` and the
ComfyUI remote-encode node use the client. The protocol is documented in docs/PROTOCOL.md, deployment (two
machines, TLS proxy, token) in docs/DEPLOY.md.
"""

from .protocol import DEFAULT_TOKEN_ENV, PROTOCOL_VERSION, Limits, ProtocolError

__all__ = ["DEFAULT_TOKEN_ENV", "PROTOCOL_VERSION", "Limits", "ProtocolError", "EncoderClient", "RemoteEncodeError"]


def __getattr__(name):  # the client pulls in torch (the contract); import it only when asked for
    if name in ("EncoderClient", "RemoteEncodeError"):
        from . import client

        return getattr(client, name)
    raise AttributeError(name)
