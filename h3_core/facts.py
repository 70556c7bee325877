"""MiniMax-H3's model facts, in one place: every other module imports them from here.

Dependency-free on purpose (no torch, no diffusers): the media code, the request rules, the
contract, the nodes and the CLI all import it cheaply. Where diffusers' MiniMax-H3 pipeline defines
the same fact (`diffusers.modular_pipelines.minimax_h3.modular_pipeline`: `MINIMAX_H3_FPS`, the
pipeline's `canvas_multiple` / `pixel_mean` / `pixel_std` / `keyframe_encode_seed` properties, the
scheduler's defaults), the literal here is pinned against diffusers' value by `tests/test_facts.py`,
so an upstream change fails a test instead of silently diverging.
"""

from __future__ import annotations

# --- time ---------------------------------------------------------------------------------------
FPS = 24  # everything H3 generates or conditions on is resampled onto 24 fps
AUDIO_SAMPLE_RATE = 32000  # the audio VAE's waveform rate (Hz)
AUDIO_LATENTS_PER_SECOND = 40  # the audio VAE's latent rate, per stereo channel
AUDIO_CHANNELS = 2  # stereo; the two channels are packed channel-major
AUDIO_LATENT_CHANNELS = 32  # audio VAE latent width (the release and the tiny H3 alike)
VIDEO_LATENT_CHANNELS = 24  # video VAE latent channels, before the DiT's 2x2 patch (the release and the tiny H3 alike)

# --- space --------------------------------------------------------------------------------------
VAE_SPATIAL_FACTOR = 16  # video VAE spatial compression
PATCH_SIZE = (1, 2, 2)  # the DiT's (t, h, w) patch
CANVAS_MULTIPLE = VAE_SPATIAL_FACTOR * PATCH_SIZE[2]  # 32: a canvas must survive the VAE and the 2x2 patch
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
# The trained canvas: diffusers' canvas rule (`resolve_canvas_size` with the pipeline's `canvas_short_edge` 768 and
# `canvas_max_pixels` 768*1344 at release) scales an aspect ratio to a 768 px short edge, shrinks it to the area cap
# and rounds each axis to the nearest 32 px. Over the allowed aspects 1:4..4:1 the largest canvas it yields is
# 1856x576 (the cap plus rounding) and the longest edge 2016 (2016x512 at 4:1): H3's trained canvases. Pinned against
# diffusers' rule by tests/test_facts.py. A larger canvas runs with a warning (rules.canvas_trained_warning), as
# ComfyUI core lets one (its widgets go to 16384 px), up to an absolute bound every contract read and every entry
# point holds (CLI, node widgets, the encoder server, whose default stays the trained size): 4096 px a side and
# 4096x2304 px (4K UHD fits; 8.8x the trained area), so a file claiming 65536x65536 cannot make a sampler allocate
# gigabytes. Beyond that a canvas is refused by name.
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
TRAINED_CANVAS_PIXELS = 1856 * 576  # 1,069,056
TRAINED_CANVAS_EDGE = 2016
MAX_CANVAS_PIXELS = 4096 * 2304  # 9,437,184
MAX_CANVAS_EDGE = 4096

# --- the frame grid -----------------------------------------------------------------------------
# The video VAE encodes 17-frame clips into 5 latent frames (plus a 5-frame head -> 2 latents), so the
# valid pixel frame counts are 17k + 5 and their latent counts 5k + 2.
FRAMES_PER_CLIP = 17
LATENTS_PER_CLIP = 5

# The trained range: diffusers checks 5-15 s on the frame count *after* snapping up to 17k + 5, so the counts
# H3 was trained on are 124 (5.17 s) .. 345 (14.375 s); 362 frames would be 15.08 s. Outside it the pack warns
# (node tooltip, log, the planner's report) but does not refuse: quality there is untested.
MIN_DURATION_S, MAX_DURATION_S = 5.0, 15.0
TRAINED_MIN_FRAMES = 124  # 17*7 + 5, the first grid point at or above 5 s
TRAINED_MAX_FRAMES = 345  # 17*20 + 5, the last grid point within 15 s
DEFAULT_FRAMES = TRAINED_MIN_FRAMES  # what a request without a length gets
# The lengths ComfyUI core 0.33's `EmptyMiniMaxH3LatentAV` allows (its `length` 5..3600, snapped up to the grid), as
# grid points: every entry point accepts them, memory bounded by the planner's estimate for the machine. Pinned
# against core's node by tests/test_facts.py.
CORE_MAX_LENGTH = 3600
MIN_FRAMES = 5  # 17*0 + 5: the shortest clip (one head clip, 2 latent frames)
MAX_FRAMES = 3592  # 17*211 + 5, the last grid point within core's 3600 (~149.7 s)
# Text to image: core's text-to-image generates the shortest clip and keeps its first frame (audio discarded).
IMAGE_FRAMES = MIN_FRAMES

