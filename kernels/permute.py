"""Gather / scatter: tokens <-> rows sorted by expert, block-padded (the block-sparse path) or not
(the torch._grouped_mm path).

Legend (shape suffixes):
  T tokens, K top_k, N = T*K assignments (assignment a = t*K + k), H hidden,
  P rows of the layout: P_max padded rows (R_max row blocks of B rows, see :mod:`.metadata`)
  for layout='padded', N for layout='sorted'. src[p]: row -> assignment (-1 padding),
  row[a]: assignment -> row (padded: padded_src_P / padded_row_N; sorted: sort_order_N /
  sorted_row_N).

  gather_rows   x_TH  -> x_PH   row p = x[token of src[p]] (times its router weight when weights
                                 are given); padding rows (-1) are zero.
  scatter_rows  y_PH  -> y_TH   y[t] = sum_k w[t, k] * y_P[row[t*K + k]] (w = 1 when no weights
                                 are given). Each output row sums its own K rows in a fixed order:
                                 deterministic, no atomics.
  sum_rows      y_SH  -> y_TH   y[t] = sum_k y_S[row[t*K + k]] (no weights; the row index alone)
  scatter_rows_weight_grad  (dy_TH, y_PH) -> dw_TK (fp32)
                                 dw[t, k] = sum_h dy[t, h] * y_P[row[t*K + k], h].

Backward of the pair: the gradient of gather_rows is scatter_rows without weights, the gradient
of scatter_rows wrt y_PH is gather_rows of dy with the weights. All three launch over host-known
sizes (T, N, P_max), so nothing here synchronises with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpret_mode, next_power_of_2, use_triton
from .launcher import launch
from .metadata import Routing


def _block_h(H: int) -> int:
    """Columns per program: a whole small row, 512-column slabs of large ones (16 under the interpreter)."""
    if interpret_mode():
        return 16
    return min(512, next_power_of_2(H))


# ----------------------------------------------------------------------------------------------
# gather_rows
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gather_rows_kernel(
    # pointers
    x_ptr, w_ptr, out_ptr, src_ptr,
    # sizes
    P, H, K,
    # strides
    stride_xt, stride_xh, stride_wt, stride_wk, stride_op, stride_oh,
    # meta-parameters
    HAS_WEIGHTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_p = offs_p < P
    mask_h = offs_h < H
    src = tl.load(src_ptr + offs_p, mask=mask_p, other=-1).to(tl.int64)
    valid = src >= 0
    src = tl.where(valid, src, 0)
    token = src // K
    x = tl.load(x_ptr + token[:, None] * stride_xt + offs_h[None, :] * stride_xh,
                mask=valid[:, None] & mask_h[None, :], other=0.0)
    if HAS_WEIGHTS:
        w = tl.load(w_ptr + token * stride_wt + (src % K) * stride_wk, mask=valid, other=0.0)
        x = x.to(tl.float32) * w.to(tl.float32)[:, None]
    tl.store(out_ptr + offs_p[:, None] * stride_op + offs_h[None, :] * stride_oh,
             x.to(out_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_h[None, :])


def _layout(routing: Routing, layout: str):
    """(row -> assignment index or -1, assignment -> row, rows) of the layout's row order."""
    if layout == "padded":
        return routing.padded_src_P, routing.padded_row_N, routing.max_padded_rows
    if layout == "sorted":
        return routing.sort_order_N, routing.sorted_row_N, routing.num_assignments
    raise ValueError(f"layout={layout!r}: expected 'padded' (block-padded rows, the block-sparse path) "
                     "or 'sorted' (rows sorted by expert, no padding)")


def gather_rows_triton(x_TH, routing: Routing, weights_TK=None, out=None, layout="padded"):
    T, H = x_TH.shape
    src_P, _, P = _layout(routing, layout)
    out = torch.empty(P, H, dtype=x_TH.dtype, device=x_TH.device) if out is None else out
    if P == 0 or H == 0:
        return out
    w = x_TH if weights_TK is None else weights_TK  # dummy pointer when there are no weights
    BLOCK_P, BLOCK_H = 16, _block_h(H)
    grid = (cdiv(P, BLOCK_P), cdiv(H, BLOCK_H))
    launch(_gather_rows_kernel, grid,
           (x_TH, w, out, src_P, P, H, routing.top_k, x_TH.stride(0), x_TH.stride(1), w.stride(0), w.stride(1),
            out.stride(0), out.stride(1)),
           dict(HAS_WEIGHTS=weights_TK is not None, BLOCK_P=BLOCK_P, BLOCK_H=BLOCK_H))
    return out


