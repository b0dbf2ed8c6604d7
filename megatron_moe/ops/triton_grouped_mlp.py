"""Dropless expert MLP as two grouped GEMMs with the gather/scatter fused (no permuted copies, but
for x and dy in a top-1 layer with many rows an expert, where sorted rows pay: see below).

    y_TH = triton_grouped_mlp(x_TH, w1_EHF, w2_EFH, weights_TK, routing, "swiglu")

Forward (s = sorted position, a(s) = t*K + k its assignment, t(s) its token, e its expert):
  1. pre_NF, wact_NF = grouped_gemm(x[t(s)] @ w1[e])         gather fused, activation in the
                       epilogue, written times the router weight: wact = weight(s)·act(pre)
  2. y_SH[s] = wact[s] @ w2[e]                                 (K = 1: scattered into token order,
                                                               y_TH[t(s)], and step 3 is skipped)
  3. y_TH[t] = Σ_k y_SH[row(t, k)]                             one program per token sums its k
                                                               rows (sum_rows): deterministic
Backward (saves x, w1, w2, pre_NF, wact_NF, the sorted router weights and the routing indices:
pre and wact are what an unfused MLP saves too, h and act(h); with recompute_activation only
pre, and wact is recomputed where dw2 reads it). Each saved [N, F] tensor is freed at its last use
(wact after step 5, pre/dpre after step 7), so the backward's peak holds one of them:
  4. g = dy[t(s)] @ w2[e]ᵀ fused with the activation backward: dpre = weight·g·act'(pre) written
     over pre_NF (its last use), d weight(s) = Σ_f g·act(pre)     (one kernel, grouped_gemm_dact)
  5. dw2[e] = Σ_s wact[s]ᵀ · dy[t(s)]                          (grouped_wgrad, gather on b; or wact
                       recomputed from pre in its prologue, rounded as the forward rounded it)
  6. dw1[e] = Σ_s x[t(s)]ᵀ · dpre[s]                           (grouped_wgrad, gather on a)
  7. dx_SH[s] = dpre[s] @ w1[e]ᵀ, then the sum over k as in 3  (grouped_gemm; K = 1: scattered)
With K = 1, GELU and at least 2,048 rows an expert on sm_90 (kernels/switches.py's ``sorted_x``;
MEGATRON_MOE_SORTED_X 1 / 0: always / never), x's rows are permuted once before step 1 (x_NH =
x[t(s)], a copy of [T, H], saved for step 6 in x's place) and steps 1 and 6 read them in sorted
order, step 1's by TMA (kernels/gluon_gemm.py's plain kernel with GELU's epilogue).
With K = 1 and at least 2,048 rows an expert on sm_90 (kernels/switches.py's ``sorted_dy``;
MEGATRON_MOE_SORTED_DY 1 / 0: always / never), dy's rows are permuted once before step 5 (dy_NH =
dy[t(s)], a copy of [T, H], freed after step 4) and steps 4 and 5 read them in sorted order, step
4's by TMA.
With bf16 compute copies of fp32 weights (training.precision.BF16Params with gradient-accumulation
fusion), steps 5 and 6 add their fp32 results straight into the masters' .grad in the kernels'
epilogues and the Function returns no gradient for w1 and w2 (master_grad.fp32_grad_of).
Step 4 overwrites a saved tensor, so the backward runs once per forward (retain_graph=True
followed by a second backward raises a clear error). On the CPU without the Triton interpreter
the same Function runs the plain-PyTorch references.

Legend: T tokens, K top_k, N = T*K assignments (in sorted order unless the name says otherwise;
S the same rows where the sorted order matters), row(t, k) the sorted position of assignment
t*K + k (sorted_row), H hidden, F ffn (w1 and pre hold 2F columns for swiglu: gate half first),
E experts.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels import switches
from megatron_moe.kernels._gluon import on_sm90
from megatron_moe.kernels.activation import ACTIVATIONS, pre_width_factor
from megatron_moe.kernels.grouped import grouped_gemm, grouped_gemm_dact, grouped_wgrad
from megatron_moe.kernels.metadata import Routing
from megatron_moe.kernels.permute import sum_rows
from .master_grad import fp32_grad_of


def _weight_grad(sink, dtype, a_MK, b_MN, offsets_E1, **kw):
    """grouped_wgrad for one weight: a new tensor in its dtype, or, when the weight is a bf16
    compute copy with a master gradient (``sink``, master_grad.MasterGrad), what the sink gives
    autograd (None; a placeholder under Megatron-LM) after adding it in fp32 into that gradient."""
    if sink is None:
        return grouped_wgrad(a_MK, b_MN, offsets_E1, out_dtype=dtype, **kw)
    out, accumulate = sink.buffer()
    grouped_wgrad(a_MK, b_MN, offsets_E1, out=out, accumulate=accumulate, **kw)
    sink.done()
    return sink.autograd_grad(out, dtype)


def release(t: torch.Tensor) -> None:
    """Free the memory of a tensor saved for the backward at its last use there. The autograd node
    holds on to its saved tensors until the whole backward of the node returns; emptying the
    storage gives the memory back now (internal intermediates only, never a caller's tensor)."""
    t.untyped_storage().resize_(0)


class TritonGroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1_EHF, w2_EFH, weights_TK, sort_order_N, sorted_row_N, token_N, offsets_E1, top_k,
                activation, recompute_activation, expert_dx):
        # router weight per sorted position (index_select takes the int32 order as it is)
        weight_N = weights_TK.reshape(-1).index_select(0, sort_order_N).float()
        # top-1 GELU with 2,048+ rows an expert (switches.sorted_x): x's rows permuted into expert order
        # once (a copy of [T, H], kept for dw1), so that step 1 reads sorted rows by TMA
        x_NH, gather_x = x_TH, token_N
        if top_k == 1 and activation == "gelu" and switches.sorted_x(token_N.shape[0], w1_EHF.shape[0],
                                                                     on_sm90(x_TH)):
            x_NH, gather_x = x_TH.index_select(0, token_N), None
        pre_NF, wact_NF = grouped_gemm(x_NH, w1_EHF, offsets_E1, gather_S=gather_x, activation=activation,
                                       act_scale_S=weight_N)
        if top_k == 1:  # written straight into token order
            y_TH = grouped_gemm(wact_NF, w2_EFH, offsets_E1, scatter_S=sort_order_N)
        else:  # left in expert order; each token sums its k rows
            y_TH = sum_rows(grouped_gemm(wact_NF, w2_EFH, offsets_E1), sorted_row_N, top_k)
        ctx.save_for_backward(x_NH, w1_EHF, w2_EFH, pre_NF, None if recompute_activation else wact_NF, weight_N,
                              sort_order_N, sorted_row_N, token_N, offsets_E1)
        ctx.top_k, ctx.activation, ctx.weights_dtype = top_k, activation, weights_TK.dtype
        ctx.x_sorted = gather_x is None  # x_NH holds x's rows in sorted order
        ctx.pre_consumed = False
        ctx.expert_dx = expert_dx  # ops/router_logits.py's ExpertDx, or None
        ctx.sinks = (fp32_grad_of(w1_EHF), fp32_grad_of(w2_EFH))  # master_grad.MasterGrad or None
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        if ctx.pre_consumed:
            raise RuntimeError("triton_grouped_mlp: a second backward through the same forward is not supported "
                               "(the first one overwrote the saved pre-activation to save memory); "
                               "run the forward again, or use mlp_impl='blocksparse'")
        (x_NH, w1_EHF, w2_EFH, pre_NF, wact_NF, weight_N, sort_order_N, sorted_row_N, token_N,
         offsets_E1) = ctx.saved_tensors
        need_x, need_w1, need_w2, need_weights = ctx.needs_input_grad[:4]
        T, K = dy_TH.shape[0], ctx.top_k
        dx = dw1 = dw2 = dweights = None
        dy_TH = dy_TH.to(x_NH.dtype)
        ctx.pre_consumed = True

        # top-1 with 2,048+ rows an expert (switches.sorted_dy): dy's rows permuted into expert order
        # once (a copy of [T, H]), so that steps 4 and 5 read sorted rows (step 4's by TMA) rather
        # than gathering them each
        dy_NH, gather_dy = dy_TH, token_N
        if K == 1 and switches.sorted_dy(token_N.shape[0], w2_EFH.shape[0], on_sm90(dy_TH)):
            dy_NH, gather_dy = dy_TH.index_select(0, token_N), None
        # 5. first: it reads pre (or wact) before step 4 overwrites pre
        if need_w2 and wact_NF is not None:
            dw2 = _weight_grad(ctx.sinks[1], w2_EFH.dtype, wact_NF, dy_NH, offsets_E1, gather_b_S=gather_dy)
        elif need_w2:  # recompute_activation: wact = weight · act(pre) in the kernel's prologue
            dw2 = _weight_grad(ctx.sinks[1], w2_EFH.dtype, pre_NF, dy_NH, offsets_E1, gather_b_S=gather_dy,
                               a_activation=ctx.activation, a_scale_S=weight_N)
        if wact_NF is not None:
            release(wact_NF)
        # 4. g = dy[t(s)] @ w2[e]ᵀ with the activation backward in the epilogue, dpre over pre.
        dpre_NF, dweight_N = grouped_gemm_dact(dy_NH, w2_EFH.transpose(1, 2), offsets_E1, pre_NF, ctx.activation,
                                               gather_S=gather_dy, scale_S=weight_N, inplace=True)
        if gather_dy is None:
            release(dy_NH)
        if need_weights:  # back to assignment order: assignment a sits at sorted position sorted_row[a]
            dweights = dweight_N.index_select(0, sorted_row_N).view(T, K).to(ctx.weights_dtype)
        if need_w1:  # 6.
            dw1 = _weight_grad(ctx.sinks[0], w1_EHF.dtype, x_NH, dpre_NF, offsets_E1,
                               gather_a_S=None if ctx.x_sorted else token_N)
        if need_x:  # 7.
            if K == 1:
                dx = grouped_gemm(dpre_NF, w1_EHF.transpose(1, 2), offsets_E1, scatter_S=sort_order_N)
                release(dpre_NF)
            else:
                dx_SH = grouped_gemm(dpre_NF, w1_EHF.transpose(1, 2), offsets_E1)
                release(dpre_NF)
                dx = sum_rows(dx_SH, sorted_row_N, K)
            if ctx.expert_dx is not None:  # the router's backward adds its part and returns the sum
                ctx.expert_dx.put(dx)
                dx = None
        return dx, dw1, dw2, dweights, None, None, None, None, None, None, None, None


