"""The router after its logits, fused: scores, top-k, combine weights, counts, aux and z losses.

* :func:`route_fwd_triton`: from fp32 logits [T, E], per token the scores (softmax, or sigmoid
  normalised for the aux loss), the top-k of scores + expert bias (lowest expert first on ties),
  the combine weights (optionally renormalised over the k), and per block of tokens the partial
  expert counts, score sums and squared logsumexps; a one-program pass sums the partials (in a
  fixed order: the losses are deterministic) into the counts and both losses.
* :func:`route_bwd_triton`: dL/dlogits from the combine weights' gradient and the two losses'
  gradients (read on the device: no host synchronisation), recomputing the scores from the
  logits.

Why: unfused, these are ~19 torch ops forward and ~25 backward per layer (``benchmarks/
count_launches.py``), each a kernel launch with its host cost whatever T; fused, 2 launches
forward and 1 backward. The eager layer is host-bound at small experts (docs/performance.md,
"The host").

Definitions (the plain-PyTorch reference :func:`route_reference`, the CPU path):
  scores = softmax(logits) or sigmoid(logits);  probs = scores (softmax) or scores / Σ_e scores
  ids = top-k of scores + bias;  weights = scores[ids] (/ Σ_k when normalised)
  aux = aux_coeff · E · Σ_e (counts_e / (T·K)) · mean_t probs[t, e]     (Switch / GShard)
  z = z_coeff · mean_t logsumexp(logits[t])²                             (ST-MoE)

Legend: T tokens, E experts, K top_k, G token blocks (programs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from .launcher import launch


def _blocks(E: int, K: int, elements: int = 4096) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K): a [BLOCK_T, BLOCK_E] fp32 tile of at most ``elements``."""
    block_e = next_power_of_2(max(E, 2))
    return max(1, min(128, elements // block_e)), block_e, next_power_of_2(max(K, 2))


# The three kernels' launches: (elements of a [BLOCK_T, BLOCK_E] tile, warps) of the forward and the
# backward (BWD_TILE_128 at 65-128 experts: BLOCK_E 128, the width swept), elements a step and warps of the
# one-program sum. benchmarks/bench_route.py sweeps them (docs/performance.md, "The router's small
# kernels swept"): on an H100 the backward ran 1.8x faster at 128 experts / top-8 in 2048-element
# tiles with 2 warps (level at 64 experts) and the sum 2.8x at 131072 tokens with 65536 elements a
# step and 16 warps.
FWD_TILE = (4096, 4)
BWD_TILE = (4096, 4)
BWD_TILE_128 = (2048, 2)
SUM_ELEMENTS, SUM_WARPS = 65536, 16


def bwd_tile(E: int) -> tuple[int, int]:
    """The backward's (elements, warps) at E experts."""
    return BWD_TILE_128 if 64 < E <= 128 else BWD_TILE


@triton.jit
def _scores(logits_ptr, rows, cols, T, E, stride_t, SOFTMAX: tl.constexpr):
    """For a block of rows (rows past T read row T-1: finite, never stored or summed): the
    softmax numerator exp(x - max), its sum, the logsumexp and the scores (0 in columns past E)."""
    col_ok = cols < E
    rows_c = tl.minimum(rows, T - 1).to(tl.int64)
    x = tl.load(logits_ptr + rows_c[:, None] * stride_t + cols[None, :], mask=col_ok[None, :],
                other=float("-inf"))
    m = tl.max(x, 1)
    ex = tl.exp(x - m[:, None])  # 0 in columns past E
    total = tl.sum(ex, 1)
    lse = m + tl.log(total)
    if SOFTMAX:
        scores = ex / total[:, None]
    else:
        scores = tl.where(col_ok[None, :], 1.0 / (1.0 + tl.exp(-x)), 0.0)
    return ex, total, lse, scores


@triton.jit
def _route_fwd_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, part_counts_ptr, part_probs_ptr,
                      part_lse2_ptr, T, E, stride_t,
                      K: tl.constexpr, SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    col_ok = cols < E
    ex, total, lse, scores = _scores(logits_ptr, rows, cols, T, E, stride_t, SOFTMAX)
    # the losses' partial sums first: probs and lse are dead during the top-k loop
    if SOFTMAX:
        probs = scores
    else:
        probs = scores / tl.maximum(tl.sum(scores, 1), 1e-20)[:, None]
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(part_probs_ptr + pid * BLOCK_E + cols, tl.sum(tl.where(ok, probs, 0.0), 0))
    tl.store(part_lse2_ptr + pid, tl.sum(tl.where(row_ok, lse * lse, 0.0), 0))
    select = scores
    if HAS_BIAS:
        select = select + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    select = tl.where(col_ok[None, :], select, float("-inf"))
    # top-k: k times the row's maximum (the lowest expert among equals), then taken out; K <= E,
    # so a finite value is always left to take
    w_TK = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    id_TK = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
    for k in range(K):
        best = tl.max(select, 1)
        idx = tl.min(tl.where(select == best[:, None], cols[None, :], BLOCK_E), 1)
        idx = tl.minimum(idx, E - 1)  # NaN scores match nothing: stay in range
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), 1)
        w_TK = tl.where(kcols[None, :] == k, w[:, None], w_TK)
        id_TK = tl.where(kcols[None, :] == k, idx[:, None], id_TK)
        chosen += hit.to(tl.int32)
        select = tl.where(hit, float("-inf"), select)
    if NORMALIZE:
        w_TK = w_TK / tl.maximum(tl.sum(w_TK, 1), 1e-20)[:, None]
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    k_ok = row_ok[:, None] & (kcols[None, :] < K)
    tl.store(ids_ptr + out, id_TK.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + out, w_TK, mask=k_ok)
    tl.store(part_counts_ptr + pid * BLOCK_E + cols, tl.sum(tl.where(ok, chosen, 0), 0))


