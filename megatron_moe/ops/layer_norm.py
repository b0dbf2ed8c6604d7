"""LayerNorm as one autograd op over kernels/layer_norm.py: 1 launch forward, 1 backward (plus
the sum of the weight and bias gradients' partials).

    y = layer_norm(x, weight_N, bias_N, eps)

On a GPU (or under the Triton interpreter) the Triton kernels, where they give torch's result
(x, weight and bias of one dtype; no autocast over a 16-bit x); otherwise, or with
``MEGATRON_MOE_FUSED_NORM=0``, ``torch.nn.functional.layer_norm``. The forward saves x and the
fp32 mean and rstd per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.layer_norm import MAX_N, layer_norm_bwd_triton, layer_norm_fwd_triton
from megatron_moe.kernels.switches import fused_norm


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_N, bias_N, eps):
        y, mean_M, rstd_M = layer_norm_fwd_triton(x, weight_N, bias_N, eps)
        ctx.save_for_backward(x, weight_N, mean_M, rstd_M)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight_N, mean_M, rstd_M = ctx.saved_tensors
        dx, dweight_N, dbias_N = layer_norm_bwd_triton(dy, x, weight_N, mean_M, rstd_M)
        return dx, dweight_N, dbias_N, None


def _fused(x: torch.Tensor, weight_N: torch.Tensor, bias_N: torch.Tensor) -> bool:
    """The kernels give torch's result here: one dtype for all three (the output's), and no
    autocast that would run torch's LayerNorm in fp32 on a 16-bit x."""
    if not (fused_norm() and x.shape[-1] <= MAX_N and x.dtype == weight_N.dtype == bias_N.dtype):
        return False
    if x.dtype != torch.float32 and torch.is_autocast_enabled(x.device.type):
        return False
    return use_triton(x, weight_N, bias_N)


def layer_norm(x: torch.Tensor, weight_N: torch.Tensor, bias_N: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension (``weight_N`` and ``bias_N`` both given)."""
    if _fused(x, weight_N, bias_N):
        return _LayerNorm.apply(x, weight_N, bias_N, float(eps))
    return F.layer_norm(x, (x.shape[-1],), weight_N, bias_N, eps)
