"""Folders nested far deeper than Python's recursion limit, made and removed iteratively (shutil.rmtree and
os.makedirs recurse once per level, so neither can clean up after a test that builds one)."""

from __future__ import annotations

from pathlib import Path


def nest(root: Path, levels: int) -> Path:
    """A folder `levels` deep under root (one-letter names; created in chunks so no path passes PATH_MAX at once)."""
    current = root
    for start in range(0, levels, 500):
        chunk = Path(*(["d"] * min(500, levels - start)))
        (current / chunk).mkdir(parents=True)
        current = current / chunk
    return current


def remove_nested(top: Path) -> None:
    """rmdir bottom-up, iteratively: what pytest's own temporary-folder cleanup cannot do for such a tree."""
    folders = [top]
    while True:
        children = [child for child in folders[-1].iterdir() if child.is_dir() and not child.is_symlink()]
        if not children:
            break
        folders.append(children[0])
    for folder in reversed(folders):
        for child in folder.iterdir():
            if not child.is_dir() or child.is_symlink():
                child.unlink()
        folder.rmdir()
