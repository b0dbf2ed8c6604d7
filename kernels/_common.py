"""Shared helpers of the Triton kernels: when to launch Triton, and small index math."""
from __future__ import annotations

import os

import torch


def interpret_mode() -> bool:
    """True when Triton runs its kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Launch the Triton kernel when the tensors are on a GPU, or on the CPU under the interpreter.

    Otherwise (CPU without the interpreter) each op runs its plain-PyTorch reference, so the
    same layer trains on a laptop and on a GPU.
    """
    if all(t.is_cuda for t in tensors):
        return True
    return interpret_mode() and all(t.device.type == "cpu" for t in tensors)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
