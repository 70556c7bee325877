"""Raw HTTP against an encoder endpoint on loopback: what `EncoderClient` would never send.

`raw` sends any method, path, headers and body (a declared length the body does not fill included); `wire` is a
request as the client would encode it; `start_upload` opens a multipart upload that declares more than it sends
(slow-upload and bytes-in-flight tests); `read_status` reads the status of an answer off a raw socket;
`metric_samples` parses a `/metrics` exposition.
"""

from __future__ import annotations

import http.client
import json
import socket

from prometheus_client.parser import text_string_to_metric_families

from h3_core.remote import protocol
from h3_core.remote.client import packing
from h3_core.request import EncodeRequest


def raw(url, method, path, body=b"", headers=None, timeout=30.0):
    """(status, headers, body) of one request; the Content-Length is the body's unless `headers` declares one."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        headers = dict(headers or {})
        if body is not None and "Content-Length" not in headers and (body or method in ("POST", "PUT")):
            headers["Content-Length"] = str(len(body))
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        if body:
            try:
                conn.send(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered early (e.g. 413 on the declared size) and closed
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def wire(request: EncodeRequest, **extra) -> tuple[str, bytes]:
    """(content type, body) of `request` as the client sends it, with `extra` fields in its JSON part."""
    body, parts = packing.request_to_wire(request)
    body.update(extra)
    content_type, buffers = packing.encode_multipart(body, parts)
    return content_type, b"".join(buffers)


def connect(url: str, timeout: float = 20.0) -> socket.socket:
    """A plain TCP connection to the server at `url`."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def start_upload(url: str, declared: int, first: bytes = b"", token: str | None = None) -> socket.socket:
    """A multipart POST (one image reference) that declares `declared` bytes and sends only its start + `first`."""
    sock = connect(url)
    boundary = "b0undary"
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (f"POST {protocol.ENCODE_PATH} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: multipart/form-data; "
            f"boundary={boundary}\r\nContent-Length: {declared}\r\n\r\n").encode()
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"request\"\r\nContent-Type: application/json"
            "\r\n\r\n").encode()
    spec = {"protocol": protocol.PROTOCOL_VERSION, "prompt": "<Picture 1> waves.", "ref_images": [{"part": "i"}]}
    image = (f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"i\"; filename=\"i.png\"\r\n"
             "Content-Type: image/png\r\n\r\n").encode()
    sock.sendall(head + part + json.dumps(spec).encode() + image + first)
    return sock


def read_status(sock: socket.socket) -> int | None:
    """The HTTP status the server wrote on `sock`, or None when it closed (or failed) without one."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    return int(data.split(b" ")[1]) if data.startswith(b"HTTP/1.1") else None


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from prometheus-client's parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def cache_components(headers) -> dict[str, str]:
    """The X-H3-Cache-Components header as {component part: tier or "miss"} ({} when absent)."""
    text = headers.get(protocol.H_CACHE_COMPONENTS, "")
    return dict(item.strip().split("=") for item in text.split(",") if item.strip())
