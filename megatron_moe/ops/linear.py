"""A linear layer with a bias, ``F.linear(x, weight, bias)``, whose backward sums the bias
gradient with kernels/column_sum.py instead of PyTorch's outer-dimension reduction, and the
same followed by a GELU (a dense MLP's first layer), whose backward computes the GELU's gradient
and the bias gradient in one pass:

    y = linear(x, weight_NK, bias_N)            # [..., K] -> [..., N]
    a = linear_gelu(x, weight_NK, bias_N)       # gelu_tanh(linear(x, weight_NK, bias_N))

Forward: ``F.linear`` (the bias in cuBLAS's epilogue). Backward: the same two GEMMs PyTorch's
own backward runs (dx = dy · W, dW = dyᵀ · x), and db = Σ rows of dy in one read of dy at the
memory's pace. Used where the kernel gives torch's result: x, weight and bias of one dtype, no
autocast, on a GPU (or under the Triton interpreter), and
``MEGATRON_MOE_BIAS_GRAD`` not "0"; otherwise (and without a bias) plain ``F.linear``.
``linear_gelu`` also needs ``MEGATRON_MOE_FUSED_GELU`` not "0"; otherwise it is
``F.gelu(linear(...), approximate="tanh")``. Its backward: dh = da · gelu'(h) and db = Σ rows of
dh from one read of h and da (kernels/column_sum.py's ``dgelu_column_sum_triton``), then the two
GEMMs on dh.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.column_sum import column_sum_triton, dgelu_column_sum_triton
from megatron_moe.kernels.switches import bias_grad_kernel, fused_gelu


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


class _LinearGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_NK, bias_N):
        h = F.linear(x, weight_NK, bias_N)
        ctx.save_for_backward(x, weight_NK, h)
        return F.gelu(h, approximate="tanh")

    @staticmethod
    def backward(ctx, dact):
        x, weight_NK, h = ctx.saved_tensors
        N = h.shape[-1]
        dh_MN, dbias_N = dgelu_column_sum_triton(h.reshape(-1, N), dact.reshape(-1, N), weight_NK.dtype)
        dx = (dh_MN @ weight_NK).view(x.shape) if ctx.needs_input_grad[0] else None
        dweight_NK = dh_MN.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dweight_NK, dbias_N if ctx.needs_input_grad[2] else None


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


def linear_gelu(x: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight_NK, bias_N), approximate="tanh")``; the GELU's backward and the
    bias gradient in one pass where the kernels apply (module docstring)."""
    if fused_gelu() and _kernel_applies(x, weight_NK, bias_N):
        return _LinearGelu.apply(x, weight_NK, bias_N)
    return F.gelu(linear(x, weight_NK, bias_N), approximate="tanh")
