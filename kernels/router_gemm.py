"""The router's three GEMMs with the bf16 split of their fp32 operands done in registers.

    logits_TE = logits_triton(x_TH, w_EH)                      # fp32 [T, E], fp32-accurate
    dx_TH, dw_EH = logits_backward_triton(dlogits_TE, x_TH, w_EH)   # both gradients in one pass
    dx_TH = logits_dx_triton(dlogits_TE, w_EH, x_TH.dtype)     # dL/dx alone
    dw_EH = logits_dw_triton(dlogits_TE, x_TH, w_EH.dtype)     # dL/dw alone, in w's dtype

The router's logits are fp32-accurate at bf16 speed (megatron_moe/ops/router_logits.py): an fp32
operand is split into bf16 parts whose products with a bf16 operand are exact on the tensor cores
and whose sum, accumulated in fp32, is the operand to 24 bits (three parts) or 16 (two):
  forward  logits = Σ_p x @ w_pᵀ           p over w's parts (1 for bf16 w; hi, mid, lo for fp32 w)
  dx       dx = Σ_q g_q @ w_hi (+ g_hi @ w_mid for fp32 w)   g = dL/dlogits in parts hi, lo
                                           (bf16 w) or hi, mid, lo (fp32 w); the products dropped
                                           are below 2^-16 of Σ|g||w| (dx is rounded to bf16)
  dw       dw = Σ_q g_qᵀ @ x               fp32 partials over blocks of tokens, summed in a fixed
                                           order (deterministic), rounded once to w's dtype
Here each kernel loads the fp32 operand's tile once and splits it in registers. The backward's
two GEMMs run as one kernel where the experts fit one block (E <= 128): a program takes a range of
tokens and a block of H, splits g's rows once for both products, writes dx's tile (added, if given,
to the experts' dx of the same x, which it overwrites: one read and one write instead of the add's
two reads and a write) and sums dw's partial over its tokens; x and dx cross memory once each
(docs/performance.md, "The router's backward in one pass"). Through torch
(:func:`logits_reference`, :func:`logits_backward_reference`; also the CPU path) the same sums take
~10 ops per layer step: the parts, their concatenations, two GEMMs and the sum over the parts,
each with its host cost (docs/performance.md, "The router's GEMMs in Triton").

Legend: T tokens, H hidden, E experts, C blocks of tokens of the weight gradient's partials.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, cdiv, dot, next_power_of_2, num_sms
from .column_sum import sum_partials
from .launcher import launch

# One fixed config per kernel and dtype of the fp32-split operand (BLOCK_E: the most experts per
# tile; fewer, a power of two from 16, for fewer experts): the logits' [BLOCK_T, BLOCK_E] tiles of a
# [T, H] x [H, E] product (E <= 128 in one tile: x read once), dx's [BLOCK_T, BLOCK_H] over E,
# dw's [BLOCK_E, BLOCK_H] over a block of tokens. Chosen by benchmarks/bench_router_gemm.py --sweep
# on an H200 (dmoe-small and qwen3 shapes; benchmarks/results/router-gemm-h200-2026-12-02/).
FWD_CONFIG = {torch.bfloat16: dict(BLOCK_T=64, BLOCK_H=64, BLOCK_E=128, num_warps=8, num_stages=4),
              torch.float32: dict(BLOCK_T=128, BLOCK_H=64, BLOCK_E=128, num_warps=8, num_stages=3)}
DX_CONFIG = {torch.bfloat16: dict(BLOCK_T=128, BLOCK_H=128, BLOCK_E=64, num_warps=4, num_stages=3),
             torch.float32: dict(BLOCK_T=128, BLOCK_H=128, BLOCK_E=64, num_warps=8, num_stages=3)}
DW_CONFIG = {torch.bfloat16: dict(BLOCK_T=32, BLOCK_H=128, BLOCK_E=64, num_warps=4, num_stages=3),
             torch.float32: dict(BLOCK_T=32, BLOCK_H=128, BLOCK_E=64, num_warps=4, num_stages=3)}
# the fused backward (E <= BWD_MAX_E: BLOCK_E = E's power of two, one block; PROGRAMS_PER_SM: the
# grid's programs per SM, each a range of tokens and a block of H; DW_FIRST: dw's products before
# dx's in the loop, where ptxas does not serialise the MMAs): the fastest of
# bench_router_gemm.py --sweep --ops bwd at dmoe-small's and dmoe-xs's shapes (micro-batch 64, bf16
# weights as in training; fp32 weights take the same, unswept): tiles, warps and stages on an H200
# (benchmarks/results/router-bwd-h200-2026-12-04/), DW_FIRST on an H100, 1.06x the other order
# (benchmarks/results/h100-tables-2026-12-06/)
BWD_CONFIG = {torch.bfloat16: dict(BLOCK_T=64, BLOCK_H=128, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2,
                                   DW_FIRST=True),
              torch.float32: dict(BLOCK_T=64, BLOCK_H=128, num_warps=4, num_stages=2, PROGRAMS_PER_SM=2,
                                  DW_FIRST=True)}
BWD_MAX_E = 128


def _config(table: dict, dtype: torch.dtype, E: int) -> dict:
    """The launch keywords of ``table``'s config for ``dtype``, BLOCK_E cut to E's power of two
    (at least 16, tl.dot's smallest)."""
    cfg = dict(table[dtype])
    cfg["BLOCK_E"] = max(16, min(cfg["BLOCK_E"], next_power_of_2(E)))
    return cfg


@triton.jit
def _split(v, PARTS: tl.constexpr):
    """The bf16 parts of fp32 ``v``, as :func:`split_bf16`: (hi, mid, lo); with two parts
    (hi, lo, lo), with one (hi, hi, hi)."""
    hi = v.to(tl.bfloat16)
    mid = hi
    lo = hi
    if PARTS >= 2:
        rest = v - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = mid
        if PARTS == 3:
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _logits_kernel(x_ptr, w_ptr, out_ptr, T, H, E, stride_xt, stride_we,
                   W_PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, e] = Σ_p Σ_h x[t, h] · w_p[e, h] in fp32 (w_p: w's bf16 parts, or w itself)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok, col_ok = rows < T, cols < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + hs[None, :],
                    mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_we + hs[:, None], mask=col_ok[None, :] & h_ok[:, None],
                    other=0.0)  # [BLOCK_H, BLOCK_E]: wᵀ's tile
        if W_PARTS == 1:
            acc = dot(x, w, acc, "tf32")
        else:
            w_hi, w_mid, w_lo = _split(w, 3)
            acc = dot(x, w_hi, acc, "tf32")
            acc = dot(x, w_mid, acc, "tf32")
            acc = dot(x, w_lo, acc, "tf32")
    tl.store(out_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _logits_dx_kernel(g_ptr, w_ptr, dx_ptr, T, H, E, stride_gt, stride_we,
                      W_PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr):
    """dx[t, h] = Σ_e (g_hi + g_mid + g_lo)[t, e] · w_hi[e, h] (+ g_hi · w_mid for fp32 w);
    g_mid = 0 for a bf16 w (two parts of g)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok, h_ok = rows < T, hs < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_ok = es < E
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_gt + es[None, :],
                    mask=row_ok[:, None] & e_ok[None, :], other=0.0)
        w = tl.load(w_ptr + es[:, None] * stride_we + hs[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        if W_PARTS == 1:
            g_hi, g_lo, _ = _split(g, 2)
            acc = dot(g_hi, w, acc, "tf32")
            acc = dot(g_lo, w, acc, "tf32")
        else:
            g_hi, g_mid, g_lo = _split(g, 3)
            w_hi, w_mid, _ = _split(w, 2)
            acc = dot(g_hi, w_hi, acc, "tf32")
            acc = dot(g_mid, w_hi, acc, "tf32")
            acc = dot(g_lo, w_hi, acc, "tf32")
            acc = dot(g_hi, w_mid, acc, "tf32")
    tl.store(dx_ptr + rows[:, None].to(tl.int64) * H + hs[None, :], cast(acc, dx_ptr.dtype.element_ty),
             mask=row_ok[:, None] & h_ok[None, :])


@triton.jit
def _logits_dw_kernel(g_ptr, x_ptr, out_ptr, T, H, E, stride_gt, stride_xt, ROWS_PER_PROGRAM,
                      G_PARTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """out[c, e, h] = Σ_{t in block c} Σ_q g_q[t, e] · x[t, h] (fp32 partials; or w's dtype with
    one block); G_PARTS bf16 parts of g (2 for a bf16 w, 3 for an fp32 one)."""
    es = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.program_id(2)
    e_ok, h_ok = es < E, hs < H
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    start = c * ROWS_PER_PROGRAM
    for t0 in range(start, tl.minimum(start + ROWS_PER_PROGRAM, T), BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        g = tl.load(g_ptr + ts[None, :].to(tl.int64) * stride_gt + es[:, None],
                    mask=e_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_E, BLOCK_T]: gᵀ's tile
        x = tl.load(x_ptr + ts[:, None].to(tl.int64) * stride_xt + hs[None, :],
                    mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        g_hi, g_mid, g_lo = _split(g, G_PARTS)
        acc = dot(g_hi, x, acc, "tf32")
        acc = dot(g_mid, x, acc, "tf32")
        if G_PARTS == 3:
            acc = dot(g_lo, x, acc, "tf32")
    tl.store(out_ptr + c.to(tl.int64) * E * H + es[:, None] * H + hs[None, :], cast(acc, out_ptr.dtype.element_ty),
             mask=e_ok[:, None] & h_ok[None, :])


@triton.jit
def _dw_step(g_hi, g_mid, g_lo, x_ptr, ts, t_ok, hs, h_ok, stride_xt, acc_dw, W_PARTS: tl.constexpr):
    """acc_dw + Σ_q g_qᵀ · x over a block of tokens (x's [BLOCK_T, BLOCK_H] tile loaded here)."""
    x = tl.load(x_ptr + ts[:, None].to(tl.int64) * stride_xt + hs[None, :], mask=t_ok[:, None] & h_ok[None, :],
                other=0.0)
    acc_dw = dot(tl.trans(g_hi), x, acc_dw, "tf32")
    acc_dw = dot(tl.trans(g_mid), x, acc_dw, "tf32")
    if W_PARTS == 3:
        acc_dw = dot(tl.trans(g_lo), x, acc_dw, "tf32")
    return acc_dw


@triton.jit
def _logits_bwd_kernel(g_ptr, w_ptr, x_ptr, dx_ptr, dw_ptr, T, H, E, stride_gt, stride_we, stride_xt,
                       ROWS_PER_PROGRAM, W_PARTS: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
                       ADD_DX: tl.constexpr, DW_FIRST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """Program (c, j), tokens [c·R, (c+1)·R) and columns j·BLOCK_H + [0, BLOCK_H), all E experts in
    one block: dx[t, h] = the sums of :func:`_logits_dx_kernel` (+ dx[t, h] as stored, ADD_DX) and
    dw_part[c, e, h] = Σ_t Σ_q g_q[t, e] · x[t, h] (of :func:`_logits_dw_kernel`), g split once.
    DW_FIRST: dw's products issued before dx's in the loop (the same sums); ptxas serialises the
    MMAs of the other order (note C7515), not of this one. Untimed: a sweep candidate."""
    c = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    es = tl.arange(0, BLOCK_E)
    h_ok, e_ok = hs < H, es < E
    w = tl.load(w_ptr + es[:, None] * stride_we + hs[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
    w_hi, w_mid, _ = _split(w, 2 if W_PARTS == 3 else 1)
    acc_dw = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    start = c * ROWS_PER_PROGRAM
    for t0 in range(start, tl.minimum(start + ROWS_PER_PROGRAM, T), BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        g = tl.load(g_ptr + ts[:, None].to(tl.int64) * stride_gt + es[None, :],
                    mask=t_ok[:, None] & e_ok[None, :], other=0.0)
        g_hi, g_mid, g_lo = _split(g, 3 if W_PARTS == 3 else 2)  # bf16 w: (hi, lo, lo)
        if HAS_DW and DW_FIRST:
            acc_dw = _dw_step(g_hi, g_mid, g_lo, x_ptr, ts, t_ok, hs, h_ok, stride_xt, acc_dw, W_PARTS)
        if HAS_DX:
            acc = dot(g_hi, w_hi, None, "tf32")
            acc = dot(g_mid, w_hi, acc, "tf32")
            if W_PARTS == 3:
                acc = dot(g_lo, w_hi, acc, "tf32")
                acc = dot(g_hi, w_mid, acc, "tf32")
            at = ts[:, None].to(tl.int64) * H + hs[None, :]
            ok = t_ok[:, None] & h_ok[None, :]
            if ADD_DX:
                acc += tl.load(dx_ptr + at, mask=ok, other=0.0).to(tl.float32)
            tl.store(dx_ptr + at, cast(acc, dx_ptr.dtype.element_ty), mask=ok)
        if HAS_DW and not DW_FIRST:
            acc_dw = _dw_step(g_hi, g_mid, g_lo, x_ptr, ts, t_ok, hs, h_ok, stride_xt, acc_dw, W_PARTS)
    if HAS_DW:
        tl.store(dw_ptr + c.to(tl.int64) * E * H + es[:, None] * H + hs[None, :],
                 cast(acc_dw, dw_ptr.dtype.element_ty), mask=e_ok[:, None] & h_ok[None, :])


def _check(x_TH: torch.Tensor, w_EH: torch.Tensor) -> None:
    if x_TH.dim() != 2 or w_EH.dim() != 2 or x_TH.shape[1] != w_EH.shape[1]:
        raise ValueError(f"router logits: expected x [T, H] and w [E, H], got {tuple(x_TH.shape)} and "
                         f"{tuple(w_EH.shape)}")
    if x_TH.dtype != torch.bfloat16 or w_EH.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"router logits: expected bf16 x and an fp32 or bf16 w, got {x_TH.dtype} and {w_EH.dtype}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def logits_triton(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """x_TH @ w_EHᵀ in fp32 [T, E] for bf16 x and an fp32 (three bf16 parts) or bf16 w."""
    _check(x_TH, w_EH)
    x_TH, w_EH = _rows(x_TH), _rows(w_EH)
    (T, H), E = x_TH.shape, w_EH.shape[0]
    out_TE = torch.empty(T, E, device=x_TH.device, dtype=torch.float32)
    if T == 0 or E == 0:
        return out_TE
    if H == 0:
        return out_TE.zero_()
    cfg = _config(FWD_CONFIG, w_EH.dtype, E)
    launch(_logits_kernel, (cdiv(T, cfg["BLOCK_T"]), cdiv(E, cfg["BLOCK_E"])),
           (x_TH, w_EH, out_TE, T, H, E, x_TH.stride(0), w_EH.stride(0)),
           dict(W_PARTS=1 if w_EH.dtype == torch.bfloat16 else 3, **cfg))
    return out_TE


def logits_dx_triton(g_TE: torch.Tensor, w_EH: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dL/dx [T, H] in ``out_dtype`` from fp32 g_TE = dL/dlogits (the sums of the module doc)."""
    g_TE, w_EH = _rows(g_TE.float()), _rows(w_EH)
    (T, E), H = g_TE.shape, w_EH.shape[1]
    dx_TH = torch.empty(T, H, device=g_TE.device, dtype=out_dtype)
    if T == 0 or H == 0:
        return dx_TH
    if E == 0:
        return dx_TH.zero_()
    cfg = _config(DX_CONFIG, w_EH.dtype, E)
    launch(_logits_dx_kernel, (cdiv(T, cfg["BLOCK_T"]), cdiv(H, cfg["BLOCK_H"])),
           (g_TE, w_EH, dx_TH, T, H, E, g_TE.stride(0), w_EH.stride(0)),
           dict(W_PARTS=1 if w_EH.dtype == torch.bfloat16 else 3, **cfg))
    return dx_TH


def logits_dw_triton(g_TE: torch.Tensor, x_TH: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dL/dw [E, H] in ``out_dtype`` (w's: bf16 takes two parts of g, fp32 three) from fp32
    g_TE = dL/dlogits and bf16 x_TH; deterministic (fixed blocks of tokens, summed in order)."""
    g_TE, x_TH = _rows(g_TE.float()), _rows(x_TH)
    (T, E), H = g_TE.shape, x_TH.shape[1]
    dev = g_TE.device
    if T == 0 or E == 0 or H == 0:
        return torch.zeros(E, H, device=dev, dtype=out_dtype)
    cfg = _config(DW_CONFIG, out_dtype, E)
    block_e, block_t = cfg["BLOCK_E"], cfg["BLOCK_T"]
    tiles = cdiv(E, block_e) * cdiv(H, cfg["BLOCK_H"])
    sms = num_sms(dev)
    blocks = max(1, min(cdiv(2 * sms, tiles), cdiv(T, 4 * block_t)))  # at least 4 token tiles each
    rows_per_program = cdiv(cdiv(T, blocks), block_t) * block_t
    C = cdiv(T, rows_per_program)
    out = torch.empty((C, E, H) if C > 1 else (E, H), device=dev, dtype=torch.float32 if C > 1 else out_dtype)
    launch(_logits_dw_kernel, (cdiv(E, block_e), cdiv(H, cfg["BLOCK_H"]), C),
           (g_TE, x_TH, out, T, H, E, g_TE.stride(0), x_TH.stride(0), rows_per_program),
           dict(G_PARTS=2 if out_dtype == torch.bfloat16 else 3, **cfg))
    if C == 1:
        return out
    return sum_partials(out.view(C, E * H), torch.empty(E, H, device=dev, dtype=out_dtype))


def logits_backward_triton(g_TE: torch.Tensor, x_TH: torch.Tensor, w_EH: torch.Tensor, need_dx: bool = True,
                           need_dw: bool = True, dx_add_TH: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dx in x's dtype, dL/dw in w's) from fp32 g_TE = dL/dlogits: the sums of
    :func:`logits_dx_triton` and :func:`logits_dw_triton`, in one kernel for E <= BWD_MAX_E (else
    those two). ``dx_add_TH``: a contiguous tensor of dx's shape and dtype (the experts' dL/dx)
    that dx is added to in place and returned as (rounded once: the fp32 sum of it as stored and
    the router's part)."""
    g_TE, x_TH, w_EH = _rows(g_TE.float()), _rows(x_TH), _rows(w_EH)
    (T, E), H = g_TE.shape, x_TH.shape[1]
    if dx_add_TH is not None and (dx_add_TH.shape != x_TH.shape or dx_add_TH.dtype != x_TH.dtype
                                  or not dx_add_TH.is_contiguous()):
        raise ValueError(f"router logits backward: dx_add_TH must be a contiguous {x_TH.dtype} tensor of shape "
                         f"{tuple(x_TH.shape)}, got {dx_add_TH.dtype} {tuple(dx_add_TH.shape)}")
    if E > BWD_MAX_E or T == 0 or E == 0 or H == 0 or not (need_dx or need_dw):
        dx = None
        if need_dx and dx_add_TH is None:
            dx = logits_dx_triton(g_TE, w_EH, x_TH.dtype)
        elif need_dx:  # the sum in fp32, rounded once as the kernel's
            dx = dx_add_TH.copy_(dx_add_TH.float() + logits_dx_triton(g_TE, w_EH, torch.float32))
        return dx, logits_dw_triton(g_TE, x_TH, w_EH.dtype) if need_dw else None
    dev = g_TE.device
    cfg = dict(BWD_CONFIG[w_EH.dtype])
    per_sm = cfg.pop("PROGRAMS_PER_SM")
    block_t, block_h = cfg["BLOCK_T"], cfg["BLOCK_H"]
    cfg["BLOCK_E"] = max(16, next_power_of_2(E))
    tiles_h = cdiv(H, block_h)
    blocks = max(1, min(cdiv(per_sm * num_sms(dev), tiles_h), cdiv(T, 4 * block_t)))  # at least 4 token tiles each
    rows_per_program = cdiv(cdiv(T, blocks), block_t) * block_t
    C = cdiv(T, rows_per_program)
    dx = None
    if need_dx:
        dx = dx_add_TH if dx_add_TH is not None else torch.empty(T, H, device=dev, dtype=x_TH.dtype)
    dw = part = None
    if need_dw:
        part = torch.empty((C, E, H) if C > 1 else (E, H), device=dev,
                           dtype=torch.float32 if C > 1 else w_EH.dtype)
    launch(_logits_bwd_kernel, (C, tiles_h),
           (g_TE, w_EH, x_TH, dx if dx is not None else g_TE, part if part is not None else g_TE, T, H, E,
            g_TE.stride(0), w_EH.stride(0), x_TH.stride(0), rows_per_program),
           dict(W_PARTS=1 if w_EH.dtype == torch.bfloat16 else 3, HAS_DX=need_dx, HAS_DW=need_dw,
                ADD_DX=dx_add_TH is not None, **cfg))
    if need_dw:
        dw = part if C == 1 else sum_partials(part.view(C, E * H), torch.empty(E, H, device=dev, dtype=w_EH.dtype))
    return dx, dw


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch references (also the CPU path without the interpreter): the same sums through
# torch ops, the fp32 operand's parts stacked into one GEMM operand
# ----------------------------------------------------------------------------------------------


def mm_f32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b of bf16 a and b, returned in ``out_dtype``: fp32 output from fp32 accumulation on the
    tensor cores on CUDA (a bf16 output: torch's bf16 GEMM, which accumulates in fp32 unless
    cuBLAS splits the reduction); elsewhere exact products and fp32 sums through an fp32 matmul."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype) if out_dtype == torch.float32 else torch.mm(a, b).to(out_dtype)
    return (a.float() @ b.float()).to(out_dtype)


def split_bf16(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """bf16 tensors whose fp32 sum is t to ~8 * parts bits (3 parts: t exactly, for fp32 t)."""
    out, rest = [t.to(torch.bfloat16)], t
    for _ in range(parts - 1):
        rest = rest - out[-1]
        out.append(rest.to(torch.bfloat16))
    return out


def logits_reference(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """:func:`logits_triton` through torch: one GEMM against w's parts stacked along E, summed."""
    T, E = x_TH.shape[0], w_EH.shape[0]
    if w_EH.dtype == torch.bfloat16:
        return mm_f32(x_TH, w_EH.t())
    return mm_f32(x_TH, torch.cat(split_bf16(w_EH, 3), 0).t()).view(T, 3, E).sum(1)


def logits_backward_reference(g_TE: torch.Tensor, x_TH: torch.Tensor, w_EH: torch.Tensor, need_dx: bool = True,
                              need_dw: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx in x's dtype, dw in w's) of :func:`logits_dx_triton` and :func:`logits_dw_triton` through
    torch, g's parts made once for both: side by side in one operand A, against w's parts stacked
    for dx (bf16 w: [g_hi, g_lo] @ [w; w]; fp32 w: [g_hi, g_mid, g_lo, g_hi] @ [w_hi; w_hi; w_hi;
    w_mid]); dw = Σ_q A_qᵀ @ x over A's first Q·E columns (g's Q parts), one GEMM summed over q."""
    E = g_TE.shape[1]
    Q = 2 if w_EH.dtype == torch.bfloat16 else 3
    g_parts = split_bf16(g_TE.float(), Q)
    a_TJ = torch.cat(g_parts if Q == 2 else g_parts + g_parts[:1], 1)
    dx = dw = None
    if need_dx:
        if Q == 2:
            b_JH = torch.cat([w_EH, w_EH], 0)
        else:
            w_hi, w_mid = split_bf16(w_EH, 2)
            b_JH = torch.cat([w_hi, w_hi, w_hi, w_mid], 0)
        dx = mm_f32(a_TJ, b_JH, x_TH.dtype)
    if need_dw:
        dw = mm_f32(a_TJ[:, :Q * E].t(), x_TH).view(Q, E, -1).sum(0).to(w_EH.dtype)
    return dx, dw