def gather_rows_reference(x_TH, routing: Routing, weights_TK=None, out=None, layout="padded"):
    src_P = _layout(routing, layout)[0].long()
    if x_TH.shape[0] == 0:  # no tokens (e.g. an expert-parallel rank that received none)
        x_PH = x_TH.new_zeros(src_P.shape[0], x_TH.shape[1])
        return x_PH if out is None else out.copy_(x_PH)
    valid_P = (src_P >= 0)[:, None]
    a_P = src_P.clamp(min=0)
    x_PH = x_TH[torch.div(a_P, routing.top_k, rounding_mode="floor")]
    if weights_TK is not None:
        x_PH = (x_PH.float() * weights_TK.reshape(-1)[a_P, None].float()).to(x_TH.dtype)
    x_PH = torch.where(valid_P, x_PH, torch.zeros_like(x_PH))
    if out is None:
        return x_PH
    return out.copy_(x_PH)


def gather_rows(x_TH, routing: Routing, weights_TK=None, out=None, layout="padded"):
    """[T, H] -> [rows, H]: row p holds the token of assignment src[p] (times its router weight when
    ``weights_TK`` is given, the product rounded once); padding rows are zero.
    layout 'padded': rows = P_max, src = padded_src_P; 'sorted': rows = N, src = sort_order_N."""
    _check_tokens(x_TH, routing, "x_TH")
    _check_weights(weights_TK, routing)
    rows = _layout(routing, layout)[2]
    if out is not None and tuple(out.shape) != (rows, x_TH.shape[1]):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(rows, x_TH.shape[1])}")
    tensors = [x_TH] + ([] if weights_TK is None else [weights_TK])
    if use_triton(*tensors):
        return gather_rows_triton(x_TH, routing, weights_TK, out, layout)
    return gather_rows_reference(x_TH, routing, weights_TK, out, layout)


# ----------------------------------------------------------------------------------------------
# scatter_rows
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scatter_rows_kernel(
    # pointers
    y_ptr, w_ptr, out_ptr, row_ptr,
    # sizes
    T, H, K,
    # strides
    stride_yp, stride_yh, stride_wt, stride_wk, stride_ot, stride_oh,
    # meta-parameters
    HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < T
    mask_h = offs_h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in range(0, K):
        row = tl.load(row_ptr + offs_t * K + k, mask=mask_t, other=0).to(tl.int64)
        y = tl.load(y_ptr + row[:, None] * stride_yp + offs_h[None, :] * stride_yh,
                    mask=mask_t[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + offs_t * stride_wt + k * stride_wk, mask=mask_t, other=0.0)
            y = y * w.to(tl.float32)[:, None]
        acc += y
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_h[None, :] * stride_oh,
             acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_h[None, :])


def _scatter_rows_launch(y_PH, weights_TK, row_N, T: int, K: int, out=None):
    H = y_PH.shape[1]
    out = torch.empty(T, H, dtype=y_PH.dtype, device=y_PH.device) if out is None else out
    if T == 0 or H == 0:
        return out
    w = y_PH if weights_TK is None else weights_TK
    BLOCK_T, BLOCK_H = 16, _block_h(H)
    grid = (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))
    launch(_scatter_rows_kernel, grid,
           (y_PH, w, out, row_N, T, H, K, y_PH.stride(0), y_PH.stride(1), w.stride(0), w.stride(1), out.stride(0),
            out.stride(1)),
           dict(HAS_WEIGHTS=weights_TK is not None, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H))
    return out


def scatter_rows_triton(y_PH, weights_TK, routing: Routing, out=None, layout="padded"):
    return _scatter_rows_launch(y_PH, weights_TK, _layout(routing, layout)[1], routing.num_tokens,
                                routing.top_k, out)


def scatter_rows_reference(y_PH, weights_TK, routing: Routing, out=None, layout="padded"):
    T, K, H = routing.num_tokens, routing.top_k, y_PH.shape[1]
    y_NH = y_PH[_layout(routing, layout)[1].long()].float()
    if weights_TK is not None:
        y_NH = y_NH * weights_TK.reshape(-1, 1).float()
    y_TH = y_NH.view(T, K, H).sum(1).to(y_PH.dtype)
    if out is None:
        return y_TH
    return out.copy_(y_TH)


def scatter_rows(y_PH, weights_TK, routing: Routing, out=None, layout="padded"):
    """[rows, H] -> [T, H]: y[t] = sum_k weights[t, k] * y_P[row[t*K + k]] (weights 1 when
    ``weights_TK`` is None), summed in fp32 by the row's own program; output in y_PH's dtype.
    layout 'padded': rows = P_max, row = padded_row_N; 'sorted': rows = N, row = sorted_row_N."""
    rows = _layout(routing, layout)[2]
    if y_PH.dim() != 2 or y_PH.shape[0] != rows:
        raise ValueError(f"y_PH has shape {tuple(y_PH.shape)}, expected [{rows}, H] ({layout} rows)")
    _check_weights(weights_TK, routing)
    if out is not None and tuple(out.shape) != (routing.num_tokens, y_PH.shape[1]):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(routing.num_tokens, y_PH.shape[1])}")
    tensors = [y_PH] + ([] if weights_TK is None else [weights_TK])
    if use_triton(*tensors):
        return scatter_rows_triton(y_PH, weights_TK, routing, out, layout)
    return scatter_rows_reference(y_PH, weights_TK, routing, out, layout)


