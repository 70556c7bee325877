"""Run as a script by tests/test_node_words.py, in one ComfyUI tree (argv[1]; the repo is argv[2]): imports the pack's
node modules under a stand-in package (not its __init__, which registers every node), with ComfyUI's own
comfy / comfy_api / folder_paths on the path and no server, and prints what the test checks as one JSON object.

  progress: the lines nodes/progress_text.py sends (fitted, summaries), with `_send_text` recorded
  token: nodes/remote.py's next step for a 401 with and without a token in the environment
  schema: each pack node's search_aliases as its V1 info says them (core 0.33) or their absence (0.3.75)
  preview: the core H3 tiny decoder the Sampler's previews would use
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

comfy_dir, repo = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
sys.argv = [str(comfy_dir / "main.py"), "--cpu"]
sys.path.insert(0, str(comfy_dir))
os.chdir(comfy_dir)

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()

import importlib  # noqa: E402

PACKAGE = "h3pack_node_words"
for name, path in ((PACKAGE, repo), (f"{PACKAGE}.nodes", repo / "nodes")):
    package = types.ModuleType(name)
    package.__path__ = [str(path)]
    sys.modules[name] = package


def node(module: str):
    return importlib.import_module(f"{PACKAGE}.nodes.{module}")


out: dict = {}

# --- progress text -------------------------------------------------------------------------------------------------
progress_text = node("progress_text")
sent: list[str] = []
progress_text._send_text = lambda text, node_id: sent.append(text)
limit = progress_text.MAX_TEXT_CHARS
lines = [progress_text.PHASE_TEXT[p].format(done=9999, total=9999, percent=100) for p in progress_text.PHASE_TEXT]
out["progress"] = {
    "limit": limit,
    "phase_lines_with_heartbeat": [progress_text.fit(line, " - 999 s") for line in lines],
    "long": progress_text.fit("x " * 60, " - 12 s"),
    "word": progress_text.fit("reading " + "supercalifragilistic " * 4 + "files"),
    "newline": progress_text.fit("two\nlines"),
    "unlimited": progress_text.fit("y" * 80, limit=None),
    "summaries": [progress_text.summary("decode_audio", 48.2), progress_text.summary("load", 2.14),
                  progress_text.summary(None, 0.4), progress_text.sampler_summary(52.4, 49),
                  progress_text.sampler_summary(123.0, 49, 35)],
}
with progress_text.PhaseText("7") as text:
    text.show("build_tiny")
    text.show("decode_video", 3, 7)
    text.show("decode_audio")
out["progress"]["phase_text_run"] = list(sent)
sent.clear()
with progress_text.PhaseText("7"):
    pass
out["progress"]["silent_run"] = list(sent)
sent.clear()
step = progress_text.with_text(lambda *a: None, "9", "denoise", suffix=lambda: ", cache skipped 35%")
step(29, 49)
out["progress"]["sampler_step"] = list(sent)
sent.clear()
progress_text.leave("9", "a " * 40)
out["progress"]["left"] = list(sent)

# --- remote: the 401 step ------------------------------------------------------------------------------------------
remote = node("remote")
client = importlib.import_module(f"{PACKAGE}.h3_core.remote.client.encoder_client")
URL, SECRET = "https://enc.example:8443", "s3cr3t-" + "t" * 30
ENVS = {
    "none": {},
    "token": {"H3_ENCODER_TOKEN": SECRET, "H3_ENCODER_URLS": URL},
    "per_origin": {"H3_ENCODER_TOKENS": f"{URL}={SECRET}"},
    "other_endpoint": {"H3_ENCODER_TOKEN": SECRET, "H3_ENCODER_URLS": "https://elsewhere.example"},
}
out["token"] = {}
for label, env in ENVS.items():
    for key in ("H3_ENCODER_TOKEN", "H3_ENCODER_URLS", "H3_ENCODER_URL", "H3_ENCODER_TOKENS"):
        os.environ.pop(key, None)
    os.environ.update(env)
    error = client.RemoteAuthError(f"{URL} answered 401 unauthorized: missing or wrong bearer token", status=401,
                                   code="unauthorized", url=URL, message="missing or wrong bearer token")
    out["token"][label] = {"step": remote.token_step(URL), "public": remote.public_error(error, URL)}
out["token"]["secret"] = SECRET
out["token"]["unset_step"] = remote.TOKEN_STEP

# --- schemas: search aliases where io.Schema takes them ------------------------------------------------------------
node_types = node("types")
out["schema"] = {"accepts": node_types.schema_accepts("search_aliases"), "nodes": {}}
for module in ("loaders", "encode", "remote", "sample", "decode", "media", "core_latent", "conditioning_io"):
    for cls in node(module).NODES:
        schema = cls.define_schema()
        info = schema.get_v1_info(cls)
        out["schema"]["nodes"][schema.node_id] = getattr(info, "search_aliases", "absent")

# --- previews: core's own H3 tiny decoder ------------------------------------------------------------------------
bridge = node("comfy_bridge")
out["preview"] = {"tae": bridge.core_tae_name(), "method": bridge.preview_method(),
                  "previewer": bridge.core_tae_previewer() is not None}
from comfy.cli_args import LatentPreviewMethod, args  # noqa: E402

args.preview_method = LatentPreviewMethod.TAESD  # taesd with no file in models/vae_approx: the pack's linear map
out["preview"]["taesd_without_file"] = bridge.core_tae_previewer() is not None

print("NODE_WORDS " + json.dumps(out))
