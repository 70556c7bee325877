"""Shared fixtures: the embedded tiny H3 is built once per test session.

Set H3_TINY_DIR to reuse an existing build while iterating locally (CI always builds fresh).
"""

import os
from pathlib import Path

import pytest
import torch

from h3_core.testing import SERVER_THREADS

# Bitwise parity between stages assumes one thread count in every process (docs/ARCHITECTURE.md §2.1, trap 5).
torch.set_num_threads(int(os.environ.get("H3_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    reuse = os.environ.get("H3_TINY_DIR")
    if reuse and (Path(reuse) / "tiny.json").is_file():
        return Path(reuse)
    from h3_core import tiny

    return tiny.build(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's local encodes on SERVER_THREADS torch threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def parity_threads():
    """Pin a parity module to H3_THREADS torch threads, whatever an earlier module left (restored afterwards):
    its in-process results are compared bitwise with subprocesses that run at H3_THREADS."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("H3_THREADS", "2")))
    yield
    torch.set_num_threads(before)
