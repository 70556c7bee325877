"""llama.cpp's GGUF tensor names for a Qwen3-VL text encoder and its vision ("mmproj") file <-> the Comfy names.

Most published Qwen3-VL GGUF text encoders are written by llama.cpp's `convert_hf_to_gguf.py`, in two files:

- the language model (`general.architecture` "qwen3vl", class `Qwen3VLTextModel`): `token_embd`, `blk.N.attn_q`
  / `attn_k` / `attn_v` / `attn_output`, `attn_q_norm` / `attn_k_norm`, `attn_norm`, `ffn_gate` / `ffn_up` /
  `ffn_down`, `ffn_norm`, and for a complete model `output_norm` and `output`. Qwen2/Qwen3 conversions apply
  no Q/K row permutation (only llama's converter does), so every tensor is the transformers tensor renamed;
- the vision tower (`general.architecture` "clip", `clip.projector_type` "qwen3vl_merger", class
  `Qwen3VLVisionModel`): `v.blk.N.ln1` / `ln2` / `attn_qkv` (the fused qkv kept fused) / `attn_out` / `ffn_up` /
  `ffn_down`, `v.position_embd`, `v.post_ln` with `mm.0` / `mm.2` (the merger's norm and two linears),
  `v.deepstack.L.norm` / `fc1` / `fc2` where L is the *absolute* vision layer of the DeepStack merger (the i-th
  merger is the i-th smallest L), and the Conv3D patch embedding split along its temporal axis into two Conv2D
  kernels `v.patch_embd.weight` (t = 0) and `v.patch_embd.weight.1` (t = 1), plus `v.patch_embd.bias`.

`comfy_names` maps a file's names to (Comfy name, temporal part); what it cannot map is refused by name. The
values shapes cannot show are read from the llama.cpp metadata (`stated_config`): rope theta and mrope sections,
the RMSNorm epsilon, the vision head count; the DeepStack layer indexes come from the `v.deepstack.L` names.
"""

from __future__ import annotations

import re

import numpy as np

from .errors import H3WeightsError, UnsupportedCheckpointError, preview

TEXT_ARCHITECTURE = "qwen3vl"
PROJECTOR_ARCHITECTURE = "clip"
PROJECTOR_TYPE = "qwen3vl_merger"  # llama.cpp's VisionProjectorType.QWEN3VL
# A name in llama.cpp's scheme (never a Comfy, transformers or diffusers name).
_LLAMA_NAME = re.compile(r"(token_embd|output_norm|output|blk\.\d+\.[a-z_0-9]+|v\.[a-z_.0-9]+|mm\.\d+)\.(weight|bias)"
                         r"(\.1)?")

_TEXT_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TEXT = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_VISION_BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
                 "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_VISION = {"v.patch_embd": "visual.patch_embed.proj", "v.position_embd": "visual.pos_embed",
           "v.post_ln": "visual.merger.norm", "mm.0": "visual.merger.linear_fc1", "mm.2": "visual.merger.linear_fc2"}
_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)")
_VISION_BLOCK_NAME = re.compile(r"v\.blk\.(\d+)\.([a-z_0-9]+)")
_DEEPSTACK_NAME = re.compile(r"v\.deepstack\.(\d+)\.([a-z_0-9]+)")
PATCH = "visual.patch_embed.proj.weight"  # the one tensor stored as two parts (stacked on dim TEMPORAL_DIM)
TEMPORAL_DIM = 2


def uses_llama_names(names) -> bool:
    """Whether a GGUF file names its tensors as llama.cpp does (told by the names, not the file name)."""
    return any(_LLAMA_NAME.fullmatch(name) for name in names)


def deepstack_layers(names) -> list[int]:
    """The absolute vision layers of the file's DeepStack mergers, ascending (`v.deepstack.L.*`)."""
    return sorted({int(m.group(1)) for m in map(_DEEPSTACK_NAME.match, names) if m})


def _comfy(name: str, deepstack: list[int]) -> tuple[str, int] | None:
    match = _LLAMA_NAME.fullmatch(name)
    if not match:
        return None
    stem, kind, part = match.group(1), match.group(2), 1 if match.group(3) else 0
    if part and stem != "v.patch_embd":
        return None
    if stem in _TEXT:
        return f"{_TEXT[stem]}.{kind}", 0
    if stem in _VISION:
        return f"{_VISION[stem]}.{kind}", part
    for pattern, table, prefix in ((_BLOCK, _TEXT_BLOCK, "model.layers"), (_VISION_BLOCK_NAME, _VISION_BLOCK,
                                                                            "visual.blocks")):
        block = pattern.fullmatch(stem)
        if block and block.group(2) in table:
            return f"{prefix}.{block.group(1)}.{table[block.group(2)]}.{kind}", 0
    deep = _DEEPSTACK_NAME.fullmatch(stem)
    if deep and deep.group(2) in _DEEPSTACK:
        merger = deepstack.index(int(deep.group(1)))
        return f"visual.deepstack_merger_list.{merger}.{_DEEPSTACK[deep.group(2)]}.{kind}", 0
    return None


