"""Grouped GEMMs of the dropless MoE with the gather and the scatter fused into the loads/stores.

Rows are grouped by expert: sorted position s belongs to expert e when
``offsets_E1[e] <= s < offsets_E1[e + 1]`` (``Routing.expert_offsets_E1``; its last entry is
S, or less when the rows past it are padding: nothing is computed or written for them). Two
kernels, each with a launcher and a plain-PyTorch reference:

* :func:`grouped_gemm` (row-grouped):  out[scatter(s)] = epilogue(scale(s) * a[gather(s)] @ w[e])
  Epilogues: none; 'gelu' / 'swiglu' (writes the pre-activation and the activation, the latter
  optionally times act_scale(s)); 'dgelu' / 'dswiglu' (backward: the GEMM result is
  g = dL/d(act); reads the saved pre-activation, writes dL/d(pre) scaled by scale(s), in place
  over the pre-activation if asked, and reduces Σ_n g·act per row, the gradient of the router
  weight, recomputing act). See :func:`grouped_gemm_dact`. The activation math is
  kernels/activation.py's, shared with the other kernels.
* :func:`grouped_wgrad`: dw[e] = Σ_{s in e} A(s)ᵀ · (scale(s) · b[gb(s)])  (empty experts: 0), with
  A(s) = a[ga(s)] or the activation recomputed from a saved pre-activation (its prologue).
  Accumulating into an fp32 gradient (out += dw), on sm_90+ the addition may be the tensor-memory
  unit's reduce-add of the tile (``tma_add_ok``; the autotuner picks it or the kernel's own
  load-add-store per shape), so the fp32 tile never enters registers.

The row-grouped kernel launches either one program per tile over an upper bound of M tiles
(``max_row_blocks``, about cdiv(S, BLOCK_M) + E) times the N tiles, programs past the last tile
exiting, or (PERSISTENT configs) a grid of one or two programs per SM that walk the tiles in a
flattened loop, so one tile's epilogue overlaps the next tile's loads. Either way each tile
finds its expert on the device (cumsum of the per-expert tile counts); nothing is read back to
the host. Transposed weights (the backward's w1ᵀ, w2ᵀ) are read through a tensor descriptor on
sm_90+ (``w_tma_ok``), the token rows always through pointers (the gather). The environment's
A/B switches (MEGATRON_MOE_AUTOTUNE, _PERSISTENT, _TMA_ADD, _W_TMA) are kernels/switches.py's.

Legend (shape suffixes). In this file N is a GEMM's output width; the S sorted positions are
metadata.py's N assignments:
  S sorted positions (rows of the grouped problem), E experts, K reduction width,
  N output width, M rows of an input (tokens when read through a gather index),
  F activation width (N for gelu, N/2 for swiglu whose pre-activation holds [gate | up]).
"""
from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors and their reduce-add (Triton 3.4+); without them: load-add-store
    from triton.tools.tensor_descriptor import TensorDescriptor
    _HAS_TMA_ADD = hasattr(tl.core.tensor_descriptor_base, "atomic_add")
except (ImportError, AttributeError):
    TensorDescriptor, _HAS_TMA_ADD = None, False

from . import gluon_dact, gluon_gemm, gluon_wgrad, launcher, switches, tuning
from ._common import (capability, cdiv, dot, expert_segments, input_precision, interpret_mode, next_power_of_2,
                      num_sms, use_triton)
from .activation import (ACTIVATIONS, activate, activation_bwd_reference, activation_fwd, gelu_and_grad_reference,
                         gelu_bwd, pre_width_factor, swiglu_bwd)
from .metadata import max_row_blocks

EPILOGUES = (None, *ACTIVATIONS)
"""The forward epilogues (``activation`` of :func:`grouped_gemm`): none or an activation."""


# ----------------------------------------------------------------------------------------------
# Autotune configs. Under the interpreter one small config (benchmarking there is far too slow).
# The A/B switches (kernels/switches.py): MEGATRON_MOE_AUTOTUNE=0 and MEGATRON_MOE_PERSISTENT=0
# shorten the config lists when this module is imported, so that a single config never goes
# through the autotuner (some Triton versions benchmark even one config: host syncs, and
# repeated in-place launches); MEGATRON_MOE_TMA_ADD is read by the prune function at each new
# tuning key.
# ----------------------------------------------------------------------------------------------


def _gemm_configs() -> list[triton.Config]:
    """The row-grouped GEMM's configs (MEGATRON_MOE_AUTOTUNE=0: the first alone;
    MEGATRON_MOE_PERSISTENT=0: no persistent ones)."""
    if interpret_mode():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PREFETCH": 0, "PERSISTENT": 0},
                              num_warps=4, num_stages=1)]
    # Large tiles (128x256) serve the plain and gelu epilogues; the backward epilogues want
    # <= 128x128 (register pressure), some with the pre-activation loaded before the main loop
    # (PREFETCH). PERSISTENT p > 0: p programs per SM loop over the tiles (the next tile's loads
    # overlap this tile's epilogue), 0: one program per tile. Measured: see docs/performance.md.
    shapes = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, PREFETCH, PERSISTENT[, maxnreg]
        (64, 64, 64, 4, 4, 0, 0),
        (64, 128, 64, 4, 4, 0, 0),
        (128, 64, 64, 4, 4, 0, 0),
        (128, 128, 64, 8, 3, 0, 0),
        (128, 128, 64, 8, 4, 0, 0),
        (128, 256, 64, 8, 3, 0, 0),
        (128, 256, 64, 8, 4, 0, 0),
        (128, 256, 32, 8, 4, 0, 0),
        (64, 128, 64, 4, 4, 1, 0),
        (128, 128, 64, 8, 3, 1, 0),
        (128, 128, 64, 8, 4, 1, 0),
        (128, 256, 64, 8, 3, 0, 1),
        (128, 128, 64, 8, 3, 0, 1),
        (128, 128, 64, 8, 4, 0, 1),
        (128, 128, 64, 8, 3, 1, 1),
        (128, 128, 64, 4, 3, 0, 2),
        (64, 128, 64, 4, 4, 0, 2),
        # registers capped so three programs share an SM (uncapped, the backward activation
        # epilogue fits two): while one runs its epilogue the others keep the tensor cores busy,
        # for a few spilled bytes
        (64, 128, 64, 4, 3, 0, 0, 168),
    ]
    if not switches.persistent():
        shapes = [c for c in shapes if not c[6]]
    return [_gemm_config(*c) for c in switches.tuning_candidates(shapes)]


