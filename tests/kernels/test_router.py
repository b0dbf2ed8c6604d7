"""The fused router (kernels/router.py, megatron_moe/ops/route.py) against its plain-PyTorch
reference in float64 through autograd: chosen experts, combine weights, counts, both losses and
dL/dlogits, for softmax and sigmoid scores, with and without renormalised weights and expert bias,
on the edges (one expert, top_k = num_experts, E not a power of two, T not a multiple of the
token block, several token blocks, all tokens to one expert).

On the CPU the kernels run under the Triton interpreter (tests/conftest.py): small shapes only.
"""
from __future__ import annotations

import pytest
import torch

from _util import needs_triton_kernels, triton_kernels_run
from megatron_moe.kernels.router import _blocks, bwd_tile, route_reference
from megatron_moe.ops.route import route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def float64_reference(logits, bias, top_k, dw, daux, dz, **kw):
    x = logits.detach().cpu().double().requires_grad_()
    b = None if bias is None else bias.cpu().double()
    ids, w, counts, aux, z = route_reference(x, b, top_k, **kw)
    grad = _grad([w, aux, z], x, [dw.cpu().double(), daux.cpu().double(), dz.cpu().double()])
    return ids, w.detach(), counts, aux.detach(), z.detach(), grad


def _grad(outs, x, douts):
    """d(Σ outs · douts)/dx over the outputs that have a gradient (a loss whose coefficient is 0
    is a constant in the reference)."""
    pairs = [(o, d) for o, d in zip(outs, douts) if o.requires_grad]
    return torch.autograd.grad([o for o, _ in pairs], [x], [d for _, d in pairs])[0]


def run_fused(logits, bias, top_k, dw, daux, dz, **kw):
    x = logits.clone().to(DEVICE).requires_grad_()
    ids, w, counts, aux, z = route(x, None if bias is None else bias.to(DEVICE), top_k, **kw)
    grad = _grad([w, aux, z], x, [dw.to(DEVICE), daux.to(DEVICE), dz.to(DEVICE)])
    return ids.cpu(), w.detach().cpu(), counts.cpu(), aux.detach().cpu(), z.detach().cpu(), grad.cpu()


CASES = [  # T, E, K
    (37, 8, 2),    # T not a multiple of anything
    (300, 16, 1),  # several token blocks (BLOCK_T = 256 at E = 16)
    (19, 3, 3),    # top_k = num_experts, E not a power of two
    (5, 1, 1),     # one expert
    (9, 64, 8),    # many experts
    (2, 130, 4),   # E past a power of two: BLOCK_E = 256, BLOCK_T = 16
    (37, 100, 8),  # BLOCK_E = 128, top-8: two token blocks, the last partial
]


@pytest.mark.parametrize("T, E, K", CASES)
@pytest.mark.parametrize("softmax", [True, False])
@pytest.mark.parametrize("normalize, with_bias", [(False, False), (True, False), (False, True)])
def test_fused_router_matches_float64(T, E, K, softmax, normalize, with_bias):
    g = torch.Generator().manual_seed(T * 1000 + E * 10 + K)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if with_bias else None
    dw, daux, dz = torch.randn(T, K, generator=g), torch.tensor(1.3), torch.tensor(-0.7)
    kw = dict(softmax=softmax, normalize=normalize, aux_coeff=0.05, z_coeff=0.01)
    want = float64_reference(logits, bias, K, dw, daux, dz, **kw)
    got = run_fused(logits, bias, K, dw, daux, dz, **kw)
    assert torch.equal(got[0], want[0]), "expert ids"
    assert got[0].dtype == torch.int64 and got[2].dtype == torch.int64
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], want[2]), "counts"
    torch.testing.assert_close(got[3].double(), want[3], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[4].double(), want[4], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[5].double(), want[5], rtol=1e-4, atol=1e-6)


def test_all_tokens_to_one_expert_and_zero_coefficients():
    """Every token's best expert is 3: counts [0, 0, 0, T, ...]; no aux or z: both exactly 0 and
    the gradient is the combine weights' alone."""
    T, E = 45, 6
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, E, generator=g) * 0.1
    logits[:, 3] += 5.0
    dw = torch.randn(T, 1, generator=g)
    want = float64_reference(logits, None, 1, dw, torch.tensor(1.0), torch.tensor(1.0))
    got = run_fused(logits, None, 1, dw, torch.tensor(1.0), torch.tensor(1.0))
    assert got[2].tolist() == [0, 0, 0, T, 0, 0] == want[2].tolist()
    assert got[3].item() == 0.0 and got[4].item() == 0.0
    torch.testing.assert_close(got[5].double(), want[5], rtol=1e-4, atol=1e-7)


