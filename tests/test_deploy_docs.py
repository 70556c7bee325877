"""docs/DEPLOY.md and docs/PROTOCOL.md against the real tools and the real server.

* every PromQL query of the docs (```promql blocks) parses with Debian's `promtool`, and every metric it names is
  in a real server's `/metrics`; the documented `prometheus.yml` passes `promtool check config`;
* the systemd unit shown in DEPLOY.md is `deploy/h3-encoder.service`, passes `systemd-analyze verify` and scores
  at most 4.0 on `systemd-analyze security`; it stops the server alone (KillMode=mixed) and waits longer than the
  longest deadline the server accepts;
* PROTOCOL.md's capabilities example is a real server's, its checksum test vector is the code's, its media table
  lists every content type the server accepts, and its error table every code the server sends on 503.

The tools come from Debian's `prometheus` and `systemd` packages (scripts/setup_comfyui.sh installs them as
root); without them those tests skip and say so.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from h3_core import __version__
from h3_core.contract import wire
from h3_core.remote import protocol
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server import ingest, request_schema
from h3_core.remote.server.config import ServerConfig
from h3_core.testing import SERVER_THREADS

REPO = Path(__file__).resolve().parents[1]
DEPLOY = (REPO / "docs" / "DEPLOY.md").read_text()
PROTOCOL_DOC = (REPO / "docs" / "PROTOCOL.md").read_text()
UNIT = REPO / "deploy" / "h3-encoder.service"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOKEN = "deploy-docs-token-" + "d" * 24


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (Debian package {'prometheus' if tool == 'promtool' else 'systemd'}; "
                    "scripts/setup_comfyui.sh installs it as root): this check did not run")
    return path


# --------------------------------------------------------------------------------------------------------------
# PromQL


def _queries() -> list[str]:
    queries = []
    for doc in DOCS:
        for block in _blocks(doc.read_text(), "promql"):
            queries += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return queries


_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "inf", "nan"}


def _metric_names(query: str) -> set[str]:
    """The metric names a query selects: identifiers that are not functions, keywords, label names or values."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)  # label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        following = text[match.end():].lstrip()
        if following.startswith("(") or match.group() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


@pytest.fixture(scope="module")
def exposition(tiny_dir) -> str:
    """A real server's /metrics after one encode (histograms with samples, every family present)."""
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource

    stage = EncoderStage(ModelSource.from_path(tiny_dir), components=("text",))
    with ServerThread(stage, ServerConfig(threads=SERVER_THREADS, token=TOKEN)) as server:
        server.call(lambda: server.service.load_seconds.update(total=1.0))  # as `serve` records the whole load
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = json.dumps({"protocol": protocol.PROTOCOL_VERSION, "prompt": "A fox.", "width": 64, "height": 64})
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        conn.request("POST", protocol.ENCODE_PATH, body=body, headers=headers)
        assert conn.getresponse().read() and True
        conn.request("GET", "/metrics", headers=headers)
        text = conn.getresponse().read().decode()
        conn.close()
    return text


def test_the_docs_have_promql_and_every_query_parses_with_promtool(tmp_path):
    promtool = _need("promtool")
    queries = _queries()
    assert len(queries) >= 10, "DEPLOY.md's queries are in ```promql blocks, one per line"
    rules = {"groups": [{"name": "docs", "rules": [{"record": f"docs:query_{i}", "expr": query}
                                                   for i, query in enumerate(queries)]}]}
    path = tmp_path / "docs_rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(queries)} rules found" in checked.stdout


def test_every_metric_a_documented_query_names_is_on_a_real_server(exposition):
    families = set(re.findall(r"^# TYPE (\S+) ", exposition, flags=re.M))
    series = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", exposition, flags=re.M))
    named = set().union(*(_metric_names(query) for query in _queries()))
    assert named, "no metric names found"
    missing = sorted(name for name in named if name not in series and name not in families)
    assert not missing, f"the docs query metrics the server does not export: {missing}"
    # The metrics table names them without the prefix: each must exist with it.
    section = DEPLOY[DEPLOY.index("What there is (prefix `h3_encoder_`)"):DEPLOY.index("plus prometheus-client")]
    for cell in re.findall(r"^\| (.+?) \| (?:counter|gauge|histogram)", section, flags=re.M):
        for name in re.findall(r"`([a-z_]+)(?:\{[^}]*\})?`", cell):
            assert f"h3_encoder_{name}" in families, name


def test_the_documented_prometheus_config_passes_promtool(tmp_path):
    promtool = _need("promtool")
    (config,) = [block for block in _blocks(DEPLOY, "yaml") if block.startswith("# prometheus.yml")]
    token = tmp_path / "h3-encoder.token"
    token.write_text(TOKEN)
    path = tmp_path / "prometheus.yml"
    path.write_text(config.replace("/etc/prometheus/h3-encoder.token", str(token)))  # the only change
    checked = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "chmod 640" in DEPLOY and "root:prometheus" in DEPLOY  # readable by Debian's prometheus user


# --------------------------------------------------------------------------------------------------------------
# systemd


