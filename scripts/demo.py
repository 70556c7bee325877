"""The main job, disaggregated, on the embedded tiny H3 (random weights: the output is noise).

1. build the tiny H3 (once) into models/tiny;
2. start the H3 encoder endpoint on loopback (`python -m h3_core serve`): text encoder + both VAE
   encoders live there;
3. start a real ComfyUI with this pack, whose graph loads only the DiT and the VAE decoders;
4. run the shipped workflows/api/ref2va_remote.json headlessly over ComfyUI's HTTP API (image,
   video-with-soundtrack and audio references -> Remote Encode -> Sampler -> Decode -> SaveVideo);
5. copy the mp4 (H.264 + AAC, 24 fps, 32 kHz stereo) to output/demo/ and print its path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACK_NAME = "comfyui-minimax-h3"


def log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def start(stack: ExitStack, name: str, argv: list[str], ready_url: str, log_path: Path, timeout: float = 180.0):
    """Start a service, stop it when the demo ends, and wait until `ready_url` answers."""
    log_file = stack.enter_context(open(log_path, "w"))
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def stop():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    stack.callback(stop)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
        try:
            get_json(ready_url, timeout=2.0)
            return proc
        except (OSError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"{name} did not come up within {timeout:.0f} s; see {log_path}")


def comfy_base(base: Path, tiny: Path) -> Path:
    for sub in ("custom_nodes", "user/default", "models/minimax_h3", "input", "output"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for link, target in ((base / "custom_nodes" / PACK_NAME, REPO), (base / "models/minimax_h3/tiny", tiny)):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    (base / "user/default/comfy.settings.json").write_text('{"Comfy.TutorialCompleted": true}\n')
    return base


def run_workflow(comfy_url: str, graph: dict, timeout: float = 900.0) -> dict:
    body = json.dumps({"prompt": graph, "client_id": str(uuid.uuid4())}).encode()
    request = urllib.request.Request(f"{comfy_url}/prompt", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            prompt_id = json.loads(response.read())["prompt_id"]
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"ComfyUI refused the workflow: {error.read().decode()[:2000]}") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = get_json(f"{comfy_url}/history/{prompt_id}").get(prompt_id)
        status = (entry or {}).get("status", {})
        if status.get("completed") or status.get("status_str") == "error":
            if status.get("status_str") != "success":
                raise RuntimeError(f"the workflow failed: {json.dumps(status.get('messages'))[-2000:]}")
            return entry["outputs"]
        time.sleep(0.5)
    raise RuntimeError(f"the workflow did not finish within {timeout:.0f} s")


def main() -> int:
    python = sys.executable
    out_dir = Path(os.environ.get("H3_DEMO_OUT", REPO / "output" / "demo"))
    tiny = Path(os.environ.get("H3_MODELS", REPO / "models" / "tiny"))
    comfy_dir = Path(os.environ.get("H3_COMFY_DIR", REPO / ".comfyui"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (tiny / "tiny.json").is_file():
        log(f"building the tiny H3 into {tiny}")
        subprocess.run([python, "-m", "h3_core", "tiny", "--out", str(tiny)], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    encoder_port, comfy_port = free_port(), free_port()
    encoder_url, comfy_url = f"http://127.0.0.1:{encoder_port}", f"http://127.0.0.1:{comfy_port}"
    base = comfy_base(out_dir / "comfyui-base", tiny)
    with ExitStack() as stack:
        log(f"starting the H3 encoder endpoint on {encoder_url} (text encoder + VAE encoders)")
        start(stack, "encoder server", [python, "-m", "h3_core", "serve", "--models", str(tiny),
                                        "--host", "127.0.0.1", "--port", str(encoder_port)],
              f"{encoder_url}/v1/health", out_dir / "encoder-server.log")
        log(f"starting ComfyUI on {comfy_url} with the pack (DiT + VAE decoders only)")
        start(stack, "ComfyUI", [python, str(comfy_dir / "main.py"), "--cpu", "--listen", "127.0.0.1",
                                 "--port", str(comfy_port), "--base-directory", str(base),
                                 "--database-url", f"sqlite:///{base}/user/comfyui.db", "--disable-api-nodes"],
              f"{comfy_url}/system_stats", out_dir / "comfyui.log")
        graph = json.loads((REPO / "workflows" / "api" / "ref2va_remote.json").read_text())
        for node in graph.values():
            if node["class_type"] == "H3SplitRemoteEncode":
                node["inputs"]["endpoint"] = encoder_url
        log("running workflows/api/ref2va_remote.json over ComfyUI's HTTP API")
        started = time.monotonic()
        outputs = run_workflow(comfy_url, graph)
        item = next(i for node in outputs.values() for i in node.get("images", []) if i["filename"].endswith(".mp4"))
        produced = base / item["type"] / item.get("subfolder", "") / item["filename"]
        target = out_dir / "h3_demo_ref2va_remote.mp4"
        shutil.copyfile(produced, target)
        log(f"done in {time.monotonic() - started:.1f} s")
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