def _gemm_config(block_m, block_n, block_k, warps, stages, prefetch, persistent, maxnreg=None) -> triton.Config:
    """A row-grouped GEMM config; its pre-hook gives the weight's descriptor (if any) the tile."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PREFETCH": prefetch,
                          "PERSISTENT": persistent}, num_warps=warps, num_stages=stages, maxnreg=maxnreg,
                         pre_hook=_size_w_desc)


def _size_w_desc(nargs) -> None:
    """Config pre-hook: the weight's tensor descriptor (W_TMA) moves one [1, BLOCK_N, BLOCK_K] box."""
    if nargs.get("W_TMA"):
        nargs["w_ptr"].block_shape = [1, nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _prune_gemm_configs(configs, named_args, **kwargs):
    """PREFETCH only means something to the backward epilogues; swiglu (two accumulators) and
    the backward epilogues (pre-activation tiles beside the accumulator) drop the tiles that
    would spill registers. PREFETCH with PERSISTENT holds a tile's pre-activation through the
    loop over tiles: compiled for sm_90 by Triton 3.6 it spills 1.8 KB (dgelu) to 7.3 KB
    (dswiglu) a thread and ran 75-200x slower than the tuned tiles (H200, 2026-12-03), so it is
    not timed. (Pruned here, not dropped from the list: the list is part of the tuning tables' key.)"""
    epilogue = kwargs.get("EPILOGUE", named_args.get("EPILOGUE"))
    backward = epilogue in ("dgelu", "dswiglu")
    kept = [c for c in configs if (backward or not c.kwargs.get("PREFETCH", 0))
            and not (c.kwargs.get("PREFETCH", 0) and c.kwargs.get("PERSISTENT", 0))]
    if epilogue == "swiglu" or backward:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return kept or configs[:1]


# Width of one partial row-sum slot of the 'dgelu'/'dswiglu' epilogue: the smallest BLOCK_N of
# any config, so every config fills every slot exactly once (no zero-fill, no atomics).
_DACT_SLOT = min(c.kwargs["BLOCK_N"] for c in _gemm_configs())


def _wgrad_configs() -> list[triton.Config]:
    """The weight gradient's configs, each tile with and without TMA_ADD (MEGATRON_MOE_AUTOTUNE=0:
    the first tile alone)."""
    if interpret_mode():
        return [triton.Config({"BLOCK_K": 16, "BLOCK_N": 16, "BLOCK_S": 16, "TMA_ADD": False}, num_warps=4,
                              num_stages=1)]
    # few rows per expert make the reduction short: fewer stages let two programs share an SM and
    # overlap one's store with the other's loads (a persistent schedule measured no better: see
    # docs/performance.md)
    shapes = [  # BLOCK_K, BLOCK_N, BLOCK_S, warps, stages
        (64, 64, 64, 4, 4),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 4, 3),
        (128, 128, 64, 4, 2),
        (128, 256, 64, 8, 3),
        (64, 128, 64, 4, 3),
        (128, 64, 64, 4, 3),
    ]
    # each tile both ways when accumulating into fp32 on sm_90+: through TMA's reduce-add or the
    # kernel's own load-add-store (_prune_wgrad_configs keeps what the call can run)
    return [_wgrad_config(*c, tma_add=t) for c in switches.tuning_candidates(shapes) for t in (False, True)]


def _wgrad_config(block_k, block_n, block_s, warps, stages, tma_add=False) -> triton.Config:
    """A weight-gradient config; its pre-hook gives the TMA output descriptor (if any) the tile."""
    return triton.Config({"BLOCK_K": block_k, "BLOCK_N": block_n, "BLOCK_S": block_s, "TMA_ADD": tma_add},
                         num_warps=warps, num_stages=stages, pre_hook=_size_out_desc)


def _size_out_desc(nargs) -> None:
    """Config pre-hook: the accumulating TMA path's descriptor moves one [1, BLOCK_K, BLOCK_N] box."""
    desc = nargs.get("out_desc")
    if desc is not None:
        desc.block_shape = [1, nargs["BLOCK_K"], nargs["BLOCK_N"]]


def _prune_wgrad_configs(configs, named_args, **kwargs):
    """TMA_ADD configs only where the launcher made the output descriptor (``tma_add_ok``). With
    one, both kinds are tuned (which one wins depends on the rows per expert: measured, see
    docs/performance.md), unless MEGATRON_MOE_TMA_ADD=1 or MEGATRON_MOE_AUTOTUNE=0 asks for the
    TMA ones only."""
    if named_args.get("out_desc") is None:
        want = False
    elif switches.tma_add() or not switches.autotune():
        want = True
    else:
        return configs  # both kinds
    return [c for c in configs if c.kwargs["TMA_ADD"] == want]


# ----------------------------------------------------------------------------------------------
# Row-grouped GEMM: out[scatter(s)] = epilogue(scale(s) * a[gather(s)] @ w[expert(s)])
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rows(index_ptr, offs_s, mask_s, HAS_INDEX: tl.constexpr):
    """int64 row of each sorted position: index[s] (gather / scatter) or s itself."""
    if HAS_INDEX:
        return tl.load(index_ptr + offs_s, mask=mask_s, other=0).to(tl.int64)
    else:
        return offs_s.to(tl.int64)


