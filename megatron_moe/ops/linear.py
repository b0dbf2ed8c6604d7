"""A linear layer with a bias, ``F.linear(x, weight, bias)``, whose backward sums the bias
gradient with kernels/column_sum.py instead of PyTorch's outer-dimension reduction:

    y = linear(x, weight_NK, bias_N)      # [..., K] -> [..., N]

Forward: ``F.linear`` (the bias in cuBLAS's epilogue). Backward: the same two GEMMs PyTorch's
own backward runs (dx = dy · W, dW = dyᵀ · x), and db = Σ rows of dy in one read of dy at the
memory's pace. Used where the kernel gives torch's result: x, weight and bias of one dtype, no
autocast, on a GPU (or under the Triton interpreter), and
``MEGATRON_MOE_BIAS_GRAD`` not "0"; otherwise (and without a bias) plain ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.column_sum import column_sum_triton
from megatron_moe.kernels.switches import bias_grad_kernel


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_NK, bias_N):
        ctx.save_for_backward(x, weight_NK)
        return F.linear(x, weight_NK, bias_N)

    @staticmethod
    def backward(ctx, dy):
        x, weight_NK = ctx.saved_tensors
        dy_MN = dy.reshape(-1, dy.shape[-1])
        dx = dy @ weight_NK if ctx.needs_input_grad[0] else None
        dweight_NK = dy_MN.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        dbias_N = column_sum_triton(dy_MN, weight_NK.dtype) if ctx.needs_input_grad[2] else None
        return dx, dweight_NK, dbias_N


def _kernel_applies(x: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None) -> bool:
    if bias_N is None or not bias_grad_kernel() or not (x.dtype == weight_NK.dtype == bias_N.dtype):
        return False
    if torch.is_autocast_enabled(x.device.type):  # the GEMMs would run in another dtype than the tensors'
        return False
    return use_triton(x, weight_NK, bias_N)


def linear(x: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight_NK, bias_N)``; the bias gradient through kernels/column_sum.py where
    it applies (module docstring)."""
    if _kernel_applies(x, weight_NK, bias_N):
        return _Linear.apply(x, weight_NK, bias_N)
    return F.linear(x, weight_NK, bias_N)
