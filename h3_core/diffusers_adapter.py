"""Every import of a diffusers *private* helper, in one place.

The pack's model math is diffusers' own, and a few of the pieces it reuses are not part of diffusers' public API
(they are module-level functions or classes no `__all__` exports). They can move or change signature in any
release, so they are imported here only, lazily (importing diffusers' H3 modules pulls in transformers'
Qwen3-VL code), and `tests/test_diffusers_adapter.py` checks each one's name and parameters against what
this module passes, failing with the helper's name when diffusers changes it. The supported diffusers range is
pinned in requirements.txt and pyproject.toml.

Public diffusers API (`diffusers.MiniMaxH3Transformer3DModel`, `diffusers.modular_pipelines.MiniMaxH3Blocks`, the
exported reference dataclasses, ...) is imported where it is used.
"""

from __future__ import annotations

#: helper name -> (module, attribute, the parameters the pack passes, in order). Read by the adapter test.
PRIVATE_HELPERS = {
    "resolve_canvas_size": (
        "diffusers.modular_pipelines.minimax_h3.modular_pipeline", "resolve_canvas_size",
        ("aspect_width", "aspect_height", "canvas_multiple", "short_edge", "max_pixels"),
    ),
    "encode_vae_condition": (
        "diffusers.modular_pipelines.minimax_h3.encoders", "encode_vae_condition",
        ("vae", "pixels", "pixel_mean", "pixel_std", "encode_seed"),
    ),
    "rotary_pos_embed": (
        "diffusers.models.transformers.transformer_minimax_h3", "MiniMaxH3RotaryPosEmbed",
        ("rope_freq_dim", "rope_theta"),
    ),
    # The video VAE's tile layout and cross-fade, called per tile by h3_core/vae_stream.py (methods: the first
    # parameter is the VAE itself).
    "vae_split_tiles": (
        "diffusers.models.autoencoders.autoencoder_kl_minimax_h3", "AutoencoderKLMiniMaxH3._split_tiles",
        ("self", "length", "tile_size", "min_overlap"),
    ),
    "vae_blend": (
        "diffusers.models.autoencoders.autoencoder_kl_minimax_h3", "AutoencoderKLMiniMaxH3._blend",
        ("self", "a", "b", "blend_extent", "dim"),
    ),
    # One temporal clip through the (spatially tiled) encoder, called per clip by h3_core/vae_encode.py.
    "vae_encode_clip": (
        "diffusers.models.autoencoders.autoencoder_kl_minimax_h3", "AutoencoderKLMiniMaxH3._encode_clip",
        ("self", "x"),
    ),
    "parameter_dtype": (
        "diffusers.models.modeling_utils", "get_parameter_dtype",
        ("parameter",),
    ),
    # The DiT's AdaLN modules, subclassed by the pruned "AdaLN curve" DiT (h3_core/weights/curve_model.py),
    # which keeps their parameters and drops the SiLU (ARCHITECTURE.md §6).
    "adaln_modulation": (
        "diffusers.models.transformers.transformer_minimax_h3", "MiniMaxH3AdaLayerNormModulation",
        ("time_embed_dim", "hidden_size"),
    ),
    "adaln_out": (
        "diffusers.models.transformers.transformer_minimax_h3", "MiniMaxH3AdaLayerNormOut",
        ("hidden_size", "time_embed_dim", "eps"),
    ),
    # `ulysses_anything`'s gather of unequal sequence shards, wrapped for gloo groups (h3_core/sequence_parallel.py).
    "cp_all_gather_anything": (
        "diffusers.hooks.context_parallel", "_all_gather_anything", ("tensor", "dim", "group"),
    ),
}


def _helper(name: str):
    import importlib

    module, attribute, _ = PRIVATE_HELPERS[name]
    found = importlib.import_module(module)
    for part in attribute.split("."):  # "Class.method" for a method
        found = getattr(found, part)
    return found


