"""LayerNorm over the last dimension, forward and backward, with the weight and bias gradients
reduced in the backward's own pass.

* :func:`layer_norm_fwd_triton`: y = (x - mean) * rstd * weight + bias per row, saving the fp32
  mean and rstd [M].
* :func:`layer_norm_bwd_triton`: one pass over x and dy gives dx and, per program, partial sums
  of dy * xhat and dy over its rows; the partials [P, N] are then added in a fixed order (the
  gradients are deterministic).

Why: at hidden 512 PyTorch's LayerNorm backward reduces the weight and bias gradients in a
separate column-reduction kernel, ``GammaBetaBackward``, far from the bandwidth floor on Hopper
(docs/performance.md, "LayerNorm with its weight gradients in the backward's pass"). Here x and
dy are read once for everything.

Legend: M rows (tokens), N the normalised size (hidden), P programs of the backward.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from .launcher import launch

MAX_N = 16384  # one row in one tile: the widest hidden size a config of ours uses is far below


def _blocks(N: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): a tile of whole rows, at most 4096 fp32 values per program."""
    block_n = next_power_of_2(N)
    return max(1, min(64, 4096 // block_n)), block_n


def bwd_launch(N: int) -> tuple[int, int, int]:
    """The backward's (programs, warps, rows per loop iteration) at hidden N, from
    benchmarks/bench_layer_norm.py's sweep on an H200 (timed from CUDA-graph replays) and the
    training step: 256 programs at N <= 512, 256 programs of 8 warps at N >= 2048, else 512 of 4;
    rows per iteration _blocks's."""
    rows = _blocks(N)[0]
    if N <= 512:
        return 256, 4, rows
    if N >= 2048:
        return 256, 8, rows
    return 512, 4, rows


@triton.jit
def _ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, stride_x, stride_y, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _ln_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                   M, N, stride_dy, stride_x, stride_dx, ROWS_PER_PROGRAM,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * ROWS_PER_PROGRAM
    for start in range(first, tl.minimum(first + ROWS_PER_PROGRAM, M), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, 1) / N
        c2 = tl.sum(wdy, 1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, 0)
        db_acc += tl.sum(dy, 0)
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=col_ok)
    tl.store(db_part_ptr + pid * N + cols, db_acc, mask=col_ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, N] with unit stride along N (a copy only when the last dimension is strided)."""
    x_MN = x.reshape(-1, x.shape[-1])
    return x_MN if x_MN.stride(-1) == 1 else x_MN.contiguous()


def layer_norm_fwd_triton(x: torch.Tensor, weight_N: torch.Tensor, bias_N: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y like x, mean_M fp32, rstd_M fp32)."""
    N = x.shape[-1]
    if N > MAX_N:
        raise ValueError(f"layer_norm: normalised size {N} > {MAX_N}, the widest row one tile holds")
    x_MN = _rows(x)
    M = x_MN.shape[0]
    y_MN = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean_M = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd_M = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        block_m, block_n = _blocks(N)
        launch(_ln_fwd_kernel, (cdiv(M, block_m),),
               (x_MN, weight_N, bias_N, y_MN, mean_M, rstd_M, M, N, x_MN.stride(0), y_MN.stride(0), float(eps)),
               dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4))
    return y_MN.view(x.shape), mean_M, rstd_M


def layer_norm_bwd_triton(dy: torch.Tensor, x: torch.Tensor, weight_N: torch.Tensor, mean_M: torch.Tensor,
                          rstd_M: torch.Tensor, programs: int | None = None, num_warps: int | None = None,
                          block_m: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx like x, dweight_N, dbias_N in the weight's dtype); ``programs``: at most this many
    programs, each over a contiguous range of rows (the partial sums' count); ``num_warps`` and
    ``block_m`` (rows per loop iteration, a power of two); each unset one from :func:`bwd_launch`
    (benchmarks/bench_layer_norm.py sweeps them)."""
    N = x.shape[-1]
    default = bwd_launch(N)
    programs, num_warps, block_m = programs or default[0], num_warps or default[1], block_m or default[2]
    x_MN, dy_MN = _rows(x), _rows(dy)
    M = x_MN.shape[0]
    dx_MN = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_n = _blocks(N)[1]
    rows_per_program = cdiv(cdiv(max(M, 1), programs), block_m) * block_m
    P = cdiv(max(M, 1), rows_per_program)
    dw_part_PN = torch.empty((P, N), dtype=torch.float32, device=x.device)
    db_part_PN = torch.empty((P, N), dtype=torch.float32, device=x.device)
    launch(_ln_bwd_kernel, (P,),
           (dy_MN, x_MN, weight_N, mean_M, rstd_M, dx_MN, dw_part_PN, db_part_PN, M, N, dy_MN.stride(0), x_MN.stride(0),
            dx_MN.stride(0), rows_per_program),
           dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps))
    dweight_N = dw_part_PN.sum(0).to(weight_N.dtype)
    dbias_N = db_part_PN.sum(0).to(weight_N.dtype)
    return dx_MN.view(x.shape), dweight_N, dbias_N


def layer_norm_reference(x: torch.Tensor, weight_N: torch.Tensor, bias_N: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-PyTorch LayerNorm the kernels compute (fp32 statistics, output in x's dtype)."""
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    y = (x32 - mean) * torch.rsqrt(var + eps) * weight_N.float() + bias_N.float()
    return y.to(x.dtype)