@needs_triton_kernels
def test_ties_take_the_lowest_expert():
    """Equal scores: the kernel takes the lowest expert first (torch.topk leaves the order open)."""
    logits = torch.zeros(7, 5)
    logits[:, 4] = 1.0
    ids, w, counts, _, _ = route(logits.to(DEVICE), None, 3)
    assert ids.cpu().tolist() == [[4, 0, 1]] * 7
    assert counts.cpu().tolist() == [7, 7, 0, 0, 7]


def test_unused_outputs_need_no_gradient():
    """Only the combine weights used (no aux, no z in the loss): the gradient is theirs alone."""
    T, E, K = 20, 8, 2
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(T, E, generator=g)
    dw = torch.randn(T, K, generator=g)
    x = logits.clone().to(DEVICE).requires_grad_()
    _, w, _, aux, _ = route(x, None, K, aux_coeff=0.1, z_coeff=0.1)
    (w * dw.to(DEVICE)).sum().backward()
    xr = logits.detach().double().requires_grad_()
    _, wr, _, _, _ = route_reference(xr, None, K, aux_coeff=0.1, z_coeff=0.1)
    (wr * dw.double()).sum().backward()
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, rtol=1e-4, atol=1e-7)


def test_losses_are_deterministic():
    """The partial sums are added in a fixed order: the same logits give the same bits."""
    logits = torch.randn(600, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    a = route(logits, None, 2, aux_coeff=0.01, z_coeff=0.001)
    b = route(logits, None, 2, aux_coeff=0.01, z_coeff=0.001)
    assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])


def test_tile_stays_within_4096_elements():
    for E in (1, 2, 3, 8, 64, 128, 130, 512, 4096):
        bt, be, bk = _blocks(E, 1)
        assert be >= E and bt * be <= max(4096, be) and bt >= 1 and bk >= 2
        bt, be, _ = _blocks(E, 1, bwd_tile(E)[0])
        assert be >= E and bt * be <= max(4096, be) and bt >= 1


def test_bad_logits_are_a_clear_error():
    from megatron_moe.kernels.router import route_fwd_triton

    with pytest.raises(ValueError, match="float32"):
        route_fwd_triton(torch.zeros(4, 3, dtype=torch.float64), None, 1)
    with pytest.raises(ValueError, match="top_k=4"):
        route_fwd_triton(torch.zeros(4, 3), None, 4)


def test_switch_and_reference_impl_take_the_plain_pytorch_router(monkeypatch):
    """MEGATRON_MOE_FUSED_ROUTER=0 and ``fused=False`` (mlp_impl='reference') run the reference;
    the outputs agree with the fused kernels'."""
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(4)).to(DEVICE).requires_grad_()
    fused = route(logits, None, 2, aux_coeff=0.01)
    plain = route(logits, None, 2, aux_coeff=0.01, fused=False)
    monkeypatch.setenv("MEGATRON_MOE_FUSED_ROUTER", "0")
    switched = route(logits, None, 2, aux_coeff=0.01)
    names = [type(r[1].grad_fn).__name__ for r in (fused, plain, switched)]
    if triton_kernels_run():
        assert names[0] == "_RouteBackward" and names[1] != "_RouteBackward" and names[2] == names[1]
    for r in (plain, switched):
        assert torch.equal(r[0], fused[0]) and torch.equal(r[2], fused[2])
        torch.testing.assert_close(r[1], fused[1])
        torch.testing.assert_close(r[3], fused[3])


@needs_triton_kernels
def test_router_step_is_five_launches():
    """benchmarks/count_launches.py's count of one bf16 router forward and backward: the logits
    GEMM and two launches forward, one launch and the logits' two gradient GEMMs in one kernel
    backward (kernels/router_gemm.py; its weight gradient's partials summed by one more launch
    when the tokens are split over programs, not at this size), none of the ~40 element-wise
    torch ops of the plain router nor the ~10 of the logits' bf16 parts through torch (their host
    time is what the fusion removes)."""
    from pathlib import Path

    from _util import load_script

    count_launches = load_script(Path(__file__).parents[2] / "benchmarks" / "count_launches.py")
    res = count_launches.layer_counts("triton_grouped", (40, 16, 32, 8, 2), DEVICE, torch.bfloat16)
    fwd, bwd = res["router fwd"], res["router bwd"]
    assert fwd["triton_names"] == ["_logits_kernel", "_route_fwd_kernel", "_route_sum_kernel"]
    assert bwd["triton_names"] == ["_route_bwd_kernel", "_logits_bwd_kernel"]
    plain = {"_softmax", "topk", "gather", "scatter_add_", "logsumexp", "_softmax_backward_data", "scatter_add",
             "mm", "cat", "sub", "_to_copy"}
    assert not plain & set(fwd["op_names"] + bwd["op_names"])
