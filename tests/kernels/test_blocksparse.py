"""Block-sparse path: gather/scatter of rows (padded and sorted layouts), SDD/DSD/DDS/TSD kernels and the
blocksparse_mlp op.

Kernels are checked against a dense torch.mm masked to the topology (built here from the expert
ids alone); the op against a float64 per-token loop. Outputs are poisoned (NaN) before the
kernels write them and unused blocks / rows are fed NaN, so a skipped write or a read of an
unused block fails. CPU: Triton under the interpreter, block size 16 (conftest sets
TRITON_INTERPRET). GPU: the same tests, plus ``gpu``-marked ones at block size 128.

    pytest tests/kernels/test_blocksparse.py            # CPU: ~1-2 minutes
"""
import math
import os
import sys

import pytest
import torch

from megatron_moe.kernels import blocksparse as bs
from megatron_moe.kernels import permute as pm
from megatron_moe.kernels.metadata import block_topology, routing_metadata
from megatron_moe.ops.blocksparse_mlp import blocksparse_mlp

sys.path.insert(0, os.path.dirname(__file__))
import _float64 as f64  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(large) in the interpreter's sigmoid

B = 16

# name: (tokens, top_k, experts, F, how the experts are picked)
CASES = {
    "one_expert": (20, 1, 1, 24, "random"),
    "top1_16_experts": (40, 1, 16, 20, "random"),
    "topk_eq_experts": (10, 4, 4, 16, "random"),
    "all_to_one": (30, 1, 4, 40, "one"),
    "empty_experts": (24, 2, 6, 24, "subset"),
}


def make_ids(T, K, E, how, gen):
    scores = torch.rand(T, E, generator=gen)
    if how == "one":
        return torch.full((T, K), 2 % E, dtype=torch.int64)
    if how == "subset":  # experts 1, 2 and 4 get nothing
        scores[:, [1, 2, 4]] = -1.0
    return scores.topk(K, dim=1).indices


def setup_case(name, device, seed=0):
    T, K, E, Fdim, how = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    ids = make_ids(T, K, E, how, gen)
    routing = routing_metadata(ids.to(device), E, B)
    return ids, routing, gen, (T, K, E, Fdim)


def expert_row_ranges(ids, E, P):
    """Expert of every padded row, from the ids alone: [P] with -1 past the last used row."""
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    padded = (counts + B - 1) // B * B
    expert_P = torch.full((P,), -1, dtype=torch.int64)
    start = 0
    for e in range(E):
        expert_P[start:start + padded[e]] = e
        start += int(padded[e])
    return expert_P, counts


def column_mask(expert_P, E, Fdim):
    """[P, E*F] bool: row p may hold only its expert's F columns."""
    col_expert = torch.arange(E * Fdim) // Fdim
    return expert_P[:, None] == col_expert[None, :]


def blocks_to_dense(s, topo):
    """[Z, B, B] or [G, Z, B, B] -> [G, P_max, E*F] placing block z at (row_indices, column_indices)."""
    s = (s[None] if s.dim() == 3 else s).double().cpu()
    G, Z = s.shape[:2]
    E, Fdim, Fb = topo.routing.num_experts, topo.num_columns, topo.blocks_per_row
    P = topo.routing.max_padded_rows
    rows, cols = topo.row_indices_Z.tolist(), topo.column_indices_Z.tolist()
    dense = torch.zeros(G, P, E * Fb * B, dtype=torch.float64)
    for z in range(Z):
        if rows[z] >= 0:
            dense[:, rows[z] * B:(rows[z] + 1) * B, cols[z] * B:(cols[z] + 1) * B] = s[:, z]
    return dense.view(G, P, E, Fb * B)[..., :Fdim].reshape(G, P, E * Fdim)


def random_blocks(G, topo, device, gen, poison_unused=True):
    """Random block data; unused blocks are NaN so a kernel that reads them fails."""
    s = torch.randn(G, topo.max_blocks, B, B, generator=gen)
    if poison_unused:
        s[:, topo.row_indices_Z.cpu() < 0] = float("nan")
    return s.to(device)


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def act_ref(h_G, activation):
    """The activation of the pre-activation groups h_G (swiglu: gate, up); None: h_G[0]."""
    if activation is None:
        return h_G[0]
    return f64.activate(torch.cat(list(h_G), -1), activation)


