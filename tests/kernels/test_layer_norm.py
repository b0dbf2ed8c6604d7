"""LayerNorm (kernels/layer_norm.py through megatron_moe/ops/layer_norm.py) against float64
autograd of torch's LayerNorm: the output and the gradients of x, weight and bias, for fp32 and
bf16 inputs, on the edges (one row, rows not a multiple of the row block, hidden not a power of
two, more rows than the backward's programs, a large mean). Also: the weight gradients are the
same in two runs (a fixed order of the partial sums); the switch, and torch's path where the
kernels' result dtype would differ. The module in the model: tests/megatron/test_model.py.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py): small shapes only.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import megatron_moe.ops.layer_norm as ops_layer_norm
from _util import triton_kernels_run
from megatron_moe.kernels.layer_norm import layer_norm_bwd_triton, layer_norm_fwd_triton, layer_norm_reference
from megatron_moe.ops.layer_norm import layer_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_kernels_run(),
                                reason="the Triton kernels run on GPUs or under the Triton interpreter")


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setenv("MEGATRON_MOE_FUSED_NORM", "1")


def inputs(shape, dtype, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(*shape, generator=g) * 3 + offset
    w = 1 + 0.5 * torch.randn(N, generator=g)
    b = 0.5 * torch.randn(N, generator=g)
    dy = torch.randn(*shape, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype), dy.to(dtype)


def float64_grads(x, w, b, dy, eps):
    xs = [t.double().requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(xs[0], (x.shape[-1],), xs[1], xs[2], eps)
    return (y.detach(), *torch.autograd.grad(y, xs, dy.double()))


CASES = [  # shape: rows x hidden (or [s, b, h])
    (1, 32),        # one row
    (37, 48),       # rows past a block, hidden not a power of two (BLOCK_N 64)
    (8, 5, 96),     # megatron's [s, b, h]
    (600, 16),      # more rows than the backward's 512 programs: each program sums several rows
    (3, 1000),      # a wide row, BLOCK_M 4
]


@pytest.mark.parametrize("shape", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_matches_float64(shape, dtype):
    eps = 1e-5
    x, w, b, dy = inputs(shape, dtype, seed=len(shape) * 100 + shape[-1])
    y64, dx64, dw64, db64 = float64_grads(x, w, b, dy, eps)
    xs = [t.to(DEVICE).requires_grad_() for t in (x, w, b)]
    y = layer_norm(*xs, eps)
    dx, dw, db = torch.autograd.grad(y, xs, dy.to(DEVICE))
    assert y.dtype == dx.dtype == dtype and dw.dtype == db.dtype == dtype
    # fp32: a few ulps of the sums; bf16: the rounding of the output (2^-8 relative)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(y.cpu().double(), y64, **tol)
    torch.testing.assert_close(dx.cpu().double(), dx64, **tol)
    scale = dict(tol, atol=tol["atol"] * (x.numel() // x.shape[-1]) ** 0.5)  # sums over the rows
    torch.testing.assert_close(dw.cpu().double(), dw64, **scale)
    torch.testing.assert_close(db.cpu().double(), db64, **scale)


@pytest.mark.parametrize("programs, num_warps, block_m", [(3, 8, 16), (1000, 4, 2), (64, 4, 32)])
def test_every_backward_launch_shape_gives_the_float64_gradients(programs, num_warps, block_m):
    """The launch shapes benchmarks/bench_layer_norm.py sweeps: a few programs over many rows
    each, more programs than rows, tiles taller than the rows a program owns."""
    x, w, b, dy = inputs((150, 48), torch.float32, seed=11)
    y64, dx64, dw64, db64 = float64_grads(x, w, b, dy, 1e-5)
    x, w, b, dy = [t.to(DEVICE) for t in (x, w, b, dy)]
    _, mean, rstd = layer_norm_fwd_triton(x, w, b, 1e-5)
    dx, dw, db = layer_norm_bwd_triton(dy, x, w, mean, rstd, programs=programs, num_warps=num_warps,
                                       block_m=block_m)
    for got, want in ((dx, dx64), (dw, dw64), (db, db64)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4)


def test_a_large_mean_keeps_its_precision():
    """Two-pass statistics: x = 1000 + noise in fp32 normalises as float64 does (a one-pass
    E[x^2] - E[x]^2 would lose the noise)."""
    x, w, b, dy = inputs((20, 64), torch.float32, offset=1000.0)
    y64 = float64_grads(x, w, b, dy, 1e-5)[0]
    y = layer_norm(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), 1e-5)
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-4, atol=1e-4)


def test_no_rows():
    x, w, b, _ = inputs((0, 32), torch.float32)
    y, mean, rstd = layer_norm_fwd_triton(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), 1e-5)
    dx, dw, db = layer_norm_bwd_triton(torch.zeros_like(y), x.to(DEVICE), w.to(DEVICE), mean, rstd)
    assert y.shape == dx.shape == (0, 32) and not dw.any() and not db.any()


def test_weight_gradients_are_deterministic():
    x, w, b, dy = [t.to(DEVICE) for t in inputs((700, 32), torch.float32, seed=7)]
    y, mean, rstd = layer_norm_fwd_triton(x, w, b, 1e-5)
    first = layer_norm_bwd_triton(dy, x, w, mean, rstd, programs=64)
    again = layer_norm_bwd_triton(dy, x, w, mean, rstd, programs=64)
    for a, c in zip(first, again):
        assert torch.equal(a, c)


def test_reference_is_torchs_layer_norm():
    x, w, b, _ = inputs((9, 40), torch.float32, seed=3)
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5), F.layer_norm(x, (40,), w, b, 1e-5))


def test_switch_off_is_torchs_layer_norm(monkeypatch):
    """MEGATRON_MOE_FUSED_NORM=0: F.layer_norm itself (bit for bit), not the kernels."""
    monkeypatch.setenv("MEGATRON_MOE_FUSED_NORM", "0")
    x, w, b, _ = [t.to(DEVICE) for t in inputs((9, 40), torch.float32, seed=4)]
    calls = []
    monkeypatch.setattr(ops_layer_norm._LayerNorm, "apply", lambda *a: calls.append(a))
    assert torch.equal(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (40,), w, b, 1e-5)) and not calls


def test_torchs_path_where_the_kernels_would_differ(monkeypatch):
    """Mixed dtypes, and a 16-bit x under autocast (which runs torch's LayerNorm in fp32): torch's
    path and its result dtype; fp32 x under autocast: the kernels."""
    calls = []
    real = ops_layer_norm._LayerNorm.apply
    monkeypatch.setattr(ops_layer_norm._LayerNorm, "apply", lambda *a: calls.append(1) or real(*a))
    x, w, b, _ = [t.to(DEVICE) for t in inputs((6, 32), torch.float32, seed=5)]
    try:  # the CPU's LayerNorm takes a bf16 x with fp32 weights; CUDA's refuses: ours does as torch does
        expected = F.layer_norm(x.bfloat16(), (32,), w, b, 1e-5)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=re.escape(str(error))):
            layer_norm(x.bfloat16(), w, b, 1e-5)
    else:
        assert torch.equal(layer_norm(x.bfloat16(), w, b, 1e-5), expected)
    assert not calls
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
        y = layer_norm(xb, wb, bb, 1e-5)
        assert not calls and y.dtype == F.layer_norm(xb, (32,), wb, bb, 1e-5).dtype
        y = layer_norm(x, w, b, 1e-5)
        assert calls and y.dtype == torch.float32
