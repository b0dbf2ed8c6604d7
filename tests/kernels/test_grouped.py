"""Grouped GEMM kernels (kernels/grouped.py) and the triton_grouped_mlp op (ops/triton_grouped_mlp.py).

Kernels are checked against their plain-PyTorch references with poisoned (NaN) outputs; the op's
output and its gradients of x, w1, w2 and the router weights against a float64 per-token loop
written here. On the CPU the kernels run under the Triton interpreter (tiny shapes; tile 16).

    pytest tests/kernels/test_grouped.py            # CPU: interpreter
    pytest tests/kernels/test_grouped.py -m gpu     # GPU-only cases (autotuned kernels, no host sync)
"""
import math
import os
import sys
from unittest import mock

import pytest
import torch
import triton

from megatron_moe.kernels import grouped as G
from megatron_moe.kernels._common import interpret_mode
from megatron_moe.kernels.metadata import routing_metadata
from megatron_moe.ops.triton_grouped_mlp import triton_grouped_mlp

sys.path.insert(0, os.path.dirname(__file__))
import _float64 as f64  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# max |error| / max |reference|. The interpreter truncates fp32 -> bf16 casts (the GPU rounds to
# nearest), doubling each rounding: y's three (pre and act, each row of the down projection, the
# sum over k) reach 2.1e-2 there, against 1.3e-2 when the sum rounds to nearest.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2 if interpret_mode() else 2e-2}


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def make_ids(kind, T, E, K, gen):
    """[T, K] expert ids with K distinct experts per token, by kind."""
    if kind == "all_one":
        assert K == 1
        return torch.full((T, 1), E // 2, dtype=torch.long)
    if kind == "sparse":  # only experts 1 and E-2: all others empty (incl. first and last)
        pool = torch.tensor([1, E - 2])
        return torch.stack([pool[torch.randperm(2, generator=gen)[:K]] for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])


def routing_for(kind, T, E, K, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids_TK = make_ids(kind, T, E, K, gen).to(device)
    return ids_TK, routing_metadata(ids_TK, E, 16)


def check_op(T, H, F, E, K, kind, activation, dtype, device, seed=0, recompute_activation=False):
    ids_TK, routing = routing_for(kind, T, E, K, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    F1 = 2 * F if activation == "swiglu" else F
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, F1, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, F, H, generator=gen) / math.sqrt(F)
    wts = torch.rand(T, K, generator=gen) + 0.1
    dy = torch.randn(T, H, generator=gen)
    # quantise to the test dtype so both sides see the same inputs
    x, w1, w2, dy = (t.to(dtype) for t in (x, w1, w2, dy))

    leaves = [t.to(device, copy=True).requires_grad_() for t in (x, w1, w2, wts)]
    y = triton_grouped_mlp(*leaves, routing, activation, recompute_activation=recompute_activation)
    assert y.dtype == dtype and y.shape == (T, H)
    y.backward(dy.to(device))

    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2, wts)]
    y_ref = f64.loop_mlp(*ref_leaves[:3], ids_TK.cpu(), ref_leaves[3], activation)
    y_ref.backward(dy.double())

    tol = TOL[dtype]
    assert rel_err(y.cpu(), y_ref) < tol, "y"
    for name, got, want in zip(("dx", "dw1", "dw2", "dweights"), leaves, ref_leaves):
        assert got.grad.dtype == got.dtype, name
        assert torch.isfinite(got.grad).all(), name
        assert rel_err(got.grad.cpu(), want.grad) < tol, name
    return leaves


@pytest.fixture(params=[False, True], ids=["per-tile", "persistent"])
def schedule(request, monkeypatch):
    """The row-grouped kernel one program per tile (its first config), or persistent: the same
    tile config with PERSISTENT=1 on a grid of 2 programs, so each program walks several tiles."""
    if request.param:
        kern = G._grouped_gemm_kernel
        base = kern.configs[0]
        cfg = triton.Config(dict(base.kwargs, PERSISTENT=1), num_warps=base.num_warps, num_stages=base.num_stages,
                            pre_hook=base.pre_hook)
        monkeypatch.setattr(kern, "configs", [cfg])
        monkeypatch.setattr(G, "num_sms", lambda device: 2)
        G.clear_tuning_cache()
        yield True
        G.clear_tuning_cache()
    else:
        yield False


# ----------------------------------------------------------------------------------------------
# The op against the float64 loop
# ----------------------------------------------------------------------------------------------

OP_CASES = {  # T, H, F, E, K, kind, activation
    "one_expert": (21, 24, 20, 1, 1, "random", "gelu"),
    "16_experts_top1": (37, 20, 18, 16, 1, "random", "swiglu"),
    "top_k_eq_num_experts": (11, 20, 17, 4, 4, "random", "gelu"),
    "empty_experts_top2": (19, 24, 20, 6, 2, "sparse", "swiglu"),
    "all_to_one_expert": (35, 20, 18, 4, 1, "all_one", "gelu"),
}


