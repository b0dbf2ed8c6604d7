"""Dropless expert MLP on torch._grouped_mm (CUTLASS grouped GEMMs on Hopper), our metadata around it.

    y_TH = grouped_mm_mlp(x_TH, w1_EHF, w2_EFH, weights_TK, routing, "gelu")

For large experts (thousands of rows each, e.g. 8 experts of ffn 14336) the vendor's grouped
GEMM beats our Triton kernels (benchmarks/NOTES.md); for small and fine-grained experts the
fused Triton path ('grouped') wins. Same math, same weights, same routing metadata (counting
sort on the GPU, no host synchronisation, unlike a sort + bincount), a deterministic backward
(rows return to assignment order with index_copy and are summed over k; no atomics).

Forward (s sorted position, t(s) its token, a(s) its assignment):
  x_NH = x[t(s)];  h = x_NH @ w1[e];  o = act(h) @ w2[e];  y[a(s)] = weight(s) * o;  sum over k
Backward (saves x, w1, w2, h, o; act(h) and x_NH are recomputed, not stored):
  dy_NH = dy[t(s)];  d weight(s) = dy_NH · o;  do = weight(s) * dy_NH;  dact = do @ w2[e]ᵀ
  dh = dact * act'(h);  dw2[e] = act(h)ᵀ do;  dw1[e] = x_NHᵀ dh;  dx[t] = Σ_k (dh @ w1[e]ᵀ)

Legend: T tokens, K top_k, N = T*K assignments, H hidden, F ffn (2F for swiglu's w1), E experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.kernels.metadata import Routing


def _gmm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def _act_and_grad(h, activation, dact=None):
    """(act(h), None), or given dact = dL/d act: (None, dL/dh in h's dtype; gelu writes it over dact)."""
    if activation == "gelu":
        if dact is not None:  # dL/dh written over dact
            return None, torch.ops.aten.gelu_backward.grad_input(dact, h, approximate="tanh", grad_input=dact)
        return F.gelu(h, approximate="tanh"), None
    gate, up = h.chunk(2, dim=1)
    silu = F.silu(gate)
    if dact is None:
        return silu * up, None
    sig = torch.sigmoid(gate.float())
    d_gate = dact.float() * up.float() * sig * (1 + gate.float() * (1 - sig))
    return None, torch.cat([d_gate.to(h.dtype), dact * silu], dim=1)


def _to_assignment_order(rows_NH, order_N, T, K):
    """Rows in sorted order -> assignment order (a permutation: index_copy, deterministic) -> sum over k."""
    out_NH = torch.empty_like(rows_NH).index_copy_(0, order_N, rows_NH)
    return out_NH if K == 1 else out_NH.view(T, K, -1).sum(1)


class GroupedMMMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1_EHF, w2_EFH, weights_TK, order_N, token_N, offs_E, top_k, activation):
        T = x_TH.shape[0]
        h_NF = _gmm(x_TH[token_N], w1_EHF, offs_E)
        o_NH = _gmm(_act_and_grad(h_NF, activation)[0], w2_EFH, offs_E)
        weight_N = weights_TK.reshape(-1)[order_N].float()
        y_NH = o_NH * weight_N[:, None].to(o_NH.dtype)
        ctx.save_for_backward(x_TH, w1_EHF, w2_EFH, h_NF, o_NH, weight_N, order_N, token_N, offs_E)
        ctx.top_k, ctx.activation, ctx.weights_dtype = top_k, activation, weights_TK.dtype
        return _to_assignment_order(y_NH, order_N, T, top_k)

    @staticmethod
    def backward(ctx, dy_TH):
        x_TH, w1_EHF, w2_EFH, h_NF, o_NH, weight_N, order_N, token_N, offs_E = ctx.saved_tensors
        need_x, need_w1, need_w2, need_weights = ctx.needs_input_grad[:4]
        T, K = x_TH.shape[0], ctx.top_k
        dx = dw1 = dw2 = dweights = None
        dy_NH = dy_TH.to(x_TH.dtype)[token_N]
        if need_weights:
            dweight_N = torch.sum(dy_NH * o_NH, dim=1, dtype=torch.float32)
            dweights = torch.empty_like(dweight_N).index_copy_(0, order_N, dweight_N).view(T, K)
            dweights = dweights.to(ctx.weights_dtype)
        do_NH = dy_NH * weight_N[:, None].to(dy_NH.dtype)
        del dy_NH
        # dw2 first, then dh: at most two [N, F] tensors (h and one more) live at a time
        if need_w2:
            dw2 = _gmm(_act_and_grad(h_NF, ctx.activation)[0].t(), do_NH, offs_E)
        dh_NF = _act_and_grad(h_NF, ctx.activation, _gmm(do_NH, w2_EFH.transpose(1, 2), offs_E))[1]
        del do_NH
        if need_w1:
            dw1 = _gmm(x_TH[token_N].t(), dh_NF, offs_E)
        if need_x:
            dx = _to_assignment_order(_gmm(dh_NF, w1_EHF.transpose(1, 2), offs_E), order_N, T, K)
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
