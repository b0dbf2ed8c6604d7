"""The router's logits as one autograd op: fp32-accurate x_TH @ w_EHᵀ for bf16 x at bf16 GEMM speed.

    logits_TE = router_logits(x_TH, w_EH)        # bf16 x, fp32 or bf16 w -> fp32 [T, E]

The fp32 operands (an fp32 weight; dL/dlogits in the backward) are split into bf16 parts whose
products are exact on the tensor cores, accumulated in fp32 (kernels/router_gemm.py has the sums).
On a GPU (or under the Triton interpreter) the split happens in the kernels' registers: one launch
forward, one or two backward; elsewhere, and with MEGATRON_MOE_ROUTER_GEMM=0 (A/B runs), the
plain-PyTorch references. Other dtypes: a plain fp32 GEMM (autograd's).

Legend: T tokens, H hidden, E experts.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.switches import router_gemm
from megatron_moe.kernels.router_gemm import (logits_backward_reference, logits_backward_triton, logits_reference,
                                              logits_triton)


class ExpertDx:
    """The experts' dL/dx of the router's own input, handed from the experts' backward to the router
    logits' backward, which adds its part into it in the same kernel (one read and one write of
    [T, H] instead of autograd's add: two reads and a write). The layer (megatron_moe/layer.py)
    makes one only where the router's backward must run after the experts': their op also returns
    the gradient of the router's combine weights, from which the logits' gradient comes. The
    experts' op then returns no gradient for x and the router's returns the sum."""

    __slots__ = ("dx",)

    def __init__(self):
        self.dx = None

    def put(self, dx: torch.Tensor) -> None:
        self.dx = dx

    def take(self) -> torch.Tensor | None:
        dx, self.dx = self.dx, None
        return dx


class _RouterLogits(torch.autograd.Function):
    """logits = x_TH @ w_EHᵀ in fp32; dx in x's dtype (plus the experts' dx, ``expert_dx``), dw in
    w's (rounded once)."""

    @staticmethod
    def forward(ctx, x_TH, w_EH, expert_dx):
        kernels = router_gemm() and use_triton(x_TH, w_EH)
        ctx.save_for_backward(x_TH, w_EH)
        ctx.kernels, ctx.expert_dx = kernels, expert_dx
        return logits_triton(x_TH, w_EH) if kernels else logits_reference(x_TH, w_EH)

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        add = ctx.expert_dx.take() if ctx.expert_dx is not None else None
        if not ctx.kernels:
            dx, dw = logits_backward_reference(g_TE, x_TH, w_EH, need_dx, need_dw)
            return (dx if add is None else add + dx), dw, None
        if add is not None and not add.is_contiguous():
            add = add.contiguous()
        dx, dw = logits_backward_triton(g_TE, x_TH, w_EH, need_dx, need_dw, dx_add_TH=add)
        return dx, dw, None


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor, expert_dx: ExpertDx | None = None) -> torch.Tensor:
    """fp32 logits x_TH @ w_EH.T: on the tensor cores for bf16 x (fp32 or bf16 w), else in fp32.
    ``expert_dx``: the holder through which the experts' backward hands over their dL/dx of the
    same x_TH (:class:`ExpertDx`); bf16 x only."""
    if x_TH.dtype == torch.bfloat16 and w_EH.dtype in (torch.float32, torch.bfloat16):
        return _RouterLogits.apply(x_TH, w_EH, expert_dx)
    if expert_dx is not None:
        raise ValueError(f"router_logits: expert_dx needs bf16 x, got {x_TH.dtype}")
    return x_TH.float() @ w_EH.float().t()
