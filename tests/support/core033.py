"""ComfyUI core 0.33 (`CORE_033` in comfy_harness: `.comfyui-0.33/`, set up by scripts/setup_comfyui.sh) for the
tests that run the pack in it: the session's 0.33 server with the pack and the tiny H3 (the one the `comfy` fixture
gives, where 0.33 is the default), its start measured; the pack's import time from a ComfyUI log; the pack's
requirements checked against core 0.33's.

    from support.core033 import core033  # noqa: F401  (module fixture: the session's shared 0.33 server)
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .comfy_harness import (
    CORE_033,
    PACK_NAME,
    REPO,
    ComfyServer,
    shared_comfy,
    thread_env,
    unavailable,
)

#: Where CI finds the tree when `.comfyui-0.33/` is not extracted (scripts/setup_comfyui.sh extracts it from here).
CORE033_ARCHIVE = REPO.parent / "shared" / "comfyui" / "core-0.33.0" / "ComfyUI-0.33.0-783545f6.tar.gz"
CORE_H3_NODES = ("EmptyMiniMaxH3LatentAV", "MiniMaxH3ImageToVideo", "MiniMaxH3AddGuide", "MiniMaxH3ReferenceToVideo",
                 "MiniMaxH3SigmaShift")
#: The tiny H3's Comfy-format files core's own loaders read (UNETLoader: core infers the DiT's size from its shapes).
TINY_DITS = {"fl2va": "minimax_h3_tiny_fl2va_fp32.safetensors", "ref2va": "minimax_h3_tiny_ref2va_fp32.safetensors"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Started:
    server: ComfyServer
    start_wall_s: float  # from spawning to /system_stats answering
    start_cpu_s: float  # user + system CPU seconds the server process used until then


def pack_import_seconds(log: str, pack: str = PACK_NAME) -> float | None:
    """The pack's line of ComfyUI's "Import times for custom nodes" table (`  0.3 seconds: .../custom_nodes/<pack>`);
    None if absent. Colour codes (0.33 logs in colour) are ignored."""
    for line in _ANSI.sub("", log).splitlines():
        m = re.search(r"([0-9.]+) seconds(?: \(IMPORT FAILED\))?: (.+)$", line)
        if m and Path(m.group(2).strip()).name == pack:
            return float(m.group(1))
    return None


@pytest.fixture(scope="module")
def core033(tiny_dir, tmp_path_factory) -> Started:
    """The session's ComfyUI 0.33 server in the `comfy` fixture's configuration (the same server, where 0.33 is the
    default: no server of its own) with this pack, the tiny H3's Comfy-format files (its DiTs in
    models/diffusion_models) and the tiny H3 as the loaders' embedded choice; skips (fails under CI) where
    scripts/setup_comfyui.sh could not set it up."""
    ok, reason = CORE_033.available()
    if not ok:
        unavailable(reason)
    env = {"H3_TINY_DIR": str(tiny_dir), **thread_env()}
    server = shared_comfy(tmp_path_factory.getbasetemp(), Path(tiny_dir) / "comfyui", env, install=CORE_033)
    assert all((server.base_dir / "models" / "diffusion_models" / name).exists() for name in TINY_DITS.values())
    server.add_model("minimax_h3", tiny_dir, "tiny")  # the loaders' embedded-tiny choice, prebuilt
    return Started(server, server.start_wall_s, server.start_cpu_s)


# ----------------------------------------------------------------------------------------- requirements


def core033_requirements_text() -> str | None:
    """Core 0.33's requirements.txt: from the set-up tree, else from the archive CI extracts it from; None without
    either."""
    path = CORE_033.dir / "requirements.txt"
    if path.is_file():
        return path.read_text()
    if CORE033_ARCHIVE.is_file():
        with tarfile.open(CORE033_ARCHIVE) as archive:
            for member in archive.getmembers():
                if member.name.lstrip("./") == "requirements.txt":
                    return archive.extractfile(member).read().decode()
    return None


def parse_requirements(text: str) -> dict[str, object]:
    """name (canonical) -> packaging Requirement, for every requirement line (comments, options, blanks skipped)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        out[canonicalize_name(req.name)] = req
    return out


def conflicts(pack: dict, core: dict) -> list[str]:
    """Where installing the pack's requirements beside core's would have to change or could not satisfy core's:
    a package core pins exactly (`==v`) whose version the pack's range excludes (pip would move core's pin), or a
    package both constrain with no version in both ranges (judged on the versions either names)."""
    from packaging.version import InvalidVersion, Version

    found = []
    for name, core_req in core.items():
        pack_req = pack.get(name)
        if pack_req is None:
            continue
        pins = [s.version for s in core_req.specifier if s.operator in ("==", "===")]
        if pins:
            bad = [v for v in pins if not pack_req.specifier.contains(v, prereleases=True)]
            if bad:
                found.append(f"{name}: core 0.33 pins =={bad[0]}, the pack asks {pack_req.specifier}")
            continue
        candidates = set()
        for spec in (*core_req.specifier, *pack_req.specifier):
            try:
                candidates.add(Version(spec.version))
            except InvalidVersion:
                pass
        if candidates and not any(core_req.specifier.contains(v, prereleases=True)
                                  and pack_req.specifier.contains(v, prereleases=True) for v in candidates):
            found.append(f"{name}: core 0.33 asks {core_req.specifier}, the pack {pack_req.specifier}: no version "
                         "named by either satisfies both")
    return found
