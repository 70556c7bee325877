"""Headless low-VRAM: keep the DiT / text encoder resident, or stream their blocks from host RAM.

Streaming is diffusers' group offloading (`diffusers.hooks.apply_group_offloading`, block level, one
block per group): every `ModuleList` child of the streamed module becomes a chain of groups whose
weights are copied to the device just before the block runs and dropped after it; on CUDA the copy of
block i+1 runs on a side stream while block i computes (prefetch, `record_stream`). The modules outside
the lists (embedders, refiner, output heads, norms) are one more group, on the device for the whole
forward. Quantised layers stream at their stored size: the hooks move parameters and buffers as they
are, whatever their dtype. On a CPU device the same hooks run with nothing to move, which is how the
tests prove streaming leaves results bit-identical.

Why diffusers' and not our own: it already handles the order of first use (lazy prefetch), buffers,
pinned host copies and the pipeline's execution device (`_execution_device` asks the hooks). Two H3
details are handled here: the text encoder is streamed below `text_encoder.model` (diffusers calls that
submodule directly), and Qwen3-VL gathers its input embeddings before the language model's own hook
runs, so the embedding table gathers on whatever device it is on and hands the rows to the caller's.

Host RAM: with `pin=True` every streamed tensor gets a pinned host copy up front (fast transfers; the
memory-mapped file pages become a reclaimable cache); with `pin=False` tensors stay where the loader put
them (memory-mapped file pages, no second copy) and are pinned per transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import devices, progress
from .planning import planner

# What streaming applies to, per component: the module to hook, and its children to recurse into.
STREAMABLE = ("transformer", "transformer_ref", "text_encoder")

# Allocator slack, CUDA context and kernels' workspaces on top of weights and activations.
DEVICE_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class Streaming:
    """What `place` did: the mode used and the bytes each forward moves / keeps on the device."""

    mode: str  # "none" (resident) or "block"
    groups: int = 0
    moved_per_forward: int = 0  # bytes copied host -> device per forward (every streamed tensor once)
    resident: int = 0  # bytes on the device for the whole forward (the unstreamed rest)


def module_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def to_device(module: torch.nn.Module, device) -> None:
    """`module.to(device)`, one submodule at a time so the copy reports as the `load` progress phase
    (the bytes read from the memory-mapped file are really read here, on their way to the device)."""
    device = torch.device(device)
    if device.type == "cpu" or not progress.active():
        module.to(device)
        return
    counter = progress.Counter("load", module_bytes(module))
    for sub in module.modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        moved = sum(t.numel() * t.element_size() for t in own if t.device != device)
        sub._apply(lambda t: t.to(device), recurse=False)
        counter.advance(moved)
    counter.finish()


def _hook_target(module: torch.nn.Module, component: str) -> tuple[torch.nn.Module, list[str] | None]:
    if component == "text_encoder":
        inner = getattr(module, "model", None)
        if inner is None or not hasattr(inner, "language_model"):
            raise TypeError(f"cannot stream {type(module).__name__}: expected a Qwen3-VL with .model.language_model")
        return inner, ["language_model", "visual"]
    return module, None


def _block_lists(target: torch.nn.Module, recurse: list[str] | None):
    """The ModuleLists diffusers will turn into streamed groups, and the modules outside them."""
    lists, rest = [], []
    for name, child in target.named_children():
        if recurse and name in recurse:
            inner_lists, inner_rest = _block_lists(child, recurse)
            lists += inner_lists
            rest += inner_rest
        elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            lists.append(child)
        else:
            rest.append(child)
    return lists, rest


def _gather_where_stored(embedding: torch.nn.Module) -> None:
    """Let an embedding table that is not on the device yet serve ids from the device: look rows up
    where the table is, return them where the ids came from (exact: a gather is a copy)."""

    def before(module, args):
        ids = args[0]
        module._h3_caller_device = ids.device
        return (ids.to(module.weight.device), *args[1:])

    def after(module, args, output):
        return output.to(module.__dict__.pop("_h3_caller_device", output.device))

    embedding.register_forward_pre_hook(before)
    embedding.register_forward_hook(after)


def stream_blocks(module: torch.nn.Module, component: str, device, *, pin: bool | None = None) -> Streaming:
    """Apply block-level group offloading to `module` (which must be on the CPU) for `device`."""
    from diffusers.hooks import apply_group_offloading

    if component not in STREAMABLE:
        raise ValueError(f"only {', '.join(STREAMABLE)} stream their blocks, not {component!r}")
    device = torch.device(device)
    target, recurse = _hook_target(module, component)
    lists, rest = _block_lists(target, recurse)
    blocks = [block for block_list in lists for block in block_list]
    sizes = [module_bytes(block) for block in blocks]
    total = module_bytes(target)
    cuda = device.type == "cuda"
    if pin is None:
        # Pre-pin only with room for a second copy and then some: the pinned copies are made while the
        # originals still exist, and the pinned allocator rounds each block up to a power of two.
        pin = cuda and devices.host_memory()[0] > 3 * total
    apply_group_offloading(
        target,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=cuda,
        record_stream=cuda,
        low_cpu_mem_usage=not pin,
        block_modules=recurse,
    )
    if component == "text_encoder":
        _gather_where_stored(target.language_model.get_input_embeddings())
    return Streaming(
        mode="block",
        groups=len(blocks),
        moved_per_forward=total,
        resident=total - sum(sizes),
    )


def choose(weight_bytes: int, activation_bytes: int, device, *, free_bytes: int | None = None) -> str:
    """'none' when weights + activations + reserve fit in the device's free memory, else 'block'."""
    device = torch.device(device)
    if device.type == "cpu":
        return "none"
    if free_bytes is None:
        free_bytes = devices.device_memory(device)[0]
    return "none" if weight_bytes + activation_bytes + DEVICE_RESERVE_BYTES <= free_bytes else "block"


def place(module: torch.nn.Module, component: str, device, offload: str = "none", *,
          activation_bytes: int = 0, free_bytes: int | None = None, pin: bool | None = None) -> Streaming:
    """Put `module` on `device`: resident (`offload='none'`), streamed ('block') or as `choose` says
    ('auto', from the planner's activation estimate). Components that never stream go resident."""
    device = torch.device(device)
    if offload not in devices.OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {', '.join(devices.OFFLOAD_MODES)}, got {offload!r}")
    if component not in STREAMABLE:
        offload = "none"
    elif offload == "auto":
        offload = choose(module_bytes(module), activation_bytes, device, free_bytes=free_bytes)
    if offload == "none":
        to_device(module, device)
        return Streaming(mode="none", resident=module_bytes(module))
    return stream_blocks(module, component, device, pin=pin)


def activation_estimate(component: str, module: torch.nn.Module, dtype, *, width: int, height: int, frames: int,
                        text_tokens: int = planner.DEFAULT_TEXT_TOKENS, ranks: int = 1) -> int:
    """The planner's activation bytes for `module`'s own widths (release or tiny), per rank of a DiT that runs
    sequence-parallel over `ranks` (each holds 1/N of the packed sequence: `planner.ComponentPlan.per_rank`)."""
    if ranks > 1 and component not in planner.DIT_COMPONENTS:
        raise ValueError(f"only the DiT runs sequence-parallel, not the {component}")
    config = getattr(module, "config", None)
    if component == "text_encoder" and config is not None:
        config = config.to_dict()
    full = planner.activation_bytes(width=width, height=height, frames=frames, text_tokens=text_tokens,
                                    dtype=dtype, component=component, config=dict(config) if config else None)
    return -(-full // ranks)
