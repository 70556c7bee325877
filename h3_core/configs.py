"""Model configurations of every H3 component: the released sizes and the embedded tiny H3.

One source for both, so the tiny model is the release with smaller numbers and nothing else
(same classes, same layer kinds, same shape couplings; docs/ARCHITECTURE.md §6). Configs are plain
dicts in the exact form diffusers' `from_config` / transformers' `Qwen3VLConfig(**...)` take.
"""

from __future__ import annotations

import copy

# --- DiT (diffusers MiniMaxH3Transformer3DModel): 50 blocks, hidden 5376, 56 heads x 128 ------------------------------
RELEASE_TRANSFORMER = {
    "num_attention_heads": 56,
    "attention_head_dim": 128,
    "hidden_size": 5376,
    "num_layers": 50,
    "num_refiner_layers": 2,
    "ffn_dim": 14336,
    "in_channels": 24,
    "audio_in_channels": 32,
    "patch_size": [1, 2, 2],
    "text_dim": 5120,
    "freq_dim": 256,
    "time_embed_hidden_dim": 5376,
    "time_embed_dim": 2688,
    "rope_freq_dim": 16,
    "rope_theta": 10000.0,
    "norm_eps": 1e-05,
    "qk_norm_eps": 1e-05,
    "final_norm_eps": 1e-05,
}

TINY_TRANSFORMER = {
    **RELEASE_TRANSFORMER,
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "hidden_size": 64,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "ffn_dim": 128,
    "text_dim": 64,
    "time_embed_hidden_dim": 64,
    "time_embed_dim": 32,
    # 2*3*4 = 24 of the 32 head dims are rotated, as 96 of 128 are in the release.
    "rope_freq_dim": 4,
}

# --- Video VAE (diffusers AutoencoderKLMiniMaxH3): x16 spatial, x4 temporal, 24 latent channels -----------------------
RELEASE_VIDEO_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 24,
    "block_out_channels": [128, 256, 256, 512, 512, 1024],
    "layers_per_block": 2,
    "spatial_downsample_factors": [2, 2, 2, 2, 1, 1],
    "temporal_downsample_factors": [1, 2, 2, 1, 1, 1],
    "norm_num_groups": 32,
    "norm_eps": 1e-06,
    "spatial_padding_mode": "reflect",
    "decoder_num_layers": 36,
    "decoder_num_attention_heads": 32,
    "decoder_attention_head_dim": 64,
    "decoder_num_register_tokens": 4,
    "decoder_ffn_mult": 4,
    "decoder_rope_theta": 100.0,
    "decoder_rope_dim_ratio": 0.75,
    "decoder_norm_eps": 1e-05,
    "clip_length": 17,
    "token_drop": 3,
    # The release ships 24 measured constants; they are weights-like and travel with each file.
    "latents_mean": [0.0] * 24,
    "latents_std": [1.0] * 24,
}

TINY_VIDEO_VAE = {
    **RELEASE_VIDEO_VAE,
    "block_out_channels": [8, 16, 16, 32, 32, 64],
    "norm_num_groups": 8,
    "decoder_num_layers": 2,
    "decoder_num_attention_heads": 2,
    # int(0.75 * 16) = 12, divisible by 6 as the decoder's 3-D rotary split needs.
    "decoder_attention_head_dim": 16,
}

# --- Audio VAE (diffusers AutoencoderKLMiniMaxH3Audio): hop 800 at 32 kHz, 32 latent channels -------------------------
RELEASE_AUDIO_VAE = {
    "encoder_dim": 64,
    "encoder_rates": [2, 4, 4, 5, 5],
    "latent_dim": 2048,
    "latent_channels": 32,
    "num_attention_heads": 8,
    "decoder_dim": 1024,
    "decoder_rates": [5, 5, 2, 2, 2, 2, 2],
    "decoder_kernel_sizes": [9, 9, 4, 4, 4, 4, 4],
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "sampling_rate": 32000,
    "latents_mean": [0.0] * 32,
    "latents_std": [1.0] * 32,
}

TINY_AUDIO_VAE = {
    **RELEASE_AUDIO_VAE,
    "encoder_dim": 4,
    "latent_dim": 64,
    "num_attention_heads": 2,
    # BigVGAN needs decoder_dim >= 2 ** len(decoder_rates) = 128.
    "decoder_dim": 128,
}

# --- Text encoder (transformers Qwen3VLForConditionalGeneration): 64 layers x 5120, tap after 50 ----------------------
QWEN_TOKEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

RELEASE_TEXT_ENCODER = {
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    # Qwen3-VL's SigLIP-2 tower (only "3 DeepStack mergers" is confirmed by the
    # sources; these are the Qwen3-VL family values, out_hidden_size = the LM width).
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 5120,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    "tie_word_embeddings": False,
    **QWEN_TOKEN_IDS,
}

# diffusers reads hidden_states[50] and refuses stacks of <= 50 layers, so 51 is the floor.
TINY_TEXT_ENCODER = {
    "text_config": {
        **RELEASE_TEXT_ENCODER["text_config"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 51,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {
        **RELEASE_TEXT_ENCODER["vision_config"],
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1, 2],
    },
    "tie_word_embeddings": True,
    **QWEN_TOKEN_IDS,
}

# --- Schedulers and pipeline config -----------------------------------------------------------------------------------

RELEASE_PIPELINE_CONFIG = {
    "canvas_short_edge": 768,
    "canvas_max_pixels": 768 * 1344,
    "reference_image_short_edge": 2048,
}

# The tiny model runs at 64 px: its canvas rule is the release's scaled down by 12.
TINY_PIPELINE_CONFIG = {
    "canvas_short_edge": 64,
    "canvas_max_pixels": 64 * 112,
    "reference_image_short_edge": 64,
}


def get(name: str, tiny: bool) -> dict:
    """A deep copy of one component's config, so callers can edit it freely."""
    table = {
        "transformer": (TINY_TRANSFORMER, RELEASE_TRANSFORMER),
        "vae": (TINY_VIDEO_VAE, RELEASE_VIDEO_VAE),
        "audio_vae": (TINY_AUDIO_VAE, RELEASE_AUDIO_VAE),
        "text_encoder": (TINY_TEXT_ENCODER, RELEASE_TEXT_ENCODER),
        "pipeline": (TINY_PIPELINE_CONFIG, RELEASE_PIPELINE_CONFIG),
    }
    if name not in table:
        raise KeyError(f"unknown H3 component {name!r}; expected one of {sorted(table)}")
    return copy.deepcopy(table[name][0 if tiny else 1])