def test_the_unit_in_deploy_md_is_the_shipped_file():
    (shown,) = [block for block in _blocks(DEPLOY, "ini") if "h3-encoder.service" in block.splitlines()[0]]
    assert shown == UNIT.read_text()


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_unit_stops_the_server_alone_and_outwaits_the_longest_deadline():
    unit = _directives(UNIT.read_text())
    assert unit["KillMode"] == ["mixed"] and unit["KillSignal"] == ["SIGTERM"]
    assert unit["Wants"] == ["network-online.target"] and unit["After"] == ["network-online.target"]
    assert unit["UMask"] == ["0077"] and int(unit["RestartSec"][0]) > 0
    for hardening in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert unit[hardening] == ["true"], hardening
    assert unit["ProtectSystem"] == ["strict"]
    exec_start = unit["ExecStart"][0]
    assert "--deadline" not in exec_start  # so the server's default applies: ServerConfig's
    config = ServerConfig()
    drain = config.max_deadline_s + 5  # service.drain's default timeout
    assert config.max_deadline_s == config.default_deadline_s == 300
    assert int(unit["TimeoutStopSec"][0]) > drain
    # ... and a client cannot ask for more than that deadline (a 1500 s request used to be accepted).
    base = {"protocol": protocol.PROTOCOL_VERSION, "prompt": "A fox."}
    accepted = request_schema.parse_request(dict(base, deadline_s=300), max_deadline_s=config.max_deadline_s)
    assert accepted.deadline_s == 300
    with pytest.raises(protocol.ProtocolError, match=r"deadline_s must be in \(0, 300\]") as refused:
        request_schema.parse_request(dict(base, deadline_s=1500), max_deadline_s=config.max_deadline_s)
    assert refused.value.status == 422


def test_systemd_analyze_verify_and_security(tmp_path):
    analyze = _need("systemd-analyze")
    # A root holding the system's unit files, the unit, and an executable where ExecStart points (verify checks it).
    units = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)
    if units is None:
        pytest.skip("no systemd unit directory on this machine: systemd-analyze verify cannot resolve targets")
    root = tmp_path / "root"
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    target = root / "etc/systemd/system/h3-encoder.service"
    target.parent.mkdir(parents=True)
    shutil.copy(UNIT, target)
    python = root / "opt/comfyui-minimax-h3-split/.venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    verified = subprocess.run([analyze, "verify", f"--root={root}", str(target)], capture_output=True, text=True)
    assert verified.returncode == 0 and not (verified.stdout + verified.stderr).strip(), verified.stderr
    scored = subprocess.run([analyze, "security", "--offline=yes", str(UNIT)], capture_output=True, text=True)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", scored.stdout)
    assert match, scored.stdout[-2000:] + scored.stderr
    assert float(match.group(1)) <= 4.0, scored.stdout
    assert f"scores this unit {match.group(1)}" in UNIT.read_text()  # the comment states the real score


# --------------------------------------------------------------------------------------------------------------
# PROTOCOL.md


def test_the_checksum_test_vector_is_the_codes():
    header, data = '{"example":1}', struct.pack("<2f", 1.0, 2.0)
    table = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    checksum = wire.checksum_of(header, table, data)
    assert f"`{checksum}`" in PROTOCOL_DOC and f"`{data.hex()}`" in PROTOCOL_DOC
    import xxhash

    prefix = json.dumps([header, [["t", "F32", [2], 0, 8]]], separators=(",", ":"))
    assert f"`{prefix}`" in PROTOCOL_DOC  # the bytes hashed, as the doc spells them
    assert checksum == "xxh3-128:" + xxhash.xxh3_128(prefix.encode() + data).hexdigest()


def test_the_capabilities_example_is_a_real_servers(tiny_dir):
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource
    from h3_core.remote.server.handler import capabilities

    start = PROTOCOL_DOC.index("### `GET /v1/capabilities`")
    shown = json.loads(_blocks(PROTOCOL_DOC[start:], "json")[0])
    stage = EncoderStage(ModelSource.from_path(tiny_dir))
    info = {"layout": "diffusers", "tiny": True, "dtype": "float32", "device": "cpu", "threads": 2}
    with ServerThread(stage, ServerConfig(token=TOKEN), model_info=info) as server:
        real = server.call(lambda: capabilities(server.service))
    shown["server"]["version"] = __version__  # the example is not rewritten for every release
    assert shown == real, "regenerate the example from:\n" + json.dumps(real)


def test_the_request_table_media_table_and_errors_match_the_server():
    assert f"| `protocol` | int, **required** | `{protocol.PROTOCOL_VERSION}`" in PROTOCOL_DOC
    media = PROTOCOL_DOC[PROTOCOL_DOC.index("| Kind | Content types"):PROTOCOL_DOC.index("How the server decodes")]
    for kind in ("image", "video", "audio"):
        (row,) = [line for line in media.splitlines() if line.startswith(f"| {kind} |")]
        assert set(re.findall(r"`([a-z]+/[a-z0-9.+-]+)`", row)) == set(ingest.allowed_content_types(kind)), kind
    errors = PROTOCOL_DOC[PROTOCOL_DOC.index("| Status | `code` | When |"):]
    (row,) = [line for line in errors.splitlines() if line.startswith("| 503 |")]
    for code in ("loading", "shutting_down", "decoder_stopped", "replica_unavailable", "abandoned"):
        assert f"`{code}`" in row, code
