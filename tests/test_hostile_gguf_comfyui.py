"""Hostile GGUF files in a real ComfyUI's model folder (security issue 36, item 1): `/object_info` answers at once
with a 96-byte array-bomb `.gguf` and a cut copy of a projector beside the tiny llama.cpp text encoder (the bomb hung
it, memory growing ~2 GB in 23 s, and the broken neighbour hid the good encoder); the broken files are left out of
the list by name, logged once, and a prompt naming one is refused at queue time with the reason."""

from __future__ import annotations

import os
import shutil
import struct
import time

import pytest
from support.comfy_harness import comfy_available, start_comfy

from h3_core.tiny import gguf_twins as tiny_gguf


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    ok, reason = comfy_available()
    if not ok:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("hostile_gguf_comfy")
    folder = tmp / "models_src" / "text_encoders"
    folder.mkdir(parents=True)
    for rel in tiny_gguf.llamacpp_paths():
        shutil.copy(tiny_dir / "comfyui" / rel, folder)
    bomb = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 21) + b"tokenizer.ggml.tokens"
    (folder / "broken.gguf").write_bytes((bomb + struct.pack("<IIQ", 9, 0, 1 << 62)).ljust(96, b"\0"))
    projector = (folder / tiny_gguf.llamacpp_paths()[1].rsplit("/", 1)[1]).read_bytes()
    (folder / "cut-mmproj.gguf").write_bytes(projector[:len(projector) // 3])
    env = {"H3_TINY_DIR": str(tiny_dir), **{k: os.environ.get(k, "2") for k in ("OMP_NUM_THREADS", "H3_THREADS")}}
    server = start_comfy(tmp / "base", models_src=tmp / "models_src", env=env)
    yield server
    server.stop()


def _options(server, node: str, name: str) -> list[str]:
    spec = server.object_info(node)["input"]["required"][name]
    return spec[1]["options"] if len(spec) > 1 and "options" in spec[1] else spec[0]


def test_object_info_lists_the_good_encoder_and_leaves_the_broken_files_out(server):
    start = time.perf_counter()
    options = _options(server, "H3SplitTextEncoderLoader", "text_encoder")
    assert time.perf_counter() - start < 30  # a server on two shared cores; the old reader never answered
    text = tiny_gguf.llamacpp_paths()[0].rsplit("/", 1)[1]
    assert text in options and "broken.gguf" not in options and "cut-mmproj.gguf" not in options
    start = time.perf_counter()
    server.object_info()  # every node's lists again: from the cache now
    assert time.perf_counter() - start < 10
    log = server.log_text()
    assert log.count("broken.gguf is left out of the loader lists") == 1 and "incomplete file" in log


def test_a_prompt_naming_the_broken_file_is_refused_at_queue_time(server):
    status, body = server.post_prompt_expect_error({
        "t": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": "broken.gguf"}},
        "e": {"class_type": "H3SplitTextEncode", "inputs": {
            "text_encoder": ["t", 0], "prompt": "A fox.", "width": 0, "height": 0, "length": 124, "task": "t2va"}},
        "s": {"class_type": "H3SplitSaveConditioning", "inputs": {"conditioning": ["e", 0], "filename_prefix": "x"}},
    })
    assert status == 400 and "broken.gguf" in str(body) and "incomplete file" in str(body)
