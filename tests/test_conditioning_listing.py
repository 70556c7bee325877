"""MiniMax H3 Load Conditioning's listing of ComfyUI's input/ (writable by anyone who can reach ComfyUI: core's
/upload/image takes a `subfolder`) is bounded, and validation never lists at all.

* A folder nested 1,500 deep (what a few uploads with long `subfolder`s make) once made the listing raise
  RecursionError, so the node vanished from /object_info for every user: now the walk is iterative and
  depth-capped.
* 20,000 uploaded files made every listing walk them all (1-2 s) and every prompt validation walk them again: now the
  walk stops after `MAX_LIST_ENTRIES` with a logged note, the listing is cached by the walked folders' mtimes, and
  validation checks only the file it is given.

The node module is imported with stand-ins for ComfyUI's `folder_paths` and `comfy_api` (only `io.ComfyNode` and
`io.Custom` are touched at import), so this runs in the fast tier; tests/test_nodes_security.py and
tests/test_core_conditioning_comfyui.py run the same node in a real ComfyUI.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from pathlib import Path

import pytest
from support.nested_dirs import nest, remove_nested

from h3_core.contract import H3Conditioning

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "h3pack_listing_under_test"


@pytest.fixture(scope="module")
def node_module():
    """nodes/conditioning_io.py imported as part of a package named after the pack, ComfyUI stubbed."""
    saved = {name: sys.modules.get(name) for name in ("folder_paths", "comfy_api", "comfy_api.latest")}
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_input_directory = lambda: folder_paths.input_dir
    folder_paths.get_output_directory = lambda: folder_paths.output_dir
    comfy_api, latest = types.ModuleType("comfy_api"), types.ModuleType("comfy_api.latest")
    latest.io = types.SimpleNamespace(ComfyNode=object, Custom=lambda name: name)
    latest.ui = types.SimpleNamespace()
    comfy_api.latest = latest
    sys.modules.update({"folder_paths": folder_paths, "comfy_api": comfy_api, "comfy_api.latest": latest})
    for name, path in ((PACKAGE, REPO), (f"{PACKAGE}.nodes", REPO / "nodes")):
        package = types.ModuleType(name)  # the package without its __init__ (which registers every node)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    try:
        module = importlib.import_module(f"{PACKAGE}.nodes.conditioning_io")
        yield module, folder_paths
    finally:
        for name in list(sys.modules):
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                del sys.modules[name]
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value


@pytest.fixture
def folders(node_module, tmp_path):
    module, folder_paths = node_module
    folder_paths.input_dir, folder_paths.output_dir = str(tmp_path / "input"), str(tmp_path / "output")
    (tmp_path / "input").mkdir()
    (tmp_path / "output" / "h3").mkdir(parents=True)
    getattr(module, "_cache", {}).clear()  # (the cache is what this module tests; absent before it)
    return module, tmp_path / "input", tmp_path / "output" / "h3"


@pytest.fixture(scope="module")
def cond_bytes():
    from support.contract_cases import make

    return make("t2va").to_bytes()


def test_deeply_nested_uploads_do_not_break_the_listing(folders, cond_bytes):
    module, inp, _ = folders
    (inp / "top.safetensors").write_bytes(cond_bytes)
    (nest(inp, 3) / "three.safetensors").write_bytes(cond_bytes)
    deep = nest(inp / "x", 1500)  # old code: rglob recursed once per level -> RecursionError
    (deep / "deep.safetensors").write_bytes(cond_bytes)
    try:
        names = module._listed(inp)
    finally:
        remove_nested(inp / "x")  # pytest's own cleanup of the temporary folder recurses per level
    assert names == ["d/d/d/three.safetensors", "top.safetensors"]
    assert "top.safetensors" in module._conditioning_files()
    # ... and validation names the bound for a file deeper than the listing goes
    with pytest.raises(module.safe_paths.UnsafePathError, match="more than 3 folders deep"):
        module.resolve_conditioning("d/d/d/d/four.safetensors")


def test_many_uploads_are_listed_within_bounds_and_cached(folders, cond_bytes, caplog, monkeypatch):
    module, inp, out = folders
    for index in range(20_000):
        (inp / f"junk_{index:05}.png").write_bytes(b"")
    (inp / "zz_real.safetensors").write_bytes(cond_bytes)
    (out / "saved.safetensors").write_bytes(cond_bytes)
    with caplog.at_level(logging.WARNING):
        choices = module._conditioning_files()
    assert f"stopped after {module.MAX_LIST_ENTRIES} entries" in caplog.text
    assert "h3/saved.safetensors [output]" in choices

    walks = []
    real_walk = module._walk
    monkeypatch.setattr(module, "_walk", lambda root: walks.append(root) or real_walk(root))
    for _ in range(20):
        assert module._conditioning_files() == choices
    assert walks == []  # served from the cache: a stat per walked folder, no walk
    (out / "new.safetensors").write_bytes(cond_bytes)  # the folder's mtime moves: the next listing sees it
    assert "h3/new.safetensors [output]" in module._conditioning_files()
    assert len(walks) == 1


def test_listing_caps_the_number_of_choices(folders, cond_bytes, monkeypatch):
    module, inp, _ = folders
    monkeypatch.setattr(module, "MAX_LIST_FILES", 5)
    for index in range(8):
        (inp / f"c{index}.safetensors").write_bytes(cond_bytes)
    assert len(module._listed(inp)) == 5


def test_validation_checks_only_the_named_file(folders, cond_bytes, monkeypatch):
    module, inp, out = folders
    (inp / "sub").mkdir()
    (inp / "sub" / "mine.safetensors").write_bytes(cond_bytes)
    (out / "saved.safetensors").write_bytes(cond_bytes)
    outside = inp.parent / "secret.safetensors"
    outside.write_bytes(cond_bytes)
    (inp / "link.safetensors").symlink_to(outside)
    os.mkfifo(inp / "fifo.safetensors")

    def no_listing(*args, **kwargs):
        raise AssertionError("validation listed a folder")

    monkeypatch.setattr(module, "_listed", no_listing)
    monkeypatch.setattr(module, "_walk", no_listing, raising=False)
    assert module.resolve_conditioning("sub/mine.safetensors") == (inp / "sub" / "mine.safetensors").resolve()
    assert module.resolve_conditioning("h3/saved.safetensors [output]") == (out / "saved.safetensors").resolve()
    assert module.LoadConditioning.validate_inputs("sub/mine.safetensors") is True
    fingerprint = module.LoadConditioning.fingerprint_inputs("sub/mine.safetensors")
    assert fingerprint.startswith(str((inp / "sub" / "mine.safetensors").resolve()))
    for name in ("/etc/passwd", str(outside), "../secret.safetensors", "link.safetensors", "fifo.safetensors",
                 "missing.safetensors", "sub/../../secret.safetensors", "h3/../../secret.safetensors [output]",
                 "x" * 5000, 7, None):
        message = module.LoadConditioning.validate_inputs(name)
        assert isinstance(message, str) and "not one of the .safetensors files" in message, (name, message)
        assert len(message) < 1200
        assert module.LoadConditioning.fingerprint_inputs(name) == "refused"
    assert module.LoadConditioning.validate_inputs(module.EMPTY_CHOICE).startswith("conditioning_file: no file")
    loaded = H3Conditioning.load(module.resolve_conditioning("sub/mine.safetensors"))
    assert loaded.to_bytes() == cond_bytes
