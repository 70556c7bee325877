"""CLI component files: `encode --text-encoder/--vae/--audio-vae`, `generate --dit/--vae/--audio-vae`, on every
tiny single file (fp32, the published precisions' twins, the quantised twins, the pruned twins).

Cost: one mp4 costs a CLI encode and a full audio VAE decode (~8 s each on 2 idle cores), so the mp4 runs
cover the pairings of the two quantised ComfyUI workflows by default and every DiT x text encoder pair with
H3_CLI_MATRIX=full. Every pair always runs up to the latents: each text encoder file encodes once, each DiT file
is resolved by `generate --dit FILE` and loaded once, and one DiT forward per pair is compared with the fp32 DiT's.
Decoding and muxing do not depend on the files.
"""

import os
import pathlib

import av
import pytest
import torch

from h3_core import cli, component_args, tiny
from h3_core.contract import H3Conditioning
from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource, ModelSourceError
from h3_core.request import EncodeRequest
from h3_core.tiny import pruned as tiny_pruned
from h3_core.tiny import twins as tiny_twins

VAE = tiny.COMFY_FILES["vae"]
AUDIO_VAE = tiny.COMFY_FILES["audio_vae"]
DITS = {
    "fl2va": [
        tiny.COMFY_FILES["transformer"],
        *(tiny_twins.twin_path("fl2va", v) for v in tiny_twins.TWIN_FILES["fl2va"]),
        *(tiny_pruned.twin_path("fl2va", v) for v in tiny_pruned.VARIANTS),
    ],
    "ref2va": [
        tiny.COMFY_FILES["transformer_ref"],
        *(tiny_twins.twin_path("ref2va", v) for v in tiny_twins.TWIN_FILES["ref2va"]),
        *(tiny_pruned.twin_path("ref2va", v) for v in tiny_pruned.VARIANTS),
    ],
}
TEXT_ENCODERS = [
    tiny.COMFY_FILES["text_encoder"],
    *(tiny_twins.twin_path("text_encoder", v) for v in tiny_twins.TWIN_FILES["text_encoder"]),
]
TASK_OF_PARTITION = {"fl2va": "t2va", "ref2va": "ref2va"}
# The pairings of the quantised ComfyUI workflows (workflows/build_workflows.py), run to an mp4 by default.
MP4_PAIRS = [
    (tiny_pruned.twin_path("fl2va", "pruned_int8_convrot"), tiny_twins.twin_path("text_encoder", "int8_convrot")),
    (tiny_pruned.twin_path("fl2va", "pruned_fp8_scaled"), tiny_twins.twin_path("text_encoder", "nvfp4_awq")),
]
if os.environ.get("H3_CLI_MATRIX") == "full":
    MP4_PAIRS = [(dit, te) for part in DITS for dit in DITS[part] for te in TEXT_ENCODERS]
PAIRS = [(dit, te) for part in DITS for dit in DITS[part] for te in TEXT_ENCODERS]
STEPS = 2  # sigma points: one DiT forward
# Latents of any file vs the fp32 DiT, relative to max|fp32 latents|: bf16 storage, the quantised formats, the
# pruned curve (measured <= 0.6 % on the tiny model; the bound is loose enough for every format's noise).
RELATIVE_BOUND = 0.05


def _path(tiny_dir, rel: str) -> str:
    path = tiny_dir / "comfyui" / rel
    if not path.is_file():
        pytest.fail(f"{rel} is missing from {tiny_dir}: rebuild the tiny H3 (python -m h3_core tiny)")
    return str(path)


def _partition(dit: str) -> str:
    return "ref2va" if "_ref2va_" in pathlib.Path(dit).name else "fl2va"


def _encode_args(tiny_dir, te: str, task: str, out, image: str) -> list[str]:
    args = ["encode", "--text-encoder", _path(tiny_dir, te), "--vae", _path(tiny_dir, VAE),
            "--audio-vae", _path(tiny_dir, AUDIO_VAE), "--width", "32", "--height", "32", "--out", str(out)]
    if task == "ref2va":
        return args + ["--prompt", "<Picture 1> waves.", "--ref-image", image]
    return args + ["--prompt", "A red fox in the snow."]


@pytest.fixture(scope="module")
def conds(tiny_dir, tmp_path_factory):
    """(text encoder, task) -> conditioning file, each written once by `python -m h3_core encode`."""
    out = tmp_path_factory.mktemp("conds")
    image = str(pathlib.Path(__file__).resolve().parents[1] / "workflows" / "inputs" / "h3_example_reference_image.png")
    cache = {}

    def get(te: str, task: str) -> pathlib.Path:
        if (te, task) not in cache:
            path = out / f"{pathlib.Path(te).stem}_{task}.safetensors"
            assert cli.main(_encode_args(tiny_dir, te, task, path, image)) == 0
            cache[te, task] = path
        return cache[te, task]

    return get


@pytest.fixture(scope="module")
def text_conds(tiny_dir):
    """Text encoder file -> a t2va conditioning at the smallest canvas (text only: no VAE needed)."""
    cache = {}

    def get(te: str) -> H3Conditioning:
        if te not in cache:
            source = ModelSource.for_file("text_encoder", _path(tiny_dir, te))
            request = EncodeRequest(prompt="A red fox in the snow.", width=32, height=32, num_frames=124)
            cache[te] = EncoderStage(source, ("text",)).encode(request)
        return cache[te]

    return get