# --- references (ref2va) ------------------------------------------------------------------------
MAX_KEYFRAMES = 2  # fl2va: first and/or last frame
MAX_GUIDES = 16  # guides at any frame (core's AddGuide chains any number; each is more rows): the pack's cap
MAX_REF_IMAGES, MAX_REF_VIDEOS, MAX_REF_AUDIOS, MAX_REFS = 9, 3, 3, 12
MIN_AUDIO_CLIP_S, MAX_AUDIO_CLIP_S = 2.0, 15.0  # every reference clip, soundtrack or standalone
MIN_REFERENCE_VIDEO_S = 2.0
# Two separate 15 s budgets: the soundtracks embedded in reference videos, and the standalone audios.
EMBEDDED_AUDIO_BUDGET_S = 15.0
STANDALONE_AUDIO_BUDGET_S = 15.0

# --- video VAE input normalisation and conditioning sampling ------------------------------------
PIXEL_MEAN = (0.485, 0.456, 0.406)  # ImageNet's, per RGB channel
PIXEL_STD = (0.229, 0.224, 0.225)
KEYFRAME_ENCODE_SEED = 42  # the conditioning posterior is sampled under this seed, whatever the request's

# --- text conditioning ----------------------------------------------------------------------------
# The DiT is conditioned on the residual stream after this Qwen3-VL layer (diffusers' `text_encoder_layer`,
# a fixed pipeline property; diffusers refuses a text model of 50 layers or fewer).
TEXT_ENCODER_LAYER = 50
# Qwen3-VL's vision tower cuts images into 16 px patches and merges 2 x 2 of them into one token (and 2 frames into
# one temporal patch); diffusers reads a reference video at 2 fps (its `video_sample_fps`), so one vision block
# covers 2 of the 24 fps frames read 1 in 12: one block per second of reference video.
VISION_PATCH_PX = 16
VISION_MERGE = 2  # spatial merge (2 x 2 patches per token) and temporal patch (2 frames per block)
VISION_TOKEN_PX = VISION_PATCH_PX * VISION_MERGE  # 32: one vision token per 32 x 32 px
REFERENCE_VIDEO_READ_FPS = 2.0
VIDEO_BLOCKS_PER_FRAME = REFERENCE_VIDEO_READ_FPS / FPS / VISION_MERGE  # 1/24

# --- the largest conditioning the encoder makes -------------------------------------------------------------------
# What a conditioning file, a wire payload or a graph's CONDITIONING is held to before a sampler sizes its work by it.
# An image reference: diffusers' reference step scales it to a `reference_image_short_edge` of 2048 px (the release
# pipeline config; pinned by tests/test_hostile_bounds.py), rounding both axes to 32 px, and refuses aspects beyond
# 1:4..4:1, so it is at most 2048 x 8192 px: a latent at most 128 a side on its short side, 512 on its long one.
REFERENCE_IMAGE_SHORT_EDGE = 2048
MAX_REFERENCE_IMAGE_EDGE = int(REFERENCE_IMAGE_SHORT_EDGE * MAX_ASPECT)  # 8192
# The prompt: the request rules' limit (the encoder endpoint's `max_prompt_chars`). Qwen's byte-level BPE never makes
# more tokens than UTF-8 bytes (at most 4 a character), and the presentation adds short labels ("<Picture i>: ",
# "<Video k>: ", "<7.5 seconds>" per vision block: under 1,024 tokens for 12 references): the text rows' bound.
MAX_PROMPT_CHARS = 16384
MAX_TEXT_TOKENS = 4 * MAX_PROMPT_CHARS + 1024  # 66,560
# Qwen3-VL's own longest sequence (`max_position_embeddings`): no presentation, text and vision blocks together, is
# longer. 9 images at 16,384 vision tokens, 3 videos of 15 blocks and MAX_TEXT_TOKENS stay under it.
TEXT_ENCODER_MAX_POSITIONS = 262144

# --- sampling -----------------------------------------------------------------------------------
VIDEO_SHIFT = 12.0  # flow-matching sigma shift of the video schedule
AUDIO_SHIFT = 3.0  # ... and of the audio schedule


def is_on_frame_grid(num_frames: int) -> bool:
    """True for the frame counts the video VAE encodes without padding: 17k + 5."""
    return num_frames >= LATENTS_PER_CLIP and num_frames % FRAMES_PER_CLIP == LATENTS_PER_CLIP


def video_latent_frames(num_frames: int) -> int:
    """Latent frames the video VAE produces: 5k + 2 for 17k + 5 frames, and 1 for a single image."""
    if num_frames == 1:
        return 1
    if not is_on_frame_grid(num_frames):
        raise ValueError(f"frame count must be of the form 17k+5 (5, 22, 39, ..., 124, ...), got {num_frames}")
    return (num_frames - LATENTS_PER_CLIP) // FRAMES_PER_CLIP * LATENTS_PER_CLIP + 2


def audio_latent_frames(num_frames: int) -> int:
    """Audio latents (per stereo channel) covering `num_frames` video frames: round(frames / 24 * 40)."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


def audio_latents(seconds: float) -> int:
    """Audio latents (per channel) in `seconds` of audio, e.g. the 15 s budget -> 600."""
    return int(round(seconds * AUDIO_LATENTS_PER_SECOND))
