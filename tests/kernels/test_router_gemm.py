"""The router's GEMMs (kernels/router_gemm.py) and their plain-PyTorch references against float64:
logits to fp32 accuracy, dx and a bf16 dw to one bf16 rounding plus the dropped products, an fp32
dw to fp32 accuracy; for fp32 and bf16 weights, on the edges (no tokens, one expert, E past a
power of two and past one block of experts, H and T not multiples of their blocks, the weight
gradient's token blocks one and several), and the weight gradient deterministic.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py): small shapes only.
"""
from __future__ import annotations

import pytest
import torch

from _util import needs_triton_kernels
from megatron_moe.kernels import router_gemm as rg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # T, H, E
    (300, 96, 16),   # T past a token block, H past a block of 64
    (1, 40, 1),      # one token, one expert
    (70, 64, 130),   # E past 128: two expert blocks in the forward, three in dx
    (1100, 32, 8),   # several token blocks of the weight gradient (partials summed)
    (0, 32, 4),      # no tokens
]


def _inputs(T, H, E, w_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(E, H, generator=g) * 0.02 + 0.5e-3).to(w_dtype)
    dl = torch.randn(T, E, generator=g) * 3
    return x, w, dl


def _check(x, w, dl, logits, dx, dw):
    xd, wd, gd = x.double(), w.double(), dl.double()
    T = x.shape[0]
    assert logits.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == w.dtype
    assert logits.shape == (T, w.shape[0]) and dx.shape == x.shape and dw.shape == w.shape
    if T == 0:  # nothing to sum: dw is exactly zero
        assert dw.abs().sum().item() == 0
        return
    ref = xd @ wd.t()
    assert ((logits.double() - ref).abs() <= 1e-6 * (xd.abs() @ wd.abs().t()).max()).all()
    # dx: one bf16 rounding (2^-9 relative) plus g's parts past 16 bits and w's past 16 (< 2^-15)
    ref_dx = gd @ wd
    bound = 2 ** -8 * ref_dx.abs() + 2 ** -15 * (gd.abs() @ wd.abs())
    assert ((dx.double() - ref_dx).abs() <= bound).all()
    ref_dw = gd.t() @ xd
    dw_scale = gd.abs().t() @ xd.abs()
    if w.dtype == torch.float32:
        assert ((dw.double() - ref_dw).abs() <= 1e-6 * dw_scale.max() + 1e-30).all()
    else:  # rounded once to bf16, from g to 16 bits
        assert ((dw.double() - ref_dw).abs() <= 2 ** -8 * ref_dw.abs() + 2 ** -14 * dw_scale).all()


@needs_triton_kernels
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, E", SHAPES)
def test_kernels_match_float64(T, H, E, w_dtype):
    x, w, dl = _inputs(T, H, E, w_dtype, T + H + E)
    x, w, dl = x.to(DEVICE), w.to(DEVICE), dl.to(DEVICE)
    out = rg.logits_triton(x, w), rg.logits_dx_triton(dl, w, x.dtype), rg.logits_dw_triton(dl, x, w.dtype)
    _check(x.cpu(), w.cpu(), dl.cpu(), *(t.cpu() for t in out))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, E", SHAPES)
def test_references_match_float64(T, H, E, w_dtype):
    x, w, dl = _inputs(T, H, E, w_dtype, 7 * T + E)
    _check(x, w, dl, rg.logits_reference(x, w), *rg.logits_backward_reference(dl, x, w))


@needs_triton_kernels
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, E", SHAPES)
def test_fused_backward_matches_float64(T, H, E, w_dtype):
    """logits_backward_triton: both gradients in one kernel (E <= 128; E = 130 takes the two
    kernels), as accurate as the two kernels; alone (dx only, dw only) the same bits as together."""
    x, w, dl = _inputs(T, H, E, w_dtype, 5 * T + H)
    x, w, dl = x.to(DEVICE), w.to(DEVICE), dl.to(DEVICE)
    dx, dw = rg.logits_backward_triton(dl, x, w)
    _check(x.cpu(), w.cpu(), dl.cpu(), rg.logits_triton(x, w).cpu(), dx.cpu(), dw.cpu())
    dx_only, none_dw = rg.logits_backward_triton(dl, x, w, need_dw=False)
    none_dx, dw_only = rg.logits_backward_triton(dl, x, w, need_dx=False)
    assert none_dw is None and none_dx is None
    assert torch.equal(dx_only, dx) and torch.equal(dw_only, dw)


@needs_triton_kernels
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_fused_backward_in_either_order_is_the_same(w_dtype, monkeypatch):
    """DW_FIRST (the sweep's other order of the two products in the loop): the same bits."""
    x, w, dl = _inputs(1100, 96, 16, w_dtype, 9)
    x, w, dl = x.to(DEVICE), w.to(DEVICE), dl.to(DEVICE)
    into = torch.randn(1100, 96, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEVICE)
    runs = []
    for dw_first in (False, True):
        monkeypatch.setitem(rg.BWD_CONFIG, w_dtype, {**rg.BWD_CONFIG[w_dtype], "DW_FIRST": dw_first})
        runs.append(rg.logits_backward_triton(dl, x, w, dx_add_TH=into.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@needs_triton_kernels
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, E", [(300, 96, 16), (70, 64, 130), (0, 32, 4)])
def test_fused_backward_adds_into_the_given_dx(T, H, E, w_dtype):
    """dx_add_TH: the router's dx added to it in place (the experts' dx of the same x), the sum
    rounded once: within one bf16 rounding of the float64 sum of it and g @ w."""
    x, w, dl = _inputs(T, H, E, w_dtype, 11 * T + E)
    other = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).bfloat16()
    x, w, dl, into = x.to(DEVICE), w.to(DEVICE), dl.to(DEVICE), other.to(DEVICE).clone()
    dx, _ = rg.logits_backward_triton(dl, x, w, need_dw=False, dx_add_TH=into)
    assert dx is into
    gd, wd = dl.double().cpu(), w.double().cpu()
    ref = other.double() + gd @ wd
    bound = 2 ** -8 * ref.abs() + 2 ** -15 * (gd.abs() @ wd.abs())
    assert ((dx.double().cpu() - ref).abs() <= bound).all()
    with pytest.raises(ValueError, match="dx_add_TH must be a contiguous"):
        rg.logits_backward_triton(dl, x, w, dx_add_TH=into.float())


@needs_triton_kernels
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_is_deterministic(w_dtype):
    """Several token blocks, their fp32 partials summed in a fixed order: the same bits on every
    call (and as accurate as one block: test_kernels_match_float64's (1100, 32, 8))."""
    x, w, dl = _inputs(1100, 32, 8, w_dtype, 3)
    x, dl = x.to(DEVICE), dl.to(DEVICE)
    runs = [rg.logits_dw_triton(dl, x, w_dtype) for _ in range(3)]
    w = w.to(DEVICE)
    runs += [rg.logits_backward_triton(dl, x, w)[1] for _ in range(2)]
    assert all(torch.equal(runs[0], r) for r in runs[1:3]) and torch.equal(runs[3], runs[4])


@needs_triton_kernels
def test_bad_operands_are_refused():
    x = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="bf16 x"):
        rg.logits_triton(x.float(), torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"x \[T, H\] and w \[E, H\]"):
        rg.logits_triton(x, torch.zeros(2, 9, device=DEVICE))
