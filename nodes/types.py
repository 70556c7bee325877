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


# --- search aliases (core >= 0.33) ----------------------------------------------------------------------------------

# Words a user types in the node search for each node beyond its display name (core 0.33's `search_aliases`: "remote
# encoder" finds Remote Encode, "ksampler" the Sampler). Every node of the pack also answers to "minimax" and "h3".
PACK_ALIASES = ("minimax", "h3")
SEARCH_ALIASES = {
    "H3SplitTextEncoderLoader": ("text encoder", "load clip", "qwen"),
    "H3SplitVideoVAELoader": ("video vae", "load vae"),
    "H3SplitAudioVAELoader": ("audio vae", "load vae"),
    "H3SplitDiTLoader": ("dit", "load diffusion model", "unet loader"),
    "H3SplitTextEncode": ("text encode", "prompt", "clip text encode"),
    "H3SplitVideoVAEEncode": ("video vae", "vae encode"),
    "H3SplitAudioVAEEncode": ("audio vae", "vae encode"),
    "H3SplitRemoteEncode": ("remote encoder", "text encode", "encoder server"),
    "H3SplitSampler": ("ksampler", "sampler", "text to video"),
    "H3SplitDecode": ("video vae", "vae decode", "audio decode"),
    "H3SplitSaveConditioning": ("save conditioning",),
    "H3SplitLoadConditioning": ("load conditioning",),
    "H3SplitEmptyLatentFromConditioning": ("empty latent", "empty video latent"),
    "H3SplitKeyframes": ("first last frame", "keyframes"),
    "H3SplitReferences": ("reference to video", "references"),
    "H3SplitGuide": ("add guide", "guide frame"),
    "H3SplitContinueVideo": ("continue video", "extend video"),
}


def schema_accepts(name: str) -> bool:
    """Whether this ComfyUI's `io.Schema` has the field `name` (a dataclass field; core 0.33 added search_aliases,
    0.3.75 lacks it)."""
    import dataclasses

    schema = getattr(io, "Schema", None)
    try:
        return name in {f.name for f in dataclasses.fields(schema)}
    except TypeError:  # not a dataclass (a stub, a future rewrite): pass nothing it may not take
        return False


SCHEMA_HAS_ALIASES = schema_accepts("search_aliases")  # detected once, at import


def Schema(**fields):  # noqa: N802 - io.Schema's stand-in at every node's define_schema
    """`io.Schema(**fields)` plus the node's search aliases where this ComfyUI's Schema takes them (feature-detected,
    so 0.3.75 keeps working)."""
    node_id = fields.get("node_id", "")
    if "search_aliases" not in fields and node_id.startswith("H3Split") and SCHEMA_HAS_ALIASES:
        fields["search_aliases"] = [*PACK_ALIASES, *SEARCH_ALIASES.get(node_id, ())]
    return io.Schema(**fields)