def check_architecture(metadata: dict, where: str) -> None:
    """Refuse, by its architecture, a llama.cpp-named file that is no Qwen3-VL text encoder or its projector."""
    arch = metadata.get("general.architecture")
    projector = metadata.get("clip.projector_type") or metadata.get("clip.vision.projector_type")
    if arch == TEXT_ARCHITECTURE or (arch == PROJECTOR_ARCHITECTURE and projector == PROJECTOR_TYPE):
        return
    what = f"{arch!r}" + (f" (projector {projector!r})" if arch == PROJECTOR_ARCHITECTURE else "")
    raise UnsupportedCheckpointError(
        f"{where}: a GGUF file with llama.cpp tensor names for architecture {what}; only Qwen3-VL text encoders "
        f"({TEXT_ARCHITECTURE!r}) and their vision files ({PROJECTOR_ARCHITECTURE!r}, projector {PROJECTOR_TYPE!r}) "
        "are mapped to the pack's names")


def comfy_names(names, where: str, *, strict: bool = True) -> dict[str, tuple[str, int]]:
    """{file name: (Comfy name, temporal part)}; a name that cannot be mapped is refused by name (`strict`) or
    kept as it is (a directory-only look, e.g. pairing a projector file)."""
    names = list(names)
    deepstack = deepstack_layers(names)
    out, unmapped = {}, []
    for name in names:
        mapped = _comfy(name, deepstack)
        if mapped is None:
            unmapped.append(name)
            mapped = (name, 0)
        out[name] = mapped
    if unmapped and strict:
        raise UnsupportedCheckpointError(
            f"{where}: llama.cpp-named GGUF tensors with no Qwen3-VL text-encoder tensor to map to: "
            f"{preview(sorted(unmapped), 4)} (a Qwen3-VL text encoder is blk.N.attn_*/ffn_* with token_embd, and its "
            "vision file v.blk.N.*, v.patch_embd, v.position_embd, v.post_ln, mm.0/mm.2, v.deepstack.L.*)")
    parts: dict[str, list[int]] = {}
    for comfy, part in out.values():
        parts.setdefault(comfy, []).append(part)
    for comfy, found in parts.items():
        wanted = [0, 1] if comfy == PATCH else [0]
        if sorted(found) != wanted:
            raise H3WeightsError(f"{where}: {comfy} needs llama.cpp parts {wanted}, the file has {sorted(found)}")
    return out


def _float(value) -> float:
    return float(str(np.float32(value)))  # metadata floats are float32: their shortest decimal (1e-06, not 9.99e-07)


def stated_config(values: dict, names, release: dict) -> dict:
    """The config values the llama.cpp metadata states and shapes cannot show, as a partial Qwen3-VL config
    ({"text_config": ...} for the language file, {"vision_config": ...} for the vision file)."""
    text, vision = {}, {}
    key = f"{TEXT_ARCHITECTURE}."
    rope = dict(release["text_config"]["rope_parameters"])
    if f"{key}rope.freq_base" in values:
        rope["rope_theta"] = _float(values[f"{key}rope.freq_base"])
    if f"{key}rope.dimension_sections" in values:  # llama.cpp pads mrope sections to 4 with zeros
        rope["mrope_section"] = [int(v) for v in values[f"{key}rope.dimension_sections"]][:len(rope["mrope_section"])]
    if any(name.startswith("blk.") for name in names):
        text["rope_parameters"] = rope
        if f"{key}attention.layer_norm_rms_epsilon" in values:
            text["rms_norm_eps"] = _float(values[f"{key}attention.layer_norm_rms_epsilon"])
    if any(name.startswith("v.") for name in names):
        if "clip.vision.attention.head_count" in values:
            vision["num_heads"] = int(values["clip.vision.attention.head_count"])
        vision["deepstack_visual_indexes"] = deepstack_layers(names)
    return {k: v for k, v in (("text_config", text), ("vision_config", vision)) if v}


# --- the inverse, for writing llama.cpp-named twins (tiny_gguf) ----------------------------------------------

def llama_name(comfy: str, deepstack_indexes: list[int]) -> str:
    """The llama.cpp name of one Comfy text-encoder tensor (the patch kernel's t = 0 part for PATCH)."""
    kind = comfy.rsplit(".", 1)[1]
    stem = comfy[:-len(kind) - 1]
    for table in (_TEXT, _VISION):
        for llama, ours in table.items():
            if stem == ours:
                return f"{llama}.{kind}"
    for pattern, table, prefix in ((r"model\.layers\.(\d+)\.(.+)", _TEXT_BLOCK, "blk"),
                                   (r"visual\.blocks\.(\d+)\.(.+)", _VISION_BLOCK, "v.blk")):
        match = re.fullmatch(pattern, stem)
        if match:
            inverse = {v: k for k, v in table.items()}
            return f"{prefix}.{match.group(1)}.{inverse[match.group(2)]}.{kind}"
    match = re.fullmatch(r"visual\.deepstack_merger_list\.(\d+)\.(.+)", stem)
    if match:
        inverse = {v: k for k, v in _DEEPSTACK.items()}
        return f"v.deepstack.{deepstack_indexes[int(match.group(1))]}.{inverse[match.group(2)]}.{kind}"
    raise H3WeightsError(f"{comfy}: no llama.cpp name")