@pytest.fixture(scope="module")
def dits(tiny_dir):
    """DiT file -> (module, source) resolved by `generate`'s own flags (`--dit FILE`), loaded once."""
    cache = {}

    def get(dit: str):
        if dit not in cache:
            args = cli.build_parser().parse_args(["generate", "--dit", _path(tiny_dir, dit), "--cond", "unused",
                                                  "--out", "unused.mp4"])
            source = component_args.model_source(args, TASK_OF_PARTITION[_partition(dit)])
            (slot,) = source.paths
            cache[dit] = source.load(slot), source
        return cache[dit]

    return get


def _latents(dits, dit: str, cond: H3Conditioning):
    """The DiT's latents for `cond` (the t2va conditioning drives either partition's DiT here: a forward of
    the file's weights is what is tested, the sampler does not care which partition it is given)."""
    model, source = dits(dit)
    stage = DiffusionStage(modules={"transformer": model}, pipeline_config=source.pipeline_config)
    return stage.sample(cond, SamplingOptions(steps=STEPS, seed=0))


@pytest.fixture(scope="module")
def fp32_latents(dits, text_conds):
    """(partition, text encoder file) -> the partition's fp32 DiT latents on that encoder's conditioning: the
    reference of every pair, computed once per distinct value (8 for the 56 pairs)."""
    cache = {}

    def get(partition: str, te: str):
        if (partition, te) not in cache:
            cache[partition, te] = _latents(dits, DITS[partition][0], text_conds(te))
        return cache[partition, te]

    return get


@pytest.mark.parametrize("dit, te", PAIRS, ids=[f"{pathlib.Path(d).stem}-{pathlib.Path(t).stem}" for d, t in PAIRS])
def test_every_dit_runs_on_every_text_encoders_conditioning(dits, text_conds, fp32_latents, dit, te):
    cond = text_conds(te)
    got = _latents(dits, dit, cond)
    reference = fp32_latents(_partition(dit), te)  # the fp32 DiT of the same partition
    assert got.video.shape == reference.video.shape and got.audio.shape == reference.audio.shape
    assert torch.isfinite(got.video).all() and torch.isfinite(got.audio).all()
    for a, b in ((got.video, reference.video), (got.audio, reference.audio)):
        assert float((a.float() - b).abs().max()) <= RELATIVE_BOUND * float(b.abs().max())


def _check_mp4(path, frames: int, width: int, height: int) -> None:
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.width, video.height) == ("h264", width, height)
        assert video.average_rate == 24
        assert audio.codec_context.name == "aac" and audio.sample_rate == 32000 and audio.channels == 2
        assert sum(1 for _ in container.decode(video=0)) == frames
    assert (frames - 5) % 17 == 0


@pytest.mark.parametrize("dit, te", MP4_PAIRS, ids=[f"{pathlib.Path(d).stem}-{pathlib.Path(t).stem}"
                                                     for d, t in MP4_PAIRS])
def test_encode_and_generate_write_a_valid_mp4(tiny_dir, conds, tmp_path, dit, te):
    cond = conds(te, TASK_OF_PARTITION[_partition(dit)])
    out = tmp_path / "out.mp4"
    code = cli.main(["generate", "--dit", _path(tiny_dir, dit), "--vae", _path(tiny_dir, VAE),
                     "--audio-vae", _path(tiny_dir, AUDIO_VAE), "--cond", str(cond), "--steps", str(STEPS),
                     "--out", str(out)])
    assert code == 0
    saved = H3Conditioning.load(cond)
    _check_mp4(out, saved.num_frames, saved.width, saved.height)


def test_component_flags_override_models_and_are_checked(tiny_dir, text_conds, tmp_path, capsys):
    """A flag beats what --models picks; a file of the wrong component or partition is refused by name."""
    pruned = tiny_pruned.twin_path("fl2va", "pruned_bf16")
    args = cli.build_parser().parse_args(["generate", "--models", str(tiny_dir), "--layout", "comfyui",
                                          "--dit", _path(tiny_dir, pruned), "--cond", "c", "--out", "o.mp4"])
    source = component_args.model_source(args, "t2va")
    assert source.paths["transformer"].name == pathlib.Path(pruned).name
    assert source.paths["vae"].name.startswith("minimax_h3_tiny_video_vae")  # the rest still from --models
    ref = _path(tiny_dir, tiny_pruned.twin_path("ref2va", "pruned_bf16"))
    args = cli.build_parser().parse_args(["generate", "--dit", ref, "--cond", "c", "--out", "o.mp4"])
    with pytest.raises(ModelSourceError, match="ref2va DiT, but a t2va request needs the fl2va DiT"):
        component_args.model_source(args, "t2va")
    args = cli.build_parser().parse_args(["generate", "--dit", _path(tiny_dir, VAE), "--cond", "c", "--out", "o"])
    with pytest.raises(ModelSourceError, match="--dit: .*video VAE, not the"):
        component_args.model_source(args, "t2va")
    # No --models and no component files: one clear line, exit 2.
    assert cli.main(["generate", "--cond", "c", "--out", "o.mp4"]) == 2
    assert "--models is required" in capsys.readouterr().err
    # A generate without a DiT among the files says which component is missing.
    cond = tmp_path / "cond.safetensors"
    text_conds(TEXT_ENCODERS[0]).save(cond)
    code = cli.main(["generate", "--vae", _path(tiny_dir, VAE), "--cond", str(cond), "--out", "o.mp4"])
    assert code == 1 and "DiT" in capsys.readouterr().err