def assert_close(actual, expected, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


IMPLS = ["triton", "reference"]


def _impl(name, impl):
    return getattr(bs, name) if impl == "triton" else getattr(bs, f"{name}_reference")


# ----------------------------------------------------------------------------------------------
# Padded gather / scatter
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["top1_16_experts", "topk_eq_experts", "empty_experts"])
@pytest.mark.parametrize("layout", ["padded", "sorted"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_scatter_rows(case, layout, impl, device):
    """Both row layouts against per-row loops over the layout's definition (padded: block-padded
    bins, padding rows zero and never read; sorted: assignments stably sorted by expert)."""
    ids, routing, gen, (T, K, E, _) = setup_case(case, device)
    H = 40
    x = torch.randn(T, H, generator=gen).to(device)
    w = torch.rand(T, K, generator=gen).to(device)
    gather = pm.gather_rows if impl == "triton" else pm.gather_rows_reference
    scatter = pm.scatter_rows if impl == "triton" else pm.scatter_rows_reference
    wgrad = pm.scatter_rows_weight_grad if impl == "triton" else pm.scatter_rows_weight_grad_reference
    if layout == "padded":
        P = routing.max_padded_rows
        src = routing.padded_src_P.cpu().long()
    else:  # independent of the metadata: a stable sort of the assignments by expert
        P = T * K
        src = torch.sort(ids.cpu().reshape(-1), stable=True).indices
    rows = torch.full((T * K,), -1, dtype=torch.long)
    rows[src[src >= 0]] = torch.arange(P)[src >= 0]
    rows = rows.view(T, K)

    for weights in (None, w):
        x_P = gather(x, routing, weights, out=poisoned((P, H), x.dtype, device), layout=layout)
        expected = torch.zeros(P, H, dtype=torch.float64)
        for p in range(P):
            if src[p] >= 0:
                t, k = divmod(int(src[p]), K)
                expected[p] = x[t].double().cpu() * (1.0 if weights is None else float(w[t, k]))
        assert_close(x_P, expected, atol=1e-6, rtol=1e-6)

    y_P = torch.randn(P, H, generator=gen)
    y_P[src < 0] = float("nan")  # padding rows are never read
    y_P = y_P.to(device)
    for weights in (None, w):
        y = scatter(y_P, weights, routing, out=poisoned((T, H), y_P.dtype, device), layout=layout)
        wk = torch.ones(T, K) if weights is None else w.cpu()
        expected = torch.stack([sum(wk[t, k].double() * y_P[rows[t, k]].double().cpu() for k in range(K))
                                for t in range(T)])
        assert_close(y, expected, atol=1e-5, rtol=1e-5)

    dy = torch.randn(T, H, generator=gen).to(device)
    expected = torch.tensor([[float(dy[t].double().cpu() @ y_P[rows[t, k]].double().cpu()) for k in range(K)]
                             for t in range(T)])
    dw = wgrad(dy, y_P, routing, layout=layout)
    assert dw.dtype == torch.float32 and dw.shape == (T, K)
    assert_close(dw, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", ["top1_16_experts", "topk_eq_experts", "all_to_one", "empty_experts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_rows(case, dtype, device):
    """sum_rows (the triton_grouped path's sum over k, rows in expert order) against a float64 loop
    over a stable sort of the ids (no metadata used); 40 columns: not a multiple of the block.
    bf16: summed in fp32 and rounded once, so within one bf16 rounding of the exact sum (two
    under the interpreter, which truncates)."""
    ids, routing, gen, (T, K, E, _) = setup_case(case, device)
    H = 40
    order = torch.sort(ids.reshape(-1), stable=True).indices  # sorted position -> assignment
    row = torch.empty(T * K, dtype=torch.long)
    row[order] = torch.arange(T * K)
    y_S = torch.randn(T * K, H, generator=gen).to(dtype)
    expected = torch.stack([sum(y_S[row[t * K + k]].double() for k in range(K)) for t in range(T)])
    got = pm.sum_rows(y_S.to(device), routing.sorted_row_N, K)
    assert got.dtype == dtype and got.shape == (T, H)
    ulp = 0.0 if dtype == torch.float32 else 2.0 ** -8 * (2 if device.type == "cpu" else 1)
    assert_close(got, expected, atol=1e-5, rtol=1e-5 + ulp)


def test_sum_rows_edges(device):
    """No tokens; one row per token (K = 1: a permutation); a clear error for sizes that do not fit."""
    empty = pm.sum_rows(torch.zeros(0, 8, device=device), torch.zeros(0, dtype=torch.int32, device=device), 3)
    assert empty.shape == (0, 8)
    y = torch.randn(5, 8, device=device)
    perm = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32, device=device)
    assert_close(pm.sum_rows(y, perm, 1), y[perm.long()], atol=0, rtol=0)
    with pytest.raises(ValueError, match="sum_rows: .*top_k=2"):
        pm.sum_rows(y, perm, 2)


@pytest.mark.parametrize("case", ["top1_16_experts", "topk_eq_experts", "all_to_one", "empty_experts"])
def test_permute_unpermute_tokens_autograd(case, device):
    """ops.permute (the expert-parallel dispatcher's permutations) against float64 autograd
    through a per-assignment loop over a stable sort of the ids (no metadata used): the
    permuted rows, the weighted sum over k, and the gradients of x, the rows and the weights."""
    from megatron_moe.ops.permute import permute_tokens, unpermute_tokens

    ids, routing, gen, (T, K, E, _) = setup_case(case, device)
    H = 24
    x = torch.randn(T, H, generator=gen)
    y_N = torch.randn(T * K, H, generator=gen)
    w = torch.rand(T, K, generator=gen)
    dx_N, dy = torch.randn(T * K, H, generator=gen), torch.randn(T, H, generator=gen)
    order = torch.sort(ids.reshape(-1), stable=True).indices  # sorted position -> assignment

    xr, yr, wr = (t.double().requires_grad_(True) for t in (x, y_N, w))
    perm_ref = torch.stack([xr[int(a) // K] for a in order])
    row = torch.empty(T * K, dtype=torch.long)
    row[order] = torch.arange(T * K)
    unperm_ref = torch.stack([sum(wr[t, k] * yr[row[t * K + k]] for k in range(K)) for t in range(T)])
    ((perm_ref * dx_N.double()).sum() + (unperm_ref * dy.double()).sum()).backward()

    xg, yg, wg = (t.to(device).requires_grad_(True) for t in (x, y_N, w))
    perm, unperm = permute_tokens(xg, routing), unpermute_tokens(yg, wg, routing)
    ((perm * dx_N.to(device)).sum() + (unperm * dy.to(device)).sum()).backward()
    assert_close(perm, perm_ref, atol=1e-6, rtol=1e-6)
    assert_close(unperm, unperm_ref, atol=1e-5, rtol=1e-5)
    for got, ref in ((xg, xr), (yg, yr), (wg, wr)):
        assert_close(got.grad, ref.grad, atol=1e-5, rtol=1e-5)


def test_gather_scatter_rows_errors(device):
    ids, routing, gen, (T, K, E, _) = setup_case("topk_eq_experts", device)
    x = torch.randn(T, 8, device=device)
    with pytest.raises(ValueError, match="layout='blocked'"):
        pm.gather_rows(x, routing, layout="blocked")
    with pytest.raises(ValueError, match=r"y_PH has shape .*sorted rows"):
        pm.scatter_rows(torch.zeros(routing.max_padded_rows + 1, 8, device=device), None, routing, layout="sorted")
    with pytest.raises(ValueError, match="y_PH has shape"):
        pm.scatter_rows_weight_grad(x, torch.zeros(T * K + 1, 8, device=device), routing, layout="sorted")


# ----------------------------------------------------------------------------------------------
# Block-sparse kernels against a dense torch.mm masked to the topology
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_sdd(case, activation, impl, device):
    ids, routing, gen, (T, K, E, Fdim) = setup_case(case, device)
    Kd, G = 24, 2 if activation == "swiglu" else 1
    topo = block_topology(routing, Fdim)
    P, Z = routing.max_padded_rows, topo.max_blocks
    a = torch.randn(P, Kd, generator=gen)
    w = torch.randn(E, Kd, G * Fdim, generator=gen)
    out = poisoned((Z, B, B), torch.float32, device)
    result = _impl("sdd", impl)(a.to(device), w.to(device), topo, activation=activation, out=out)

    expert_P, _ = expert_row_ranges(ids, E, P)
    mask = column_mask(expert_P, E, Fdim)
    pre = torch.stack([a.double() @ w[:, :, g * Fdim:(g + 1) * Fdim].double().permute(1, 0, 2).reshape(Kd, E * Fdim)
                       for g in range(G)]) * mask
    act = result if activation is None else result[0]
    assert act is out
    assert_close(blocks_to_dense(act, topo)[0], act_ref(pre, activation) * mask)
    if activation is not None:
        assert result[1].shape == ((Z, B, B) if G == 1 else (G, Z, B, B))
        assert_close(blocks_to_dense(result[1], topo), pre)
    unused = topo.row_indices_Z.cpu() < 0
    assert torch.all(act.cpu()[unused] == 0), "unused blocks must be written as zeros"
    # columns past F in the last column block are zero
    if Fdim % B:
        last = (topo.column_indices_Z.cpu() % topo.blocks_per_row == topo.blocks_per_row - 1) & ~unused
        assert torch.all(act.cpu()[last][:, :, Fdim % B:] == 0)


@pytest.mark.parametrize("case", ["top1_16_experts", "all_to_one", "empty_experts"])
@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_sdd_activation_grad(case, activation, impl, device):
    ids, routing, gen, (T, K, E, Fdim) = setup_case(case, device, seed=1)
    N, G = 32, 2 if activation == "swiglu" else 1
    topo = block_topology(routing, Fdim)
    P = routing.max_padded_rows
    dy = torch.randn(P, N, generator=gen)
    w_EFN = torch.randn(E, Fdim, N, generator=gen)  # passed as the strided view w_ENF = wᵀ
    pre = random_blocks(G, topo, device, gen)
    pre = pre[0] if G == 1 else pre
    out = poisoned(tuple(pre.shape), torch.float32, device)
    d_pre = _impl("sdd_activation_grad", impl)(dy.to(device), w_EFN.to(device).transpose(1, 2), topo, pre,
                                               activation, out=out)
    assert d_pre is out

    expert_P, _ = expert_row_ranges(ids, E, P)
    mask = column_mask(expert_P, E, Fdim)
    dact = (dy.double() @ w_EFN.double().reshape(E * Fdim, N).t()) * mask
    h = blocks_to_dense(pre, topo).requires_grad_()
    grads = torch.autograd.grad(act_ref(h, activation), h, dact)[0] if activation else dact[None]
    assert_close(blocks_to_dense(d_pre, topo), grads * mask)
    assert torch.all(bs._grouped(d_pre).cpu()[:, topo.row_indices_Z.cpu() < 0] == 0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_dsd(case, groups, impl, device):
    ids, routing, gen, (T, K, E, Fdim) = setup_case(case, device, seed=2)
    N = 40
    topo = block_topology(routing, Fdim)
    P = routing.max_padded_rows
    s = random_blocks(groups, topo, device, gen)
    w_ENF = torch.randn(E, N, groups * Fdim, generator=gen)  # passed as the strided view [E, G*F, N]
    out = poisoned((P, N), torch.float32, device)
    y = _impl("dsd", impl)(s[0] if groups == 1 else s, w_ENF.to(device).transpose(1, 2), topo, out=out)
    assert y is out

    dense = blocks_to_dense(s, topo)
    expected = sum(dense[g] @ w_ENF[:, :, g * Fdim:(g + 1) * Fdim].double().transpose(1, 2).reshape(E * Fdim, N)
                   for g in range(groups))
    assert_close(y, expected)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_dds(case, groups, impl, device):
    ids, routing, gen, (T, K, E, Fdim) = setup_case(case, device, seed=3)
    M = 40
    topo = block_topology(routing, Fdim)
    P = routing.max_padded_rows
    a = torch.randn(P, M, generator=gen)
    s = random_blocks(groups, topo, device, gen)
    out = poisoned((E, M, groups * Fdim), torch.float32, device)
    dw = _impl("dds", impl)(a.to(device), s, topo, out=out)
    assert dw is out

    dense = blocks_to_dense(s, topo)  # [G, P, E*F]
    expected = torch.cat([(a.double().t() @ dense[g]).view(M, E, Fdim).permute(1, 0, 2) for g in range(groups)], -1)
    assert_close(dw, expected)
    _, counts = expert_row_ranges(ids, E, P)
    assert torch.all(dw.cpu()[counts == 0] == 0), "an expert without tokens has an exact zero gradient"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_tsd(case, groups, impl, device):
    ids, routing, gen, (T, K, E, Fdim) = setup_case(case, device, seed=4)
    N = 40
    topo = block_topology(routing, Fdim)
    P = routing.max_padded_rows
    s = random_blocks(groups, topo, device, gen)
    d = torch.randn(P, N, generator=gen)
    out = poisoned((E, groups * Fdim, N), torch.float32, device)
    dw = _impl("tsd", impl)(s[0] if groups == 1 else s, d.to(device), topo, out=out)
    assert dw is out

    dense = blocks_to_dense(s, topo)
    expected = torch.cat([(dense[g].t() @ d.double()).view(E, Fdim, N) for g in range(groups)], 1)
    assert_close(dw, expected)
    _, counts = expert_row_ranges(ids, E, P)
    assert torch.all(dw.cpu()[counts == 0] == 0)


def test_kernels_bf16(device):
    """bf16 operands (tensor cores on the GPU), fp32 accumulation: loose match of the dense product."""
    ids, routing, gen, (T, K, E, Fdim) = setup_case("empty_experts", device, seed=5)
    H = 32
    topo = block_topology(routing, Fdim)
    P = routing.max_padded_rows
    a = torch.randn(P, H, generator=gen).bfloat16()
    w1 = torch.randn(E, H, Fdim, generator=gen).bfloat16()
    w2 = torch.randn(E, Fdim, H, generator=gen).bfloat16()
    act, pre = bs.sdd(a.to(device), w1.to(device), topo, activation="gelu")
    assert act.dtype == pre.dtype == torch.bfloat16
    expert_P, _ = expert_row_ranges(ids, E, P)
    mask = column_mask(expert_P, E, Fdim)
    h = (a.double() @ w1.double().permute(1, 0, 2).reshape(H, E * Fdim)) * mask
    assert_close(blocks_to_dense(pre, topo)[0], h, atol=5e-2, rtol=2e-2)
    y = bs.dsd(act, w2.to(device), topo)
    expected = blocks_to_dense(act, topo)[0] @ w2.double().reshape(E * Fdim, H)
    assert_close(y, expected, atol=5e-2, rtol=2e-2)
    dw = bs.dds(a.to(device), act, topo)
    assert_close(dw, (a.double().t() @ blocks_to_dense(act, topo)[0]).view(H, E, Fdim).permute(1, 0, 2),
                 atol=2e-1, rtol=2e-2)


def test_shape_errors(device):
    _, routing, gen, (T, K, E, Fdim) = setup_case("topk_eq_experts", device)
    topo = block_topology(routing, Fdim)
    P = routing.max_padded_rows
    a = torch.randn(P, 8, device=device)
    with pytest.raises(ValueError, match="w_EKF"):
        bs.sdd(a, torch.randn(E, 9, Fdim, device=device), topo)
    with pytest.raises(ValueError, match="activation"):
        bs.sdd(a, torch.randn(E, 8, Fdim, device=device), topo, activation="relu")
    with pytest.raises(ValueError, match="a_PK"):
        bs.sdd(a[1:], torch.randn(E, 8, Fdim, device=device), topo)
    with pytest.raises(ValueError, match="dtype"):
        bs.dsd(torch.zeros(topo.max_blocks, B, B, device=device), torch.randn(E, Fdim, 8, device=device).double(), topo)
    with pytest.raises(ValueError, match="weights_TK"):
        pm.scatter_rows(torch.zeros(P, 8, device=device), torch.ones(T, K + 1, device=device), routing)


# ----------------------------------------------------------------------------------------------
# The op against a float64 per-token loop
# ----------------------------------------------------------------------------------------------


def run_op_case(case, activation, dtype, device, seed=0):
    ids, routing, gen, (T, K, E, Fdim) = setup_case(case, device, seed=seed)
    H = 32
    F1 = 2 * Fdim if activation == "swiglu" else Fdim
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, F1, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, Fdim, H, generator=gen) / math.sqrt(Fdim)
    weights = torch.rand(T, K, generator=gen)
    dy = torch.randn(T, H, generator=gen)

    leaves = [t.to(device=device, dtype=dtype).clone().requires_grad_() for t in (x, w1, w2)]
    w_dev = weights.to(device).clone().requires_grad_()
    y = blocksparse_mlp(*leaves, w_dev, routing, activation)
    y.backward(dy.to(device=device, dtype=dtype))
    got = [y] + [t.grad for t in leaves] + [w_dev.grad]

    ref_leaves = [t.to(dtype).double().requires_grad_() for t in (x, w1, w2)] + [weights.double().requires_grad_()]
    y_ref = f64.loop_mlp(*ref_leaves[:3], ids, ref_leaves[3], activation)
    y_ref.backward(dy.to(dtype).double())
    expected = [y_ref] + [t.grad for t in ref_leaves]
    return got, expected, ids, E


OP_NAMES = ["y", "dx", "dw1", "dw2", "dweights"]


def check_op(got, expected, dtype):
    for name, g, e in zip(OP_NAMES, got, expected):
        assert g.shape == e.shape, name
        assert g.dtype == (torch.float32 if name == "dweights" else dtype), name
        if dtype == torch.float32:
            assert_close(g, e, atol=2e-5, rtol=1e-4)
        else:  # bf16 operands and bf16 intermediates: a relative error of the whole tensor
            err = (g.double().cpu() - e).norm() / e.norm().clamp_min(1e-12)
            assert err < 3e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_op_fp32(case, activation, device):
    got, expected, ids, E = run_op_case(case, activation, torch.float32, device)
    check_op(got, expected, torch.float32)
    empty = torch.bincount(ids.reshape(-1), minlength=E) == 0
    assert torch.all(got[2].cpu()[empty] == 0) and torch.all(got[3].cpu()[empty] == 0)


@pytest.mark.parametrize("case,activation", [("top1_16_experts", "gelu"), ("empty_experts", "swiglu")])
def test_op_bf16(case, activation, device):
    got, expected, _, _ = run_op_case(case, activation, torch.bfloat16, device)
    check_op(got, expected, torch.bfloat16)


@pytest.mark.parametrize("case,activation", [("all_to_one", "swiglu"), ("topk_eq_experts", "gelu")])
def test_op_reference_path(case, activation, monkeypatch):
    """CPU without the interpreter: the same Function runs the plain-PyTorch references."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(bs, "sdd_triton", None)  # would raise if called
    got, expected, _, _ = run_op_case(case, activation, torch.float32, torch.device("cpu"))
    check_op(got, expected, torch.float32)


def test_op_deterministic(device):
    runs = [run_op_case("topk_eq_experts", "swiglu", torch.float32, device, seed=7)[0] for _ in range(2)]
    for name, a, b in zip(OP_NAMES, *runs):
        assert torch.equal(a, b), name


# ----------------------------------------------------------------------------------------------
# GPU only: the default block size, bf16, and no host synchronisation
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_op_gpu_block128(activation, dtype, monkeypatch):
    from megatron_moe.experts import reference_experts

    monkeypatch.setenv("MEGATRON_MOE_AUTOTUNE", "0")  # each kernel's default config: no tuning time

    torch.manual_seed(0)
    T, K, E, H, Fdim, block = 1000, 2, 8, 256, 320, 128
    dev = torch.device("cuda")
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    ids[ids == 5] = 6  # expert 5 empty
    x = torch.randn(T, H, device=dev)
    w1 = torch.randn(E, H, 2 * Fdim if activation == "swiglu" else Fdim, device=dev) / math.sqrt(H)
    w2 = torch.randn(E, Fdim, H, device=dev) / math.sqrt(Fdim)
    weights = torch.rand(T, K, device=dev)
    dy = torch.randn(T, H, device=dev)

    leaves = [t.to(dtype).clone().requires_grad_() for t in (x, w1, w2)] + [weights.clone().requires_grad_()]
    y = blocksparse_mlp(*leaves[:3], leaves[3], routing_metadata(ids, E, block), activation)
    y.backward(dy.to(dtype))
    ref = [t.to(dtype).double().requires_grad_() for t in (x, w1, w2)] + [weights.double().requires_grad_()]
    y_ref = reference_experts(*ref[:3], ids, ref[3], activation)
    y_ref.backward(dy.to(dtype).double())
    for name, g, e in zip(OP_NAMES, [y] + [t.grad for t in leaves], [y_ref] + [t.grad for t in ref]):
        err = (g.double() - e).norm() / e.norm()
        assert err < (3e-2 if dtype == torch.bfloat16 else 1e-5), f"{name}: relative error {err:.3g}"
    assert torch.all(leaves[1].grad[5] == 0) and torch.all(leaves[2].grad[5] == 0)


@pytest.mark.gpu
def test_op_gpu_no_host_sync(monkeypatch):
    monkeypatch.setenv("MEGATRON_MOE_AUTOTUNE", "0")
    torch.manual_seed(0)
    T, K, E, H, Fdim, block = 512, 2, 8, 128, 192, 128
    dev = torch.device("cuda")
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(E, H, 2 * Fdim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(E, Fdim, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(T, K, device=dev, requires_grad=True)
    routing = routing_metadata(ids, E, block)
    blocksparse_mlp(x, w1, w2, weights, routing, "swiglu").sum().backward()  # autotune outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        blocksparse_mlp(x, w1, w2, weights, routing, "swiglu").sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
