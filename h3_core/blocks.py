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
    if components:
        pipe.update_components(**components)
    pipe.register_to_config(**pipeline_config)
    return pipe


def run_blocks(pipe, **inputs):
    """Call a block pipeline with the inputs its blocks declare (one request dict serves every task)."""
    declared = {param.name for param in pipe.blocks.inputs if param.name}
    return pipe(**{name: value for name, value in inputs.items() if name in declared})


def workflow_blocks(task: str, prefixes: tuple[str, ...]) -> dict:
    """Leaf blocks of diffusers' *resolved* workflow for `task` (never the auto blocks: ARCHITECTURE.md §2.1 trap 1)."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    workflow = MiniMaxH3Blocks().get_workflow(task)
    return {name: block for name, block in workflow.sub_blocks.items() if name.split(".")[0] in prefixes}