@triton.jit
def _route_sum_kernel(part_counts_ptr, part_probs_ptr, part_lse2_ptr, counts_ptr, aux_ptr, z_ptr,
                      G, E, aux_scale, z_scale, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: the partials of the G token blocks summed in order; aux = aux_scale ·
    Σ_e counts_e · Σ_t probs[t, e], z = z_scale · Σ_t lse_t²."""
    cols = tl.arange(0, BLOCK_E)
    gs = tl.arange(0, BLOCK_G)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    probs = tl.zeros((BLOCK_E,), tl.float32)
    lse2 = tl.zeros((BLOCK_G,), tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + gs
        g_ok = g < G
        at = g[:, None] * BLOCK_E + cols[None, :]
        counts += tl.sum(tl.load(part_counts_ptr + at, mask=g_ok[:, None], other=0), 0)
        probs += tl.sum(tl.load(part_probs_ptr + at, mask=g_ok[:, None], other=0.0), 0)
        lse2 += tl.load(part_lse2_ptr + g, mask=g_ok, other=0.0)
    tl.store(counts_ptr + cols, counts.to(tl.int64), mask=cols < E)
    tl.store(aux_ptr, aux_scale * tl.sum(counts.to(tl.float32) * probs, 0))
    tl.store(z_ptr, z_scale * tl.sum(lse2, 0))


@triton.jit
def _route_bwd_kernel(logits_ptr, ids_ptr, dweights_ptr, counts_ptr, daux_ptr, dz_ptr, dlogits_ptr,
                      T, E, stride_t, aux_scale, z_scale,
                      K: tl.constexpr, SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
                      HAS_DW: tl.constexpr, HAS_AUX: tl.constexpr, HAS_Z: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    ex, total, lse, scores = _scores(logits_ptr, rows, cols, T, E, stride_t, SOFTMAX)
    rows_c = tl.minimum(rows, T - 1).to(tl.int64)
    # dL/dscores from the combine weights (each expert at most once per row)
    ds = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    if HAS_DW:
        if NORMALIZE:  # w_k = s_k / max(S, 1e-20), S = Σ_k s_k: a first pass for S and Σ_k dw_k s_k
            S = tl.zeros((BLOCK_T,), tl.float32)
            dot = tl.zeros((BLOCK_T,), tl.float32)
            for k in range(K):
                idx = tl.load(ids_ptr + rows_c * K + k).to(tl.int32)
                s_k = tl.sum(tl.where(cols[None, :] == idx[:, None], scores, 0.0), 1)
                S += s_k
                dot += tl.load(dweights_ptr + rows_c * K + k) * s_k
            S_c = tl.maximum(S, 1e-20)
            corr = tl.where(S >= 1e-20, dot / (S_c * S_c), 0.0)
        for k in range(K):
            idx = tl.load(ids_ptr + rows_c * K + k).to(tl.int32)
            dw = tl.load(dweights_ptr + rows_c * K + k)
            if NORMALIZE:
                dw = dw / S_c - corr
            ds += tl.where(cols[None, :] == idx[:, None], dw[:, None], 0.0)
    # dL/dprobs from the aux loss: the same for every token
    if HAS_AUX:
        c = tl.load(counts_ptr + cols, mask=col_ok, other=0).to(tl.float32)
        dp = (tl.load(daux_ptr) * aux_scale) * c[None, :]
        if SOFTMAX:
            ds += dp
        else:  # probs = s / max(Σ s, 1e-20)
            tot = tl.sum(scores, 1)
            tot_c = tl.maximum(tot, 1e-20)
            corr_p = tl.where(tot >= 1e-20, tl.sum(dp * scores, 1) / (tot_c * tot_c), 0.0)
            ds += dp / tot_c[:, None] - corr_p[:, None]
    if SOFTMAX:
        dx = scores * (ds - tl.sum(ds * scores, 1)[:, None])
    else:
        dx = ds * scores * (1.0 - scores)
    if HAS_Z:  # z = z_coeff · mean lse²: dlse_t = 2 z_coeff lse_t / T, dx = dlse · softmax
        dx += (tl.load(dz_ptr) * z_scale) * lse[:, None] * (ex / total[:, None])
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(dlogits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], dx, mask=ok)


def _aux_scale(aux_coeff: float, T: int, E: int, K: int) -> float:
    """aux = this · Σ_e counts_e · Σ_t probs[t, e] (the definition above, its sums unnormalised)."""
    return aux_coeff * E / (T * K) / T


def _check(logits_TE: torch.Tensor, top_k: int) -> None:
    if logits_TE.dim() != 2 or logits_TE.dtype != torch.float32:
        raise ValueError(f"route: logits must be a float32 [T, E] tensor, got {logits_TE.dtype} "
                         f"{tuple(logits_TE.shape)}")
    if not 1 <= top_k <= logits_TE.shape[1]:
        raise ValueError(f"route: top_k={top_k} must lie in [1, E={logits_TE.shape[1]}]")


def route_fwd_triton(logits_TE, bias_E, top_k, *, softmax=True, normalize=False, aux_coeff=0.0, z_coeff=0.0):
    """(ids_TK int64, weights_TK fp32, counts_E int64, aux fp32 [], z fp32 []); T >= 1."""
    _check(logits_TE, top_k)
    T, E = logits_TE.shape
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    elements, warps = FWD_TILE
    BLOCK_T, BLOCK_E, BLOCK_K = _blocks(E, top_k, elements)
    G = cdiv(T, BLOCK_T)
    dev = logits_TE.device
    ids_TK = torch.empty(T, top_k, device=dev, dtype=torch.int64)
    weights_TK = torch.empty(T, top_k, device=dev, dtype=torch.float32)
    # per token block: counts (int32) [G, BLOCK_E], then, viewed as fp32, score sums [G, BLOCK_E]
    # and squared logsumexps [G]; one allocation
    part = torch.empty(G * (2 * BLOCK_E + 1), device=dev, dtype=torch.int32)
    part_counts = part[:G * BLOCK_E]
    part_probs, part_lse2 = part[G * BLOCK_E:].view(torch.float32).split([G * BLOCK_E, G])
    bias = bias_E if bias_E is not None else weights_TK  # unread without HAS_BIAS
    launch(_route_fwd_kernel, (G,),
           (logits_TE, bias, ids_TK, weights_TK, part_counts, part_probs, part_lse2, T, E, logits_TE.stride(0)),
           dict(K=top_k, SOFTMAX=softmax, NORMALIZE=normalize, HAS_BIAS=bias_E is not None, BLOCK_T=BLOCK_T,
                BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, num_warps=warps))
    counts_E = torch.empty(E, device=dev, dtype=torch.int64)
    aux = torch.empty((), device=dev, dtype=torch.float32)
    z = torch.empty((), device=dev, dtype=torch.float32)
    launch(_route_sum_kernel, (1,),
           (part_counts, part_probs, part_lse2, counts_E, aux, z, G, E, _aux_scale(aux_coeff, T, E, top_k),
            z_coeff / T),
           dict(BLOCK_G=max(2, min(SUM_ELEMENTS // BLOCK_E, next_power_of_2(G))), BLOCK_E=BLOCK_E,
                num_warps=SUM_WARPS))
    return ids_TK, weights_TK, counts_E, aux, z


def route_bwd_triton(logits_TE, ids_TK, counts_E, dweights_TK, daux, dz, *, softmax=True, normalize=False,
                     aux_coeff=0.0, z_coeff=0.0):
    """dL/dlogits fp32 [T, E]; ``dweights_TK``, ``daux`` or ``dz`` None: no gradient from it."""
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    elements, warps = bwd_tile(E)
    BLOCK_T, BLOCK_E, _ = _blocks(E, K, elements)
    dlogits_TE = torch.empty(T, E, device=logits_TE.device, dtype=torch.float32)
    if T == 0:
        return dlogits_TE
    has_aux, has_z = daux is not None and aux_coeff > 0, dz is not None and z_coeff > 0
    dummy = dlogits_TE
    launch(_route_bwd_kernel, (cdiv(T, BLOCK_T),),
           (logits_TE, ids_TK, dweights_TK.float().contiguous() if dweights_TK is not None else dummy, counts_E,
            daux if has_aux else dummy, dz if has_z else dummy, dlogits_TE, T, E, logits_TE.stride(0),
            _aux_scale(aux_coeff, T, E, K), 2.0 * z_coeff / T),
           dict(K=K, SOFTMAX=softmax, NORMALIZE=normalize, HAS_DW=dweights_TK is not None, HAS_AUX=has_aux, HAS_Z=has_z,
                BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, num_warps=warps))
    return dlogits_TE


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference (and the CPU path without the Triton interpreter)
# ----------------------------------------------------------------------------------------------


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many times each of 0..n-1 occurs in ``ids`` (int64 [n]). A scatter-add rather than
    torch.bincount, which reads the maximum back to the host on CUDA."""
    flat = ids.reshape(-1).long()
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard loss E * sum_e f_e * P_e: f_e = share of the T*K assignments routed to e
    (no gradient), P_e = mean router probability of e. Equals 1 when perfectly balanced."""
    T, E = probs_TE.shape
    f_E = tokens_per_expert_E.to(probs_TE.dtype) / max(T * top_k, 1)
    return E * torch.sum(f_E * probs_TE.mean(dim=0))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def route_reference(logits_TE, bias_E, top_k, *, softmax=True, normalize=False, aux_coeff=0.0, z_coeff=0.0):
    """The same outputs as :func:`route_fwd_triton`, differentiable through autograd (in the
    logits' dtype; float64 for tests). Ties in the top-k: torch.topk's order."""
    if softmax:
        scores_TE = probs_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    select_TE = scores_TE.detach() + bias_E if bias_E is not None else scores_TE
    ids_TK = torch.topk(select_TE, top_k, dim=-1).indices
    weights_TK = torch.gather(scores_TE, 1, ids_TK)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    counts_E = count_ids(ids_TK, logits_TE.shape[1])
    zero = logits_TE.new_zeros(())
    aux = aux_coeff * load_balancing_loss(probs_TE, counts_E, top_k) if aux_coeff > 0 else zero
    z = z_coeff * z_loss(logits_TE) if z_coeff > 0 else zero
    return ids_TK, weights_TK, counts_E, aux, z
