"""The disaggregated encoder endpoint: run H3's encoders on another machine, shared by several ComfyUIs.

    protocol.py  versioned request/response schema, limits, error model, EncodeRequest <-> wire (no pickle)
    server.py    aiohttp app: one model thread behind a bounded queue, deadlines, cache, auth, graceful drain
    client.py    EncoderClient: handshake, timeouts, retries with backoff, failover, cancel forwarding

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
