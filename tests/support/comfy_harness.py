"""Run this pack inside a real ComfyUI server (and its real frontend) on CPU, on loopback.

`bash scripts/test.sh` sets everything up (scripts/setup_comfyui.sh): ComfyUI core 0.33 in `.comfyui-0.33/` (the
tests' default), ComfyUI 0.3.75 in the venv and its tree copied to `.comfyui/`, Debian chromium, playwright-core in
`tests/ui`.

Use from a test module::

    from support.comfy_harness import comfy  # noqa: F401  (the session fixture: one server per session)

    def test_x(comfy):
        info = comfy.object_info("H3SomeNode")
        result = comfy.run_prompt({"1": {"class_type": ..., "inputs": {...}}}, timeout=120)
        assert result.files[0].suffix == ".mp4"

Importing the fixture into several modules is fine: servers are cached per configuration, so the
session still starts one (registering it once in conftest.py via `pytest_plugins` works too).
`comfy_factory(models_src=None, env=None, extra_args=(), install=None)` gives a server with another setup.

Two ComfyUIs: `CORE_033` (core 0.33.0 with its own H3, `.comfyui-0.33/`, run from the same venv with the overlay of
core's differing pins first on its path: the default everywhere, DEFAULT_INSTALL) and `COMFY_0375` (0.3.75,
`.comfyui/`: the smoke set of tests/test_comfy0375_smoke.py and tests/test_templates_newest_frontend.py, or every test
with H3_COMFY=0.3.75); both set up by scripts/setup_comfyui.sh. `start_comfy(..., install=COMFY_0375)` /
`shared_comfy(..., install=COMFY_0375)` start the other one; `install.available()` says whether it is set up.

The server's base directory links the embedded tiny H3's ComfyUI models (`tiny_dir/comfyui`)
into `models/diffusion_models`, `models/text_encoders` and `models/vae`; its environment gets
`H3_TINY_DIR=<tiny_dir>`. `start_comfy(base_dir, ...)` starts an unshared one (stop() it).

Where ComfyUI is not set up, the fixture skips (it fails instead when CI is set, so a broken
setup cannot pass as skipped); likewise the UI helper when chromium or playwright-core is missing.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pytest

PACK_NAME = "comfyui-minimax-h3"
REPO = Path(__file__).resolve().parents[2]
COMFY_DIR = Path(os.environ.get("H3_COMFY_DIR", REPO / ".comfyui"))
COMFY033_DIR = Path(os.environ.get("H3_COMFY033_DIR", REPO / ".comfyui-0.33"))
UI_DIR = REPO / "tests" / "ui"
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae")
START_TIMEOUT_S = 300.0  # real time: ComfyUI + torch imports take ~30 s idle, several times that at load 8 on 2 cores
IN_CI = bool(os.environ.get("CI"))


class ComfyError(RuntimeError):
    """The server did not start, died, or a prompt did not end as expected (message has the log tail)."""


def unavailable(reason: str) -> None:
    """Skip a test for a missing prerequisite; in CI, fail instead (the setup is part of CI)."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: the setup step must provide it)", pytrace=False)
    pytest.skip(reason)


def comfy_available() -> tuple[bool, str]:
    """Whether the ComfyUI the tests run in by default (DEFAULT_INSTALL) is set up, and why not."""
    return DEFAULT_INSTALL.available()


@dataclass(frozen=True)
class ComfyInstall:
    """A ComfyUI tree the harness starts with this venv's python: its folder, and folders put first on the server's
    path (PYTHONPATH) for the packages whose versions it pins differently from the venv's."""

    label: str
    dir: Path
    site: tuple[Path, ...] = ()

    def available(self) -> tuple[bool, str]:
        if not (self.dir / "main.py").is_file():
            return False, f"ComfyUI {self.label} is not set up at {self.dir}: run scripts/setup_comfyui.sh"
        for folder in self.site:
            if not any(folder.glob(".h3-stamp-*")):
                return False, (f"ComfyUI {self.label}'s packages are not set up at {folder}: run "
                               "scripts/setup_comfyui.sh (its log says why when it cannot)")
        return True, ""

    @property
    def version(self) -> str:
        """`__version__` of the tree's comfyui_version.py ('' if unreadable)."""
        try:
            text = (self.dir / "comfyui_version.py").read_text()
        except OSError:
            return ""
        return next((ln.split("=", 1)[1].strip().strip("\"'") for ln in text.splitlines()
                     if ln.startswith("__version__")), "")


