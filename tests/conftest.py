"""Test set-up: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported, hence here.
Markers: ``gpu`` (needs CUDA, skipped in CPU CI), ``slow`` (long CPU tests).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