def resolve_canvas_size(aspect_width: float, aspect_height: float, canvas_multiple: int, short_edge: int,
                        max_pixels: int) -> tuple[int, int]:
    """(height, width) H3 generates at for an aspect ratio: short edge, area cap, rounded to the canvas multiple."""
    return _helper("resolve_canvas_size")(aspect_width, aspect_height, canvas_multiple, short_edge, max_pixels)


def encode_vae_condition(vae, pixels, pixel_mean, pixel_std, encode_seed: int):
    """Normalised video-VAE latents of one condition: posterior sampled under `encode_seed`, fp16 round trip."""
    return _helper("encode_vae_condition")(vae, pixels, pixel_mean, pixel_std, encode_seed=encode_seed)


def rope_inv_freq(rope_freq_dim: int, rope_theta: float):
    """The DiT's rotary `inv_freq` table exactly as diffusers computes it (bit-identical)."""
    return _helper("rotary_pos_embed")(rope_freq_dim, rope_theta).inv_freq


def vae_split_tiles(vae, length: int, tile_size: int, min_overlap: int) -> tuple[list[int], list[int], list[int]]:
    """(starts, lengths, overlaps) of the video VAE's spatial tiles along one axis, exactly as its decode lays them."""
    return _helper("vae_split_tiles")(vae, length, tile_size, min_overlap)


def vae_blend(vae, a, b, blend_extent: int, dim: int):
    """The video VAE's linear cross-fade of `a`'s last and `b`'s first `blend_extent` slices along `dim` (its own
    arithmetic, so a streamed decode stays bit-identical to diffusers')."""
    return _helper("vae_blend")(vae, a, b, blend_extent, dim)


def vae_encode_clip(vae, x):
    """The video VAE's moments of one temporal clip `[1, 3, clip_length, H, W]` (its own spatial tiling)."""
    return _helper("vae_encode_clip")(vae, x)


def parameter_dtype(module):
    """The dtype diffusers casts a module's input to (layerwise casting aware), as `vae.decode` does."""
    return _helper("parameter_dtype")(module)


def run_offload_hook(module) -> None:
    """Bring an offloaded `module` onto its execution device before calling one of its parts directly.

    accelerate's offload hooks (diffusers' model CPU offload) live in `module._hf_hook`; diffusers'
    `apply_forward_hook` runs their `pre_forward` before `vae.encode` / `vae.decode`, and a hook wraps only the
    top-level `forward`. The pack calls a VAE's clips and the text encoder's inner `model` directly, so it runs the
    hook itself, here: a private attribute of accelerate's convention, read in this one place."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(module)


def adaln_modulation_class():
    """diffusers' per-block AdaLN modulation module (a class to subclass)."""
    return _helper("adaln_modulation")


def adaln_out_class():
    """diffusers' final AdaLN norm-and-modulation module (a class to subclass)."""
    return _helper("adaln_out")


# --- context parallelism on the CPU (h3_core/sequence_parallel.py) -------------------------------------------------
#
# diffusers' context-parallel code is written for accelerators. Two spots fail on a CPU-only process group (gloo),
# which the tests use to run the very code path NCCL takes on CUDA:
#   (a) `ModelMixin._resolve_parallel_config` picks the rank's device as `rank % torch.accelerator.device_count()`,
#       which divides by zero where torch sees no accelerator;
#   (b) `ulysses_anything`'s gather of unequal shards (`hooks.context_parallel._all_gather_anything`) calls
#       `dist.all_gather` with tensors of different lengths, which NCCL accepts and gloo refuses.
# Both shims act only where the failing case arises; on CUDA with NCCL diffusers' own code runs untouched.

