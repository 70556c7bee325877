"""DiT LoRA files in every trainer's key format, for the LoRA, LoRA-format and step-cache tests (one builder, no test
imports another).

Each writer draws random factors for a tiny H3 DiT and saves them under one trainer's naming:

    comfy_lora      Comfy-Org / reference names under `diffusion_model.`, lora_A/lora_B + `.alpha` (Turbo exports)
    native_lora     the same names, any prefix ('' = bare reference names, `diffusion_model.` = ai-toolkit), lora_A/B
                    or kohya lora_down/lora_up, with or without `.alpha`
    musubi_lora     musubi-tuner: `lora_unet_` + the native name with `.` -> `_`, lora_down/lora_up + `.alpha`
    diffsynth_lora  DiffSynth-Studio: bare native names, peft `.lora_A.default.weight`, qkv rows interleaved per head
    diffusers_lora  diffusers' names under `transformer.` (save_lora_weights), lora_A/lora_B
    pdd_lora        PDD Acc: bare diffusers names, lora_down/lora_up, plus the per-interval head bank
"""

import torch
from safetensors.torch import save_file

RANK = 4


def _native_modules(transformer, audio=True, refiner=True):
    """(native module, out, in) of every LoRA-able Linear of `transformer`, in the reference checkpoint's names."""
    c = transformer.config
    hidden, inner, ffn = c.hidden_size, c.num_attention_heads * c.attention_head_dim, c.ffn_dim
    out = []
    for block in range(c.num_layers):
        base = f"blocks.{block}"
        out += [(f"{base}.attn.qkv_proj", 3 * inner, hidden), (f"{base}.attn.out_proj", hidden, inner),
                (f"{base}.mlp.fc1", 2 * ffn, hidden), (f"{base}.mlp.fc2", hidden, ffn),
                (f"{base}.adaln_proj.linear", 18 * hidden, c.time_embed_dim)]
    if refiner:
        for block in range(c.num_refiner_layers):
            base = f"token_refiner.blocks.{block}"
            out += [(f"{base}.attn.qkv_proj", 3 * inner, hidden), (f"{base}.attn.out_proj", hidden, inner),
                    (f"{base}.mlp.fc1", 2 * ffn, hidden), (f"{base}.mlp.fc2", hidden, ffn)]
    patch = transformer.proj_in.in_features
    out += [("video_patch_proj", hidden, patch), ("condition_proj", hidden, c.text_dim),
            ("time_embedder.proj_in", transformer.time_embedder.linear_1.out_features,
             transformer.time_embedder.linear_1.in_features),
            ("time_embedder.proj_out", transformer.time_embedder.linear_2.out_features,
             transformer.time_embedder.linear_2.in_features),
            ("final_layer.adaln_proj.linear", 2 * hidden, c.time_embed_dim),
            ("final_layer.video_out", transformer.proj_out.out_features, hidden)]
    if audio:
        out += [("audio_patch_proj", hidden, c.audio_in_channels),
                ("final_layer.audio_out", c.audio_in_channels, hidden)]
    return out


def _pairs(modules, seed):
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(RANK, inp, generator=g) * 0.1, torch.randn(out, RANK, generator=g) * 0.1)
            for name, out, inp in modules}


