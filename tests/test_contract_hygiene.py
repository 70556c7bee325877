"""The contract is a package of small modules and never unpickles (import rules: tests/test_layout.py)."""

import pathlib
import pickle

import torch
from support.contract_cases import make

from h3_core.contract import H3Conditioning

ROOT = pathlib.Path(__file__).resolve().parents[1] / "h3_core"


def test_contract_package_is_the_expected_modules():
    """A package of small modules, one concern each, not one file."""
    assert {p.name for p in (ROOT / "contract").glob("*.py")} >= {
        "__init__.py", "conditioning.py", "layout.py", "wire.py", "comfy.py", "vllm.py"}


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