def cpu_accelerator_count():
    """A context in which `torch.accelerator.device_count()` says 1 when torch sees no accelerator (shim (a)): the
    device diffusers derives from it is then `cpu:0`, i.e. the CPU, which is where a gloo rank computes."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def patched():
        if torch.accelerator.device_count() > 0:
            yield
            return
        original = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: 1
        try:
            yield
        finally:
            torch.accelerator.device_count = original

    return patched()


def install_uneven_gather_for_gloo() -> None:
    """Route diffusers' gather of unequal sequence shards through a padded gather on gloo groups (shim (b)).

    Each rank pads its shard to the longest one, gathers equal-size tensors (what gloo can), and keeps each rank's
    real rows: the gathered values are the same rows diffusers' own gather gives. Idempotent; NCCL groups keep
    diffusers' function."""
    import importlib

    import torch
    import torch.distributed as dist

    module_name, attribute, _ = PRIVATE_HELPERS["cp_all_gather_anything"]
    module = importlib.import_module(module_name)
    original = getattr(module, attribute)
    if getattr(original, "_h3_gloo_shim", False):
        return

    def all_gather_anything(tensor, dim, group):
        backend = str(dist.get_backend(group))
        if "gloo" not in backend or ("nccl" in backend and tensor.is_cuda):
            return original(tensor, dim, group)
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        length = torch.tensor([tensor.shape[dim]], dtype=torch.int64)
        lengths = [torch.empty_like(length) for _ in range(world)]
        dist.all_gather(lengths, length, group=group)
        lengths = [int(n) for n in lengths]
        pad_shape = list(tensor.shape)
        pad_shape[dim] = max(lengths) - tensor.shape[dim]
        padded = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(gathered, lengths)], dim=dim)

    all_gather_anything._h3_gloo_shim = True
    setattr(module, attribute, all_gather_anything)


# --- step caching (h3_core/step_cache.py) ----------------------------------------------------------------------------
# diffusers' block cache hooks (FirstBlockCache, MagCache, ...) and the pack's `every:K` hook read a block's
# hidden-states argument and output through `TransformerBlockRegistry`, which does not list H3's block; the
# per-run hook state lives in a `StateManager`, switched by the model's `cache_context`.
PRIVATE_HELPERS.update({
    "transformer_block_registry": (
        "diffusers.hooks._helpers", "TransformerBlockRegistry.register", ("model_class", "metadata"),
    ),
    "transformer_block_metadata": (
        "diffusers.hooks._helpers", "TransformerBlockMetadata",
        ("return_hidden_states_index", "return_encoder_hidden_states_index", "hidden_states_argument_name"),
    ),
    "hook_state_manager": ("diffusers.hooks.hooks", "StateManager", ("state_cls", "init_args", "init_kwargs")),
    "hook_base_state": ("diffusers.hooks.hooks", "BaseState", ()),
    # Group offloading's per-group hook: its `next_group` is the prefetch link a cached step must not follow.
    "group_offloading_hook": ("diffusers.hooks.group_offloading", "GroupOffloadingHook", ("group",)),
})


def register_h3_block() -> object:
    """List H3's transformer block in diffusers' `TransformerBlockRegistry` (idempotent) and return its metadata:
    the block takes `hidden_states` first and returns the new hidden states alone (one packed sequence, no
    separate encoder stream)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    metadata = _helper("transformer_block_metadata")(return_hidden_states_index=None,
                                                     return_encoder_hidden_states_index=None,
                                                     hidden_states_argument_name="hidden_states")
    _helper("transformer_block_registry")(model_class=MiniMaxH3TransformerBlock, metadata=metadata)
    return metadata


def hook_state_classes() -> tuple[type, type]:
    """(BaseState, StateManager): diffusers' per-context state of a stateful hook."""
    return _helper("hook_base_state"), _helper("hook_state_manager")


def group_offloading_hook_class() -> type:
    return _helper("group_offloading_hook")


