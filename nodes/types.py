"""Socket types. Core types wherever core has one (CONDITIONING, LATENT, IMAGE, AUDIO, VIDEO);
`io.Custom` only for state core lacks: our loaded models and a request's media bundle."""

from comfy_api.latest import io

CATEGORY = "MiniMax H3 (split)"  # the 0.2-0.4 tree; nodes now sit in core's folders (below), under "MiniMax H3"
# Where core files the same kind of node (Load VAE: loaders, CLIP Text Encode: conditioning, KSampler: sampling,
# VAE Decode: latent), so the Node Library shows the pack beside core's counterparts.
LOADERS_CATEGORY = "loaders/MiniMax H3"
CONDITIONING_CATEGORY = "conditioning/MiniMax H3"
SAMPLING_CATEGORY = "sampling/MiniMax H3"
LATENT_CATEGORY = "latent/MiniMax H3"

TextEncoder = io.Custom("MINIMAX_H3_TEXT_ENCODER")
VideoVAE = io.Custom("MINIMAX_H3_VIDEO_VAE")
AudioVAE = io.Custom("MINIMAX_H3_AUDIO_VAE")
DiT = io.Custom("MINIMAX_H3_DIT")
# Keyframes and references in the order the prompt's <Picture i> / <Video k> / <Audio j> tags use.
Media = io.Custom("MINIMAX_H3_MEDIA")
