"""h3_core.safe_paths: a workflow-named file or folder resolves inside its root, or is refused without opening."""

import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from h3_core import safe_paths
from h3_core.safe_paths import UnsafePathError


@pytest.fixture
def root(tmp_path):
    inside = tmp_path / "input"
    (inside / "sub").mkdir(parents=True)
    save_file({"x": torch.zeros(2)}, str(inside / "sub" / "ok.safetensors"))
    (tmp_path / "secret.safetensors").write_bytes(b"SECRETBYTES" * 10)
    return inside


def test_a_file_inside_resolves(root):
    assert safe_paths.resolve_file(root, "sub/ok.safetensors") == (root / "sub" / "ok.safetensors").resolve()
    assert "x" in safe_paths.check_safetensors_header(root / "sub" / "ok.safetensors")


@pytest.mark.parametrize("name", ["/etc/passwd", "../secret.safetensors", "sub/../../secret.safetensors",
                                  "/dev/zero", "", "a\x00.safetensors", "C:/x.safetensors", "sub"])
def test_names_that_leave_the_root_or_are_not_files_are_refused(root, name):
    with pytest.raises(UnsafePathError):
        safe_paths.resolve_file(root, name)


def test_symlinks_out_of_the_root_and_special_files_are_refused(root):
    (root / "out.safetensors").symlink_to(root.parent / "secret.safetensors")
    (root / "zero.safetensors").symlink_to("/dev/zero")
    os.mkfifo(root / "fifo.safetensors")
    (root / "dir.safetensors").mkdir()
    for name, rule in (("out.safetensors", "outside"), ("zero.safetensors", "outside"),
                       ("fifo.safetensors", "not a regular file"), ("dir.safetensors", "not a regular file"),
                       ("missing.safetensors", "not found")):
        with pytest.raises(UnsafePathError, match=rule):
            safe_paths.resolve_file(root, name)


def test_opening_a_fifo_never_blocks(root):
    os.mkfifo(root / "fifo.safetensors")
    done = []
    thread = threading.Thread(target=lambda: done.append(pytest.raises(UnsafePathError, safe_paths.open_regular,
                                                                       root / "fifo.safetensors")))
    thread.start()
    thread.join(5)
    assert done, "open_regular blocked on a FIFO"


def test_header_checks_never_quote_the_file(root):
    bad = root / "bad.safetensors"
    for payload in (b"SECRETBYTES" * 10, b"\x05", b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe\xfd\xfc",
                    b"\x02\x00\x00\x00\x00\x00\x00\x00[]"):
        bad.write_bytes(payload)
        with pytest.raises(UnsafePathError, match="not a safetensors file") as caught:
            safe_paths.check_safetensors_header(bad)
        text = str(caught.value)
        assert "SECRET" not in text and str(int.from_bytes(payload[:8].ljust(8, b"\0"), "little")) not in text


def test_child_dir_is_one_component(tmp_path):
    models = tmp_path / "minimax_h3"
    (models / "H3").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (models / "linked").symlink_to(tmp_path / "elsewhere")  # placed by the operator: followed
    assert safe_paths.resolve_child_dir([models], "H3") == models.resolve() / "H3"
    assert safe_paths.resolve_child_dir([tmp_path / "nope", models], "linked").is_dir()
    for name in ("../elsewhere", "..", ".", "/etc", "H3/../../elsewhere", "a/b", "missing"):
        with pytest.raises(UnsafePathError):
            safe_paths.resolve_child_dir([models], name)