@pytest.mark.parametrize("case", OP_CASES)
def test_grouped_mlp_fp32(case, device, schedule):
    check_op(*OP_CASES[case], dtype=torch.float32, device=device)


@pytest.mark.parametrize("case", ["top_k_eq_num_experts", "empty_experts_top2"])
def test_grouped_mlp_bf16(case, device):
    check_op(*OP_CASES[case], dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("case", ["one_expert", "16_experts_top1", "all_to_one_expert"])
def test_top1_backward_with_dy_sorted_once_or_gathered(case, device, monkeypatch):
    """Top-1: the backward permutes dy once and its activation backward and dw2 read sorted rows
    (MEGATRON_MOE_SORTED_DY=1), or they gather dy's rows themselves (=0): both against
    the float64 loop (check_op), and the same bits (only the rows' addresses differ)."""
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("MEGATRON_MOE_SORTED_DY", on)
        runs.append(check_op(*OP_CASES[case], dtype=torch.bfloat16, device=device))
    for a, b in zip(*runs):
        assert torch.equal(a.grad, b.grad)


TOP1_GELU_CASES = {  # T, H, F, E, K, kind, activation
    "one_expert": OP_CASES["one_expert"],
    "all_to_one_expert": OP_CASES["all_to_one_expert"],
    "16 experts, some empty": (37, 20, 18, 16, 1, "random", "gelu"),
    "the Gluon kernel's shapes (H 64, F 32; sm_90)": (150, 64, 32, 4, 1, "sparse", "gelu"),
}


@pytest.mark.parametrize("case", list(TOP1_GELU_CASES))
def test_top1_gelu_forward_with_x_sorted_once_or_gathered(case, device, monkeypatch):
    """Top-1 GELU: the forward permutes x once and the up projection and dw1 read sorted rows
    (MEGATRON_MOE_SORTED_X=1; on sm_90 the up projection runs kernels/gluon_gemm.py's kernel, by TMA),
    or they gather x's rows themselves (=0): both against the float64 loop (check_op), and the same
    bits (the same products, only the rows' addresses differ)."""
    import megatron_moe.ops.triton_grouped_mlp as op

    gathers = []

    def spy(*args, **kw):
        if kw.get("activation"):
            gathers.append(kw.get("gather_S") is not None)
        return G.grouped_gemm(*args, **kw)

    monkeypatch.setattr(op, "grouped_gemm", spy)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("MEGATRON_MOE_SORTED_X", on)
        runs.append(check_op(*TOP1_GELU_CASES[case], dtype=torch.bfloat16, device=device))
    assert gathers == [False, True]
    for a, b in zip(*runs):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("case", ["16_experts_top1", "top_k_eq_num_experts", "empty_experts_top2"])
def test_grouped_mlp_recompute_activation(case, device):
    """Only pre saved, wact recomputed in the dw2 kernel: the same gradients against the float64
    loop, and the same as saving wact (the recompute rounds as the forward did)."""
    saved = check_op(*OP_CASES[case], dtype=torch.float32, device=device)
    recomputed = check_op(*OP_CASES[case], dtype=torch.float32, device=device, recompute_activation=True)
    for a, b in zip(saved, recomputed):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def test_grouped_mlp_reference_path(monkeypatch):
    """CPU without Triton: the same Function runs the plain-PyTorch references."""
    calls = []
    real = G.grouped_gemm_triton
    monkeypatch.setattr(G, "grouped_gemm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(G, "use_triton", lambda *tensors: False)
    for case in ("empty_experts_top2", "top_k_eq_num_experts"):
        check_op(*OP_CASES[case], dtype=torch.float32, device=torch.device("cpu"))
    assert not calls


def test_grouped_mlp_matches_reference_experts(device):
    """Same numbers as the project's reference_experts (another independent path)."""
    from megatron_moe.experts import reference_experts

    T, H, F, E, K = 13, 20, 18, 5, 2
    ids_TK, routing = routing_for("random", T, E, K, device, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, w1, w2 = (torch.randn(T, H, generator=gen), torch.randn(E, H, 2 * F, generator=gen),
                  torch.randn(E, F, H, generator=gen))
    wts = torch.rand(T, K, generator=gen)
    x, w1, w2, wts = (t.to(device) for t in (x, w1, w2, wts))
    y = triton_grouped_mlp(x, w1, w2, wts, routing, "swiglu")
    y_ref = reference_experts(x.double(), w1.double(), w2.double(), ids_TK, wts.double(), "swiglu")
    assert rel_err(y.cpu(), y_ref.cpu()) < 2e-5


# ----------------------------------------------------------------------------------------------
# Kernels against their references (outputs poisoned with NaN: every element must be written)
# ----------------------------------------------------------------------------------------------


def kernel_inputs(kind, T, E, K, device, seed=0):
    _, r = routing_for(kind, T, E, K, device, seed)
    S = T * K
    gen = torch.Generator().manual_seed(seed + 7)
    scale = (torch.rand(S, generator=gen) + 0.5).to(device)
    return r, S, scale, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
def test_grouped_gemm_kernel(activation, dtype, device, schedule):
    T, E, K, H, F = 17, 5, 2, 35, 19
    r, S, scale, gen = kernel_inputs("random", T, E, K, device)
    a = torch.randn(T, H, generator=gen).to(device, dtype)
    Nw = 2 * F if activation == "swiglu" else F
    w = torch.randn(E, Nw, H, generator=gen).to(device, dtype).transpose(1, 2)  # [E, H, Nw], strided
    kw = dict(gather_S=r.sorted_token_N, scatter_S=r.sort_order_N, scale_S=scale, activation=activation)
    if activation:  # the activation alone times a second per-row scale
        kw["act_scale_S"] = (torch.rand(S, generator=gen) - 0.5).to(device)
    out = torch.full((S, Nw), float("nan"), device=device, dtype=dtype)
    act = torch.full((S, F), float("nan"), device=device, dtype=dtype) if activation else None
    got = G.grouped_gemm_triton(a, w, r.expert_offsets_E1, out=out, act_out=act, **kw)
    want = G.grouped_gemm_reference(a, w, r.expert_offsets_E1, **kw)
    got, want = (got, want) if activation else ((got,), (want,))
    for g, wnt in zip(got, want):
        assert torch.isfinite(g).all()
        # bf16 act: the interpreter truncates fp32 -> bf16 (pre, then act): a few ulps, not a bug
        assert rel_err(g, wnt) < TOL[dtype]
    # independent check of the plain GEMM part: row of assignment (t, k) = scale · a[t] @ w[e]
    a_idx = r.sort_order_N.long()
    direct = torch.stack([a[int(r.sorted_token_N[s])].double() @ w[int(r.expert_ids_N[a_idx[s]])].double()
                          for s in range(S)]) * scale.double()[:, None]
    pre = torch.empty_like(direct).index_copy_(0, a_idx, direct)
    assert rel_err(got[0], pre) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_gemm_dact_kernel(activation, dtype, device, schedule):
    T, E, K, H, F = 17, 5, 2, 35, 19
    r, S, scale, gen = kernel_inputs("sparse", T, E, K, device)
    dy = torch.randn(T, H, generator=gen).to(device, dtype)
    w2 = torch.randn(E, F, H, generator=gen).to(device, dtype)
    pre = torch.randn(S, 2 * F if activation == "swiglu" else F, generator=gen).to(device, dtype)
    args = (dy, w2.transpose(1, 2), r.expert_offsets_E1, pre, activation)
    got = G.grouped_gemm_dact_triton(*args, gather_S=r.sorted_token_N, scale_S=scale)
    want = G.grouped_gemm_dact_reference(*args, gather_S=r.sorted_token_N, scale_S=scale)
    for name, g, wnt in zip(("dpre", "dscale"), got, want):
        assert g.shape == wnt.shape and g.dtype == wnt.dtype, name
        assert rel_err(g, wnt) < TOL[dtype] / 2, name
    # independent float64 check: g = dy[t(s)] @ w2[e]ᵀ, dpre = scale·g·act'(pre), dscale = Σ g·act(pre)
    e_S = r.expert_ids_N[r.sort_order_N.long()].long()
    g = torch.stack([dy[int(t)].double() @ w2[int(e)].double().t() for t, e in zip(r.sorted_token_N, e_S)])
    h = pre.double()
    if activation == "gelu":
        act, dact = f64.gelu_and_grad(h)
        dpre = g * dact * scale.double()[:, None]
    else:
        act, dgate, dup = f64.swiglu_and_grads(*h.chunk(2, dim=1))
        dpre = torch.cat([g * dgate, g * dup], 1) * scale.double()[:, None]
    assert rel_err(got[0], dpre) < TOL[dtype]
    assert rel_err(got[1], (g * act).sum(1)) < TOL[dtype]
    # in place: dpre lands in pre's storage, same values
    pre2 = pre.clone()
    got_in, _ = G.grouped_gemm_dact_triton(dy, w2.transpose(1, 2), r.expert_offsets_E1, pre2, activation,
                                           gather_S=r.sorted_token_N, scale_S=scale, inplace=True)
    assert got_in.data_ptr() == pre2.data_ptr() and torch.equal(got_in, got[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_wgrad_kernel(dtype, device):
    T, E, K, Ka, Nb = 23, 6, 2, 35, 21
    r, S, scale, gen = kernel_inputs("sparse", T, E, K, device)  # experts 0, 2, 3, 5 empty
    a = torch.randn(S, Ka, generator=gen).to(device, dtype)
    b = torch.randn(T, Nb * 2, generator=gen).to(device, dtype)[:, ::2]  # strided columns
    out = torch.full((E, Ka, Nb), float("nan"), device=device, dtype=dtype)
    kw = dict(gather_b_S=r.sorted_token_N, scale_S=scale)
    got = G.grouped_wgrad_triton(a, b, r.expert_offsets_E1, out=out, **kw)
    want = G.grouped_wgrad_reference(a, b, r.expert_offsets_E1, **kw)
    assert rel_err(got, want) < TOL[dtype] / 2
    counts = r.tokens_per_expert_E.cpu()
    assert (counts == 0).sum() == 4
    assert (got[counts == 0] == 0).all() and got[counts > 0].abs().amin(dim=(1, 2)).gt(0).all()
    # independent: dw[e] = Σ over e's rows of a[s]ᵀ scale(s) b[t(s)]
    e_S = torch.repeat_interleave(torch.arange(E, device=device), r.tokens_per_expert_E.long())
    b_rows = b[r.sorted_token_N.long()].double() * scale.double()[:, None]
    direct = torch.stack([a[e_S == e].double().t() @ b_rows[e_S == e] for e in range(E)])
    assert rel_err(got, direct) < TOL[dtype]


@pytest.mark.parametrize("Nb", [21, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_wgrad_accumulates_into_fp32_out(dtype, Nb, device):
    """accumulate=True: out += dw in fp32 before the store (gradient accumulation fusion), for
    bf16 and fp32 inputs; experts without rows keep out as it was; no rows at all: out unchanged;
    accumulate=False with out: overwritten. Against float64 sums of the per-expert products.
    On an sm_90+ GPU, 20 columns (80-byte rows) take the TMA reduce-add path, 21 the kernel's own
    load-add-store; the tiles overhang out's 35 x Nb on both sides."""
    T, E, K, Ka = 23, 6, 2, 35
    r, S, _, gen = kernel_inputs("sparse", T, E, K, device)  # experts 0, 2, 3, 5 empty
    a = torch.randn(S, Ka, generator=gen).to(device, dtype)
    b = torch.randn(T, Nb, generator=gen).to(device, dtype)
    start = torch.randn(E, Ka, Nb, generator=gen).to(device)
    out = start.clone()
    kw = dict(gather_b_S=r.sorted_token_N)  # (no scale: its bf16 rounding is the other test's)
    got = G.grouped_wgrad(a, b, r.expert_offsets_E1, out=out, accumulate=True, **kw)
    assert got is out and got.dtype == torch.float32
    e_S = torch.repeat_interleave(torch.arange(E, device=device), r.tokens_per_expert_E.long())
    b_rows = b[r.sorted_token_N.long()].double()
    dw = torch.stack([a[e_S == e].double().t() @ b_rows[e_S == e] for e in range(E)])
    err = (got.double() - (start.double() + dw)).abs().max() / dw.abs().max()
    assert err < 1e-6, err  # one fp32 rounding of each sum, nothing at bf16
    empty = r.tokens_per_expert_E.cpu() == 0
    assert torch.equal(got[empty], start[empty])
    again = G.grouped_wgrad(a, b, r.expert_offsets_E1, out=got, accumulate=False, **kw)
    assert ((again.double() - dw).abs().max() / dw.abs().max()) < 1e-6
    none = routing_metadata(torch.empty(0, K, dtype=torch.long, device=device), E, 16)
    kept = start.clone()
    G.grouped_wgrad(a[:0], b[:0], none.expert_offsets_E1, gather_b_S=none.sorted_token_N, out=kept, accumulate=True)
    assert torch.equal(kept, start)
    if device.type == "cuda":
        tma = torch.cuda.get_device_capability()[0] >= 9 and Nb % 4 == 0
        assert G.tma_add_ok(start) == tma
    with pytest.raises(ValueError, match="accumulate=True adds into out"):
        G.grouped_wgrad(a, b, r.expert_offsets_E1, accumulate=True, **kw)
    with pytest.raises(ValueError, match="out must be"):
        G.grouped_wgrad(a, b, r.expert_offsets_E1, out=start[:, :, :3], accumulate=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_wgrad_activation_prologue(activation, dtype, device):
    """dw2 from the saved pre-activation: A(s) = a_scale(s) · act(pre[s]) recomputed in the
    kernel equals the forward kernel's act_out (same rounding) fed to the plain wgrad, and a
    float64 computation from pre; 70 rows on one expert, none on two (sizes not multiples of 16)."""
    T, E, K, H, F = 37, 5, 2, 19, 21
    gen = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.tensor([1, 3])[torch.randperm(2, generator=gen)] for _ in range(T)])
    ids[:6, 0] = 4  # expert 4: 6 rows; experts 0 and 2: none
    r = routing_metadata(ids.to(device), E, 16)
    S = T * K
    X = 2 * F if activation == "swiglu" else F
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    w1 = (torch.randn(E, H, X, generator=gen) / math.sqrt(H)).to(device, dtype)
    a_scale = (torch.rand(S, generator=gen) + 0.2).to(device)
    dy = torch.randn(T, H, generator=gen).to(device, dtype)
    pre, act = G.grouped_gemm(x, w1, r.expert_offsets_E1, gather_S=r.sorted_token_N, activation=activation,
                              act_scale_S=a_scale)
    kw = dict(gather_b_S=r.sorted_token_N)
    out = torch.full((E, F, H), float("nan"), device=device, dtype=dtype)
    got = G.grouped_wgrad_triton(pre, dy, r.expert_offsets_E1, a_activation=activation, a_scale_S=a_scale,
                                 out=out, **kw)
    from_act = G.grouped_wgrad_triton(act, dy, r.expert_offsets_E1, **kw)
    assert rel_err(got, from_act) < (1e-6 if dtype == torch.float32 else 1e-2)
    want = G.grouped_wgrad_reference(pre, dy, r.expert_offsets_E1, a_activation=activation, a_scale_S=a_scale, **kw)
    assert rel_err(got, want) < TOL[dtype] / 2
    # float64 from pre
    a64 = f64.activate(pre.double(), activation) * a_scale.double()[:, None]
    e_S = torch.repeat_interleave(torch.arange(E, device=device), r.tokens_per_expert_E.long())
    dy_rows = dy[r.sorted_token_N.long()].double()
    direct = torch.stack([a64[e_S == e].t() @ dy_rows[e_S == e] for e in range(E)])
    assert rel_err(got, direct) < TOL[dtype]
    assert (got[[0, 2]] == 0).all()


def test_grouped_wgrad_activation_errors(device):
    off = torch.tensor([0, 3], dtype=torch.int32, device=device)
    pre, dy = torch.randn(3, 7, device=device), torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="even number of columns"):
        G.grouped_wgrad(pre, dy, off, a_activation="swiglu")
    with pytest.raises(ValueError, match="a_scale_S"):
        G.grouped_wgrad(pre, dy, off, a_scale_S=torch.ones(3, device=device))
    with pytest.raises(ValueError, match="a_activation"):
        G.grouped_wgrad(pre, dy, off, a_activation="relu")


def test_grouped_wgrad_gather_a_one_expert(device):
    T, H, F = 21, 19, 33
    r, S, _, gen = kernel_inputs("random", T, 1, 1, device)
    x = torch.randn(T, H, generator=gen).to(device)
    d = torch.randn(S, F, generator=gen).to(device)
    got = G.grouped_wgrad_triton(x, d, r.expert_offsets_E1, gather_a_S=r.sorted_token_N)
    assert rel_err(got[0], x[r.sorted_token_N.long()].double().t() @ d.double()) < TOL[torch.float32]


def test_shape_errors(device):
    off = torch.tensor([0, 3], dtype=torch.int32, device=device)
    a = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="K="):
        G.grouped_gemm(a, torch.randn(1, 9, 4, device=device), off)
    with pytest.raises(ValueError, match="offsets_E1"):
        G.grouped_gemm(a, torch.randn(2, 8, 4, device=device), off)
    with pytest.raises(ValueError, match="swiglu"):
        G.grouped_gemm_triton(a, torch.randn(1, 8, 5, device=device), off, activation="swiglu")
    with pytest.raises(ValueError, match="share"):
        G.grouped_gemm(a, torch.randn(1, 8, 4, device=device, dtype=torch.float64), off)


# ----------------------------------------------------------------------------------------------
# GPU only: autotuned tile sizes, realistic shapes, no host synchronisation
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_mlp_gpu_bf16_vs_reference_experts(activation):
    from megatron_moe.experts import reference_experts

    T, H, F, E, K = 1536, 512, 704, 16, 2
    dev = torch.device("cuda")
    ids_TK, routing = routing_for("random", T, E, K, dev, seed=5)
    ids_TK[: T // 2, 0] = 3  # imbalance: expert 3 gets over half of the first choices
    ids_TK[: T // 2, 1] = torch.where(ids_TK[: T // 2, 1] == 3, 4, ids_TK[: T // 2, 1])
    routing = routing_metadata(ids_TK, E, 128)
    F1 = 2 * F if activation == "swiglu" else F
    x = torch.randn(T, H, device=dev)
    w1 = torch.randn(E, H, F1, device=dev) / H ** 0.5
    w2 = torch.randn(E, F, H, device=dev) / F ** 0.5
    wts = torch.rand(T, K, device=dev)
    dy = torch.randn(T, H, device=dev)
    leaves = [t.bfloat16().requires_grad_() for t in (x, w1, w2)] + [wts.clone().requires_grad_()]
    triton_grouped_mlp(*leaves, routing, activation).backward(dy.bfloat16())  # autotune outside the sync check
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = triton_grouped_mlp(*leaves, routing, activation)
        y.backward(dy.bfloat16())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = reference_experts(*ref[:3], ids_TK, ref[3], activation)
    y_ref.backward(dy.double())
    assert rel_err(y, y_ref) < 2e-2
    for name, got, want in zip(("dx", "dw1", "dw2", "dweights"), leaves, ref):
        assert rel_err(got.grad, want.grad) < 2e-2, name


def test_wgrad_configs_prune_to_what_the_call_can_run(monkeypatch):
    """The weight-gradient autotuner tries TMA reduce-add configs only where the launcher made the
    output descriptor; then both kinds, unless MEGATRON_MOE_TMA_ADD=1 or a single config is asked
    for (MEGATRON_MOE_AUTOTUNE=0): the reduce-add ones only."""
    configs = [G._wgrad_config(128, 128, 64, 4, st, tma_add=t) for st in (2, 3) for t in (False, True)]
    kinds = lambda kept: sorted({c.kwargs["TMA_ADD"] for c in kept})  # noqa: E731
    monkeypatch.delenv("MEGATRON_MOE_TMA_ADD", raising=False)
    monkeypatch.setenv("MEGATRON_MOE_AUTOTUNE", "1")
    assert kinds(G._prune_wgrad_configs(configs, {"out_desc": None})) == [False]
    assert len(G._prune_wgrad_configs(configs, {"out_desc": object()})) == 4
    monkeypatch.setenv("MEGATRON_MOE_TMA_ADD", "1")
    assert kinds(G._prune_wgrad_configs(configs, {"out_desc": object()})) == [True]
    assert kinds(G._prune_wgrad_configs(configs, {"out_desc": None})) == [False]
    monkeypatch.delenv("MEGATRON_MOE_TMA_ADD")
    monkeypatch.setenv("MEGATRON_MOE_AUTOTUNE", "0")
    assert kinds(G._prune_wgrad_configs(configs, {"out_desc": object()})) == [True]
    assert all(c.kwargs["TMA_ADD"] in (False, True) for c in G._wgrad_configs())


def test_a_config_chosen_after_clearing_launches_its_own_kernel(monkeypatch):
    """The same arguments launched again after clear_tuning_cache under another config (a test's
    or a tile sweep's) reach the launcher under another key: the launcher keeps one compiled
    kernel per key, and the first config's kernel on the second config's grid computed only the
    grid's tiles (wrong input gradients in a GPU test, 2026-12-03). The CPU stands in for the GPU:
    the launcher and the config choice are recorded, not run."""
    seen, base = [], G._grouped_gemm_kernel.configs[0]
    configs = iter([triton.Config(dict(base.kwargs, PERSISTENT=p), num_warps=base.num_warps,
                                  num_stages=base.num_stages) for p in (0, 1)])
    monkeypatch.setattr(G, "interpret_mode", lambda: False)
    monkeypatch.setattr(G, "_config", lambda *a: next(configs))
    monkeypatch.setattr(G.launcher, "launch",
                        lambda fn, grid, args, kwargs, key=None: seen.append((kwargs["PERSISTENT"], key)))
    args = (torch.zeros(4, 8), torch.zeros(2, 8, 8), torch.zeros(3, dtype=torch.int32))
    try:
        for _ in range(2):
            G.clear_tuning_cache()
            for _ in range(2):  # the second launch of a key: the hot path
                G._launch(G._grouped_gemm_kernel, (1,), args, {"EPILOGUE": "none"}, (8, 8), {})
    finally:
        G.clear_tuning_cache()
    assert [p for p, _ in seen] == [0, 0, 1, 1]
    assert seen[0][1] == seen[1][1] and seen[2][1] == seen[3][1] and seen[0][1] != seen[2][1]


@pytest.mark.gpu
def test_grouped_wgrad_tma_add_equals_load_add_store(monkeypatch):
    """The accumulating weight gradient through TMA's reduce-add and through the kernel's own
    fp32 load-add-store give the same bits (one fp32 add of the same sum per element), over
    uneven experts with one empty, K and N not multiples of the tile, and a second
    accumulation on top of the first."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0+")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    T, E, H, F = 700, 8, 200, 324
    ids = torch.randint(0, E - 1, (T, 1), generator=gen)  # expert E-1 empty
    ids[:300] = 2  # one heavy expert
    r = routing_metadata(ids.to(dev), E, 128)
    x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
    d = torch.randn(T, F, generator=gen).to(dev, torch.bfloat16)[r.sorted_token_N.long()]
    start = torch.randn(E, H, F, generator=gen).to(dev)
    outs = {}
    for flag in ("1", "0"):  # "1": the reduce-add configs only (unset: the autotuner's choice)
        monkeypatch.setenv("MEGATRON_MOE_TMA_ADD", flag)
        G.clear_tuning_cache()
        out = start.clone()
        assert G.tma_add_ok(out) == (flag == "1")
        for _ in range(2):
            G.grouped_wgrad(x, d, r.expert_offsets_E1, gather_a_S=r.sorted_token_N, out=out, accumulate=True)
        outs[flag] = out
    assert torch.equal(outs["1"], outs["0"])
    assert torch.equal(outs["1"][E - 1], start[E - 1])
    e_S = torch.repeat_interleave(torch.arange(E, device=dev), r.tokens_per_expert_E.long())
    xs = x[r.sorted_token_N.long()].double()
    dw = torch.stack([xs[e_S == e].t() @ d[e_S == e].double() for e in range(E)])
    assert ((outs["1"].double() - (start.double() + 2 * dw)).abs().max() / dw.abs().max()) < 1e-5


@pytest.mark.gpu
def test_every_tile_config_computes_the_reference(monkeypatch):
    """Each config the autotuner may pick for the row-grouped kernel (tiles, persistent
    schedules, register caps that spill), alone, on the four epilogue kinds: sizes that are
    not multiples of any tile, one empty expert, a heavy one, gather / scatter / scales. The
    plain, dgelu and dswiglu calls take transposed weights, as the backward does (TMA loads on sm_90+)."""
    monkeypatch.delenv("MEGATRON_MOE_AUTOTUNE", raising=False)
    monkeypatch.delenv("MEGATRON_MOE_PERSISTENT", raising=False)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    T, E, H, F = 900, 6, 200, 328
    ids = torch.randint(0, E - 1, (T, 1), generator=gen)  # expert E-1 empty
    ids[:400] = 1
    r = routing_metadata(ids.to(dev), E, 128)
    off, tok, order = r.expert_offsets_E1, r.sorted_token_N, r.sort_order_N
    bf = torch.bfloat16
    x = torch.randn(T, H, generator=gen).to(dev, bf)
    w1 = (torch.randn(E, H, F, generator=gen) / H ** 0.5).to(dev, bf)
    act = torch.randn(T, F, generator=gen).to(dev, bf)
    pre = torch.randn(T, F, generator=gen).to(dev, bf)
    scale = torch.rand(T, generator=gen).to(dev)
    w2t = (torch.randn(E, F, H, generator=gen) / F ** 0.5).to(dev, bf).transpose(1, 2)
    calls = {  # epilogue: the call, given the kernel's entry point or the reference
        "gelu": lambda f: f(x, w1, off, gather_S=tok, activation="gelu", act_scale_S=scale),
        "none": lambda f: f(act, w1.transpose(1, 2), off, scatter_S=order),
    }
    pre2 = torch.randn(T, 2 * F, generator=gen).to(dev, bf)
    want = {"gelu": calls["gelu"](G.grouped_gemm_reference), "none": calls["none"](G.grouped_gemm_reference),
            "dgelu": G.grouped_gemm_dact_reference(x, w2t, off, pre, "gelu", gather_S=tok, scale_S=scale),
            "dswiglu": G.grouped_gemm_dact_reference(x, w2t, off, pre2, "swiglu", gather_S=tok, scale_S=scale)}
    kern, saved = G._grouped_gemm_kernel, G._grouped_gemm_kernel.configs
    configs = G._gemm_configs()
    assert any(c.maxnreg for c in configs)
    try:
        for epilogue in ("gelu", "none", "dgelu", "dswiglu"):
            for cfg in G._prune_gemm_configs(configs, {}, EPILOGUE=epilogue):
                kern.configs = [cfg]
                G.clear_tuning_cache()
                if epilogue == "dgelu":
                    got = G.grouped_gemm_dact(x, w2t, off, pre, "gelu", gather_S=tok, scale_S=scale)
                elif epilogue == "dswiglu":
                    got = G.grouped_gemm_dact(x, w2t, off, pre2, "swiglu", gather_S=tok, scale_S=scale)
                else:
                    got = calls[epilogue](G.grouped_gemm)
                for g, w in zip(got if isinstance(got, tuple) else (got,),
                                want[epilogue] if isinstance(want[epilogue], tuple) else (want[epilogue],)):
                    assert rel_err(g, w) < 2e-2, f"{epilogue}: {cfg}"
    finally:
        kern.configs = saved
        G.clear_tuning_cache()


def test_the_backward_epilogues_do_not_time_a_prefetch_in_a_persistent_loop():
    """PREFETCH + PERSISTENT spills kilobytes a thread (ptxas, sm_90): pruned for every epilogue,
    while each backward epilogue keeps its other PREFETCH and PERSISTENT tiles and the candidate
    list (the tuning tables' key) stays as it is."""
    configs = [G._gemm_config(*c) for c in [(128, 128, 64, 8, 3, 1, 1), (128, 128, 64, 8, 3, 0, 1),
                                               (128, 128, 64, 8, 3, 1, 0), (64, 64, 64, 4, 4, 0, 0)]]
    for epilogue in ("dgelu", "dswiglu"):
        kept = [(c.kwargs["PREFETCH"], c.kwargs["PERSISTENT"]) for c in G._prune_gemm_configs(configs, {},
                                                                                              EPILOGUE=epilogue)]
        assert kept == [(0, 1), (1, 0), (0, 0)], epilogue
    kept = [(c.kwargs["PREFETCH"], c.kwargs["PERSISTENT"]) for c in G._prune_gemm_configs(configs, {}, EPILOGUE="none")]
    assert kept == [(0, 1), (0, 0)]
    # the pruned tile is still a candidate when the autotuner runs (MEGATRON_MOE_AUTOTUNE=0, as
    # the GPU suite runs, keeps only the first tile; the interpreter has one tile of its own)
    with mock.patch.object(G.switches, "autotune", return_value=True), \
            mock.patch.object(G.switches, "persistent", return_value=True), \
            mock.patch.object(G, "interpret_mode", return_value=False):
        assert any(c.kwargs["PREFETCH"] and c.kwargs["PERSISTENT"] for c in G._gemm_configs())


@pytest.mark.gpu
def test_grouped_mlp_gpu_fp32_tight():
    check_op(200, 96, 80, 8, 2, "random", "swiglu", torch.float32, torch.device("cuda"))


def test_second_backward_is_a_clear_error(device):
    """The backward writes dL/d(pre) over the saved pre-activation: a second one must refuse."""
    T, H, F, E, K = 9, 16, 12, 3, 2
    ids_TK, routing = routing_for("random", T, E, K, device)
    leaves = [torch.randn(*shape, device=device).requires_grad_()
              for shape in ((T, H), (E, H, F), (E, F, H), (T, K))]
    y = triton_grouped_mlp(*leaves, routing, "gelu")
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.sum().backward()


def test_padding_rows_are_skipped(device):
    """Experts(skip_padding=True), as a2a_splits='padded' uses it: rows with id E (padding, some
    in the middle, the last ones too) are neither computed nor read; the valid rows' outputs and
    every gradient equal the float64 loop over the valid rows alone."""
    from megatron_moe import MoEConfig
    from megatron_moe.experts import Experts

    T, H, F, E = 29, 20, 18, 4
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, E, (T, 1), generator=gen)
    ids[5:12] = E
    ids[-4:] = E
    valid = ids[:, 0] < E
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, F, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, F, H, generator=gen) / math.sqrt(F)
    dy = torch.randn(T, H, generator=gen)
    experts = Experts(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, mlp_impl="triton_grouped",
                                block_size=16))
    leaves = [t.to(device, copy=True).requires_grad_() for t in (x, w1, w2)]
    y, _ = experts(leaves[0], ids.to(device), torch.ones(T, 1, device=device), w1=leaves[1], w2=leaves[2],
                   skip_padding=True)
    (y[valid.to(device)] * dy[valid].to(device)).sum().backward()

    ref = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
    y_ref = f64.loop_mlp(ref[0][valid], ref[1], ref[2], ids[valid],
                         torch.ones(int(valid.sum()), 1, dtype=torch.float64), "gelu")
    y_ref.backward(dy[valid].double())
    assert rel_err(y[valid.to(device)].detach().cpu(), y_ref) < TOL[torch.float32]
    assert rel_err(leaves[0].grad[valid.to(device)].cpu(), ref[0].grad[valid]) < TOL[torch.float32]
    for got, want in zip(leaves[1:], ref[1:]):
        assert rel_err(got.grad.cpu(), want.grad) < TOL[torch.float32]