# The venv's prefix, not REPO/.venv: the overlay is installed per venv (H3_VENV) by scripts/setup_comfyui.sh.
CORE033_SITE = Path(sys.prefix) / "h3-comfyui-0.33-site"
COMFY_0375 = ComfyInstall("0.3.75", COMFY_DIR)
CORE_033 = ComfyInstall("0.33.0", COMFY033_DIR, (CORE033_SITE,))
#: The ComfyUI every test runs in unless it names one (`install=`): core 0.33, or 0.3.75 with H3_COMFY=0.3.75 (how the
#: whole ComfyUI tier is tried on 0.3.75: `H3_COMFY=0.3.75 bash scripts/test.sh -m comfyui`). Every run also runs the
#: 0.3.75 smoke set (tests/test_comfy0375_smoke.py, tests/test_templates_newest_frontend.py), which names COMFY_0375.
DEFAULT_INSTALL = COMFY_0375 if os.environ.get("H3_COMFY") == "0.3.75" else CORE_033


def chromium_path() -> str | None:
    path = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    return path if path and os.access(path, os.X_OK) else None


def ui_available() -> tuple[bool, str]:
    """Whether the frontend test can run here, and why not."""
    if chromium_path() is None:
        return False, "chromium is not installed (scripts/setup_comfyui.sh installs Debian's as root)"
    if shutil.which("node") is None:
        return False, "node is not installed"
    if not (UI_DIR / "node_modules" / "playwright-core").is_dir():
        return False, "playwright-core is not installed in tests/ui (run `npm ci` there)"
    return True, ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_base_dir(base: Path, models_src: Path | None = None) -> Path:
    """Lay out a ComfyUI base directory: the pack symlinked as custom_nodes/<PACK_NAME>, the
    settings that skip the first-run dialogs, models/ (model files from models_src/<folder>/
    symlinked into models/<folder>/), input/ and output/."""
    base = Path(base)
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_NAME
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    (base / "user" / "default").mkdir(parents=True, exist_ok=True)
    (base / "user" / "default" / "comfy.settings.json").write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    for sub in ("input", "output", "temp"):
        (base / sub).mkdir(exist_ok=True)
    for folder in (*MODEL_FOLDERS, "checkpoints", "loras", "clip_vision", "audio_encoders"):
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
    if models_src is not None:
        link_models(base, models_src)
    return base


def link_models(base: Path, models_src: Path, folders: Iterable[str] = MODEL_FOLDERS) -> list[Path]:
    """Symlink every file of models_src/<folder>/ into base/models/<folder>/ (new files are
    visible to a running server: ComfyUI lists model folders on each request)."""
    made = []
    for folder in folders:
        src = Path(models_src) / folder
        if not src.is_dir():
            continue
        for f in sorted(src.iterdir()):
            dst = Path(base) / "models" / folder / f.name
            if not dst.exists():
                dst.symlink_to(f.resolve())
            made.append(dst)
    return made


@dataclass
class PromptResult:
    prompt_id: str
    status: str  # "success" | "error" | "interrupted"
    messages: list[dict]  # every JSON ws message seen from POST to the end, in order
    binary: list[bytes]  # binary ws frames (previews), raw
    history: dict  # the /history/<id> entry ({} if none was written)
    outputs: dict  # history["outputs"]: node id -> ui dict
    files: list[Path]  # local paths of every {filename, subfolder, type} in outputs
    error: dict | None  # the execution_error message's data, if any
    elapsed_s: float

    def types(self) -> list[str]:
        return [m.get("type") for m in self.messages]

    def of_type(self, kind: str) -> list[dict]:
        return [m.get("data", {}) for m in self.messages if m.get("type") == kind]

    def executed_nodes(self) -> list[str]:
        """Node ids in the order they started (cached ones excluded)."""
        return [d["node"] for d in self.of_type("executing") if d.get("node") is not None]


