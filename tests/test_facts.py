"""Every H3 fact in `h3_core.facts` pinned against diffusers' own value, where diffusers defines it.

The literals live in `facts` (which imports nothing, so the media code and the nodes stay light); these
tests make an upstream change fail loudly instead of letting the pack drift from diffusers.
"""

import math
import re

import pytest
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as mp
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.schedulers import MiniMaxH3Scheduler

from h3_core import configs, facts, rules


@pytest.fixture(scope="module")
def pipe():
    """The pipeline's property defaults (what it reports with no component loaded: the release's values)."""
    return object.__new__(mp.MiniMaxH3ModularPipeline)


def test_fps_and_audio_rates(pipe):
    assert facts.FPS == mp.MINIMAX_H3_FPS == pipe.fps == 24
    assert facts.AUDIO_LATENTS_PER_SECOND == mp.MINIMAX_H3_AUDIO_LATENTS_PER_SECOND == 40
    assert facts.AUDIO_SAMPLE_RATE == pipe.audio_sampling_rate == 32000
    assert facts.AUDIO_CHANNELS == mp.MINIMAX_H3_AUDIO_CHANNELS == pipe.audio_channels == 2
    assert facts.AUDIO_LATENT_CHANNELS == pipe.audio_latent_channels == 32
    assert facts.VIDEO_LATENT_CHANNELS == pipe.vae_latent_channels == 24


def test_canvas_and_patch(pipe):
    assert facts.VAE_SPATIAL_FACTOR == pipe.vae_spatial_compression_ratio == 16
    assert facts.PATCH_SIZE == pipe.patch_size == (1, 2, 2)
    assert facts.CANVAS_MULTIPLE == pipe.canvas_multiple == 32
    assert (facts.MIN_ASPECT, facts.MAX_ASPECT) == (mp.MINIMAX_H3_MIN_ASPECT_RATIO, mp.MINIMAX_H3_MAX_ASPECT_RATIO)


def test_canvas_bound_is_the_largest_canvas_of_diffusers_rule():
    """Every contract read bounds the canvas by what diffusers' canvas rule can produce at the release's
    config (short edge 768, area cap 768x1344, axes rounded to 32) over the allowed aspects. A sweep over every
    aspect w:h with w, h <= 120 (it holds the maximisers 29:9 and 4:1) finds exactly the bound."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep as step

    defaults = {spec.name: spec.default for spec in step().expected_configs}
    assert (facts.CANVAS_SHORT_EDGE, facts.CANVAS_MAX_PIXELS) == (defaults["canvas_short_edge"],
                                                                  defaults["canvas_max_pixels"])
    release = configs.RELEASE_PIPELINE_CONFIG
    assert (release["canvas_short_edge"], release["canvas_max_pixels"]) == (facts.CANVAS_SHORT_EDGE,
                                                                          facts.CANVAS_MAX_PIXELS)
    rule = (facts.CANVAS_MULTIPLE, facts.CANVAS_SHORT_EDGE, facts.CANVAS_MAX_PIXELS)
    canvases = {mp.resolve_canvas_size(w, h, *rule)
                for w in range(1, 121) for h in range(1, 121) if facts.MIN_ASPECT <= w / h <= facts.MAX_ASPECT}
    assert max(height * width for height, width in canvases) == facts.TRAINED_CANVAS_PIXELS
    assert max(max(canvas) for canvas in canvases) == facts.TRAINED_CANVAS_EDGE
    for height, width in canvases:
        assert rules.check_canvas(width, height) == (width, height)
        assert rules.canvas_trained_warning(width, height) is None
    # beyond it a canvas runs with a warning, up to the absolute bound (4096 px a side, 4096x2304 px)
    assert facts.MAX_CANVAS_EDGE == 4096 and facts.MAX_CANVAS_PIXELS == 4096 * 2304
    assert "beyond H3's trained size" in rules.canvas_trained_warning(3840, 2176)
    assert rules.check_canvas(3840, 2176) == (3840, 2176)


def test_frame_grid(pipe):
    assert (facts.FRAMES_PER_CLIP, facts.LATENTS_PER_CLIP) == (pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk)
    for n in range(1, 400):
        on_grid = mp.align_num_frames(n, 17, 5) == n
        assert facts.is_on_frame_grid(n) == on_grid, n
        if on_grid:
            assert facts.video_latent_frames(n) == mp.video_latent_num_frames(n, 17, 5), n
        assert facts.audio_latent_frames(n) == mp.audio_latent_num_frames(n), n


def test_single_image_and_off_grid_latent_frames():
    assert facts.video_latent_frames(1) == 1  # an image reference or keyframe encodes to one latent frame
    with pytest.raises(ValueError, match="17k\\+5"):
        facts.video_latent_frames(125)


def test_frame_range_is_diffusers_duration_after_snapping(pipe):
    """diffusers checks 5-15 s on the frame count *after* snapping up to 17k+5 (so 346..361 -> 362 = 15.08 s
    is refused): the trained range is 124..345, where the rules stop warning."""
    assert (facts.MIN_DURATION_S, facts.MAX_DURATION_S) == (pipe.min_duration, pipe.max_duration)
    accepted = [n for n in range(1, 400)
                if pipe.min_duration <= mp.align_num_frames(n, 17, 5) / pipe.fps <= pipe.max_duration]
    snapped = sorted({mp.align_num_frames(n, 17, 5) for n in accepted})
    assert (facts.TRAINED_MIN_FRAMES, facts.TRAINED_MAX_FRAMES) == (snapped[0], snapped[-1]) == (124, 345)
    assert facts.TRAINED_MIN_FRAMES == mp.align_num_frames(math.ceil(pipe.min_duration * pipe.fps), 17, 5)
    assert facts.DEFAULT_FRAMES == facts.TRAINED_MIN_FRAMES


def test_allowed_lengths_are_comfyui_cores():
    """The lengths every entry point accepts are those ComfyUI core 0.33's EmptyMiniMaxH3LatentAV allows (its
    `length` widget 5..3600, snapped up to 17k+5 by its `align_frame_count`), as grid points: 5..3592 frames. Read
    from core's source (.comfyui-0.33/, scripts/setup_comfyui.sh), so a change there fails here."""
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / ".comfyui-0.33" / "comfy_extras" / "nodes_minimax_h3.py"
    if not source.exists():
        pytest.skip("ComfyUI core 0.33 is not set up (scripts/setup_comfyui.sh)")
    text = source.read_text(encoding="utf-8")
    widgets = re.findall(r'io\.Int\.Input\("length", default=(\d+), min=(\d+), max=(\d+), step=(\d+)', text)
    assert widgets and set(widgets) == {("124", "5", "3600", "17")}, widgets  # every core H3 node alike
    assert "frame_count = align_frame_count(max(5, length))" in text  # at least 5, snapped up
    core_max = int(widgets[0][2])
    assert facts.CORE_MAX_LENGTH == core_max
    grid = [n for n in range(1, core_max + 1) if facts.is_on_frame_grid(n)]
    assert (facts.MIN_FRAMES, facts.MAX_FRAMES) == (grid[0], grid[-1]) == (5, 3592)
    assert facts.IMAGE_FRAMES == facts.MIN_FRAMES == rules.snap_frames_up(1)  # core's text to image: 1 -> 5 frames


