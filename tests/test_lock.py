"""The test environment is the committed lock: requirements-lock.txt pins every package the set-up installs, inside
the ranges users get from requirements*.txt (scripts/setup_env.sh and setup_comfyui.sh install with it as pip
constraints; `bash scripts/lock.sh` refreshes it)."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-lock.txt"
#: Installed by hand or by the tests themselves, never by the set-up: pip's own tools and the pack's distribution.
NOT_LOCKED = {"pip", "setuptools", "wheel", "minimax-h3-split"}


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
            assert match, f"requirements-lock.txt: {line!r} is not an exact pin NAME==VERSION"
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def _requirements(path: Path) -> list[Requirement]:
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            found.append(Requirement(line))
    return found


def test_every_requirement_is_pinned_within_its_range():
    pins = _lock()
    for name in ("requirements.txt", "requirements-dev.txt"):
        for requirement in _requirements(REPO / name):
            key = canonicalize_name(requirement.name)
            assert key in pins, f"{name}: {requirement.name} is not in requirements-lock.txt (run bash scripts/lock.sh)"
            assert requirement.specifier.contains(pins[key], prereleases=True), (
                f"{name} asks {requirement}, the lock pins {pins[key]}: refresh it (bash scripts/lock.sh)")
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"  # the pins of setup_env.sh


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not in a virtual environment made by the set-up")
def test_the_environment_is_the_lock():
    pins = _lock()
    # The venv's own site-packages (other folders some tests put on sys.path, e.g. core 0.33's overlay, are not the
    # venv: setup_comfyui.sh pins those at core's versions on purpose).
    folders = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {canonicalize_name(dist.metadata["Name"]): dist.version for dist in md.distributions(path=folders)}
    unlocked = sorted(set(installed) - set(pins) - NOT_LOCKED)
    assert not unlocked, f"installed but not in requirements-lock.txt: {unlocked} (run bash scripts/lock.sh)"
    moved = sorted(f"{name} {pins[name]} -> {version}" for name, version in installed.items()
                   if name in pins and version.split("+")[0] != pins[name].split("+")[0])
    assert not moved, f"installed versions differ from requirements-lock.txt: {moved}"
