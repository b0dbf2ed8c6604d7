"""Dropless expert MLP on torch._grouped_mm (CUTLASS grouped GEMMs on Hopper), our metadata around it.

    y_TH = grouped_mm_mlp(x_TH, w1_EHF, w2_EFH, weights_TK, routing, "gelu")

For large experts (thousands of rows each, e.g. 8 experts of ffn 14336) the vendor's grouped
GEMM beats our Triton kernels (benchmarks/NOTES.md); for small and fine-grained experts the
fused Triton path ('grouped') wins. Same math, same weights, same routing metadata (counting
sort on the GPU, no host synchronisation, unlike a sort + bincount), a deterministic backward
(rows return to assignment order with index_copy and are summed over k; no atomics).

Forward (s sorted position, t(s) its token, a(s) its assignment):
  x_NH = x[t(s)];  h = x_NH @ w1[e];  o = act(h) @ w2[e];  y[a(s)] = weight(s) * o;  sum over k
Backward (saves x, w1, w2, h, o; act(h) and x_NH are recomputed, not stored; dh overwrites h; o and
h/dh are freed at their last use):
  dy_NH = dy[t(s)];  d weight(s) = dy_NH · o;  do = weight(s) * dy_NH;  dact = do @ w2[e]ᵀ
  dh = dact * act'(h);  dw2[e] = act(h)ᵀ do;  dw1[e] = x_NHᵀ dh;  dx[t] = Σ_k (dh @ w1[e]ᵀ)

Legend: T tokens, K top_k, N = T*K assignments, H hidden, F ffn (2F for swiglu's w1), E experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.experts import activate
from megatron_moe.kernels.metadata import Routing
from megatron_moe.ops.grouped_mlp import release


def _gmm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def _dact_into_h(dact, h, activation):
    """dL/dh from dL/d act, written over h (its last use: one [N, F] tensor fewer at the peak)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward.grad_input(dact, h, approximate="tanh", grad_input=h)
    gate, up = h.chunk(2, dim=1)
    sig = torch.sigmoid(gate.float())
    d_up = dact * F.silu(gate)
    gate.copy_(dact.float() * up.float() * sig * (1 + gate.float() * (1 - sig)))
    up.copy_(d_up)
    return h


def _to_assignment_order(rows_NH, order_N, T, K):
    """Rows in sorted order -> assignment order (a permutation: index_copy, deterministic) -> sum over k."""
    out_NH = torch.empty_like(rows_NH).index_copy_(0, order_N, rows_NH)
    return out_NH if K == 1 else out_NH.view(T, K, -1).sum(1)


class GroupedMMMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1_EHF, w2_EFH, weights_TK, order_N, token_N, offs_E, top_k, activation):
        T = x_TH.shape[0]
        h_NF = _gmm(x_TH[token_N], w1_EHF, offs_E)
        o_NH = _gmm(activate(h_NF, activation), w2_EFH, offs_E)
        weight_N = weights_TK.reshape(-1)[order_N].float()
        y_NH = o_NH * weight_N[:, None].to(o_NH.dtype)
        ctx.save_for_backward(x_TH, w1_EHF, w2_EFH, h_NF, o_NH, weight_N, order_N, token_N, offs_E)
        ctx.top_k, ctx.activation, ctx.weights_dtype = top_k, activation, weights_TK.dtype
        ctx.h_consumed = False
        return _to_assignment_order(y_NH, order_N, T, top_k)

    @staticmethod
    def backward(ctx, dy_TH):
        if ctx.h_consumed:
            raise RuntimeError("grouped_mm_mlp: a second backward through the same forward is not supported "
                               "(the first one overwrote the saved pre-activation to save memory); "
                               "run the forward again, or use mlp_impl='blocksparse'")
        x_TH, w1_EHF, w2_EFH, h_NF, o_NH, weight_N, order_N, token_N, offs_E = ctx.saved_tensors
        need_x, need_w1, need_w2, need_weights = ctx.needs_input_grad[:4]
        T, K = x_TH.shape[0], ctx.top_k
        dx = dw1 = dw2 = dweights = None
        ctx.h_consumed = True  # h is overwritten and o freed below
        dy_NH = dy_TH.to(x_TH.dtype)[token_N]
        if need_weights:
            dweight_N = torch.sum(dy_NH * o_NH, dim=1, dtype=torch.float32)
            dweights = torch.empty_like(dweight_N).index_copy_(0, order_N, dweight_N).view(T, K)
            dweights = dweights.to(ctx.weights_dtype)
        release(o_NH)  # its last use
        do_NH = dy_NH * weight_N[:, None].to(dy_NH.dtype)
        del dy_NH
        # dw2 first, then dh over h: at most two [N, F] tensors (h and one more) live at a time
        if need_w2:
            dw2 = _gmm(activate(h_NF, ctx.activation).t(), do_NH, offs_E)
        dh_NF = _dact_into_h(_gmm(do_NH, w2_EFH.transpose(1, 2), offs_E), h_NF, ctx.activation)
        del do_NH, h_NF
        if need_w1:
            dw1 = _gmm(x_TH[token_N].t(), dh_NF, offs_E)
        if need_x:
            dx_NH = _gmm(dh_NF, w1_EHF.transpose(1, 2), offs_E)
            release(dh_NF)  # h's memory
            dx = _to_assignment_order(dx_NH, order_N, T, K)
        return dx, dw1, dw2, dweights, None, None, None, None, None


def grouped_mm_mlp(x_TH: torch.Tensor, w1_EHF: torch.Tensor, w2_EFH: torch.Tensor, weights_TK: torch.Tensor,
                   routing: Routing, activation: str) -> torch.Tensor:
    """y[t] = Σ_k weights[t, k] · (act(x[t] @ w1[e_tk]) @ w2[e_tk]) through torch._grouped_mm.

    Shapes and dtypes as :func:`megatron_moe.ops.grouped_mlp.grouped_mlp`. On CUDA,
    torch._grouped_mm needs bfloat16 and hidden/ffn sizes that are multiples of 8.
    """
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"mlp_impl='grouped_mm' needs torch._grouped_mm (torch >= 2.8); this is torch "
                           f"{torch.__version__}: use mlp_impl='grouped'")
    T, K = routing.num_tokens, routing.top_k
    H, F_ = x_TH.shape[1], w2_EFH.shape[1]
    if x_TH.is_cuda and (x_TH.dtype != torch.bfloat16 or H % 8 or F_ % 8):
        raise ValueError(f"mlp_impl='grouped_mm' on CUDA needs bfloat16 and hidden_size, ffn_hidden_size "
                         f"multiples of 8 (torch._grouped_mm); got {x_TH.dtype}, hidden {H}, ffn {F_}: "
                         "use mlp_impl='grouped'")
    if x_TH.shape[0] != T or weights_TK.shape != (T, K) or w1_EHF.shape[0] != routing.num_experts:
        raise ValueError(f"grouped_mm_mlp: x {tuple(x_TH.shape)}, weights {tuple(weights_TK.shape)} and "
                         f"w1 {tuple(w1_EHF.shape)} do not match the routing (T={T}, K={K}, "
                         f"E={routing.num_experts})")
    offs_E = routing.expert_offsets_E1[1:].to(torch.int32)
    return GroupedMMMLP.apply(x_TH, w1_EHF, w2_EFH, weights_TK, routing.sort_order_N.long(),
                              routing.sorted_token_N.long(), offs_E, K, activation)