def triton_grouped_mlp(x_TH: torch.Tensor, w1_EHF: torch.Tensor, w2_EFH: torch.Tensor, weights_TK: torch.Tensor,
                       routing: Routing, activation: str, recompute_activation: bool = False,
                       expert_dx=None) -> torch.Tensor:
    """y[t] = Σ_k weights[t, k] · (act(x[t] @ w1[e_tk]) @ w2[e_tk]), in x's dtype.

    x_TH [T, H] (fp32/bf16/fp16); w1_EHF [E, H, F] (swiglu: [E, H, 2F], gate first) and
    w2_EFH [E, F, H] in x's dtype; weights_TK [T, K] router combine weights (fp32; gets a
    gradient); routing from ``routing_metadata`` of the [T, K] expert ids. No host
    synchronisation on the GPU. ``recompute_activation``: save pre only (not wact) and recompute
    wact inside the dw2 kernel (less activation memory, a slower dw2). ``expert_dx``
    (ops/router_logits.py's ExpertDx): dL/dx_TH goes to it, not to autograd (the router's backward,
    which must run after this one, adds its own part and returns the sum).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    T, K = routing.num_tokens, routing.top_k
    E = w1_EHF.shape[0]
    if x_TH.dim() != 2 or x_TH.shape[0] != T:
        raise ValueError(f"x_TH must be [T={T}, H], got {tuple(x_TH.shape)}")
    H = x_TH.shape[1]
    F = w2_EFH.shape[1]
    if w1_EHF.shape != (E, H, pre_width_factor(activation) * F) or w2_EFH.shape != (E, F, H):
        raise ValueError(f"{activation}: expected w1 [E, H, {'2F' if activation == 'swiglu' else 'F'}] and "
                         f"w2 [E, F, H] with E={E}, H={H}; got {tuple(w1_EHF.shape)} and {tuple(w2_EFH.shape)}")
    if weights_TK.shape != (T, K):
        raise ValueError(f"weights_TK must be [{T}, {K}], got {tuple(weights_TK.shape)}")
    if routing.num_experts != E:
        raise ValueError(f"routing has {routing.num_experts} experts but w1 has {E}")
    offsets_E1 = routing.expert_offsets_E1
    if offsets_E1.dtype != torch.int32:
        offsets_E1 = offsets_E1.to(torch.int32)
    return TritonGroupedMLP.apply(x_TH, w1_EHF, w2_EFH, weights_TK, routing.sort_order_N, routing.sorted_row_N,
                                  routing.sorted_token_N, offsets_E1, K, activation, recompute_activation, expert_dx)
