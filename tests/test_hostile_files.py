"""Hostile files and answers: files that change under a reader, canvases without an upper bound,
headers parsed whole, shapes beyond int64 and non-finite values.

Each test here once failed: a loaded conditioning was a view of its memory-mapped file (a
rewrite changed it after its checksum was verified, a truncation killed the process with SIGBUS); a file or a
server answer could claim any canvas; a conditioning header could be 100 MB and was parsed whole; a shape of
[1, 0, 2**64] escaped as a TypeError; NaN embeddings loaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from support import warm_cli
from support.contract_cases import _retamper, make
from support.hostile_peer import CAPS, REQUEST, HostileServer

from h3_core import rules, safetensors_header
from h3_core.contract import ContractError, H3Conditioning, wire
from h3_core.remote.client.encoder_client import EncoderClient, RemoteEncodeError
from h3_core.weights.errors import H3WeightsError
from h3_core.weights.headers import read_header as read_weights_header

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _python(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- 1. files that change under a reader ----------------------------------------------------------------------


def _big(tmp_path) -> tuple[H3Conditioning, Path]:
    """A t2va conditioning of ~1.7 MB, the size of the one the issue's ComfyUI attack replaced."""
    cond = make("t2va", prompt_embeds=torch.randn(1, 6600, 64), text_token_tags=torch.ones(6600, dtype=torch.int64))
    path = tmp_path / "c.safetensors"
    cond.save(path)
    return cond, path


