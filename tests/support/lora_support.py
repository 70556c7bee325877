"""A Comfy/native-named DiT LoRA file for the LoRA and step-cache tests (one builder, no test imports another)."""

import torch
from safetensors.torch import save_file

RANK = 4


def comfy_lora(path, transformer, alpha=8.0, seed=0):
    """A Comfy/native-named LoRA (fused qkv_proj, mlp.fc1 [gate; value], `.alpha`), as Turbo exports ship."""
    g = torch.Generator().manual_seed(seed)
    hidden = transformer.config.hidden_size
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    tensors = {}
    for block in range(transformer.config.num_layers):
        base = f"diffusion_model.blocks.{block}"
        tensors[f"{base}.attn.qkv_proj.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.1
        tensors[f"{base}.attn.qkv_proj.lora_B.weight"] = torch.randn(3 * inner, RANK, generator=g) * 0.1
        tensors[f"{base}.attn.qkv_proj.alpha"] = torch.tensor(alpha)
        tensors[f"{base}.mlp.fc1.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.1
        tensors[f"{base}.mlp.fc1.lora_B.weight"] = torch.randn(2 * transformer.config.ffn_dim, RANK, generator=g) * 0.1
        tensors[f"{base}.mlp.fc1.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return tensors
