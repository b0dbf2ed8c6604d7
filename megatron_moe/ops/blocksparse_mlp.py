"""The paper's block-sparse expert MLP: padded gather -> SDD (+activation) -> DSD -> padded scatter.

Legend: T tokens, K top_k, H hidden, F ffn, E experts, P_max padded rows, Z blocks (B x B).
  w1 [E, H, F] (swiglu: [E, H, 2F], gate half first), w2 [E, F, H], weights_TK fp32 [T, K].

Forward                                         Backward (dy_TH)
  x_P   = gather_rows(x)         [P_max, H]     dy_P = gather_rows(dy, weights)    [P_max, H]
  a, h  = sdd(x_P, w1, act)        [Z, B, B]      dweights = sum_h dy[t] * y_P[row]    (fp32)
  y_P   = dsd(a, w2)               [P_max, H]     dw2  = tsd(a, dy_P)      aᵀ dy_P     [E, F, H]
  y     = scatter_rows(y_P, weights) [T, H]     dh   = sdd_activation_grad(dy_P, w2ᵀ, h)
                                                       = (dy_P @ w2ᵀ on the topology) * act'(h)
                                                  dx   = scatter_rows(dsd(dh, w1ᵀ))  [T, H]
                                                  dw1  = dds(x_P, dh)      x_Pᵀ dh     [E, H, F]

The hidden matrix lives on ``block_topology(routing, F)``; for SwiGLU the gate and the up
halves are two groups of that topology (h and dh are [2, Z, B, B]), each padded to whole blocks
on its own, so F need not be a multiple of B. Saved for the backward: the pre-activation h,
the activation a and y_P; x_P is gathered again. w1ᵀ and w2ᵀ are strided views. No step reads
a device value on the host, so forward and backward queue without synchronising.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels.activation import ACTIVATIONS, pre_width_factor
from megatron_moe.kernels.blocksparse import dds, dsd, sdd, sdd_activation_grad, tsd
from megatron_moe.kernels.metadata import Routing, block_topology
from megatron_moe.kernels.permute import gather_rows, scatter_rows, scatter_rows_weight_grad


class BlockSparseMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1_EHF, w2_EFH, weights_TK, routing: Routing, activation: str):
        topology = block_topology(routing, w2_EFH.shape[1])
        x_PH = gather_rows(x_TH, routing)
        a_ZBB, h = sdd(x_PH, w1_EHF, topology, activation=activation)
        y_PH = dsd(a_ZBB, w2_EFH, topology)
        y_TH = scatter_rows(y_PH, weights_TK, routing)
        ctx.save_for_backward(x_TH, w1_EHF, w2_EFH, weights_TK, h, a_ZBB, y_PH)
        ctx.routing, ctx.topology, ctx.activation = routing, topology, activation
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        x_TH, w1_EHF, w2_EFH, weights_TK, h, a_ZBB, y_PH = ctx.saved_tensors
        routing, topology = ctx.routing, ctx.topology
        need_x, need_w1, need_w2, need_weights = ctx.needs_input_grad[:4]
        dy_TH = dy_TH.to(x_TH.dtype)
        dx = dw1 = dw2 = dweights = None

        if need_weights:
            dweights = scatter_rows_weight_grad(dy_TH, y_PH, routing).to(weights_TK.dtype)
        dy_PH = gather_rows(dy_TH, routing, weights_TK)
        if need_w2:
            dw2 = tsd(a_ZBB, dy_PH, topology)
        if need_x or need_w1:
            dh = sdd_activation_grad(dy_PH, w2_EFH.transpose(1, 2), topology, h, ctx.activation)
            if need_x:
                dx = scatter_rows(dsd(dh, w1_EHF.transpose(1, 2), topology), None, routing)
            if need_w1:
                dw1 = dds(gather_rows(x_TH, routing), dh, topology)
        return dx, dw1, dw2, dweights, None, None


def blocksparse_mlp(x_TH, w1_EHF, w2_EFH, weights_TK, routing: Routing, activation: str):
    """y[t] = sum_k weights[t, k] * act(x[t] @ w1[e]) @ w2[e], e = the k-th expert of token t,
    computed on the block-sparse layout of ``routing`` (Triton on the GPU / under the
    interpreter, plain PyTorch otherwise). Weights in another dtype than x are cast to x's."""
    T, H = x_TH.shape
    E, F = w2_EFH.shape[0], w2_EFH.shape[1]
    F1 = pre_width_factor(activation) * F
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is invalid: expected one of {ACTIVATIONS}")
    if tuple(w1_EHF.shape) != (E, H, F1) or tuple(w2_EFH.shape) != (E, F, H):
        raise ValueError(f"w1 {tuple(w1_EHF.shape)} / w2 {tuple(w2_EFH.shape)} do not fit x [{T}, {H}] "
                         f"({activation}: expected w1 [{E}, {H}, {F1}], w2 [{E}, {F}, {H}])")
    if routing.num_experts != E or routing.num_tokens != T:
        raise ValueError(f"routing is for {routing.num_tokens} tokens / {routing.num_experts} experts, "
                         f"got x [{T}, {H}] and {E} experts")
    w1_EHF, w2_EFH = w1_EHF.to(x_TH.dtype), w2_EFH.to(x_TH.dtype)
    return BlockSparseMLP.apply(x_TH, w1_EHF, w2_EFH, weights_TK, routing, activation)
