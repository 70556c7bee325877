"""GGUF files in a real ComfyUI (core 0.33, CPU, loopback): the DiT and text-encoder loaders list `.gguf` files from
ComfyUI-GGUF's folders (models/unet, models/clip: core's legacy names for diffusion_models / text_encoders), and a
graph with a GGUF DiT and a GGUF text encoder runs to an mp4."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.comfy_harness import comfy_available, start_comfy

from h3_core import tiny
from h3_core.tiny import gguf_twins as tiny_gguf

DIT = tiny_gguf.gguf_path("fl2va_pruned", "Q4_K")
TE = tiny_gguf.gguf_path("text_encoder", "Q8_0")
PROMPT = "A red fox trots through fresh snow at dawn; wind in the pines, crunching steps."


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    ok, reason = comfy_available()
    if not ok:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("gguf_comfy")
    models = tmp / "models_src"
    for rel in {*tiny_gguf.SOURCES.values(), tiny.COMFY_FILES["vae"], tiny.COMFY_FILES["audio_vae"]}:
        (models / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tiny_dir) / "comfyui" / rel, models / rel)
    tiny_gguf.write_gguf_twins(models, types=("Q4_K", "Q8_0"))
    base, kept = tmp / "base", tmp / "gguf_folders"
    for rel, folder in ((DIT, "unet"), (TE, "clip")):  # ComfyUI-GGUF's folders (the others stay in the usual ones)
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        (kept / folder).mkdir(parents=True, exist_ok=True)
        (models / rel).rename(kept / folder / Path(rel).name)
        (base / "models" / folder / Path(rel).name).symlink_to(kept / folder / Path(rel).name)
    env = {"H3_TINY_DIR": str(tiny_dir), **{k: os.environ.get(k, "2") for k in ("OMP_NUM_THREADS", "H3_THREADS")}}
    server = start_comfy(base, models_src=models, env=env)
    yield server
    server.stop()


def _options(server, node: str, name: str) -> list[str]:
    spec = server.object_info(node)["input"]["required"][name]
    return spec[1]["options"] if len(spec) > 1 and "options" in spec[1] else spec[0]


def test_loaders_list_gguf_files_from_the_model_folders(server):
    dits = _options(server, "H3SplitDiTLoader", "dit")
    encoders = _options(server, "H3SplitTextEncoderLoader", "text_encoder")
    assert Path(DIT).name in dits and tiny_gguf.gguf_path("fl2va", "Q8_0").split("/", 1)[1] in dits
    assert Path(TE).name in encoders
    assert not any(name.endswith(".gguf") for name in _options(server, "H3SplitVideoVAELoader", "vae"))


def test_gguf_dit_and_text_encoder_run_to_an_mp4(server):
    graph = {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": Path(TE).name}},
        "2": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": Path(tiny.COMFY_FILES["vae"]).name}},
        "3": {"class_type": "H3SplitAudioVAELoader", "inputs": {"audio_vae": Path(tiny.COMFY_FILES["audio_vae"]).name}},
        "4": {"class_type": "H3SplitDiTLoader", "inputs": {"dit": Path(DIT).name,
                                                          "partition": "fl2va (t2va, first/last frame)"}},
        "5": {"class_type": "H3SplitTextEncode", "inputs": {"text_encoder": ["1", 0], "prompt": PROMPT, "width": 128,
                                                           "height": 64, "length": 124, "task": "t2va"}},
        "6": {"class_type": "H3SplitSampler", "inputs": {"dit": ["4", 0], "conditioning": ["5", 0], "seed": 0,
                                                        "steps": 2, "video_shift": 12.0, "audio_shift": 3.0}},
        "7": {"class_type": "H3SplitDecode", "inputs": {"latent": ["6", 0], "vae": ["2", 0], "audio_vae": ["3", 0]}},
        "8": {"class_type": "SaveVideo", "inputs": {"video": ["7", 0], "filename_prefix": "h3/gguf", "format": "mp4",
                                                    "codec": "h264"}},
    }  # fmt: skip
    result = server.run_prompt(graph, timeout=600)
    assert result.status == "success", result.error
    videos = [path for path in result.files if path.suffix == ".mp4"]
    assert len(videos) == 1 and videos[0].stat().st_size > 0
    import av

    with av.open(str(videos[0])) as container:
        video = container.streams.video[0]
        assert (video.width, video.height) == (128, 64)
        assert sum(1 for _ in container.decode(video=0)) == 124
