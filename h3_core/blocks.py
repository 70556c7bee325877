"""Plumbing over diffusers' modular MiniMax-H3 blocks, shared by both stages.

Both stages run diffusers' own leaf blocks of the task's *resolved* workflow
(`MiniMaxH3Blocks().get_workflow(task)`), never the auto blocks, which pick their branch from raw
inputs a split stage does not have (docs/ARCHITECTURE.md §2.1, trap 1). Components are the modules
our loaders built, handed over with `update_components`, so every weight layout takes one path.
"""

from __future__ import annotations


def pipeline_for(blocks: dict, components: dict, pipeline_config: dict):
    """A diffusers ModularPipeline over `blocks` holding our already-loaded components."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    pipe = SequentialPipelineBlocks.from_blocks_dict(blocks).init_pipeline()
    _allow_core_lengths(pipe)
    if components:
        pipe.update_components(**components)
    pipe.register_to_config(**pipeline_config)
    return pipe


_WIDENED: dict[type, type] = {}


def _allow_core_lengths(pipe) -> None:
    """Let diffusers' blocks run the lengths ComfyUI core allows (facts.MIN_FRAMES..MAX_FRAMES: 5 frames to ~150 s).

    diffusers' setup steps refuse a video outside its trained 5-15 s (`min_duration` / `max_duration`, read-only
    properties of the pipeline); the pack's rules allow what core does and warn outside the trained range instead
    (rules.trained_range_warning). Every other check of those steps stays diffusers' own. The pipeline's class is
    swapped for a subclass whose two properties are the pack's bounds (one subclass per class, cached)."""
    from . import facts

    cls = type(pipe)
    if not hasattr(cls, "min_duration"):
        return
    widened = _WIDENED.get(cls)
    if widened is None:
        widened = _WIDENED[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__,
            "min_duration": property(lambda self: facts.MIN_FRAMES / facts.FPS),
            "max_duration": property(lambda self: facts.MAX_FRAMES / facts.FPS),
        })
    pipe.__class__ = widened


def run_blocks(pipe, **inputs):
    """Call a block pipeline with the inputs its blocks declare (one request dict serves every task)."""
    declared = {param.name for param in pipe.blocks.inputs if param.name}
    return pipe(**{name: value for name, value in inputs.items() if name in declared})


def workflow_blocks(task: str, prefixes: tuple[str, ...]) -> dict:
    """Leaf blocks of diffusers' *resolved* workflow for `task` (never the auto blocks: ARCHITECTURE.md §2.1 trap 1)."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    workflow = MiniMaxH3Blocks().get_workflow(task)
    return {name: block for name, block in workflow.sub_blocks.items() if name.split(".")[0] in prefixes}
