"""Oversized safetensors headers: time and peak memory to refuse one, per reader.

    python bench/hostile_headers.py [--mb 93] [--answer-mb 23.7] [--timeout 600]

Each case runs in its own process and reports the seconds the reader took and its peak RSS over the process's
baseline (`ru_maxrss` after the imports): `H3Conditioning.load` of a file whose header is `--mb` MB of valid JSON
(empty tensor entries, the attack), `weights.check` and the weights header reader on the same file as a
model, and the remote client receiving an answer whose header is `--answer-mb` MB. Prints one JSON object.
Run it on two checkouts to compare (the figures before the caps: 135 s / 2.3 GB for `load`, 107 s for
`check`, 48.6 s / +226 MB for the client).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASE = r"""
import json, resource, sys, threading, time, socket
kind, path = sys.argv[1], sys.argv[2]
from h3_core.contract import H3Conditioning
from h3_core import weights
from h3_core.remote.client.encoder_client import EncoderClient
from h3_core.request import EncodeRequest

def serve(data):
    caps = json.dumps({"protocol": {"name": "h3-encoder", "version": 2, "versions": [2]},
                       "model": {"fingerprint": "abc", "components": ["text", "video", "audio"], "dtype": "float32"},
                       "limits": {}, "deadline_s": {"max": 600}}).encode()
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(8)
    def handle(conn):
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(65536)
        first, _, rest = head.partition(b"\r\n\r\n")
        lines = first.split(b"\r\n")
        length = next((int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length")), 0)
        while len(rest) < length:
            rest += conn.recv(1 << 20)
        body = caps if b"capabilities" in first.split(b"\r\n")[0] else data
        try:
            kind = b"json" if body is caps else b"octet-stream"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/%s\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (kind, len(body)))
            conn.sendall(body)  # not joined: the server's copy must not count as the client's memory
        except OSError:
            pass
        conn.close()
    def loop():
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"

url = serve(open(path, "rb").read()) if kind == "client" else None
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
try:
    if kind == "load":
        H3Conditioning.load(path)
    elif kind == "check":
        report = weights.check(path)
        raise ValueError(str(report).splitlines()[-1]) if not report.ok else None
    elif kind == "header":
        weights.headers.read_header([path])
    else:
        EncoderClient(url, retries=0, read_timeout=600).encode(
            EncodeRequest(prompt="A fox.", width=64, height=64, num_frames=124))
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {str(exc)[:160]}"
seconds = time.perf_counter() - started
extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print(json.dumps({"seconds": round(seconds, 4), "extra_mb": round(extra / 1e6, 1), "error": error}))
"""


def write_header_file(path: str, header_bytes: int) -> None:
    entry = b'"t%09d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    count = header_bytes // (len(entry % 0) + 1)
    body = b"{" + b",".join(entry % i for i in range(count)) + b"}"
    body += b" " * (header_bytes - len(body))
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little"))
        f.write(body)


def run(kind: str, path: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, "-c", CASE, kind, path], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "extra_mb": None, "error": f"still running after {timeout:g} s"}
    if done.returncode:
        return {"seconds": None, "extra_mb": None, "error": f"exit {done.returncode}: {done.stderr[-300:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=93.0, help="header size of the file cases (MB, 1e6 bytes)")
    parser.add_argument("--answer-mb", type=float, default=23.7, help="header size of the client's answer (MB)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case before giving up")
    parser.add_argument("--cases", default="load,check,header,client")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="h3-bench-headers-") as folder:
        big, answer = os.path.join(folder, "big.safetensors"), os.path.join(folder, "answer.safetensors")
        write_header_file(big, int(args.mb * 1e6))
        write_header_file(answer, int(args.answer_mb * 1e6))
        for kind in args.cases.split(","):
            results[kind] = run(kind, answer if kind == "client" else big, args.timeout)
            print(f"{kind}: {results[kind]}", file=sys.stderr, flush=True)
    print(json.dumps({"header_mb": args.mb, "answer_header_mb": args.answer_mb, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
