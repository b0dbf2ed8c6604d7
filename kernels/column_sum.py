"""Column sums of a [M, N] matrix in fp32: a linear layer's bias gradient, db = Σ_m dy[m, :].

* :func:`column_sum_triton`: each program of a first kernel sums a [rows, BLOCK_N] slab of x into
  fp32 partials [P, N]; a second adds the partials in a fixed order (deterministic, like
  kernels/layer_norm.py's weight gradients) and rounds once to the output's dtype.
* :func:`dgelu_column_sum_triton`: the same sum of dL/dh = dL/d act · gelu'(h), computed on the
  way from h and dL/d act and stored: a GELU's backward and the bias gradient of the linear
  layer before it in one pass (two reads and one write of [M, N], where the GELU's backward and
  then the sum take two reads, one write, then one read more).

Why: PyTorch reduces such an outer dimension (``dy.sum(0)`` in a linear layer's backward) well
below an H200's bandwidth at a micro-batch's shapes (1.3 TB/s at [32768, 768]; docs/performance.md,
"The bias gradients summed by our kernel").

Legend: M rows (tokens), N columns (the layer's outputs), P programs along the rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, cdiv
from .activation import gelu_and_grad, gelu_and_grad_reference
from .launcher import launch

# (BLOCK_M, BLOCK_N, warps, programs in all): one fixed config, the fastest of
# benchmarks/bench_column_sum.py's sweep over gpt-small's bias shapes on an H200
BLOCK_M, BLOCK_N, NUM_WARPS, PROGRAMS = 32, 128, 8, 512
FINISH_BLOCK_N = 128  # columns per program of the partials' sum
# the same for the GELU's backward with the sum (two reads and a write per element): the fastest
# of benchmarks/bench_column_sum.py's sweep at gpt-small's fc1 shape on an H200
DGELU_BLOCK_M, DGELU_BLOCK_N, DGELU_NUM_WARPS, DGELU_PROGRAMS = 32, 128, 4, 2048


@triton.jit
def _column_sum_kernel(x_ptr, part_ptr, h_ptr, dh_ptr, M, N, stride_x, ROWS_PER_PROGRAM,
                       DGELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """DGELU: x is dL/d act; h (the pre-activation) and dh (dL/dh, written) share x's strides,
    and the sum is of dh as stored (rounded to its dtype), as a sum of the stored tensor gives."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # summed over its rows once, at the end
    first = pid_m * ROWS_PER_PROGRAM
    for start in range(first, tl.minimum(first + ROWS_PER_PROGRAM, M), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DGELU:
            _, grad = gelu_and_grad(tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32))
            dh = (x * grad).to(dh_ptr.dtype.element_ty)
            tl.store(dh_ptr + offs, dh, mask=mask)
            x = dh.to(tl.float32)
        acc += x
    tl.store(part_ptr + pid_m * N + cols, tl.sum(acc, 0), mask=col_ok)


@triton.jit
def _column_sum_finish_kernel(part_ptr, out_ptr, P, N, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(0, P):  # in order: the same bits every time
        acc += tl.load(part_ptr + p * N + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + cols, cast(acc, out_ptr.dtype.element_ty), mask=col_ok)


def _launch(x_MN, out_dtype, h_MN, dh_MN, block_m, block_n, num_warps, programs) -> torch.Tensor:
    M, N = x_MN.shape
    if M == 0 or N == 0:
        return torch.zeros(N, dtype=out_dtype, device=x_MN.device)
    col_blocks = cdiv(N, block_n)
    rows_per_program = cdiv(cdiv(M, max(1, programs // col_blocks)), block_m) * block_m
    P = cdiv(M, rows_per_program)
    part_PN = torch.empty((P, N), dtype=torch.float32, device=x_MN.device)
    dgelu = h_MN is not None
    launch(_column_sum_kernel, (col_blocks, P),
           (x_MN, part_PN, h_MN if dgelu else x_MN, dh_MN if dgelu else x_MN, M, N, x_MN.stride(0), rows_per_program),
           dict(DGELU=dgelu, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps))
    return sum_partials(part_PN, torch.empty(N, dtype=out_dtype, device=x_MN.device))


def sum_partials(part_PN: torch.Tensor, out_N: torch.Tensor) -> torch.Tensor:
    """out_N = Σ_p part_PN[p] (contiguous fp32 partials, added in order: the same bits every time),
    rounded once to out_N's dtype (contiguous, N elements, any shape)."""
    P, N = part_PN.shape
    launch(_column_sum_finish_kernel, (cdiv(N, FINISH_BLOCK_N),), (part_PN, out_N, P, N),
           dict(BLOCK_N=FINISH_BLOCK_N, num_warps=4))
    return out_N


def column_sum_triton(x_MN: torch.Tensor, out_dtype: torch.dtype | None = None, *, block_m: int = BLOCK_M,
                      block_n: int = BLOCK_N, num_warps: int = NUM_WARPS, programs: int = PROGRAMS) -> torch.Tensor:
    """Σ_m x_MN[m, :] as [N] in ``out_dtype`` (default x's), accumulated in fp32. ``block_m``,
    ``block_n`` (powers of two), ``num_warps`` and ``programs`` (at most this many in all) for the
    benchmark's sweep."""
    if x_MN.dim() != 2:
        raise ValueError(f"column_sum: x_MN must be 2-D [M, N], got {tuple(x_MN.shape)}")
    if x_MN.stride(-1) != 1:
        x_MN = x_MN.contiguous()
    return _launch(x_MN, out_dtype or x_MN.dtype, None, None, block_m, block_n, num_warps, programs)


def dgelu_column_sum_triton(h_MN: torch.Tensor, dact_MN: torch.Tensor, out_dtype: torch.dtype | None = None, *,
                            block_m: int = DGELU_BLOCK_M, block_n: int = DGELU_BLOCK_N,
                            num_warps: int = DGELU_NUM_WARPS,
                            programs: int = DGELU_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh_MN, db_N): dh = dact · gelu'(h) (GELU, tanh approximation; fp32 math, rounded once to
    dact's dtype) and db = Σ_m dh[m, :] in ``out_dtype`` (default dact's), from the pre-activation
    h and dact = dL/d gelu(h), both [M, N] of one dtype."""
    if h_MN.dim() != 2 or h_MN.shape != dact_MN.shape or h_MN.dtype != dact_MN.dtype:
        raise ValueError(f"dgelu_column_sum: h_MN and dact_MN must be 2-D [M, N] of one shape and dtype, got "
                         f"{h_MN.dtype} {tuple(h_MN.shape)} and {dact_MN.dtype} {tuple(dact_MN.shape)}")
    h_MN, dact_MN = h_MN.contiguous(), dact_MN.contiguous()
    dh_MN = torch.empty_like(dact_MN)
    db_N = _launch(dact_MN, out_dtype or dact_MN.dtype, h_MN, dh_MN, block_m, block_n, num_warps, programs)
    return dh_MN, db_N


def column_sum_reference(x_MN: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The plain-PyTorch sum the kernel computes (fp32 accumulation, one rounding)."""
    return x_MN.float().sum(0).to(out_dtype or x_MN.dtype)


def dgelu_column_sum_reference(h_MN: torch.Tensor, dact_MN: torch.Tensor,
                               out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch (dh, db) the kernel computes: fp32 math on the inputs, dh rounded once, db
    the fp32 sum of the rounded dh, rounded once."""
    _, grad = gelu_and_grad_reference(h_MN.float())
    dh_MN = (dact_MN.float() * grad).to(dact_MN.dtype)
    return dh_MN, column_sum_reference(dh_MN, out_dtype)
