"""Test set-up: Triton kernels run under the interpreter when there is no GPU.

The folders mirror the package's tiers: kernels/, layer/, megatron/, training/, tools/ (plus
test_imports.py, which checks that imports only point down the tiers).

TRITON_INTERPRET must be set before any kernel module is imported, hence here.
Markers: ``gpu`` (needs CUDA, skipped in CPU CI), ``slow`` (long CPU tests).
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/_util.py for every tier's tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sysconfig  # noqa: E402

import pytest  # noqa: E402


def write_small_corpus(folder: Path, total_chars: int, max_file_chars: int) -> Path:
    """Copy mid-sized Python stdlib sources (sorted, deterministic) into ``folder`` until about
    ``total_chars`` characters: a corpus every machine has, small enough for CPU training tests."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="ignore")
        if 2_000 < len(text) < max_file_chars:
            (folder / f.name).write_text(text)
            total += len(text)
        if total > total_chars:
            break
    return folder


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def small_corpus():
    """``small_corpus(folder, total_chars, max_file_chars)``: see write_small_corpus."""
    return write_small_corpus


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
