"""The diffusers private helpers the pack reuses still exist with the parameters it passes.

If a diffusers release renames, moves or re-signs one of them, this fails naming the helper (and the module to
look in), instead of an obscure error deep inside an encode or a weight load.
"""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

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
