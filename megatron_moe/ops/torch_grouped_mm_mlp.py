"""Dropless expert MLP on torch._grouped_mm (CUTLASS grouped GEMMs on Hopper), our metadata around it.

    y_TH = torch_grouped_mm_mlp(x_TH, w1_EHF, w2_EFH, weights_TK, routing, "gelu")

For large experts (thousands of rows each, e.g. 8 experts of ffn 14336) the vendor's grouped
GEMM is well ahead of our Triton kernels; for small and fine-grained experts the two paths are
close (measured: see docs/performance.md). Same math, same weights, same routing metadata
(counting sort on the GPU, no host synchronisation, unlike a sort + bincount), a deterministic
backward (each token sums its own k rows in a fixed order; no atomics).

Forward (s sorted position, t(s) its token, a(s) its assignment, row(a) its sorted position):
  x_NH = x[t(s)];  h = x_NH @ w1[e];  o = act(h) @ w2[e];  y[t] = Σ_k weight(t, k) o[row(t, k)]
Backward (saves x, w1, w2, h, o; x_NH is gathered again, act(h) recomputed, not stored):
  d weight(t, k) = dy[t] · o[row(t, k)];  do = weight(s) * dy[t(s)];  dact = do @ w2[e]ᵀ
  (dh, act(h)) in one pass over (h, dact), written over them;  dw2[e] = act(h)ᵀ do
  dw1[e] = x_NHᵀ dh;  dx[t] = Σ_k (dh @ w1[e]ᵀ)[row(t, k)]
Everything between the GEMMs is one pass each (kernels/permute.py: gather with the router weight,
the weighted sum over k, its weight gradient; kernels/activation.py), fp32 math, one rounding.
At most two [N, F] tensors live at a time (h and dact / act); o and h/dh are freed at their last use.

Legend: T tokens, K top_k, N = T*K assignments, H hidden, F ffn (2F for swiglu's w1), E experts.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels.activation import activate, activation_backward_
from megatron_moe.kernels.metadata import Routing
from megatron_moe.kernels.permute import gather_rows, scatter_rows, scatter_rows_weight_grad
from megatron_moe.ops.triton_grouped_mlp import release


def _gmm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


class TorchGroupedMMMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1_EHF, w2_EFH, weights_TK, routing, activation):
        token_N = routing.sorted_token_N.long()
        offs_E = routing.expert_offsets_E1[1:]
        h_NF = _gmm(x_TH[token_N], w1_EHF, offs_E)
        o_NH = _gmm(activate(h_NF, activation), w2_EFH, offs_E)
        ctx.save_for_backward(x_TH, w1_EHF, w2_EFH, weights_TK, h_NF, o_NH)
        ctx.routing, ctx.token_N, ctx.offs_E, ctx.activation = routing, token_N, offs_E, activation
        ctx.h_consumed = False
        return scatter_rows(o_NH, weights_TK, routing, layout="sorted")

    @staticmethod
    def backward(ctx, dy_TH):
        if ctx.h_consumed:
            raise RuntimeError("torch_grouped_mm_mlp: a second backward through the same forward is not supported "
                               "(the first one overwrote the saved pre-activation to save memory); "
                               "run the forward again, or use mlp_impl='blocksparse'")
        x_TH, w1_EHF, w2_EFH, weights_TK, h_NF, o_NH = ctx.saved_tensors
        need_x, need_w1, need_w2, need_weights = ctx.needs_input_grad[:4]
        routing, token_N, offs_E = ctx.routing, ctx.token_N, ctx.offs_E
        dx = dw1 = dw2 = dweights = None
        ctx.h_consumed = True  # h is overwritten and o freed below
        dy_TH = dy_TH.to(x_TH.dtype)
        if need_weights:
            dweights = scatter_rows_weight_grad(dy_TH, o_NH, routing, layout="sorted").to(weights_TK.dtype)
        release(o_NH)  # its last use
        do_NH = gather_rows(dy_TH, routing, weights_TK, layout="sorted")
        # dact, then (dh over h, act over dact) in one pass: two [N, F] tensors live at a time
        act_NF = activation_backward_(h_NF, _gmm(do_NH, w2_EFH.transpose(1, 2), offs_E), ctx.activation)
        dh_NF = h_NF
        if need_w2:
            dw2 = _gmm(act_NF.t(), do_NH, offs_E)
        del act_NF, do_NH, h_NF
        if need_w1:
            dw1 = _gmm(x_TH[token_N].t(), dh_NF, offs_E)
        if need_x:
            dx_NH = _gmm(dh_NF, w1_EHF.transpose(1, 2), offs_E)
            release(dh_NF)  # h's memory
            dx = scatter_rows(dx_NH, None, routing, layout="sorted")
        return dx, dw1, dw2, dweights, None, None


def torch_grouped_mm_mlp(x_TH: torch.Tensor, w1_EHF: torch.Tensor, w2_EFH: torch.Tensor, weights_TK: torch.Tensor,
                         routing: Routing, activation: str) -> torch.Tensor:
    """y[t] = Σ_k weights[t, k] · (act(x[t] @ w1[e_tk]) @ w2[e_tk]) through torch._grouped_mm.

    Shapes and dtypes as :func:`megatron_moe.ops.triton_grouped_mlp.triton_grouped_mlp`. On CUDA,
    torch._grouped_mm needs bfloat16 and hidden/ffn sizes that are multiples of 8.
    """
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"mlp_impl='torch_grouped_mm' needs torch._grouped_mm (torch >= 2.8); this is torch "
                           f"{torch.__version__}: use mlp_impl='triton_grouped'")
    T, K = routing.num_tokens, routing.top_k
    H, F_ = x_TH.shape[1], w2_EFH.shape[1]
    if x_TH.is_cuda and (x_TH.dtype != torch.bfloat16 or H % 8 or F_ % 8):
        raise ValueError(f"mlp_impl='torch_grouped_mm' on CUDA needs bfloat16 and hidden_size, ffn_hidden_size "
                         f"multiples of 8 (torch._grouped_mm); got {x_TH.dtype}, hidden {H}, ffn {F_}: "
                         "use mlp_impl='triton_grouped'")
    if x_TH.shape[0] != T or weights_TK.shape != (T, K) or w1_EHF.shape[0] != routing.num_experts:
        raise ValueError(f"torch_grouped_mm_mlp: x {tuple(x_TH.shape)}, weights {tuple(weights_TK.shape)} and "
                         f"w1 {tuple(w1_EHF.shape)} do not match the routing (T={T}, K={K}, "
                         f"E={routing.num_experts})")
    return TorchGroupedMMMLP.apply(x_TH, w1_EHF, w2_EFH, weights_TK, routing, activation)