def native_lora(path, transformer, prefix="diffusion_model.", kohya=False, alpha=None, seed=0, audio=True,
                refiner=True):
    """Reference-checkpoint names (Comfy-Org files, ai-toolkit under `diffusion_model.`, bare for the reference
    generate.py), every LoRA-able Linear of the DiT."""
    down, up = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
    tensors = {}
    for name, (a, b) in _pairs(_native_modules(transformer, audio, refiner), seed).items():
        tensors[f"{prefix}{name}{down}"], tensors[f"{prefix}{name}{up}"] = a, b
        if alpha is not None:
            tensors[f"{prefix}{name}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(path))
    return tensors


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


def musubi_lora(path, transformer, alpha=2.0, seed=0):
    """musubi-tuner (kohya networks): `lora_unet_<native name with . -> _>.lora_down/lora_up.weight` + `.alpha`."""
    tensors = {}
    for name, (a, b) in _pairs(_native_modules(transformer), seed).items():
        flat = "lora_unet_" + name.replace(".", "_")
        tensors[f"{flat}.lora_down.weight"], tensors[f"{flat}.lora_up.weight"] = a, b
        tensors[f"{flat}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(path))
    return tensors


def interleave_qkv(up, head_dim):
    """[q_all; k_all; v_all] rows -> DiffSynth's per-head [h0: q k v, h1: q k v, ...]."""
    heads = up.shape[0] // (3 * head_dim)
    return up.reshape(3, heads, head_dim, up.shape[1]).transpose(0, 1).reshape(up.shape).contiguous()


def diffsynth_lora(path, transformer, seed=0):
    """DiffSynth-Studio: bare native names with peft's `.default.` infix; returns (file tensors, the same factors in
    [q; k; v] order = what the reference converter sees for a released 128-wide head)."""
    head_dim = transformer.config.attention_head_dim
    tensors, ordered = {}, {}
    for name, (a, b) in _pairs(_native_modules(transformer), seed).items():
        ordered[name] = (a, b)
        stored = interleave_qkv(b, head_dim) if name.endswith("qkv_proj") else b
        tensors[f"{name}.lora_A.default.weight"], tensors[f"{name}.lora_B.default.weight"] = a, stored
    save_file(tensors, str(path))
    return tensors, ordered


def diffusers_lora(path, transformer, prefix="transformer.", kohya=False, seed=0, metadata=None):
    """diffusers' own names (every Linear of the DiT), as `save_lora_weights` writes them."""
    down, up = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear):
            tensors[f"{prefix}{name}{down}"] = torch.randn(RANK, module.in_features, generator=g) * 0.1
            tensors[f"{prefix}{name}{up}"] = torch.randn(module.out_features, RANK, generator=g) * 0.1
    save_file(tensors, str(path), metadata=metadata)
    return tensors


def pdd_lora(path, transformer, bank=32, seed=0, comfy=False):
    """PDD Acc (alibaba-pai MiniMax-H3-Acc-LoRAs): a trunk LoRA on bare diffusers names with lora_down/lora_up (no
    alpha) on the blocks' and refiner's attention / FFN / AdaLN Linears, plus `proj_out` / `audio_proj_out` head banks
    [bank, out, in] / [bank, out]. `comfy=True`: the bank as Comfy's converted copies store it,
    `diffusion_model.final_layer.{video,audio}_out.set_weight` [bank*out, in] / `.set_bias` [bank*out]."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith(("transformer_blocks.", "token_refiner.")):
            tensors[f"{name}.lora_down.weight"] = torch.randn(RANK, module.in_features, generator=g) * 0.1
            tensors[f"{name}.lora_up.weight"] = torch.randn(module.out_features, RANK, generator=g) * 0.1
    for head, native in (("proj_out", "video_out"), ("audio_proj_out", "audio_out")):
        linear = getattr(transformer, head)
        weight = linear.weight.detach().float()[None] + torch.randn(bank, *linear.weight.shape, generator=g) * 0.05
        bias = linear.bias.detach().float()[None] + torch.randn(bank, linear.out_features, generator=g) * 0.05
        if comfy:
            tensors[f"diffusion_model.final_layer.{native}.set_weight"] = weight.reshape(-1, linear.in_features)
            tensors[f"diffusion_model.final_layer.{native}.set_bias"] = bias.reshape(-1)
        else:
            tensors[f"{head}.weight"], tensors[f"{head}.bias"] = weight, bias
    save_file(tensors, str(path))
    return tensors


# --- ComfyUI core 0.33's own LoRA loading, as a reference for the key formats it reads -------------------------------

_CORE_SCRIPT = r'''
import json, sys
sys.argv = ["main.py", "--cpu"]
import torch
import comfy.options
comfy.options.enable_args_parsing()
import comfy.sd, comfy.utils, comfy.lora
from safetensors.torch import save_file
dit_file, lora_file, out_file = json.loads(sys.stdin.read())
model = comfy.sd.load_diffusion_model(dit_file)
key_map = comfy.lora.model_lora_keys_unet(model.model, {})
lora = comfy.utils.load_torch_file(lora_file)
loaded = comfy.lora.load_lora(lora, key_map)
patched = model.clone()
patched.add_patches(loaded, 1.0)
before = {k: v.detach().float().clone() for k, v in model.model.state_dict().items()}
patched.patch_model()
after = patched.model.state_dict()
deltas = {k[len("diffusion_model."):]: (after[k].float() - before[k]).contiguous()
          for k in loaded if k.startswith("diffusion_model.")}
save_file(deltas, out_file)
'''


def core033_deltas(core_dir, site, dit_file, lora_file, out_file, env=None):
    """Core 0.33 loads `lora_file` onto `dit_file` (comfy.sd.load_diffusion_model, comfy.lora.load_lora with core's
    own key map, the ModelPatcher's merge): {core weight name: merged - original} plus the LoRA keys core did not load
    (core logs `lora key not loaded: ...` for each)."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = os.pathsep.join([*(str(s) for s in site), str(core_dir)])
    done = subprocess.run([sys.executable, "-c", _CORE_SCRIPT], input=json.dumps([str(dit_file), str(lora_file),
                          str(out_file)]), capture_output=True, text=True, cwd=str(core_dir), env=run_env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"core 0.33 failed to load the LoRA:\n{done.stderr[-3000:]}")
    log = done.stdout + done.stderr
    not_loaded = sorted({line.split("lora key not loaded:", 1)[1].strip() for line in log.splitlines()
                         if "lora key not loaded:" in line})
    return load_file(str(out_file)), not_loaded
