"""The contract package never unpickles and never imports ComfyUI, diffusers or vLLM."""

import ast
import pathlib
import pickle

import pytest
import torch
from contract_cases import make

from h3_core.contract import H3Conditioning

ROOT = pathlib.Path(__file__).resolve().parents[1] / "h3_core"
# The contract package and the two modules it builds on; each must stay free of pickle and of the frameworks
# it adapts to (ComfyUI, diffusers, vLLM), so it can run on either side of a process boundary.
_SOURCES = sorted((ROOT / "contract").glob("*.py")) + [ROOT / "facts.py", ROOT / "safetensors_header.py"]
_PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
_FRAMEWORKS = {"comfy", "comfy_api", "comfy_extras", "folder_paths", "nodes", "diffusers", "vllm", "vllm_omni"}


def _imported_roots(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", _SOURCES, ids=lambda p: p.name)
def test_module_never_imports_pickle_or_frameworks(path):
    tree = ast.parse(path.read_text())
    roots = _imported_roots(tree)
    assert not roots & _PICKLERS
    assert not roots & _FRAMEWORKS
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not {"torch.load", "torch.save", "pickle.load", "pickle.loads"} & calls


def test_contract_package_is_the_expected_modules():
    assert len(_SOURCES) >= 8  # a package of small modules, not one file
    assert {p.name for p in (ROOT / "contract").glob("*.py")} >= {
        "__init__.py", "conditioning.py", "layout.py", "wire.py", "comfy.py", "vllm.py"}


def test_facts_module_is_dependency_free():
    assert _imported_roots(ast.parse((ROOT / "facts.py").read_text())) <= {"__future__"}


def test_round_trips_never_unpickle(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    c = make("ref2va_video", prompt_dtype=torch.bfloat16)
    assert H3Conditioning.from_bytes(c.to_bytes()) == c
    c.save(tmp_path / "c.safetensors")
    assert H3Conditioning.load(tmp_path / "c.safetensors") == c