@triton.jit
def _expert_tiles(offsets_ptr, E, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Lanes 0..BLOCK_E-1 (experts; lanes >= E are empty): (lane index, BLOCK_M-row tiles of the
    expert, their inclusive cumsum), from the expert offsets."""
    e_idx = tl.arange(0, BLOCK_E)
    lo_E = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
    hi_E = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
    tiles_E = (hi_E - lo_E + BLOCK_M - 1) // BLOCK_M
    return e_idx, tiles_E, tl.cumsum(tiles_E, axis=0)


@triton.jit
def _tile_coords(tile, tiles_cum_E, tiles_E, e_idx, offsets_ptr, num_tiles_n, BLOCK_M: tl.constexpr):
    """(expert, first sorted row, end of the expert's rows, N tile) of output tile ``tile``; expert
    == E past the last tile. Consecutive tiles share their rows (L2 reuse of a's rows)."""
    pid_m = tile // num_tiles_n
    pid_n = tile % num_tiles_n
    # the expert owning M tile pid_m: the experts whose inclusive tile cumsum is <= pid_m
    expert = tl.sum((tiles_cum_E <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(e_idx == expert, tiles_cum_E - tiles_E, 0), axis=0)
    seg_end = tl.load(offsets_ptr + expert + 1)
    row0 = tl.load(offsets_ptr + expert) + (pid_m - first_tile) * BLOCK_M
    return expert, row0, seg_end, pid_n


@triton.jit
def _load_pre(pre_ptrs, mask_o, N, EPILOGUE: tl.constexpr):
    """The saved pre-activation tile of a backward epilogue: (h, h) for dgelu, (gate, up) for
    dswiglu, whose up half lies N columns to the right."""
    h = tl.load(pre_ptrs, mask=mask_o, other=0.0)
    if EPILOGUE == "dswiglu":
        h_up = tl.load(pre_ptrs + N, mask=mask_o, other=0.0)
    else:
        h_up = h
    return h, h_up


@triton.jit
def _forward_epilogue(
    acc, acc_up, out_ptr, act_ptr, scale_ptr, act_scale_ptr, offs_s, mask_s, rows_o, offs_n, mask_o,
    N, stride_om, stride_actm,
    EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_ACT_SCALE: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """out = scale(s)·acc (gelu / swiglu: the pre-activation; swiglu's up half, scale(s)·acc_up,
    N columns to the right); then act = act_scale(s)·act(pre) from the rounded pre into act."""
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows_o[:, None] * stride_om + offs_n[None, :]
    out_ty = out_ptr.dtype.element_ty
    if HAS_SCALE:
        acc = acc * scale
        if EPILOGUE == "swiglu":
            acc_up = acc_up * scale
    pre = acc.to(out_ty)
    tl.store(out_ptrs, pre, mask=mask_o)
    if EPILOGUE == "gelu" or EPILOGUE == "swiglu":
        # activation of the stored (rounded) pre-activation: the backward recomputes the same
        if EPILOGUE == "gelu":
            up = pre
        else:
            up = acc_up.to(out_ty)
            tl.store(out_ptrs + N, up, mask=mask_o)
        act = activation_fwd(pre.to(tl.float32), up.to(tl.float32), EPILOGUE, FAST_MATH)
        if HAS_ACT_SCALE:
            act = act * tl.load(act_scale_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)[:, None]
        act_ptrs = act_ptr + rows_o[:, None] * stride_actm + offs_n[None, :]
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask_o)


@triton.jit
def _backward_epilogue(
    acc, h, h_up, pre_ptrs, out_ptr, dscale_ptr, scale_ptr, offs_s, mask_s, rows_o, offs_n, mask_o, pid_n,
    N, num_slots, stride_om,
    EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, FAST_MATH: tl.constexpr, PREFETCH: tl.constexpr,
    SLOT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """acc = g = dL/d(act), without the scale. out = scale(s)·g·act'(pre) (dswiglu: d gate, and
    d up N columns to the right), pre read at the output rows (prefetched: h, h_up; else None,
    loaded here); Σ_n g·act(pre) of the tile into its row-sum slot of dscale."""
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows_o[:, None] * stride_om + offs_n[None, :]
    if not PREFETCH:
        h, h_up = _load_pre(pre_ptrs, mask_o, N, EPILOGUE)
    if HAS_SCALE:
        g_scaled = acc * scale
    else:
        g_scaled = acc
    if EPILOGUE == "dgelu":
        act = gelu_bwd(h.to(tl.float32), g_scaled, out_ptrs, mask_o, FAST_MATH)
    else:  # dswiglu
        act = swiglu_bwd(h.to(tl.float32), h_up.to(tl.float32), g_scaled, out_ptrs, N, mask_o, FAST_MATH)
    # Σ_n g·act of this tile goes to slot pid_n * (BLOCK_N // SLOT); the tile's other slots get
    # 0, so whatever BLOCK_N the autotuner picks, every slot is written exactly once.
    row_sum = tl.sum(acc * act, axis=1)
    offs_j = tl.arange(0, BLOCK_N // SLOT)
    part = tl.where(offs_j[None, :] == 0, row_sum[:, None], 0.0)
    offs_slot = pid_n * (BLOCK_N // SLOT) + offs_j
    tl.store(dscale_ptr + rows_o[:, None] * num_slots + offs_slot[None, :], part,
             mask=mask_s[:, None] & (offs_slot < num_slots)[None, :])


@triton.jit
def _gemm_tile(
    expert, row0, seg_end, pid_n,
    a_ptr, w_ptr, out_ptr, act_ptr, pre_ptr, dscale_ptr, scale_ptr, act_scale_ptr, gather_ptr, scatter_ptr,
    K, N, num_slots,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_actm, stride_prem,
    EPILOGUE: tl.constexpr, HAS_GATHER: tl.constexpr, HAS_SCATTER: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_ACT_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    SLOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, W_TMA: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of expert ``expert`` (rows row0.. of its segment):
    rows and masks (and the backward's prefetched pre-activation), the main loop over K, the
    forward or backward epilogue."""
    offs_s = row0 + tl.arange(0, BLOCK_M)
    mask_s = offs_s < seg_end
    rows_a = _rows(gather_ptr, offs_s, mask_s, HAS_GATHER)
    rows_o = _rows(scatter_ptr, offs_s, mask_s, HAS_SCATTER)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_o = mask_s[:, None] & mask_n[None, :]
    BACKWARD: tl.constexpr = EPILOGUE == "dgelu" or EPILOGUE == "dswiglu"
    if BACKWARD:
        pre_ptrs = pre_ptr + rows_o[:, None] * stride_prem + offs_n[None, :]
        if PREFETCH:  # in flight during the main loop
            h, h_up = _load_pre(pre_ptrs, mask_o, N, EPILOGUE)
        else:  # loaded by the epilogue
            h, h_up = None, None
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
    if not W_TMA:
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EPILOGUE == "swiglu":  # the up half's accumulator
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc_up = None
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_s[:, None] & mask_k[None, :], other=0.0)
        if W_TMA:  # the tile of the [E, N, K] storage, transposed in shared memory; outside the expert: 0
            w = w_ptr.load([expert, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).trans()
        else:
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = dot(a, w, acc, DOT_PRECISION)
        if EPILOGUE == "swiglu":
            w_up = tl.load(w_ptrs + N * stride_wn, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_up = dot(a, w_up, acc_up, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        if not W_TMA:
            w_ptrs += BLOCK_K * stride_wk

    if BACKWARD:
        _backward_epilogue(acc, h, h_up, pre_ptrs, out_ptr, dscale_ptr, scale_ptr, offs_s, mask_s, rows_o, offs_n,
                           mask_o, pid_n, N, num_slots, stride_om,
                           EPILOGUE, HAS_SCALE, FAST_MATH, PREFETCH, SLOT, BLOCK_N)
    else:
        _forward_epilogue(acc, acc_up, out_ptr, act_ptr, scale_ptr, act_scale_ptr, offs_s, mask_s, rows_o, offs_n,
                          mask_o, N, stride_om, stride_actm,
                          EPILOGUE, HAS_SCALE, HAS_ACT_SCALE, FAST_MATH)


# restore_value: benchmarking a config runs the kernel several times; an in-place backward
# epilogue (out over the pre-activation) must read the saved pre-activation each time
@triton.autotune(configs=_gemm_configs(), key=["K", "N", "EPILOGUE", "W_TMA"],
                 prune_configs_by={"early_config_prune": _prune_gemm_configs}, restore_value=["out_ptr"])
@triton.jit
def _grouped_gemm_kernel(
    # pointers
    a_ptr,  # [M, K] any strides, read through gather_ptr
    w_ptr,  # [E, K, N] any strides (swiglu: [E, K, 2N], gate half first); W_TMA: a tensor
    #         descriptor over the [E, N, K] storage of a transposed w (K contiguous)
    out_ptr,  # [S, N]: result / pre-activation (swiglu: [S, 2N]) / dL/d(pre) (dswiglu: [S, 2N]);
    #           the backward epilogues may write it over pre_ptr (same rows and strides)
    act_ptr,  # [S, N]: activation (gelu, swiglu), times act_scale(s) when HAS_ACT_SCALE
    pre_ptr,  # [S, N] (dswiglu: [S, 2N]): saved pre-activation, read by dgelu / dswiglu
    dscale_ptr,  # fp32 [S, num_slots]: partial Σ_n g·act of dgelu / dswiglu
    scale_ptr,  # fp32 [S] per sorted position
    act_scale_ptr,  # fp32 [S] per sorted position (gelu / swiglu: multiplies the activation only)
    gather_ptr,  # int [S]: row of a read by sorted position s
    scatter_ptr,  # int [S]: row of out / act / pre / dscale written by sorted position s
    offsets_ptr,  # int32 [E+1]: expert segments of the sorted positions
    # sizes
    K, N, E, num_slots,
    # strides
    stride_am, stride_ak,
    stride_we, stride_wk, stride_wn,
    stride_om, stride_actm, stride_prem,
    # meta-parameters
    EPILOGUE: tl.constexpr,  # "none", "gelu", "swiglu", "dgelu" or "dswiglu"
    HAS_GATHER: tl.constexpr, HAS_SCATTER: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_ACT_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    FAST_MATH: tl.constexpr,  # hardware tanh in the activation epilogues (16-bit outputs on a GPU)
    BLOCK_E: tl.constexpr, SLOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,  # backward epilogues: load the pre-activation before the main loop
    PERSISTENT: tl.constexpr,  # 0: one program per tile; 1: the grid loops over the tiles, flattened
    W_TMA: tl.constexpr,  # w through the tensor-memory unit (w_tma_ok), else pointer loads
):
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    e_idx, tiles_E, tiles_cum_E = _expert_tiles(offsets_ptr, E, BLOCK_E, BLOCK_M)
    if PERSISTENT:
        # every program walks the tiles pid, pid + grid, ...; flatten=True lets the software
        # pipeline load the next tile's operands while this tile's epilogue runs
        num_tiles = tl.sum(tiles_E, axis=0) * num_tiles_n
        for tile in tl.range(pid, num_tiles, tl.num_programs(0), flatten=True):
            expert, row0, seg_end, pid_n = _tile_coords(tile, tiles_cum_E, tiles_E, e_idx, offsets_ptr,
                                                        num_tiles_n, BLOCK_M)
            _gemm_tile(expert, row0, seg_end, pid_n,
                       a_ptr, w_ptr, out_ptr, act_ptr, pre_ptr, dscale_ptr, scale_ptr, act_scale_ptr,
                       gather_ptr, scatter_ptr, K, N, num_slots,
                       stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_actm, stride_prem,
                       EPILOGUE, HAS_GATHER, HAS_SCATTER, HAS_SCALE, HAS_ACT_SCALE, DOT_PRECISION,
                       FAST_MATH, SLOT, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH, W_TMA)
    else:
        expert, row0, seg_end, pid_n = _tile_coords(pid, tiles_cum_E, tiles_E, e_idx, offsets_ptr,
                                                    num_tiles_n, BLOCK_M)
        if expert >= E:  # past the last tile of the last expert (the grid is an upper bound)
            return
        _gemm_tile(expert, row0, seg_end, pid_n,
                   a_ptr, w_ptr, out_ptr, act_ptr, pre_ptr, dscale_ptr, scale_ptr, act_scale_ptr,
                   gather_ptr, scatter_ptr, K, N, num_slots,
                   stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_actm, stride_prem,
                   EPILOGUE, HAS_GATHER, HAS_SCATTER, HAS_SCALE, HAS_ACT_SCALE, DOT_PRECISION,
                   FAST_MATH, SLOT, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH, W_TMA)


# ----------------------------------------------------------------------------------------------
# Grouped weight gradient: dw[e] = Σ_{s in e} A(s)ᵀ · (scale(s) · b[gb(s)]),
#   A(s) = a[ga(s)], or a_scale(s) · act(a[s]) recomputed from a saved pre-activation
# ----------------------------------------------------------------------------------------------


# restore_value: benchmarking a config runs the kernel several times, which must not add into an
# ACCUMULATE output more than once
@triton.autotune(configs=_wgrad_configs(), key=["K", "N", "ACT_A", "ACCUMULATE", "TMA_OK"],
                 prune_configs_by={"early_config_prune": _prune_wgrad_configs}, restore_value=["out_ptr"])
@triton.jit
def _grouped_wgrad_kernel(
    # pointers
    a_ptr,  # [Ma, K] any strides, read through gather_a_ptr (ACT_A 'swiglu': [S, 2K] = [gate | up])
    b_ptr,  # [Mb, N] any strides, read through gather_b_ptr
    out_ptr,  # [E, K, N] any strides (ACCUMULATE: read, added to, written back)
    out_desc,  # TMA_OK: host tensor descriptor of out (fp32 [E, K, N], rows contiguous); else None
    scale_ptr,  # fp32 [S]: multiplies b's rows
    a_scale_ptr,  # fp32 [S]: multiplies the recomputed activation (ACT_A only)
    gather_a_ptr, gather_b_ptr,  # int [S]
    offsets_ptr,  # int32 [E+1]
    # sizes
    K, N,
    # strides
    stride_am, stride_ak,
    stride_bm, stride_bn,
    stride_oe, stride_ok, stride_on,
    # meta-parameters
    HAS_GATHER_A: tl.constexpr, HAS_GATHER_B: tl.constexpr, HAS_SCALE: tl.constexpr,
    ACT_A: tl.constexpr,  # "none", or "gelu" / "swiglu": A = a_scale · act(a), a the pre-activation
    HAS_A_SCALE: tl.constexpr, FAST_MATH: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # out += dw (fp32 out: gradient accumulation over micro-batches)
    TMA_OK: tl.constexpr,  # out_desc was made (tma_add_ok): the TMA_ADD configs may run
    TMA_ADD: tl.constexpr,  # (config) ACCUMULATE through the tensor-memory unit's reduce-add
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # one program per [BLOCK_K, BLOCK_N] tile of one expert; consecutive programs share its rows
    pid = tl.program_id(0)
    num_tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    expert = pid // (num_tiles_k * num_tiles_n)
    pid_kn = pid % (num_tiles_k * num_tiles_n)
    pid_k = pid_kn // num_tiles_n
    pid_n = pid_kn % num_tiles_n
    seg_start = tl.load(offsets_ptr + expert)
    seg_end = tl.load(offsets_ptr + expert + 1)

    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < K
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for s0 in range(seg_start, seg_end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < seg_end
        rows_a = _rows(gather_a_ptr, offs_s, mask_s, HAS_GATHER_A)
        rows_b = _rows(gather_b_ptr, offs_s, mask_s, HAS_GATHER_B)
        # a tile loaded transposed: [BLOCK_K, BLOCK_S]
        a_ptrs = a_ptr + rows_a[None, :] * stride_am + offs_k[:, None] * stride_ak
        mask_a = mask_k[:, None] & mask_s[None, :]
        a_t = tl.load(a_ptrs, mask=mask_a, other=0.0)
        if ACT_A != "none":  # the forward's act_out, recomputed from the pre-activation (same rounding)
            if ACT_A == "swiglu":
                up = tl.load(a_ptrs + K * stride_ak, mask=mask_a, other=0.0)
            else:
                up = a_t
            act = activation_fwd(a_t.to(tl.float32), up.to(tl.float32), ACT_A, FAST_MATH)
            if HAS_A_SCALE:
                act = act * tl.load(a_scale_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)[None, :]
            a_t = act.to(a_ptr.dtype.element_ty)
        b = tl.load(b_ptr + rows_b[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                    mask=mask_s[:, None] & mask_n[None, :], other=0.0)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * scale[:, None]).to(b_ptr.dtype.element_ty)
        acc = dot(a_t, b, acc, DOT_PRECISION)

    if TMA_ADD:
        # out += acc by the tensor-memory unit (cp.reduce.async.bulk.tensor.add from shared memory,
        # done in L2; the box is clipped at out's bounds): the fp32 tile never enters registers, so
        # the program needs fewer of them and more programs share an SM, and it only waits for the
        # bulk copy at its exit. One add per element, the same fp32 rounding as the load-add-store
        # path: deterministic, the same bits for one config.
        if seg_end > seg_start:  # an empty expert adds nothing
            out_desc.atomic_add([expert, pid_k * BLOCK_K, pid_n * BLOCK_N], acc[None, :, :])
    else:
        out_ptrs = (out_ptr + expert.to(tl.int64) * stride_oe + offs_k[:, None].to(tl.int64) * stride_ok
                    + offs_n[None, :] * stride_on)
        mask_out = mask_k[:, None] & mask_n[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=mask_out, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_index(name: str, idx, S: int, device) -> None:
    if idx is None:
        return
    if idx.dim() != 1 or idx.shape[0] != S or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 vector of the {S} sorted positions, "
                         f"got {tuple(idx.shape)} {idx.dtype}")
    if idx.device != device:
        raise ValueError(f"{name} is on {idx.device}, expected {device}")


def _check_scale(scale_S, S: int, name: str = "scale_S") -> None:
    if scale_S is not None and (scale_S.dim() != 1 or scale_S.shape[0] != S or scale_S.dtype != torch.float32):
        raise ValueError(f"{name} must be a float32 vector of the {S} sorted positions, "
                         f"got {tuple(scale_S.shape)} {scale_S.dtype}")


def _check_offsets(offsets_E1, E: int) -> None:
    if offsets_E1.dim() != 1 or offsets_E1.shape[0] != E + 1 or offsets_E1.dtype != torch.int32:
        raise ValueError(f"offsets_E1 must be int32 [E+1] = [{E + 1}], "
                         f"got {tuple(offsets_E1.shape)} {offsets_E1.dtype}")


def _num_sorted(a_MK, gather_S) -> int:
    return gather_S.shape[0] if gather_S is not None else a_MK.shape[0]


def _check_gemm(a_MK, w_EKN, offsets_E1, gather_S, scatter_S, scale_S, act_scale_S=None) -> int:
    if a_MK.dim() != 2 or w_EKN.dim() != 3:
        raise ValueError(f"expected a [M, K] and w [E, K, N], got {tuple(a_MK.shape)} and {tuple(w_EKN.shape)}")
    if a_MK.shape[1] != w_EKN.shape[1]:
        raise ValueError(f"a has K={a_MK.shape[1]} columns but w has K={w_EKN.shape[1]} rows")
    if a_MK.dtype != w_EKN.dtype or a_MK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a and w must share one of float32/bfloat16/float16, got {a_MK.dtype} and {w_EKN.dtype}")
    _check_offsets(offsets_E1, w_EKN.shape[0])
    S = _num_sorted(a_MK, gather_S)
    _check_index("gather_S", gather_S, S, a_MK.device)
    _check_index("scatter_S", scatter_S, S, a_MK.device)
    _check_scale(scale_S, S)
    _check_scale(act_scale_S, S, "act_scale_S")
    return S


# Tuned launches: once the autotuner has chosen a config for a launch key (its own key, the
# tensors' dtypes and the meta-parameters), later launches call the JIT function with that config
# directly, skipping the autotuner's per-call work on the host (measured: see docs/performance.md).
_TUNED: dict = {}


def clear_tuning_cache() -> None:
    """Forget every tuned config in this process (the autotuners' and the launch cache): the next
    launches tune again, e.g. after a change of a kernel's ``configs``, unless a config tuned under
    the same kernel, candidates and switches is kept on disk (kernels/tuning.py)."""
    _TUNED.clear()
    _HOT.clear()
    _grouped_gemm_kernel.cache.clear()
    _grouped_wgrad_kernel.cache.clear()


# (kernel, tune key, the arguments' specialisation, meta) -> (its config, the launch's keywords, the launcher's key)
_HOT: dict = {}


def _launch(kernel, grid, args, meta, tune_key, hook_args):
    """``kernel[grid](*args, **meta)``: through the autotuner the first time per key (unless an
    earlier process stored its choice: kernels/tuning.py), then with the chosen config through
    kernels/launcher.py (the compiled kernel's own launcher after its first launch). The config's
    pre-hook sees ``hook_args`` (the arguments it reads) and the launch's keywords."""
    if interpret_mode():
        kernel[grid](*args, **meta)
        return
    hot_key = (kernel.fn.__name__, tune_key, launcher.arg_key(args), tuple(meta.items()))  # our arguments: all keyed
    hot = _HOT.get(hot_key)
    if hot is None:
        cfg = _config(kernel, grid, args, meta, tune_key)
        if cfg is None:  # the autotuner chose and launched
            return
        cfg_kwargs = cfg.all_kwargs()
        # the launcher's key names the config too: after clear_tuning_cache the same arguments may
        # get another config (a test's or a sweep's), whose kernel is another compiled kernel
        hot = _HOT[hot_key] = (cfg, {**meta, **cfg_kwargs}, (hot_key, tuple(cfg_kwargs.items())))
    cfg, kwargs, launch_key = hot
    if cfg.pre_hook is not None:  # as the autotuner does before each launch
        cfg.pre_hook({**hook_args, **kwargs})
    launcher.launch(kernel.fn, grid, args, kwargs, key=launch_key)


def _config(kernel, grid, args, meta, tune_key):
    """The config of a launch key: this process's earlier choice, a stored one, or (None) the
    autotuner's, which has then launched the kernel."""
    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    key = (kernel.fn.__name__, tune_key, dtypes, tuple(meta.items()))
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    cfg = tuning.stored_config(kernel, key[1:], device)
    if cfg is None:
        tuned_before, start = len(kernel.cache), time.perf_counter()
        tuning.precompile(kernel, args, meta)  # the candidates compiled in parallel first
        kernel[grid](*args, **meta)
        cfg = getattr(kernel, "best_config", None)
        if cfg is not None:
            _TUNED[key] = cfg
            tuned_s = time.perf_counter() - start if len(kernel.cache) > tuned_before else None
            tuning.remember(kernel, key[1:], device, cfg, tuned_s, label=f"K={tune_key[0]} N={tune_key[1]} "
                            + " ".join(f"{k}={v}" for k, v in meta.items() if isinstance(v, str)))
        return None
    _TUNED[key] = cfg
    kernel.best_config = cfg  # as after tuning (benchmarks/profile_layer.py reads it)
    return cfg


def _launch_gemm(a_MK, w_EKN, offsets_E1, out, act, pre, dscale, *, N, epilogue, gather_S, scatter_S, scale_S,
                 act_scale_S=None):
    S, E, K = out.shape[0], w_EKN.shape[0], a_MK.shape[1]
    dummy = offsets_E1
    num_slots = dscale.shape[1] if dscale is not None else 0
    sms = num_sms(a_MK.device)

    def grid(meta):
        tiles = max_row_blocks(S, E, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
        return (min(tiles, sms * meta["PERSISTENT"]) if meta["PERSISTENT"] else tiles,)

    w_tma = epilogue != "swiglu" and w_tma_ok(w_EKN)  # (swiglu's second weight tile: pointers only)
    # box: _size_w_desc
    w_arg = TensorDescriptor.from_tensor(w_EKN.transpose(1, 2), [1, 16, 16]) if w_tma else w_EKN
    args = (a_MK, w_arg, out, act if act is not None else out, pre if pre is not None else out,
            dscale if dscale is not None else dummy, scale_S if scale_S is not None else dummy,
            act_scale_S if act_scale_S is not None else dummy,
            gather_S if gather_S is not None else dummy, scatter_S if scatter_S is not None else dummy,
            offsets_E1,
            K, N, E, num_slots,
            a_MK.stride(0), a_MK.stride(1),
            w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
            out.stride(0), act.stride(0) if act is not None else 0, pre.stride(0) if pre is not None else 0)
    meta = dict(EPILOGUE=epilogue, HAS_GATHER=gather_S is not None, HAS_SCATTER=scatter_S is not None,
                HAS_SCALE=scale_S is not None, HAS_ACT_SCALE=act_scale_S is not None,
                FAST_MATH=out.dtype != torch.float32 and not interpret_mode(),
                BLOCK_E=max(2, next_power_of_2(E)), SLOT=_DACT_SLOT, W_TMA=w_tma,
                DOT_PRECISION=input_precision(a_MK.dtype))
    _launch(_grouped_gemm_kernel, grid, args, meta, (K, N), {"w_ptr": w_arg})


def w_tma_ok(w_EKN: torch.Tensor) -> bool:
    """Whether the row-grouped kernel reads the weights through a tensor descriptor (Hopper's
    tensor-memory unit) instead of pointer loads: for transposed weights (K contiguous, the
    backward's w1ᵀ and w2ᵀ views), 16-bit, where ``_tma_can_describe`` their [E, N, K] storage,
    unless MEGATRON_MOE_W_TMA=0 (kernels/switches.py). The transposed weights' tiles are then
    moved by the tensor-memory unit instead of strided pointer loads; weights with N contiguous
    (the forward's) gained nothing from it and keep the pointer loads (measured: see
    docs/performance.md)."""
    return w_EKN.element_size() == 2 and switches.w_tma() and _tma_can_describe(w_EKN.transpose(1, 2))


def _tma_can_describe(t: torch.Tensor) -> bool:
    """Whether a host tensor descriptor over ``t`` can be used: Triton has them, an NVIDIA GPU of
    compute capability 9.0+ (not the interpreter), the last dimension contiguous, the base and the
    other strides multiples of 16 bytes (the tensor-memory unit's rules)."""
    return (TensorDescriptor is not None and t.is_cuda and not interpret_mode() and _tma_aligned(t)
            and torch.version.hip is None and capability(t.device.index)[0] >= 9)


def _tma_aligned(t: torch.Tensor) -> bool:
    """The tensor-memory unit's layout rules: the last dimension contiguous, the base address and
    the other strides multiples of 16 bytes."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]))


def grouped_gemm_triton(a_MK, w_EKN, offsets_E1, *, gather_S=None, scatter_S=None, scale_S=None,
                        activation=None, act_scale_S=None, out_dtype=None, out=None, act_out=None):
    """Triton launcher of :func:`grouped_gemm` (same arguments; ``out``/``act_out`` may be given
    preallocated, contiguous rows)."""
    S = _check_gemm(a_MK, w_EKN, offsets_E1, gather_S, scatter_S, scale_S, act_scale_S)
    if activation not in EPILOGUES:
        raise ValueError(f"activation={activation!r}: expected one of {EPILOGUES}")
    if act_scale_S is not None and activation is None:
        raise ValueError("act_scale_S scales the activation: pass activation='gelu' or 'swiglu'")
    E, K, Nw = w_EKN.shape
    if activation == "swiglu" and Nw % 2:
        raise ValueError(f"swiglu needs an even number of w columns [gate | up], got {Nw}")
    N = Nw // pre_width_factor(activation)
    out_dtype = out_dtype or a_MK.dtype
    dev = a_MK.device
    if out is None:
        out = torch.empty(S, Nw, device=dev, dtype=out_dtype)
    if activation is not None and act_out is None:
        act_out = torch.empty(S, N, device=dev, dtype=out_dtype)
    for name, t, cols in (("out", out, Nw), ("act_out", act_out, N)):
        if t is not None and (t.shape != (S, cols) or t.stride(1) != 1):
            raise ValueError(f"{name} must be [{S}, {cols}] with contiguous rows, got {tuple(t.shape)}")
    if S > 0 and N > 0:
        if K == 0:
            out.zero_()
            if activation is not None:  # act(0) = 0 for gelu and swiglu
                act_out.zero_()
        else:
            _launch_gemm(a_MK, w_EKN, offsets_E1, out, act_out, None, None, N=N, epilogue=activation or "none",
                         gather_S=gather_S, scatter_S=scatter_S, scale_S=scale_S, act_scale_S=act_scale_S)
    return out if activation is None else (out, act_out)


def grouped_gemm_dact_triton(a_MK, w_EKN, offsets_E1, pre_SX, activation, *, gather_S=None, scale_S=None,
                             inplace=False):
    """Triton launcher of :func:`grouped_gemm_dact`."""
    S, X = _check_dact(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S, scale_S)
    N, K = w_EKN.shape[2], w_EKN.shape[1]
    dev = a_MK.device
    dpre_SX = pre_SX if inplace else torch.empty_like(pre_SX)
    if S == 0 or N == 0 or K == 0:  # g = 0
        return dpre_SX.zero_(), torch.zeros(S, device=dev)
    dscale_part = torch.empty(S, cdiv(N, _DACT_SLOT), device=dev, dtype=torch.float32)
    _launch_gemm(a_MK, w_EKN, offsets_E1, dpre_SX, None, pre_SX, dscale_part, N=N, epilogue="d" + activation,
                 gather_S=gather_S, scatter_S=None, scale_S=scale_S)
    return dpre_SX, dscale_part.sum(1)


def _check_dact(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S, scale_S) -> tuple[int, int]:
    S = _check_gemm(a_MK, w_EKN, offsets_E1, gather_S, None, scale_S)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    N = w_EKN.shape[2]
    X = pre_width_factor(activation) * N
    if pre_SX.shape != (S, X) or pre_SX.stride(1) != 1:
        raise ValueError(f"pre_SX must be [{S}, {X}] with contiguous rows, got {tuple(pre_SX.shape)}")
    return S, X


def grouped_wgrad_triton(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, scale_S=None,
                         a_activation=None, a_scale_S=None, out_dtype=None, out=None, accumulate=False):
    """Triton launcher of :func:`grouped_wgrad`."""
    E = offsets_E1.shape[0] - 1
    S, K = _check_wgrad(a_MK, b_MN, offsets_E1, gather_a_S, gather_b_S, scale_S, a_activation, a_scale_S)
    N = b_MN.shape[1]
    _check_wgrad_out(out, accumulate, (E, K, N), a_MK.device)
    if out is None:
        out = torch.empty(E, K, N, device=a_MK.device, dtype=out_dtype or a_MK.dtype)
    if S == 0:
        return out if accumulate else out.zero_()
    if E == 0 or K == 0 or N == 0:
        return out

    def grid(meta):
        return (E * cdiv(K, meta["BLOCK_K"]) * cdiv(N, meta["BLOCK_N"]),)

    dummy = offsets_E1
    tma_ok = bool(accumulate) and tma_add_ok(out)
    out_desc = TensorDescriptor.from_tensor(out, [1, 16, 16]) if tma_ok else None  # box: _size_out_desc
    args = (a_MK, b_MN, out, out_desc, scale_S if scale_S is not None else dummy,
            a_scale_S if a_scale_S is not None else dummy,
            gather_a_S if gather_a_S is not None else dummy, gather_b_S if gather_b_S is not None else dummy,
            offsets_E1,
            K, N,
            a_MK.stride(0), a_MK.stride(1), b_MN.stride(0), b_MN.stride(1),
            out.stride(0), out.stride(1), out.stride(2))
    meta = dict(HAS_GATHER_A=gather_a_S is not None, HAS_GATHER_B=gather_b_S is not None,
                HAS_SCALE=scale_S is not None, ACT_A=a_activation or "none", HAS_A_SCALE=a_scale_S is not None,
                FAST_MATH=a_MK.dtype != torch.float32 and not interpret_mode(), ACCUMULATE=bool(accumulate),
                TMA_OK=tma_ok, DOT_PRECISION=input_precision(a_MK.dtype))
    _launch(_grouped_wgrad_kernel, grid, args, meta, (K, N), {"out_desc": out_desc})
    return out


def tma_add_ok(out: torch.Tensor) -> bool:
    """Whether an accumulating weight gradient may add into ``out`` through TMA: fp32 out where
    Triton has the descriptors' reduce-add and ``_tma_can_describe`` it, unless
    MEGATRON_MOE_TMA_ADD=0 (kernels/switches.py). The autotuner then chooses between the
    reduce-add and the kernel's own load-add-store of the fp32 tile (``_prune_wgrad_configs``);
    without it the kernel loads, adds and stores."""
    return (_HAS_TMA_ADD and out.dtype == torch.float32 and switches.tma_add() is not False
            and _tma_can_describe(out))


def _check_wgrad_out(out, accumulate, shape, device) -> None:
    if out is None:
        if accumulate:
            raise ValueError("grouped_wgrad: accumulate=True adds into out: pass out (e.g. an fp32 .grad)")
        return
    if tuple(out.shape) != shape or out.device != device or not out.is_floating_point():
        raise ValueError(f"out must be a floating-point [{shape[0]}, {shape[1]}, {shape[2]}] tensor on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def _check_wgrad(a_MK, b_MN, offsets_E1, gather_a_S, gather_b_S, scale_S, a_activation=None,
                 a_scale_S=None) -> tuple[int, int]:
    """(S sorted rows, K columns of A = rows of each dw)."""
    if a_MK.dim() != 2 or b_MN.dim() != 2:
        raise ValueError(f"expected 2-D a and b, got {tuple(a_MK.shape)} and {tuple(b_MN.shape)}")
    if a_MK.dtype != b_MN.dtype or a_MK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a and b must share one of float32/bfloat16/float16, got {a_MK.dtype} and {b_MN.dtype}")
    if a_activation not in EPILOGUES:
        raise ValueError(f"a_activation={a_activation!r}: expected one of {EPILOGUES}")
    if a_scale_S is not None and a_activation is None:
        raise ValueError("a_scale_S scales the recomputed activation: pass a_activation='gelu' or 'swiglu'")
    K = a_MK.shape[1]
    if a_activation == "swiglu":
        if K % 2:
            raise ValueError(f"a_activation='swiglu' needs a = [gate | up] with an even number of columns, got {K}")
        K //= 2
    E = offsets_E1.shape[0] - 1
    _check_offsets(offsets_E1, E)
    S = _num_sorted(a_MK, gather_a_S)
    if _num_sorted(b_MN, gather_b_S) != S:
        raise ValueError(f"a provides {S} sorted rows but b provides {_num_sorted(b_MN, gather_b_S)}")
    _check_index("gather_a_S", gather_a_S, S, a_MK.device)
    _check_index("gather_b_S", gather_b_S, S, a_MK.device)
    _check_scale(scale_S, S)
    _check_scale(a_scale_S, S, "a_scale_S")
    return S, K


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch references (also the CPU path when Triton is not launched). They slice each
# expert's segment, which reads offsets_E1 on the host: that is fine on the CPU, and the GPU
# always runs the kernels above, which never synchronise.
# ----------------------------------------------------------------------------------------------


def _grouped_matmul_f32(a_MK, w_EKN, offsets_E1, gather_S):
    """fp32 [S, N] = a[gather(s)] @ w[expert(s)]."""
    S = _num_sorted(a_MK, gather_S)
    rows = a_MK if gather_S is None else a_MK[gather_S.long()]
    acc = torch.zeros(S, w_EKN.shape[2], device=a_MK.device, dtype=torch.float32)
    for e, lo, hi in expert_segments(offsets_E1):
        acc[lo:hi] = rows[lo:hi].float() @ w_EKN[e].float()
    return acc


def _scatter_rows(x_SN, scatter_S):
    if scatter_S is None:
        return x_SN
    return torch.empty_like(x_SN).index_copy_(0, scatter_S.long(), x_SN)


def grouped_gemm_reference(a_MK, w_EKN, offsets_E1, *, gather_S=None, scatter_S=None, scale_S=None,
                           activation=None, act_scale_S=None, out_dtype=None):
    _check_gemm(a_MK, w_EKN, offsets_E1, gather_S, scatter_S, scale_S, act_scale_S)
    out_dtype = out_dtype or a_MK.dtype
    acc = _grouped_matmul_f32(a_MK, w_EKN, offsets_E1, gather_S)
    if scale_S is not None:
        acc = acc * scale_S[:, None]
    pre = acc.to(out_dtype)
    if activation is None:
        return _scatter_rows(pre, scatter_S)
    if activation not in EPILOGUES:
        raise ValueError(f"activation={activation!r}: expected one of {EPILOGUES}")
    act = _activation_reference(pre, activation, act_scale_S, out_dtype)
    return _scatter_rows(pre, scatter_S), _scatter_rows(act, scatter_S)


def grouped_gemm_dact_reference(a_MK, w_EKN, offsets_E1, pre_SX, activation, *, gather_S=None, scale_S=None,
                                inplace=False):
    _check_dact(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S, scale_S)
    g = _grouped_matmul_f32(a_MK, w_EKN, offsets_E1, gather_S)
    g_scaled = g if scale_S is None else g * scale_S[:, None]
    dpre, act = activation_bwd_reference(pre_SX, g_scaled, activation)
    dpre = dpre.to(pre_SX.dtype)
    return (pre_SX.copy_(dpre) if inplace else dpre), (g * act).sum(1)


def _activation_reference(pre_SX, activation, act_scale_S, out_dtype):
    """The forward's act_out from its rounded pre-activation: act_scale(s) · act(pre), in out_dtype,
    with the kernel epilogue's GELU formula (torch's own gelu rounds differently)."""
    h = pre_SX.float()
    act = gelu_and_grad_reference(h)[0] if activation == "gelu" else activate(h, activation)
    if act_scale_S is not None:
        act = act * act_scale_S[:, None]
    return act.to(out_dtype)


def grouped_wgrad_reference(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, scale_S=None,
                            a_activation=None, a_scale_S=None, out_dtype=None, out=None, accumulate=False):
    _, K = _check_wgrad(a_MK, b_MN, offsets_E1, gather_a_S, gather_b_S, scale_S, a_activation, a_scale_S)
    E = offsets_E1.shape[0] - 1
    _check_wgrad_out(out, accumulate, (E, K, b_MN.shape[1]), a_MK.device)
    a = a_MK if gather_a_S is None else a_MK[gather_a_S.long()]
    if a_activation is not None:
        a = _activation_reference(a, a_activation, a_scale_S, a_MK.dtype)
    b = b_MN if gather_b_S is None else b_MN[gather_b_S.long()]
    b = b.float() if scale_S is None else (b.float() * scale_S[:, None]).to(b.dtype).float()
    dw = torch.zeros(E, K, b_MN.shape[1], device=a_MK.device, dtype=torch.float32)
    for e, lo, hi in expert_segments(offsets_E1):
        dw[e] = a[lo:hi].float().t() @ b[lo:hi]
    if out is None:
        return dw.to(out_dtype or a_MK.dtype)
    return out.copy_(out.float() + dw if accumulate else dw)


# ----------------------------------------------------------------------------------------------
# Public entry points (Triton on the GPU / under the interpreter, the reference otherwise)
# ----------------------------------------------------------------------------------------------


def grouped_gemm(a_MK, w_EKN, offsets_E1, *, gather_S=None, scatter_S=None, scale_S=None,
                 activation=None, act_scale_S=None, out_dtype=None):
    """Row-grouped GEMM: for sorted position s of expert e,
    ``out[scatter(s)] = epilogue(scale(s) * a[gather(s)] @ w[e])``.

    a_MK [M, K] and w_EKN [E, K, N] (any strides, e.g. ``w2.transpose(1, 2)``) share one dtype;
    gather_S / scatter_S: int vectors of the S sorted positions (None = identity; scatter must be
    a permutation of [0, S)); scale_S: fp32 [S]; offsets_E1: int32 [E+1] with offsets_E1[-1] = S.
    Accumulates in fp32. Returns, in ``out_dtype`` (default a's):
      activation None:     out [S, N]
      activation 'gelu':   (pre [S, N], act_scale(s) * gelu_tanh(pre) [S, N])
      activation 'swiglu': (pre [S, N] = [gate | up], act_scale(s) * silu(gate) * up [S, N/2])
    act_scale_S (fp32 [S], default 1) multiplies the activation only, after it is computed from
    the rounded pre-activation. On sm_90 a bf16 call without ``scale_S`` runs
    kernels/gluon_gemm.py's kernels where they apply (MEGATRON_MOE_GLUON_GEMM=0: never).
    """
    if gluon_gemm.supported(a_MK, w_EKN, offsets_E1, gather_S=gather_S, scatter_S=scatter_S, scale_S=scale_S,
                            activation=activation, act_scale_S=act_scale_S, out_dtype=out_dtype):
        _check_gemm(a_MK, w_EKN, offsets_E1, gather_S, scatter_S, scale_S, act_scale_S)
        return gluon_gemm.grouped_gemm_gluon(a_MK, w_EKN, offsets_E1, gather_S=gather_S, activation=activation,
                                             act_scale_S=act_scale_S)
    fn = grouped_gemm_triton if use_triton(a_MK, w_EKN, offsets_E1) else grouped_gemm_reference
    return fn(a_MK, w_EKN, offsets_E1, gather_S=gather_S, scatter_S=scatter_S, scale_S=scale_S,
              activation=activation, act_scale_S=act_scale_S, out_dtype=out_dtype)


def grouped_gemm_dact(a_MK, w_EKN, offsets_E1, pre_SX, activation, *, gather_S=None, scale_S=None,
                      inplace=False):
    """Backward of the activation fused into the GEMM that produces its output gradient.

    With g[s] = a[gather(s)] @ w[e] (= dL/d act, e.g. dy[t] @ w2[e]ᵀ) and the saved
    pre-activation pre_SX (gelu: [S, N]; swiglu: [S, 2N] = [gate | up]), returns
      dpre_SX [S, X]: scale(s) * g * act'(pre)  (swiglu: [d_gate | d_up]), in pre's dtype,
              written over pre_SX when ``inplace`` (pre is then gone: the caller owns it),
      dscale_S fp32 [S]: Σ_n g·act(pre), i.e. dL/d scale(s) when the forward multiplied the
              expert output by scale(s) (act recomputed from pre, not read).
    """
    if gluon_dact.supported(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S=gather_S, scale_S=scale_S):
        _check_dact(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S, scale_S)
        return gluon_dact.grouped_gemm_dact_pingpong(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S=gather_S,
                                                     scale_S=scale_S, inplace=inplace)
    fn = grouped_gemm_dact_triton if use_triton(a_MK, w_EKN, offsets_E1) else grouped_gemm_dact_reference
    return fn(a_MK, w_EKN, offsets_E1, pre_SX, activation, gather_S=gather_S, scale_S=scale_S, inplace=inplace)


def grouped_wgrad(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, scale_S=None,
                  a_activation=None, a_scale_S=None, out_dtype=None, out=None, accumulate=False):
    """Grouped weight gradient: dw[e] = Σ_{s of e} A(s)ᵀ · (scale(s) · b[gb(s)]) → [E, K, N].

    A(s) = a[ga(s)], or with ``a_activation`` ('gelu' / 'swiglu') the activation recomputed from
    the saved pre-activation a (swiglu: [S, 2K] = [gate | up]) times a_scale(s), rounded to a's
    dtype: exactly what ``grouped_gemm(..., activation=, act_scale_S=)`` wrote as its activation,
    which then need not be kept for the backward. Experts without rows get exact zeros.
    Accumulates in fp32; returns ``out_dtype`` (default a's), or writes into ``out`` [E, K, N]
    and returns it; with ``accumulate`` ``out += dw`` before the one rounding to out's dtype
    (fp32 out: gradient accumulation over micro-batches fused into the GEMM's epilogue; on sm_90+
    done by TMA's reduce-add where ``tma_add_ok(out)``, with the same bits). On sm_90 a gradient
    without scale or activation (new bf16 or fp32, or into fp32 ``out``, added or not) runs
    kernels/gluon_wgrad.py's kernel where it applies.
    """
    kw = dict(gather_a_S=gather_a_S, gather_b_S=gather_b_S, scale_S=scale_S, a_activation=a_activation,
              a_scale_S=a_scale_S, out_dtype=out_dtype, out=out, accumulate=accumulate)
    if gluon_wgrad.supported(a_MK, b_MN, offsets_E1, **kw):
        _check_wgrad(a_MK, b_MN, offsets_E1, gather_a_S, gather_b_S, scale_S, a_activation, a_scale_S)
        return gluon_wgrad.grouped_wgrad_gluon(a_MK, b_MN, offsets_E1, gather_a_S=gather_a_S, gather_b_S=gather_b_S,
                                               out_dtype=out_dtype, out=out, accumulate=accumulate)
    fn = grouped_wgrad_triton if use_triton(a_MK, b_MN, offsets_E1) else grouped_wgrad_reference
    return fn(a_MK, b_MN, offsets_E1, gather_a_S=gather_a_S, gather_b_S=gather_b_S, scale_S=scale_S,
              a_activation=a_activation, a_scale_S=a_scale_S, out_dtype=out_dtype, out=out,
              accumulate=accumulate)
