"""The diffusers private helpers the pack reuses still exist with the parameters it passes.

If a diffusers release renames, moves or re-signs one of them, this fails naming the helper (and the module to
look in), instead of an obscure error deep inside an encode or a weight load.
"""

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from h3_core import diffusers_adapter

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(diffusers_adapter.PRIVATE_HELPERS))
def test_private_helper_is_where_and_how_we_call_it(name):
    module_name, attribute, params = diffusers_adapter.PRIVATE_HELPERS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        pytest.fail(f"diffusers helper {name!r}: module {module_name} no longer imports ({error})")
    helper = module
    for part in attribute.split("."):  # "Class.method" names a method
        helper = getattr(helper, part, None)
    assert helper is not None, f"diffusers helper {name!r}: {module_name}.{attribute} is gone"
    signature = inspect.signature(helper)
    got = tuple(signature.parameters)[: len(params)]
    assert got == params, f"diffusers helper {name!r} ({module_name}.{attribute}) now takes {got}, we pass {params}"


def test_helpers_compute_what_the_pack_relies_on():
    assert diffusers_adapter.resolve_canvas_size(16, 9, 32, 768, 768 * 1344) == (768, 1344)
    inv = diffusers_adapter.rope_inv_freq(4, 10000.0)
    assert inv.ndim == 1 and inv.numel() > 0


def test_no_private_diffusers_import_outside_the_adapter():
    """Only `diffusers_adapter.py` may import from diffusers' internal modules."""
    private = set()
    for module_name, _, _ in diffusers_adapter.PRIVATE_HELPERS.values():
        private.add(module_name)
    offenders = []
    for path in sorted((ROOT / "h3_core").rglob("*.py")) + sorted((ROOT / "nodes").rglob("*.py")):
        if path.name == "diffusers_adapter.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in private:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports from {node.module}")
    assert not offenders, offenders


def test_private_attributes_are_where_the_adapter_reads_them():
    """The diffusers attributes step caching and the sequence-parallel DiT read (diffusers_adapter.PRIVATE_ATTRIBUTES)
    exist on the objects that carry them: a failure names the attribute diffusers moved."""
    from diffusers import MiniMaxH3Transformer3DModel, ModelMixin
    from diffusers.hooks import HookRegistry, ModelHook
    from diffusers.hooks import group_offloading as offloading

    assert set(diffusers_adapter.PRIVATE_ATTRIBUTES) == {
        "_diffusers_hook", "next_group", "onload_leader", "onload_self", "_parallel_config", "_cp_plan"}
    linear = torch.nn.Linear(2, 2)
    HookRegistry.check_if_exists_or_initialize(linear).register_hook(ModelHook(), "probe")
    assert [type(hook) for hook in diffusers_adapter.hooks_of(linear)] == [ModelHook], "_diffusers_hook moved"
    assert diffusers_adapter.hooks_of(torch.nn.Linear(2, 2)) == []
    group = offloading.ModuleGroup([linear], torch.device("cpu"), torch.device("cpu"), offload_leader=linear,
                                   onload_leader=linear)
    assert diffusers_adapter.group_leader(group) is linear and group.onload_self is True, "ModuleGroup changed"
    hook = object.__new__(offloading.GroupOffloadingHook)  # its __init__ sets next_group = None (pinned below)
    hook.next_group = None
    assert diffusers_adapter.prefetched_group(hook) is None
    diffusers_adapter.set_prefetch(hook, group, linked=True)
    assert diffusers_adapter.prefetched_group(hook) is group and group.onload_self is False
    diffusers_adapter.set_prefetch(hook, group, linked=False)
    assert diffusers_adapter.prefetched_group(hook) is None and group.onload_self is True
    assert "self.next_group" in inspect.getsource(offloading.GroupOffloadingHook)
    assert "_parallel_config" in inspect.getsource(ModelMixin.enable_parallelism), "ModelMixin._parallel_config moved"
    assert diffusers_adapter.has_context_parallel_plan(object.__new__(MiniMaxH3Transformer3DModel)), "_cp_plan moved"
    assert diffusers_adapter.context_parallel_split_hooks(linear) == []


def test_no_private_attribute_is_read_outside_the_adapter():
    """`x._diffusers_hook`, `getattr(x, "_cp_plan")`, ...: only diffusers_adapter.py names diffusers' private
    attributes (test_private_attributes_are_where_the_adapter_reads_them pins them)."""
    names = set(diffusers_adapter.PRIVATE_ATTRIBUTES)
    offenders = []
    for path in sorted((ROOT / "h3_core").rglob("*.py")) + sorted((ROOT / "nodes").rglob("*.py")):
        if path.name == "diffusers_adapter.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = node.attr if isinstance(node, ast.Attribute) else (
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if named in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} names {named}")
    assert not offenders, offenders
