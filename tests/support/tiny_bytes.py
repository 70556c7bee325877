"""The committed bytes of the tiny build (seed 0): which file changed when the model fingerprint moves.

The model fingerprint (`ModelSource.fingerprint`, shown by the endpoint's capabilities and in docs/PROTOCOL.md) is a
digest of many files; when it moves, this names the files behind it. The build's bytes depend only on the pack, the
locked environment (requirements-lock.txt) and the seed: a change here is either the pack's (refresh the fixture with
the command below, in the same commit) or the environment's (the lock was not used, or was changed).

Refresh after a change to the build:  .venv/bin/python -m tests.support.tiny_bytes --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "seed0_files.json"


def expected() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def differences(manifest: dict, want: dict) -> list[str]:
    """Lines naming every file whose bytes differ from the committed ones (changed, missing, new)."""
    got, files = manifest["files"], want["files"]
    lines = [f"changed: {name}" for name in sorted(files) if name in got and got[name] != files[name]]
    lines += [f"missing: {name}" for name in sorted(set(files) - set(got))]
    lines += [f"new: {name}" for name in sorted(set(got) - set(files))]
    return lines


def libraries(manifest: dict, want: dict) -> list[str]:
    """The libraries whose version differs from the committed build's (the usual reason bytes move)."""
    got, was = manifest.get("built_with", {}), want.get("built_with", {})
    return [f"{name} {was.get(name)} -> {got.get(name)}" for name in sorted(set(got) | set(was))
            if got.get(name) != was.get(name)]


def write() -> None:
    from h3_core import tiny

    with tempfile.TemporaryDirectory() as tmp:
        build = tiny.build(Path(tmp) / "tiny", seed=0)
        manifest = json.loads((build / "tiny.json").read_text(encoding="utf-8"))
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({key: manifest[key] for key in ("seed", "built_with", "files")}, indent=1,
                                  sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE} ({len(manifest['files'])} files)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    write()
