"""The router's logits as one autograd op: fp32-accurate x_TH @ w_EHᵀ for bf16 x at bf16 GEMM speed.

    logits_TE = router_logits(x_TH, w_EH)        # bf16 x, fp32 or bf16 w -> fp32 [T, E]

The fp32 operands (an fp32 weight; dL/dlogits in the backward) are split into bf16 parts whose
products are exact on the tensor cores, accumulated in fp32 (kernels/router_gemm.py has the sums).
On a GPU (or under the Triton interpreter) the split happens in the kernels' registers: one launch
forward, two or three backward; elsewhere, and with MEGATRON_MOE_ROUTER_GEMM=0 (A/B runs), the
plain-PyTorch references. Other dtypes: a plain fp32 GEMM (autograd's).

Legend: T tokens, H hidden, E experts.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.switches import router_gemm
from megatron_moe.kernels.router_gemm import (logits_backward_reference, logits_dw_triton, logits_dx_triton,
                                              logits_reference, logits_triton)


class _RouterLogits(torch.autograd.Function):
    """logits = x_TH @ w_EHᵀ in fp32; dx in x's dtype, dw in w's (rounded once)."""

    @staticmethod
    def forward(ctx, x_TH, w_EH):
        kernels = router_gemm() and use_triton(x_TH, w_EH)
        ctx.save_for_backward(x_TH, w_EH)
        ctx.kernels = kernels
        return logits_triton(x_TH, w_EH) if kernels else logits_reference(x_TH, w_EH)

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if not ctx.kernels:
            return logits_backward_reference(g_TE, x_TH, w_EH, need_dx, need_dw)
        dx = logits_dx_triton(g_TE, w_EH, x_TH.dtype) if need_dx else None
        dw = logits_dw_triton(g_TE, x_TH, w_EH.dtype) if need_dw else None
        return dx, dw


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """fp32 logits x_TH @ w_EH.T: on the tensor cores for bf16 x (fp32 or bf16 w), else in fp32."""
    if x_TH.dtype == torch.bfloat16 and w_EH.dtype in (torch.float32, torch.bfloat16):
        return _RouterLogits.apply(x_TH, w_EH)
    return x_TH.float() @ w_EH.float().t()
