"""Tokens <-> rows sorted by expert, with autograd: the expert-parallel dispatcher's two permutations.

    x_NH = permute_tokens(x_TH, routing)                # row s = x[token of assignment sort_order[s]]
    y_TH = unpermute_tokens(y_NH, weights_TK, routing)  # y[t] = Σ_k weights[t, k] · y_NH[row(t, k)]

One pass each, forward and backward (kernels/permute.py, layout='sorted'): the gradient of the
gather is the unweighted sum over k, the gradient of the weighted sum is the weighted gather of dy
plus the weights' gradient dy[t] · y_NH[row(t, k)]. Sums in fp32, one rounding. No host
synchronisation. Replaces the torch chain zeros / index_copy / fp32 multiply / sum / cast (five
passes over the rows, two of them in fp32), a large share of a fine-grained layer's step
(measured: see docs/performance.md).

Legend: T tokens, K top_k, N = T*K assignments (rows), H hidden.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels.metadata import Routing
from megatron_moe.kernels.permute import gather_rows, scatter_rows, scatter_rows_weight_grad


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, routing):
        ctx.routing = routing
        return gather_rows(x_TH, routing, layout="sorted")

    @staticmethod
    def backward(ctx, dx_NH):
        return scatter_rows(dx_NH.contiguous(), None, ctx.routing, layout="sorted"), None


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, weights_TK, routing):
        ctx.save_for_backward(y_NH, weights_TK)
        ctx.routing = routing
        return scatter_rows(y_NH, weights_TK, routing, layout="sorted")

    @staticmethod
    def backward(ctx, dy_TH):
        y_NH, weights_TK = ctx.saved_tensors
        routing = ctx.routing
        dy_TH = dy_TH.to(y_NH.dtype).contiguous()
        dy_NH = dweights = None
        if ctx.needs_input_grad[0]:
            dy_NH = gather_rows(dy_TH, routing, weights_TK, layout="sorted")
        if ctx.needs_input_grad[1]:
            dweights = scatter_rows_weight_grad(dy_TH, y_NH, routing, layout="sorted").to(weights_TK.dtype)
        return dy_NH, dweights, None


def permute_tokens(x_TH: torch.Tensor, routing: Routing) -> torch.Tensor:
    """[T, H] -> [N, H]: the token of each assignment, in the order of ``routing.sort_order_N``
    (by expert, stable)."""
    return _PermuteTokens.apply(x_TH, routing)


def unpermute_tokens(y_NH: torch.Tensor, weights_TK: torch.Tensor, routing: Routing) -> torch.Tensor:
    """[N, H] rows in sorted order -> [T, H]: each token's K rows weighted by ``weights_TK`` and
    summed in fp32; output in y_NH's dtype."""
    return _UnpermuteTokens.apply(y_NH, weights_TK, routing)
