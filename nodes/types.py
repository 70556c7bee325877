"""Socket types. Core types wherever core has one (CONDITIONING, LATENT, IMAGE, AUDIO, VIDEO);
`io.Custom` only for state core lacks: our loaded models and a request's media bundle."""

from comfy_api.latest import io

CATEGORY = "MiniMax H3 (split)"

TextEncoder = io.Custom("MINIMAX_H3_TEXT_ENCODER")
VideoVAE = io.Custom("MINIMAX_H3_VIDEO_VAE")
AudioVAE = io.Custom("MINIMAX_H3_AUDIO_VAE")
DiT = io.Custom("MINIMAX_H3_DIT")
# Keyframes and references in the order the prompt's <Picture i> / <Video k> / <Audio j> tags use.
Media = io.Custom("MINIMAX_H3_MEDIA")