@dataclass
class ComfyServer:
    url: str
    base_dir: Path
    log_path: Path
    proc: subprocess.Popen
    env_extra: dict = field(default_factory=dict)
    install: ComfyInstall | None = None  # the tree it runs (start_comfy sets it)
    start_wall_s: float = 0.0  # from spawning to /system_stats answering
    start_cpu_s: float = 0.0  # user + system CPU seconds the server process used until then

    # ---------------------------------------------------------------- plain HTTP
    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        """One HTTP call; returns (status, parsed JSON or bytes). Never raises on an HTTP status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        if "json" in ctype:
            return status, json.loads(raw or b"null")
        return status, raw

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        status, body = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ComfyError(f"GET {path} -> {status}: {body!r:.500}")
        return body

    def object_info(self, node_class: str | None = None) -> dict:
        """/object_info (all node types), or the entry of one node type (KeyError if absent)."""
        if node_class is None:
            return self.get_json("/object_info")
        return self.get_json(f"/object_info/{urllib.parse.quote(node_class)}")[node_class]

    def pack_nodes(self) -> dict:
        """The /object_info entries of the node types this pack registered."""
        module = f"custom_nodes.{PACK_NAME}"
        return {
            k: v
            for k, v in self.object_info().items()
            if v.get("python_module") == module or str(v.get("python_module", "")).startswith(module + ".")
        }

    def add_model(self, folder: str, src: str | os.PathLike, name: str | None = None) -> Path:
        """Symlink a model file into models/<folder>/ (as `name`, e.g. a real model's file name
        for a tiny file); a running server sees it on its next listing."""
        dst = self.base_dir / "models" / folder / (name or Path(src).name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        dst.symlink_to(Path(src).resolve())
        return dst

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        """POST /free: asks the prompt worker to unload models / drop its caches (applied
        asynchronously, when the worker is idle)."""
        self.request("POST", "/free", {"unload_models": unload_models, "free_memory": free_memory})

    def history(self, prompt_id: str) -> dict:
        return self.get_json(f"/history/{prompt_id}").get(prompt_id, {})

    def view(self, filename: str, subfolder: str = "", type: str = "output") -> bytes:
        q = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        status, body = self.request("GET", f"/view?{q}")
        if status != 200:
            raise ComfyError(f"/view {q} -> {status}")
        return body if isinstance(body, bytes) else json.dumps(body).encode()

    def interrupt(self, prompt_id: str | None = None) -> None:
        """POST /interrupt (the running prompt, or only prompt_id if it is the one running)."""
        status, body = self.request("POST", "/interrupt", {"prompt_id": prompt_id} if prompt_id else {})
        if status != 200:
            raise ComfyError(f"/interrupt -> {status}: {body!r:.300}")

    def post_prompt_expect_error(self, graph: Mapping) -> tuple[int, dict]:
        """POST /prompt expecting a rejection; returns (status, body) as the server sent them.
        Should it be accepted after all, the prompt is removed from the queue/interrupted."""
        status, body = self.request("POST", "/prompt", {"prompt": graph, "client_id": uuid.uuid4().hex})
        if status == 200 and isinstance(body, dict) and "prompt_id" in body:
            self.request("POST", "/queue", {"delete": [body["prompt_id"]]})
            self.interrupt(body["prompt_id"])
        return status, body

    def output_path(self, item: Mapping) -> Path:
        root = {"output": "output", "temp": "temp", "input": "input"}[item.get("type", "output")]
        return self.base_dir / root / item.get("subfolder", "") / item["filename"]

    # ---------------------------------------------------------------- prompt runs
    def run_prompt(
        self,
        graph: Mapping,
        timeout: float = 120.0,
        *,
        check: bool = True,
        extra_data: Mapping | None = None,
        on_message: Callable[[dict], Any] | None = None,
    ) -> PromptResult:
        """Run an API-format graph and wait for it to finish.

        Opens /ws?clientId=, POSTs /prompt, collects every ws message until the server says the
        prompt is done (`executing` with node None), then reads /history/<id>. `on_message(msg)`
        is called on each JSON message as it arrives (e.g. to call `self.interrupt()`).
        check=True raises ComfyError (with node errors / traceback / log tail) unless it succeeded;
        a rejected prompt (400) always raises. On timeout the prompt is interrupted and
        TimeoutError raised."""
        return asyncio.run(self._run_prompt(dict(graph), timeout, check, extra_data, on_message))

    async def _run_prompt(self, graph, timeout, check, extra_data, on_message) -> PromptResult:
        import aiohttp

        client_id = uuid.uuid4().hex
        messages: list[dict] = []
        binary: list[bytes] = []
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{self.ws_url}/ws?clientId={client_id}", max_msg_size=0) as ws:
                body = {"prompt": graph, "client_id": client_id}
                if extra_data:
                    body["extra_data"] = dict(extra_data)
                async with session.post(f"{self.url}/prompt", json=body) as r:
                    answer = await r.json(content_type=None)
                    if r.status != 200:
                        raise ComfyError(f"POST /prompt -> {r.status}: {json.dumps(answer, indent=1)[:4000]}")
                prompt_id = answer["prompt_id"]
                try:
                    await asyncio.wait_for(self._collect(ws, prompt_id, messages, binary, on_message), timeout)
                except asyncio.TimeoutError:
                    self.interrupt(prompt_id)
                    self.request("POST", "/queue", {"delete": [prompt_id]})
                    raise TimeoutError(
                        f"prompt {prompt_id} did not finish in {timeout} s; ws types seen: "
                        f"{[m.get('type') for m in messages][-30:]}\n{self.log_tail()}"
                    ) from None
        history = {}
        for _ in range(50):  # history is written just before the final `executing`; be lenient
            history = self.history(prompt_id)
            if history.get("status", {}).get("status_str") in ("success", "error"):
                break
            await asyncio.sleep(0.1)
        types = [m.get("type") for m in messages]
        error = next((m["data"] for m in messages if m.get("type") == "execution_error"), None)
        if "execution_interrupted" in types:
            status = "interrupted"
        elif error is not None or history.get("status", {}).get("status_str") == "error":
            status = "error"
        else:
            status = "success"
        outputs = history.get("outputs", {})
        files = [self.output_path(item) for item in _file_items(outputs)]
        result = PromptResult(
            prompt_id, status, messages, binary, history, outputs, files, error, time.monotonic() - t0
        )
        if check and status != "success":
            detail = json.dumps(error, indent=1)[:6000] if error else f"ws types: {types}"
            raise ComfyError(f"prompt {prompt_id} ended with {status}:\n{detail}\n{self.log_tail()}")
        return result

    async def _collect(self, ws, prompt_id, messages, binary, on_message) -> None:
        import aiohttp

        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                binary.append(msg.data)
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise ComfyError(f"websocket closed ({msg.type}) before prompt {prompt_id} finished\n{self.log_tail()}")
            m = json.loads(msg.data)
            data = m.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue  # another prompt's message (the ws gets broadcasts too)
            messages.append(m)
            if on_message is not None:
                on_message(m)
            if m.get("type") == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                return

    # ---------------------------------------------------------------- frontend
    def load_workflow_ui(
        self,
        workflow: Mapping | str | os.PathLike | None = None,
        *,
        template: str | None = None,
        run: bool = False,
        timeout: float = 240.0,
        screenshot: str | os.PathLike | None = None,
        wait_for_types: Iterable[str] = (),
        search_templates: Iterable[str] = (),
        search_nodes: Iterable[str] = (),
        same_page: bool = False,
    ) -> dict:
        """Load a UI-format workflow into the real frontend in headless chromium
        (tests/ui/load_workflow.mjs) the way a dropped file is loaded, or `template="NAME"` (one of
        this pack's example_workflows/) the way the template browser loads it, and return the
        script's JSON report (see that file: `problems` lists alerts, toasts, page errors and
        unexpected console errors), plus `returncode` and `stderr_tail`. run=True also queues
        app.graphToPrompt()'s output and waits for it. search_templates / search_nodes: type each
        query into the template browser's search / the canvas's node search first and report what
        they list (`template_search`, `node_search`); without a workflow or template, only that.
        same_page: load into the page the previous same_page load against this server left open (its frontend
        booted once: ~4.5 CPU-s of chromium saved a load), as a user loads one template after another; the report
        covers this load only. Skips (fails in CI) when chromium/node/playwright-core is missing."""
        ok, reason = ui_available()
        if not ok:
            unavailable(reason)
        return run_ui_loader(
            self.url,
            workflow,
            template=f"{PACK_NAME}/{template}" if template else None,
            run=run,
            timeout=timeout,
            screenshot=screenshot,
            wait_for_types=wait_for_types,
            log_tail=self.log_tail,
            search_templates=search_templates,
            search_nodes=search_nodes,
            same_page=same_page,
        )

    # ---------------------------------------------------------------- lifecycle
    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http") :]

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    @property
    def input_dir(self) -> Path:
        return self.base_dir / "input"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- ComfyUI log tail ({self.log_path}) ---\n{tail}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, wait, then SIGKILL. Idempotent."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def progress_as_sent(events: list, every: list, install: ComfyInstall | None = None) -> bool:
    """Whether a node's ws progress `events` are `every` update its bar made, as `install` (default: DEFAULT_INSTALL)
    sends them: 0.3.75 each one; core 0.33 throttles a bar (comfy.utils.ProgressBar: the first and the last update,
    one with a preview, else none within 100 ms of the last sent), so there an ordered subsequence with the first and
    the last."""
    events, every = list(events), list(every)
    if (install or DEFAULT_INSTALL) == COMFY_0375:
        return events == every
    rest = iter(every)
    return bool(events) and events[0] == every[0] and events[-1] == every[-1] and all(e in rest for e in events)


def _file_items(outputs: Mapping) -> list[dict]:
    items = []
    for ui in outputs.values():
        for value in ui.values():
            if isinstance(value, list):
                items += [v for v in value if isinstance(v, dict) and "filename" in v]
    return items


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (Linux /proc), in seconds (0.0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def import_failures(log: str, pack: str = PACK_NAME) -> list[str]:
    """Lines of a ComfyUI log saying that `pack` did not load."""
    bad = ("IMPORT FAILED", "Cannot import", "Error while calling comfy_entrypoint", "Skip ", "did not return")
    return [ln for ln in log.splitlines() if pack in ln and any(b in ln for b in bad)]


def start_comfy(
    base_dir: Path,
    *,
    models_src: Path | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Iterable[str] = (),
    port: int | None = None,
    start_timeout: float = START_TIMEOUT_S,
    require_pack: bool = True,
    install: ComfyInstall | None = None,
) -> ComfyServer:
    """Lay out base_dir (make_base_dir), start `install`'s main.py --cpu (DEFAULT_INSTALL's: core 0.33) on
    127.0.0.1 with this venv's python, wait for /system_stats, check that the pack imported. Raises ComfyError with
    the log tail if the server dies, takes longer than start_timeout, or the pack failed."""
    install = install or DEFAULT_INSTALL
    ok, reason = install.available()
    if not ok:
        raise ComfyError(reason)
    comfy_dir = install.dir
    base_dir = make_base_dir(Path(base_dir), models_src)
    env_extra = dict(env or {})
    proc_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    proc_env.pop("PYTHONPATH", None)  # never let pytest's path leak into the server's imports
    if install.site:
        proc_env["PYTHONPATH"] = os.pathsep.join(str(folder) for folder in install.site)
    for attempt in range(3):
        p = port or free_port()
        log_path = base_dir / f"comfyui-{p}.log"
        argv = [
            sys.executable, str(comfy_dir / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(p),
            "--base-directory", str(base_dir), "--database-url", f"sqlite:///{base_dir}/user/comfyui.db",
            "--disable-api-nodes", "--disable-auto-launch", *extra_args,
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=base_dir,
                env=proc_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        server = ComfyServer(f"http://127.0.0.1:{p}", base_dir, log_path, proc, env_extra, install)
        t0 = time.monotonic()
        deadline = t0 + start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(server.url + "/system_stats", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        if proc.poll() is not None:
            log = server.log_text()
            if port is None and "address already in use" in log.lower() and attempt < 2:
                continue  # lost the free-port race: take another
            raise ComfyError(f"ComfyUI exited with {proc.returncode} during startup\n{server.log_tail(120)}")
        if time.monotonic() >= deadline:
            server.stop()
            raise ComfyError(f"ComfyUI did not answer /system_stats within {start_timeout} s\n{server.log_tail(120)}")
        server.start_wall_s, server.start_cpu_s = time.monotonic() - t0, process_cpu_seconds(proc.pid)
        failures = import_failures(server.log_text())
        if require_pack and failures:
            server.stop()
            raise ComfyError(f"the pack failed to import: {failures}\n{server.log_tail(120)}")
        return server
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------- frontend


def run_ui_loader(
    url: str,
    workflow: Mapping | str | os.PathLike | None,
    *,
    template: str | None = None,
    run: bool = False,
    timeout: float = 240.0,
    screenshot: str | os.PathLike | None = None,
    wait_for_types: Iterable[str] = (),
    log_tail: Callable[[], str] | None = None,
    search_templates: Iterable[str] = (),
    search_nodes: Iterable[str] = (),
    same_page: bool = False,
) -> dict:
    """Run tests/ui/load_workflow.mjs against a server at `url`; returns its JSON report with
    `returncode` (the script's exit status) and `stderr_tail` added. Raises ComfyError if it printed no report.
    A load runs in a chromium of its own; a `same_page` load runs in this process's browser session for `url`
    (`UiSession`: one chromium, the page the previous same_page load left open, its frontend booted once)."""
    with tempfile.TemporaryDirectory(prefix="h3-ui-") as tmp:
        argv = ["--timeout", str(int(timeout))]
        if template:
            argv += ["--template", template]
        elif workflow is None:
            pass  # searches only
        elif isinstance(workflow, Mapping):
            path = Path(tmp) / "workflow.json"
            path.write_text(json.dumps(workflow))
            argv.append(str(path))
        else:
            argv.append(str(Path(workflow).resolve()))
        if run:
            argv.append("--run")
        if screenshot:
            argv += ["--screenshot", str(screenshot)]
        for t in wait_for_types:
            argv += ["--wait-type", t]
        for query in search_templates:
            argv += ["--search-templates", query]
        for query in search_nodes:
            argv += ["--search-nodes", query]
        if same_page:
            return UiSession.for_url(url).load([*argv, "--same-page"], timeout + 60, log_tail)
        return _run_ui_once(url, argv, timeout + 60, log_tail)


def _run_ui_once(url: str, argv: list[str], timeout: float, log_tail: Callable[[], str] | None) -> dict:
    """One load in a chromium of its own (`node load_workflow.mjs ARGS`): a fresh browser, as a user opening ComfyUI."""
    env = {**os.environ, "COMFY_URL": url, "CHROMIUM_PATH": chromium_path() or ""}
    try:
        p = subprocess.run(["node", str(UI_DIR / "load_workflow.mjs"), *argv], cwd=UI_DIR, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ComfyError(f"load_workflow.mjs timed out after {timeout} s\n{(e.stderr or '')[-3000:]}") from None
    stderr_tail = "\n".join(p.stderr.splitlines()[-40:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        extra = log_tail() if log_tail else ""
        raise ComfyError(
            f"load_workflow.mjs exited {p.returncode} without a report\n{p.stdout[-2000:]}\n{stderr_tail}\n{extra}"
        )
    report = json.loads(lines[-1])
    report["returncode"] = p.returncode
    report["stderr_tail"] = stderr_tail
    return report


class UiSession:
    """One `node tests/ui/load_workflow.mjs --serve` (one headless chromium) for the same_page loads this process
    makes against one ComfyUI URL: the frontend boots once (~4.5 CPU-s of chromium) and each load goes into the page
    the one before left open, as a user loads one template after another. At most `KEEP` sessions stay open (a test
    module's server is seldom used again once the next module's has started); all close at exit."""

    KEEP = 2
    _open: dict[str, "UiSession"] = {}

    @classmethod
    def for_url(cls, url: str) -> "UiSession":
        session = cls._open.pop(url, None)
        if session is None or session.proc.poll() is not None:
            session = cls(url)
        cls._open[url] = session  # the most recently used last
        while len(cls._open) > cls.KEEP:
            cls._open.pop(next(iter(cls._open))).close()
        return session

    @classmethod
    def close_all(cls) -> None:
        while cls._open:
            cls._open.popitem()[1].close()

    def __init__(self, url: str):
        self.url = url
        self.log = tempfile.NamedTemporaryFile(prefix="h3-ui-session-", suffix=".log", delete=False)
        env = {**os.environ, "COMFY_URL": url, "CHROMIUM_PATH": chromium_path() or ""}
        self.proc = subprocess.Popen(["node", str(UI_DIR / "load_workflow.mjs"), "--serve"], cwd=UI_DIR, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def load(self, argv: list[str], timeout: float, log_tail: Callable[[], str] | None = None) -> dict:
        """One load (the script's arguments, as on its command line); its report. A load that prints no report
        within `timeout` s, or a session that died, raises ComfyError (the session is closed; the next load
        starts another)."""
        stderr_from = os.path.getsize(self.log.name)
        line = b""
        try:
            self.proc.stdin.write(json.dumps(argv).encode() + b"\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
                if ready:
                    piece = os.read(self.proc.stdout.fileno(), 1 << 20)
                    if not piece:
                        break
                    line += piece
        except (BrokenPipeError, OSError):
            pass
        stderr_tail = "\n".join(self._stderr(stderr_from).splitlines()[-40:])
        if not line.endswith(b"\n"):
            self.close()
            UiSession._open.pop(self.url, None)
            extra = log_tail() if log_tail else ""
            why = "died" if self.proc.returncode is not None else f"printed no report within {timeout:g} s"
            raise ComfyError(f"load_workflow.mjs --serve {why}\n{line[-2000:]!r}\n{stderr_tail}\n{extra}")
        report = json.loads(line)
        report["returncode"] = report.get("exit_code", 3)
        report["stderr_tail"] = stderr_tail
        return report

    def _stderr(self, start: int) -> str:
        with open(self.log.name, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # EOF: the script closes chromium and exits
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(15)
        self.proc.stdout.close()
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log.name)


atexit.register(UiSession.close_all)


# ------------------------------------------------------------------------------------- fixtures

# One server per configuration for the whole session, even when several test modules import
# the fixture (each import registers its own fixture definition).
_SERVERS: dict[tuple, ComfyServer] = {}


def shared_comfy(
    tmp_root: Path,
    models_src: Path | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Iterable[str] = (),
    install: ComfyInstall | None = None,
) -> ComfyServer:
    """The session's server for this configuration: started on first use (base dir under
    tmp_root), reused afterwards, stopped at session end. Skips (fails in CI) without ComfyUI.
    install: which ComfyUI tree (COMFY_0375, CORE_033); None is DEFAULT_INSTALL (core 0.33 unless H3_COMFY=0.3.75)."""
    install = install or DEFAULT_INSTALL
    env = dict(env or {})
    extra_args = tuple(extra_args)
    key = (str(models_src), tuple(sorted(env.items())), extra_args, str(install.dir))
    server = _SERVERS.get(key)
    if server is None or not server.alive():
        ok, reason = install.available()
        if not ok:
            unavailable(reason)
        base = Path(tempfile.mkdtemp(prefix="comfy-base-", dir=tmp_root))
        server = _SERVERS[key] = start_comfy(base, models_src=models_src, env=env, extra_args=extra_args,
                                             install=install)
    return server


def _stop_all() -> None:
    while _SERVERS:
        _, server = _SERVERS.popitem()
        server.stop()


atexit.register(_stop_all)  # also when pytest exits without tearing fixtures down


def thread_env() -> dict[str, str]:
    return {k: os.environ.get(k, "2") for k in ("OMP_NUM_THREADS", "H3_THREADS")}


@pytest.fixture(scope="session")
def comfy(tiny_dir, tmp_path_factory) -> ComfyServer:
    """A real ComfyUI server with this pack, the tiny H3's ComfyUI models linked in, and
    H3_TINY_DIR set; started once per session, stopped at session end."""
    env = {"H3_TINY_DIR": str(tiny_dir), **thread_env()}
    yield shared_comfy(tmp_path_factory.getbasetemp(), Path(tiny_dir) / "comfyui", env)
    _stop_all()


@pytest.fixture(scope="session")
def comfy_factory(tmp_path_factory):
    """`comfy_factory(models_src=None, env=None, extra_args=(), install=None)` -> a session-shared server for
    that configuration (thread variables are added to env; install: COMFY_0375 or CORE_033, None the default)."""

    def make(models_src=None, env=None, extra_args=(), install=None):
        return shared_comfy(tmp_path_factory.getbasetemp(), models_src, {**thread_env(), **(env or {})}, extra_args,
                            install)

    yield make
    _stop_all()