def test_reference_limits():
    step = MiniMaxH3Ref2VASetupStep()
    assert (facts.MAX_REF_IMAGES, facts.MAX_REF_VIDEOS, facts.MAX_REF_AUDIOS, facts.MAX_REFS) == \
        (step.max_images, step.max_videos, step.max_audios, step.max_references) == (9, 3, 3, 12)


def test_audio_clip_limits_and_budgets():
    # vLLM-Omni's serving rules (diffusers defines none): every clip 2-15 s, two separate 15 s budgets.
    assert (facts.MIN_AUDIO_CLIP_S, facts.MAX_AUDIO_CLIP_S, facts.MIN_REFERENCE_VIDEO_S) == (2.0, 15.0, 2.0)
    assert (facts.EMBEDDED_AUDIO_BUDGET_S, facts.STANDALONE_AUDIO_BUDGET_S) == (15.0, 15.0)
    assert [facts.audio_latents(s) for s in (2.0, 15.0)] == [80, 600]


def test_vae_pixel_statistics_and_keyframe_seed(pipe):
    assert facts.PIXEL_MEAN == tuple(pipe.pixel_mean) == (0.485, 0.456, 0.406)
    assert facts.PIXEL_STD == tuple(pipe.pixel_std) == (0.229, 0.224, 0.225)
    assert facts.KEYFRAME_ENCODE_SEED == pipe.keyframe_encode_seed == 42


def test_flow_shifts():
    assert facts.VIDEO_SHIFT == MiniMaxH3Scheduler().config.shift == 12.0
    # The audio schedule's shift is the released checkpoint's scheduler config; diffusers states it in the
    # pipeline's documentation.
    doc = " ".join(mp.MiniMaxH3ModularPipeline.__doc__.split())
    assert re.search(r"`shift = 12\.0` for video, `shift = 3\.0` for audio", doc)
    assert facts.AUDIO_SHIFT == 3.0


def test_text_encoder_layer(pipe):
    assert facts.TEXT_ENCODER_LAYER == pipe.text_encoder_layer == 50


def test_vision_token_geometry():
    """Qwen3-VL's patch and merge sizes (transformers' defaults, and the release config the pack builds) and the
    rate diffusers reads reference videos at: the numbers the text encoder's memory estimate counts tokens with."""
    import inspect

    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    for vision in (Qwen3VLVisionConfig().to_dict(), configs.RELEASE_TEXT_ENCODER["vision_config"]):
        assert vision["patch_size"] == facts.VISION_PATCH_PX == 16
        assert vision["spatial_merge_size"] == vision["temporal_patch_size"] == facts.VISION_MERGE == 2
    assert facts.VISION_TOKEN_PX == 32
    default = inspect.signature(MiniMaxH3Ref2VATextEncoderStep.__init__).parameters["video_sample_fps"].default
    assert facts.REFERENCE_VIDEO_READ_FPS == default == MiniMaxH3Ref2VATextEncoderStep().video_sample_fps == 2.0
    assert facts.VIDEO_BLOCKS_PER_FRAME == 1 / 24  # one vision block per second of 24 fps reference video


def test_facts_have_one_name():
    """Every module reads a fact as `facts.X`: nothing imports a name out of `facts` (which would give the fact a
    second spelling, e.g. `rules.FPS`), and no module but `facts` defines one of its names at module level."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = {name for name in vars(facts) if name.isupper()}
    for path in [*root.glob("h3_core/**/*.py"), *root.glob("nodes/**/*.py"), *root.glob("bench/**/*.py")]:
        if path.name == "facts.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").endswith("facts"), f"{path}: import facts, read facts.X"
            if isinstance(node, ast.Assign):
                defined = {t.id for t in node.targets if isinstance(t, ast.Name)}
                assert not defined & names, f"{path}:{node.lineno} redefines {defined & names}"
