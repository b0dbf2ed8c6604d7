"""kernels/activation.py: the in-place (dL/dh, act(h)) pass against float64 formulas (_float64.py).

Triton under the interpreter on the CPU (tiles of 4 x 16, so the shapes below cut tiles in both
directions), the compiled kernel on a GPU; fp32 tight, bf16 to its rounding.

    pytest tests/kernels/test_activation.py
"""
import os
import sys

import pytest
import torch

from megatron_moe.kernels import activation as A

sys.path.insert(0, os.path.dirname(__file__))
import _float64 as f64  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def expected64(h, dact, activation):
    """(dL/dh, act) in float64 from the inputs as stored (rounded)."""
    h, dact = h.double().cpu(), dact.double().cpu()
    if activation == "gelu":
        act, grad = f64.gelu_and_grad(h)
        return dact * grad, act
    F = dact.shape[1]
    act, dgate, dup = f64.swiglu_and_grads(h[:, :F], h[:, F:])
    return torch.cat([dact * dgate, dact * dup], 1), act


def max_rel(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 20), (1, 3), (0, 16)])
def test_activation_backward(impl, activation, dtype, shape):
    N, F = shape
    g = torch.Generator().manual_seed(N * 100 + F)
    X = 2 * F if activation == "swiglu" else F
    h = (3 * torch.randn(N, X, generator=g)).to(DEVICE, dtype)
    dact = torch.randn(N, F, generator=g).to(DEVICE, dtype)
    want_dh, want_act = expected64(h, dact, activation)
    op = A.activation_backward_ if impl == "triton" else A.activation_backward_reference_
    h_in, d_in = h.clone(), dact.clone()
    out = op(h_in, d_in, activation)
    assert out is d_in and out.dtype == dtype  # in place: act over dact, dL/dh over h
    if N == 0:
        return
    assert max_rel(h_in, want_dh) < TOL[dtype], max_rel(h_in, want_dh)
    assert max_rel(d_in, want_act) < TOL[dtype], max_rel(d_in, want_act)


def test_strided_inputs():
    """Column views (strides not unit along rows) are read and written where they live."""
    g = torch.Generator().manual_seed(1)
    base_h = torch.randn(9, 40, generator=g).to(DEVICE)
    base_d = torch.randn(9, 30, generator=g).to(DEVICE)
    h, d = base_h[:, 5:25], base_d[:, 3:23]
    want_dh, want_act = expected64(h, d, "gelu")
    untouched_h, untouched_d = base_h[:, :5].clone(), base_d[:, 23:].clone()
    A.activation_backward_(h, d, "gelu")
    assert max_rel(h, want_dh) < 1e-5 and max_rel(d, want_act) < 1e-5
    assert torch.equal(base_h[:, :5], untouched_h) and torch.equal(base_d[:, 23:], untouched_d)


def test_errors():
    h, d = torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="activation='relu'"):
        A.activation_backward_(h, d, "relu")
    with pytest.raises(ValueError, match=r"h_NX has shape \(4, 8\), expected \(4, 16\)"):
        A.activation_backward_(h, d, "swiglu")
    with pytest.raises(ValueError, match="dtype and device"):
        A.activation_backward_(h, d.double(), "gelu")