def sum_rows(y_SH: torch.Tensor, row_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """[S, H] -> [T, H] with T = len(row_N) / top_k: y[t] = sum_k y_S[row[t*K + k]], summed in fp32
    in k order by the token's own program and rounded once to y_SH's dtype (scatter_rows without
    weights, from the row index alone: the triton_grouped path's sum over k, its rows left in
    expert order by the GEMM)."""
    N = row_N.shape[0]
    if y_SH.dim() != 2 or row_N.dim() != 1 or top_k < 1 or N % top_k:
        raise ValueError(f"sum_rows: y_SH [S, H] and row_N [T*top_k] expected, got {tuple(y_SH.shape)}, "
                         f"{tuple(row_N.shape)} with top_k={top_k}")
    T = N // top_k
    if use_triton(y_SH):
        return _scatter_rows_launch(y_SH, None, row_N, T, top_k)
    return y_SH[row_N.long()].float().view(T, top_k, y_SH.shape[1]).sum(1).to(y_SH.dtype)


# ----------------------------------------------------------------------------------------------
# scatter_rows_weight_grad
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scatter_weight_grad_kernel(
    # pointers
    dy_ptr, y_ptr, out_ptr, row_ptr,
    # sizes
    N, H, K,
    # strides
    stride_dt, stride_dh, stride_yp, stride_yh,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    token = offs_n // K
    row = tl.load(row_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = mask_n[:, None] & (offs_h < H)[None, :]
        dy = tl.load(dy_ptr + token[:, None] * stride_dt + offs_h[None, :] * stride_dh, mask=mask, other=0.0)
        y = tl.load(y_ptr + row[:, None] * stride_yp + offs_h[None, :] * stride_yh, mask=mask, other=0.0)
        acc += tl.sum(dy.to(tl.float32) * y.to(tl.float32), axis=1)
    tl.store(out_ptr + offs_n, acc, mask=mask_n)


def scatter_rows_weight_grad_triton(dy_TH, y_PH, routing: Routing, layout="padded"):
    N, H = routing.num_assignments, y_PH.shape[1]
    out = torch.empty(routing.num_tokens, routing.top_k, dtype=torch.float32, device=y_PH.device)
    if N == 0:
        return out
    BLOCK_N, BLOCK_H = 16, min(_block_h(H), 128)
    launch(_scatter_weight_grad_kernel, (cdiv(N, BLOCK_N),),
           (dy_TH, y_PH, out, _layout(routing, layout)[1], N, H, routing.top_k, dy_TH.stride(0), dy_TH.stride(1),
            y_PH.stride(0), y_PH.stride(1)),
           dict(BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H))
    return out


def scatter_rows_weight_grad_reference(dy_TH, y_PH, routing: Routing, layout="padded"):
    T, K, H = routing.num_tokens, routing.top_k, y_PH.shape[1]
    y_TKH = y_PH[_layout(routing, layout)[1].long()].float().view(T, K, H)
    return (dy_TH.float()[:, None, :] * y_TKH).sum(-1)


def scatter_rows_weight_grad(dy_TH, y_PH, routing: Routing, layout="padded"):
    """Gradient of :func:`scatter_rows` wrt its weights: fp32 [T, K],
    dw[t, k] = sum_h dy[t, h] * y_P[row[t*K + k], h]."""
    _check_tokens(dy_TH, routing, "dy_TH")
    rows = _layout(routing, layout)[2]
    if y_PH.dim() != 2 or tuple(y_PH.shape) != (rows, dy_TH.shape[1]):
        raise ValueError(f"y_PH has shape {tuple(y_PH.shape)}, expected {(rows, dy_TH.shape[1])}")
    if use_triton(dy_TH, y_PH):
        return scatter_rows_weight_grad_triton(dy_TH, y_PH, routing, layout)
    return scatter_rows_weight_grad_reference(dy_TH, y_PH, routing, layout)


def _check_tokens(x_TH, routing: Routing, name: str) -> None:
    if x_TH.dim() != 2 or x_TH.shape[0] != routing.num_tokens:
        raise ValueError(f"{name} has shape {tuple(x_TH.shape)}, expected [{routing.num_tokens}, H]")


def _check_weights(weights_TK, routing: Routing) -> None:
    if weights_TK is not None and tuple(weights_TK.shape) != (routing.num_tokens, routing.top_k):
        raise ValueError(f"weights_TK has shape {tuple(weights_TK.shape)}, "
                         f"expected {(routing.num_tokens, routing.top_k)}")
