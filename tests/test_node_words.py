"""What the pack's nodes say, in each ComfyUI (0.3.75 and core 0.33), without a server: the progress text fits one
line of a node and ends in a summary (UX review 4: it overflowed under the next node's badges and stayed after the
run), the Remote Encode node's 401 step tells "no token set" from "token refused", the node schemas carry search
aliases where core's io.Schema takes them (0.33), and the Sampler's previews use core's own H3 tiny decoder (taeh3)
only where core has one.

tests/support/node_words_probe.py imports the node modules in a fresh Python per ComfyUI tree and prints JSON.
tests/test_nodes_comfyui.py checks the Sampler's cached-run line in a real server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.comfy_harness import COMFY_0375, CORE_033, unavailable

REPO = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "support" / "node_words_probe.py"


@pytest.fixture(scope="module", params=[COMFY_0375, CORE_033], ids=["0.3.75", "core-0.33"])
def said(request) -> dict:
    install = request.param
    ok, reason = install.available()
    if not ok:
        unavailable(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_ENCODER")}
    env.pop("PYTHONPATH", None)
    if install.site:
        env["PYTHONPATH"] = os.pathsep.join(str(folder) for folder in install.site)
    run = subprocess.run([sys.executable, str(PROBE), str(install.dir), str(REPO)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=REPO)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("NODE_WORDS ")), None)
    assert run.returncode == 0 and line, run.stdout[-3000:] + run.stderr[-3000:]
    return {"label": install.label, **json.loads(line[len("NODE_WORDS "):])}


def test_progress_lines_fit_one_line_and_end_in_a_summary(said):
    progress = said["progress"]
    limit = progress["limit"]
    fitted = [*progress["phase_lines_with_heartbeat"], progress["long"], progress["word"],
              *progress["summaries"], *progress["phase_text_run"], *progress["sampler_step"], *progress["left"]]
    assert all(len(line) <= limit and "\n" not in line for line in fitted), [ln for ln in fitted if len(ln) > limit]
    # every phase's own words fit whole, with the heartbeat's age (nothing cut mid-word)
    assert not any("\u2026" in line for line in progress["phase_lines_with_heartbeat"])
    assert progress["long"].endswith("\u2026 - 12 s")  # a cut keeps the heartbeat's age
    assert progress["word"] == "reading supercalifragilistic supercalifragili\u2026"  # no word end close by
    assert progress["newline"] == "two lines" and len(progress["unlimited"]) == 80  # RemoteText: URLs stay whole
    assert progress["summaries"] == ["decoded in 48 s", "weights read in 2.1 s", "done in 0.4 s",
                                     "done: 49 DiT forwards in 52 s",
                                     "done in 123 s, cache skipped 35% of DiT blocks"]
    # a node's work: its steps, then a summary in place of the last step (not "decoding audio (one pass) - 45 s")
    run = progress["phase_text_run"]
    assert run[:3] == ["building tiny H3 (first use, ~30 s)", "decoding video: tile 3/7", "decoding audio (one pass)"]
    assert run[-1].startswith("decoded in ") and run[-1].endswith(" s"), run
    assert progress["silent_run"] == []  # nothing shown, nothing summarised (a cached load)
    assert progress["sampler_step"] == ["DiT forward 29/49, cache skipped 35%"]  # the step count stays readable
    assert progress["left"][0].endswith("\u2026")


def test_remote_401_tells_no_token_from_a_refused_token(said):
    token = said["token"]
    unset = token["unset_step"]
    assert token["none"]["step"] == unset and token["none"]["public"].endswith(unset)
    assert token["other_endpoint"]["step"] == unset  # no token goes to an endpoint the environment does not list
    for label, variable in (("token", "H3_ENCODER_TOKEN"), ("per_origin", "H3_ENCODER_TOKENS")):
        step = token[label]["step"]
        assert step.startswith(f"ComfyUI sent this endpoint the token from {variable} and the server refused it")
        assert "Set H3_ENCODER_TOKEN and" not in step and token[label]["public"].endswith(step)
    for case in ("none", "token", "per_origin", "other_endpoint"):
        assert token["secret"] not in json.dumps(token[case])  # the variable is named, its value never shown


def test_search_aliases_only_where_the_schema_takes_them(said):
    schema = said["schema"]
    assert len(schema["nodes"]) >= 15
    if said["label"] == "0.3.75":
        assert schema["accepts"] is False and set(schema["nodes"].values()) == {"absent"}
        return
    assert schema["accepts"] is True
    for node_id, aliases in schema["nodes"].items():
        assert aliases[:2] == ["minimax", "h3"], node_id
    assert "remote encoder" in schema["nodes"]["H3SplitRemoteEncode"]
    assert "text encode" in schema["nodes"]["H3SplitTextEncode"]
    assert "video vae" in schema["nodes"]["H3SplitVideoVAELoader"]


def test_sampler_previews_use_cores_h3_decoder_only_where_core_has_one(said):
    preview = said["preview"]
    assert preview["tae"] == (None if said["label"] == "0.3.75" else "taeh3")
    # without --preview-method taesd, or without models/vae_approx/taeh3*, the pack's linear map previews
    assert preview["previewer"] is False and preview["taesd_without_file"] is False
