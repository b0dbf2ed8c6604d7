"""The bias gradient's column sum (kernels/column_sum.py) and the linear op that uses it
(megatron_moe/ops/linear.py), against float64: sums for fp32 / bf16 / fp16 on the edges (one row,
no rows, rows and columns not multiples of the tile, more rows than one program's share, a
large offset that fp32 partials must keep), the same bits in two runs (a fixed order of the
partials), every config of the benchmark's sweep; the op's output and its x, weight and bias
gradients against float64 autograd of F.linear, for [s, b, h] inputs, and torch's path where
the kernel would not give torch's result (no bias, mixed dtypes, the switch off).

On the CPU the kernels run under the Triton interpreter (tests/conftest.py): small shapes only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_moe.ops.linear as ops_linear
from _util import triton_kernels_run
from megatron_moe.kernels.column_sum import column_sum_reference, column_sum_triton
from megatron_moe.ops.linear import linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_kernels_run(),
                                reason="the Triton kernels run on GPUs or under the Triton interpreter")

CASES = [  # rows x columns
    (1, 8),      # one row
    (0, 24),     # no rows: zeros
    (70, 300),   # rows past the row tile, columns past the column tile (128), neither a power of two
    (600, 40),   # more rows than one program's share (programs=4 below): several per program
]


@pytest.mark.parametrize("shape", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_column_sum_matches_float64(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) + 0.25).to(dtype).to(DEVICE)
    want = x.double().sum(0)
    for kw in ({}, {"programs": 4, "block_m": 16, "block_n": 32}):
        got = column_sum_triton(x, **kw)
        assert got.dtype == dtype and got.shape == (shape[1],)
        # fp32 accumulation, one rounding to the output dtype
        tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype] * max(1.0, want.abs().max())
        assert (got.double() - want).abs().max() <= tol, kw
        assert torch.equal(column_sum_triton(x, **kw), got)  # the same bits again
    got32 = column_sum_triton(x, torch.float32)  # the partials themselves, before any 16-bit rounding
    assert (got32.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())
    assert (column_sum_reference(x, torch.float32).double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


def test_column_sum_keeps_a_large_offset_and_strided_rows():
    """A column of 1000 + small values: bf16 partials would lose the small part; fp32 keeps it.
    A row stride wider than the row (a slice of a wider matrix) is read in place."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(300, 64, generator=g)
    wide = torch.cat([base, 1000 + torch.zeros(300, 16)], dim=1).to(DEVICE)  # fp32
    got = column_sum_triton(wide[:, :64], programs=8, block_m=16, block_n=32)
    assert (got.double().cpu() - base.double().sum(0)).abs().max() < 1e-3
    ones = torch.full((4096, 8), 1000.0).to(torch.bfloat16).to(DEVICE)
    assert column_sum_triton(ones, torch.float32).tolist() == [4096000.0] * 8


def test_column_sum_refuses_a_vector():
    with pytest.raises(ValueError, match="x_MN must be 2-D"):
        column_sum_triton(torch.zeros(5, device=DEVICE))


def _float64_linear(x, w, b, dy):
    xs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = F.linear(*xs)
    return (y.detach(), *torch.autograd.grad(y, xs, dy.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_float64(dtype, monkeypatch):
    """[s, b, h] input (megatron's layout): y and the gradients of x, weight and bias; the op took
    the kernel's path (counted), and the switch-off path (torch's reduction) agrees."""
    monkeypatch.setenv("MEGATRON_MOE_BIAS_GRAD", "1")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, 48, generator=g).to(dtype).to(DEVICE).requires_grad_()
    w = (0.1 * torch.randn(40, 48, generator=g)).to(dtype).to(DEVICE).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).to(DEVICE).requires_grad_()
    dy = torch.randn(6, 5, 40, generator=g).to(dtype).to(DEVICE)
    calls = []
    real = ops_linear.column_sum_triton
    monkeypatch.setattr(ops_linear, "column_sum_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = linear(x, w, b)
    got = (y, *torch.autograd.grad(y, (x, w, b), dy))
    assert calls == [1]
    want = _float64_linear(x, w, b, dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, e in zip(("y", "dx", "dw", "db"), got, want):
        assert a.dtype == dtype and a.shape == e.shape, name
        assert ((a.double() - e).abs().max() / e.abs().max()) < tol, name
    monkeypatch.setenv("MEGATRON_MOE_BIAS_GRAD", "0")
    y0 = linear(x, w, b)
    plain = (y0, *torch.autograd.grad(y0, (x, w, b), dy))
    assert calls == [1]  # torch's reduction this time
    for name, a, e in zip(("y", "dx", "dw", "db"), got, plain):
        assert ((a.double() - e.double()).abs().max() / e.double().abs().max()) < tol, name


def test_linear_falls_back_where_the_kernel_would_differ(monkeypatch):
    """No bias, a bias of another dtype, autocast, or the switch off: F.linear itself."""
    monkeypatch.setenv("MEGATRON_MOE_BIAS_GRAD", "1")
    x = torch.randn(4, 8, device=DEVICE)
    w, b = torch.randn(3, 8, device=DEVICE), torch.randn(3, device=DEVICE)
    assert ops_linear._kernel_applies(x, w, b)
    assert not ops_linear._kernel_applies(x, w, None)
    assert not ops_linear._kernel_applies(x, w, b.double())
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        assert not ops_linear._kernel_applies(x, w, b)
    monkeypatch.setenv("MEGATRON_MOE_BIAS_GRAD", "0")
    assert not ops_linear._kernel_applies(x, w, b)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
