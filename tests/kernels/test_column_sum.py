"""The bias gradient's column sum (kernels/column_sum.py), alone and with a GELU's backward on
the way, and the linear ops that use them (megatron_moe/ops/linear.py), against float64: sums for
fp32 / bf16 / fp16 on the edges (one row, no rows, rows and columns not multiples of the tile,
more rows than one program's share, a large offset that fp32 partials must keep), the same bits
in two runs (a fixed order of the partials), two launch shapes; the op's output and its x, weight
and bias gradients against float64 autograd of F.linear, for [s, b, h] inputs, and torch's path
where the kernel would not give torch's result (no bias, mixed dtypes, the switch off). The
GELU's gradient and its column sum likewise (the same edges), and ``linear_gelu`` as ``linear``.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py): small shapes only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_moe.ops.linear as ops_linear
from _util import triton_kernels_run
from megatron_moe.kernels.activation import gelu_and_grad_reference
from megatron_moe.kernels.column_sum import (column_sum_reference, column_sum_triton, dgelu_column_sum_reference,
                                             dgelu_column_sum_triton)
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


OPS = {  # op: (the float64 math, the kernel its backward calls, its switch)
    "linear": (lambda x, w, b: F.linear(x, w, b), "column_sum_triton", "MEGATRON_MOE_BIAS_GRAD"),
    "linear_gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), "dgelu_column_sum_triton",
                    "MEGATRON_MOE_FUSED_GELU"),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_ops_match_float64(op, dtype, monkeypatch):
    """[s, b, h] input (megatron's layout): y and the gradients of x, weight and bias against
    float64 autograd of the same math; the op took its kernel's path (counted), and the switch-off
    path (torch's reduction; for linear_gelu torch's GELU backward, then the sum) agrees."""
    math64, kernel, switch = OPS[op]
    fn = getattr(ops_linear, op)
    monkeypatch.setenv("MEGATRON_MOE_BIAS_GRAD", "1")
    monkeypatch.setenv("MEGATRON_MOE_FUSED_GELU", "1")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, 48, generator=g).to(dtype).to(DEVICE).requires_grad_()
    w = (0.2 * torch.randn(136, 48, generator=g)).to(dtype).to(DEVICE).requires_grad_()
    b = torch.randn(136, generator=g).to(dtype).to(DEVICE).requires_grad_()
    dy = torch.randn(6, 5, 136, generator=g).to(dtype).to(DEVICE)
    calls = []
    real = getattr(ops_linear, kernel)
    monkeypatch.setattr(ops_linear, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    y = fn(x, w, b)
    got = (y, *torch.autograd.grad(y, (x, w, b), dy))
    assert calls == [1]
    xs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y64 = math64(*xs)
    want = (y64.detach(), *torch.autograd.grad(y64, xs, dy.double()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, e in zip(("y", "dx", "dw", "db"), got, want):
        assert a.dtype == dtype and a.shape == e.shape, name
        assert ((a.double() - e).abs().max() / e.abs().max()) < tol, name
    monkeypatch.setenv(switch, "0")
    y0 = fn(x, w, b)
    plain = (y0, *torch.autograd.grad(y0, (x, w, b), dy))
    assert calls == [1]  # torch's path this time
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


def _err(a, b) -> float:
    """The largest absolute difference (0 for empty tensors)."""
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _scale(t) -> float:
    return max(1.0, t.abs().max().item() if t.numel() else 0.0)


@pytest.mark.parametrize("shape", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dgelu_column_sum_matches_float64(shape, dtype):
    """dh = dact · gelu'(h) and its column sum against float64, with both launch shapes; the same
    bits twice; the plain-PyTorch reference agrees."""
    g = torch.Generator().manual_seed(3)
    h = (2 * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)
    dact = (torch.randn(*shape, generator=g) + 0.25).to(dtype).to(DEVICE)
    _, grad64 = gelu_and_grad_reference(h.double())
    dh64 = dact.double() * grad64
    db64 = dh64.sum(0)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    # db sums dh as stored: each element rounded once (to nearest on a GPU; the Triton interpreter
    # rounds toward zero), so its error grows with the column's Σ|dh|
    db_tol = tol * (_scale(db64) + (dh64.abs().sum(0).max().item() if dh64.numel() else 0.0))
    for kw in ({}, {"programs": 4, "block_m": 16, "block_n": 32}):
        dh, db = dgelu_column_sum_triton(h, dact, **kw)
        assert dh.dtype == dtype and dh.shape == shape and db.dtype == dtype and db.shape == (shape[1],)
        assert _err(dh, dh64) <= tol * _scale(dh64), kw
        assert _err(db, db64) <= db_tol, kw
        dh2, db2 = dgelu_column_sum_triton(h, dact, **kw)
        assert torch.equal(dh2, dh) and torch.equal(db2, db), kw
    dh_ref, db_ref = dgelu_column_sum_reference(h, dact)
    assert _err(dh, dh_ref) <= tol * _scale(dh64)
    assert _err(db, db_ref) <= db_tol


def test_dgelu_column_sum_refuses_mismatched_inputs():
    h = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one shape and dtype"):
        dgelu_column_sum_triton(h, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="one shape and dtype"):
        dgelu_column_sum_triton(h, h.double())