# --- private attributes of diffusers objects (hooks, group offloading, context parallelism) -------------------------
# Step caching walks diffusers' hook chains and group-offloading prefetch links, and the sequence-parallel DiT reads
# the parallel config enable_parallelism set. They are attributes, not importable helpers: they are read here only,
# and tests/test_diffusers_adapter.py pins each on a real diffusers object (and that no other module names one).
PRIVATE_HELPERS.update({
    # A context-parallel split hook on the first block: step caching runs its pre_forward to see this rank's rows.
    "context_parallel_split_hook": (
        "diffusers.hooks.context_parallel", "ContextParallelSplitHook.pre_forward", ("self", "module"),
    ),
})
#: attribute -> what carries it, in diffusers.
PRIVATE_ATTRIBUTES = {
    "_diffusers_hook": "an nn.Module once a hook is registered on it: its HookRegistry (diffusers.hooks.hooks)",
    "next_group": "GroupOffloadingHook: the ModuleGroup it prefetches after its own",
    "onload_leader": "ModuleGroup: the module whose forward onloads the group",
    "onload_self": "ModuleGroup: whether the group onloads itself (False while a neighbour prefetches it)",
    "_parallel_config": "ModelMixin: the ParallelConfig enable_parallelism set",
    "_cp_plan": "a ModelMixin class: its context-parallel plan",
}


def hooks_of(module) -> list:
    """The diffusers hooks registered on `module`, outermost last (registration order); [] when none."""
    registry = getattr(module, "_diffusers_hook", None)
    return [] if registry is None else list(registry.hooks.values())


def context_parallel_split_hooks(block) -> list:
    """The context-parallel input-split hooks on `block` (enable_parallelism's plan), outermost first."""
    try:
        split_cls = _context_parallel_split_class()
    except (ImportError, AttributeError):  # a diffusers without context parallelism has none
        return []
    return [hook for hook in reversed(hooks_of(block)) if isinstance(hook, split_cls)]


def _context_parallel_split_class() -> type:
    import importlib

    module, attribute, _ = PRIVATE_HELPERS["context_parallel_split_hook"]
    return getattr(importlib.import_module(module), attribute.split(".")[0])


def prefetched_group(hook):
    """The group a group-offloading hook prefetches next (None: none, or not such a hook)."""
    return getattr(hook, "next_group", None) if isinstance(hook, group_offloading_hook_class()) else None


def group_leader(group):
    """The module whose forward onloads `group`."""
    return group.onload_leader


def set_prefetch(hook, group, linked: bool) -> None:
    """Cut (`linked=False`: the group onloads itself when its turn comes) or restore the prefetch link from `hook`'s
    group to `group`."""
    hook.next_group, group.onload_self = (group, False) if linked else (None, True)


def parallel_config(model):
    """The ParallelConfig `enable_parallelism` set on `model`, or None."""
    return getattr(model, "_parallel_config", None)


def has_context_parallel_plan(model) -> bool:
    return getattr(type(model), "_cp_plan", None) is not None


# A module the context-parallel plan splits (its input, or its output) or gathers runs inside diffusers' hooks: a
# torch forward hook on it sees the call's whole input but the rank's shard of the output (or the reverse, after a
# gather). A branch computed beside such a module (a LoRA's B(Ax)) goes through the same hooks to match its output.
PRIVATE_HELPERS.update({
    "context_parallel_gather_hook": (
        "diffusers.hooks.context_parallel", "ContextParallelGatherHook.post_forward", ("self", "module", "output"),
    ),
})


def context_parallel_hooks(module) -> list:
    """The context-parallel split and gather hooks on `module`, outermost first ([] when it has none)."""
    hooks = hooks_of(module)
    if not hooks:
        return []
    try:
        import importlib

        found = importlib.import_module(PRIVATE_HELPERS["context_parallel_gather_hook"][0])
        classes = (found.ContextParallelSplitHook, found.ContextParallelGatherHook)
    except (ImportError, AttributeError):
        return []
    return [hook for hook in reversed(hooks) if isinstance(hook, classes)]


def as_the_layer_sees(hooks: list, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The input `module`'s own forward gets, from the input its call got (its hooks' pre_forward, outermost first)."""
    for hook in hooks:
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
    return args, kwargs


def as_the_layer_returns(hooks: list, module, output):
    """What `module`'s call returns for its own forward's `output` (its hooks' post_forward, innermost first)."""
    for hook in reversed(hooks):
        output = hook.post_forward(module, output)
    return output