def test_a_file_rewritten_in_place_after_load_does_not_change_the_conditioning(tmp_path):
    cond, path = _big(tmp_path)
    loaded = H3Conditioning.load(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # in place: same inode, every data byte changed
        f.seek(size - 1_000_000)
        f.write(b"\x7f" * 1_000_000)
    assert loaded == cond


def test_a_file_truncated_after_load_does_not_kill_the_reader(tmp_path):
    """The issue's SIGBUS (exit -7): a mapped tensor read after its file was cut to 64 bytes."""
    _, path = _big(tmp_path)
    done = _python(
        "import sys, os, torch\n"
        "from h3_core.contract import H3Conditioning\n"
        "c = H3Conditioning.load(sys.argv[1])\n"
        "os.truncate(sys.argv[1], 64)\n"
        "print(float(c.prompt_embeds.double().sum()))\n", str(path))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_a_file_that_changes_size_while_read_is_refused_clearly(tmp_path):
    _, path = _big(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0" * 64)  # longer than its header says: the data does not tile the file
    with pytest.raises(ContractError, match="tensors need"):
        H3Conditioning.load(path)


# --- 2. the canvas and the frame count are bounded wherever a contract is read ---------------------------------


@pytest.mark.parametrize(("width", "height"), [(65536, 65536), (131072, 131072), (8192, 8192), (4128, 512),
                                               (4096, 2336)])
def test_a_canvas_beyond_the_absolute_bound_is_refused_on_every_read(width, height, tmp_path):
    data = make("t2va").to_bytes()
    hostile = _retamper(data, lambda h: h.update(width=width, height=height))
    for read in (H3Conditioning.from_bytes, lambda b: H3Conditioning.load(_write(tmp_path, b))):
        with pytest.raises(ContractError, match="larger than the pack runs"):
            read(hostile)
    cond = make("t2va")
    comfy = cond.to_comfy()
    comfy[0][1]["minimax_h3_pack"] = dict(comfy[0][1]["minimax_h3_pack"], width=width, height=height)
    with pytest.raises(ContractError, match="larger than the pack runs"):
        H3Conditioning.from_comfy(comfy)


@pytest.mark.parametrize(("width", "height"), [(2048, 512), (1408, 768), (3840, 2176), (4096, 2304), (2304, 4096)])
def test_a_canvas_beyond_the_trained_size_reads_with_a_warning(width, height):
    """As ComfyUI core: larger than H3 was trained for runs (the Sampler and `plan` warn), up to the absolute bound."""
    make("t2va", width=width, height=height)
    assert "beyond H3's trained size" in rules.canvas_trained_warning(width, height)


def _write(tmp_path, data: bytes) -> Path:
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("width", "height"), [(1344, 768), (768, 1344), (2016, 512), (512, 2016), (1536, 672),
                                               (1856, 576), (1024, 1024)])
def test_every_canvas_of_diffusers_rule_is_accepted(width, height):
    assert rules.check_canvas(width, height) == (width, height)
    make("t2va", width=width, height=height)  # the contract takes it (t2va: no latent shape to match)


@pytest.mark.parametrize("frames", [3609, 17 * 1000 + 5])
def test_frames_beyond_the_longest_output_are_refused_on_read(frames):
    hostile = _retamper(make("t2va").to_bytes(), lambda h: h.update(num_frames=frames))
    with pytest.raises(ContractError, match="num_frames: must be within"):
        H3Conditioning.from_bytes(hostile)


def test_cli_refuses_a_canvas_beyond_the_absolute_bound(tmp_path):
    done = warm_cli.run(["encode", "--models", str(tmp_path), "--prompt", "A fox.", "--width", "8192", "--height",
                         "8192", "--out", str(tmp_path / "c.safetensors")], cwd=REPO, capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode != 0 and "larger than the pack runs" in done.stderr, done.stderr[-2000:]


def _answer(data: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % len(data)) + data


@pytest.fixture
def hostile():
    servers = []

    def start(answer: bytes) -> HostileServer:
        server = HostileServer(encode=lambda server, conn: server.send(conn, _answer(answer)),
                               caps=json.dumps(CAPS).encode())
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("change", [dict(num_frames=345), dict(width=96, height=64), dict(width=64, height=96),
                                    dict(task="fl2va")])
def test_client_refuses_an_answer_for_another_geometry(hostile, change):
    """The request asks for 64x64 and 124 frames; a well-formed answer for anything else is refused."""
    base = make("t2va")
    if change.get("task") == "fl2va":
        answer = make("fl2va").to_bytes()
    else:
        answer = H3Conditioning(**{**_fields(base), **change}).to_bytes()
    server = hostile(answer)
    with pytest.raises(RemoteEncodeError, match="does not answer this request"):
        EncoderClient(server.url, retries=0, read_timeout=30).encode(REQUEST)


def test_client_takes_an_answer_of_the_requested_geometry(hostile):
    server = hostile(make("t2va").to_bytes())
    assert EncoderClient(server.url, retries=0, read_timeout=30).encode(REQUEST) == make("t2va")


def _fields(cond: H3Conditioning) -> dict:
    return dict(task=cond.task, height=cond.height, width=cond.width, num_frames=cond.num_frames,
                prompt_embeds=cond.prompt_embeds, text_token_tags=cond.text_token_tags)


# --- 4. oversized headers are refused before parsing ------------------------------------------------------------


def test_the_largest_valid_conditioning_header_fits_the_cap():
    """The cap is derived from what a conditioning can hold: the most references, the longest metadata (made of
    the characters JSON escapes twice), 2 + 12 + 6 tensors; a header of that conditioning fits it."""
    refs = [("image", False)] * 9 + [("video", True)] * 3
    lat = [torch.zeros(1, 24, 1, 4, 4)] * 9 + [torch.zeros(1, 24, 2, 4, 4)] * 3
    filler = '"\\' * (wire.MAX_METADATA_BYTES // 4 - 16)  # each escapes to 2 bytes, then to 4 in the outer header
    cond = make("ref2va", condition_latents=lat, audio_condition_latents=[torch.zeros(160, 32)] * 3,
                references=refs, metadata={"note": filler})
    assert wire.metadata_size(cond.metadata) <= wire.MAX_METADATA_BYTES
    data = cond.to_bytes()
    n = int.from_bytes(data[:8], "little")
    assert wire.MAX_HEADER_BYTES >= n > wire.MAX_HEADER_BYTES * 0.75, (n, wire.MAX_HEADER_BYTES)
    assert H3Conditioning.from_bytes(data) == cond
    with pytest.raises(ContractError, match="over the 16384-byte limit"):
        make("t2va", metadata={"note": "x" * wire.MAX_METADATA_BYTES})


_PEAK = """
import json, resource, sys, time
from h3_core.contract import ContractError, H3Conditioning
from h3_core.weights.errors import H3WeightsError
from h3_core.weights.headers import read_header
kind, path = sys.argv[1], sys.argv[2]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
try:
    H3Conditioning.load(path) if kind == "cond" else read_header([path])
    error = None
except (ContractError, H3WeightsError) as exc:
    error = str(exc)
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"error": error, "seconds": seconds, "extra_bytes": (peak - base) * 1024}))
"""


def write_hostile_header(path: Path, header_bytes: int) -> None:
    """A safetensors file whose header is `header_bytes` of valid JSON listing empty tensors (the issue's 93 MB
    attack): everything a parser would have to build, present on disk."""
    entry = b'"t%09d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    count = header_bytes // (len(entry % 0) + 1)
    body = b"{" + b",".join(entry % i for i in range(count)) + b"}"
    body += b" " * (header_bytes - len(body))
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little"))
        f.write(body)


@pytest.mark.parametrize("kind", ["cond", "model"])
def test_a_93_mb_header_is_refused_before_parsing_under_50_mb(kind, tmp_path):
    path = tmp_path / "huge-header.safetensors"
    write_hostile_header(path, 93 * 1000 * 1000)
    done = _python(_PEAK, kind, str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["error"] and "exceeds the" in result["error"], result
    assert result["extra_bytes"] < 50 * MiB, result
    print(f"93 MB {kind} header: refused in {result['seconds'] * 1000:.2f} ms, +{result['extra_bytes'] / MiB:.1f} MiB")


def test_a_model_header_may_list_at_most_the_cap_of_tensors():
    entries = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
               for i in range(safetensors_header.MAX_TENSORS_PER_FILE + 1)}
    raw = json.dumps(entries).encode()
    with pytest.raises(safetensors_header.HeaderError, match="tensors, more than the 16384 allowed"):
        safetensors_header.parse_header(raw)


# --- 5. shapes beyond int64 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[1, 0, 2**64], [2**63, 0], [2**40, 2**40, 0], [1, 2**64, 0]])
def test_shapes_beyond_int64_raise_the_documented_errors(shape, tmp_path):
    data = make("t2va").to_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["prompt_embeds"]["shape"] = shape
    header["prompt_embeds"]["data_offsets"] = [0, 0]
    raw = json.dumps(header).encode()
    hostile = len(raw).to_bytes(8, "little") + raw
    with pytest.raises(ContractError, match="int64"):
        H3Conditioning.from_bytes(hostile)
    path = _write(tmp_path, hostile)
    with pytest.raises(ContractError, match="int64"):
        H3Conditioning.load(path)
    with pytest.raises(H3WeightsError, match="int64"):
        read_weights_header([str(path)])


# --- 6. non-finite values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["prompt_embeds", "condition_latents.0", "audio_condition_latents.0"])
def test_non_finite_values_are_refused_on_read(value, field, tmp_path):
    data = make("ref2va").to_bytes()

    def poison(tensors):
        tensors[field] = tensors[field].clone()
        tensors[field].view(-1)[tensors[field].numel() // 2] = value

    hostile = _retamper(data, edit_tensors=poison)  # re-sealed: the checksum matches, the values are the attack
    with pytest.raises(ContractError, match=f"{field}: must be finite"):
        H3Conditioning.from_bytes(hostile)
    with pytest.raises(ContractError, match="must be finite"):
        H3Conditioning.load(_write(tmp_path, hostile))


def test_client_refuses_a_non_finite_answer(hostile):
    def poison(tensors):
        tensors["prompt_embeds"] = tensors["prompt_embeds"].clone()
        tensors["prompt_embeds"][0, 3, 5] = math.nan

    server = hostile(_retamper(make("t2va").to_bytes(), edit_tensors=poison))
    with pytest.raises(RemoteEncodeError, match="must be finite"):
        EncoderClient(server.url, retries=0, read_timeout=30).encode(REQUEST)


def test_finite_check_is_one_pass_in_bounded_pieces():
    t = torch.zeros(3 * wire._FINITE_PIECE + 7)
    wire.check_finite("x", t)
    t[-1] = math.inf
    with pytest.raises(ContractError, match=f"at element {t.numel() - 1}"):
        wire.check_finite("x", t)
    st.save({"x": t})  # (a plain tensor stays writable: the check never copies or changes it)
    assert math.isinf(float(t[-1]))


def test_plan_refuses_a_canvas_beyond_the_absolute_bound_and_warns_beyond_the_trained_size(capsys):
    from h3_core import cli

    assert cli.main(["plan", "--table", "--width", "8192", "--height", "8192"]) != 0
    assert "larger than the pack runs" in capsys.readouterr().err
    assert cli.main(["plan", "--table", "--width", "2560", "--height", "1440"]) == 0
    assert "warning: canvas 2560x1440 is beyond H3's trained size" in capsys.readouterr().out


# --- 1b. model weights replaced under a running process ------------------------------------------------------


def test_a_weight_file_rewritten_in_place_is_refused_before_the_next_run(tiny_dir, tmp_path):
    """Weights stay memory-mapped on the CPU: a file changed in place (same inode) is refused by name before the
    next sample, instead of computing with changed weights or dying of SIGBUS; a file replaced by a rename (the
    safe way, documented) is not an error: the loaded weights keep the old inode."""
    import shutil

    from h3_core import weights
    from h3_core.diffusion import DiffusionStage, SamplingOptions

    path = tmp_path / "minimax_h3_fl2va_fp32.safetensors"
    shutil.copy(tiny_dir / "comfyui" / "diffusion_models" / "minimax_h3_tiny_fl2va_fp32.safetensors", path)
    dit = weights.load_transformer(str(path))
    stage = DiffusionStage(modules={"transformer": dit}, pipeline_config={})
    weights.file_identity.check_unchanged(dit, "DiT")
    replacement = tmp_path / "new.safetensors"
    shutil.copy(path, replacement)
    os.replace(replacement, path)  # a rename: the mapping keeps the old inode
    weights.file_identity.check_unchanged(dit, "DiT")
    dit = weights.load_transformer(str(path))
    stage = DiffusionStage(modules={"transformer": dit}, pipeline_config={})
    with open(path, "ab") as f:  # in place (growing it keeps this test process safe from SIGBUS)
        f.write(b"\0" * 4096)
    with pytest.raises(H3WeightsError, match="rewritten in place after it was loaded"):
        stage.sample(make("t2va"), SamplingOptions(steps=2))
