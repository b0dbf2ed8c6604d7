"""Permutation metadata: the Triton path equals the plain-PyTorch reference bit for bit, and the
reference itself agrees with an independent per-assignment loop.

On the CPU the Triton kernels run under the interpreter (conftest sets TRITON_INTERPRET), so the
shapes stay small; small tile sizes force many chunks, several E tiles and a multi-step scan.
"""
import pytest
import torch

from megatron_moe.kernels import metadata as md

ROUTING_TENSORS = [
    "expert_ids_N", "sort_order_N", "tokens_per_expert_E", "expert_offsets_E1",
    "padded_offsets_E1", "padded_row_N", "padded_src_P", "row_block_expert_R", "sorted_row_N",
]
TOPOLOGY_TENSORS = ["row_indices_Z", "column_indices_Z", "offsets_t_C1", "block_offsets_t_Z"]
# tiny tiles: many chunks per call, several expert tiles, several scan steps
SMALL_TILES = dict(chunk_size=16, max_block_e=8, block_c=4)
METHODS = {"onehot": False, "pairwise": True}


def assert_same(got, ref, names):
    for name in names:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype == torch.int32, (name, a.dtype, b.dtype)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert a.device == b.device, name
        assert torch.equal(a, b), f"{name}:\n got {a.cpu().tolist()}\n ref {b.cpu().tolist()}"


def random_ids(T, K, E, seed, distinct=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if distinct:  # like a top-k router: K different experts per token
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    else:
        ids = torch.randint(0, E, (T, K), generator=g)
    return ids.to(device)


def check_triton(ids_TK, E, B, columns=(1, 40), **tiles):
    """Triton routing + topology == reference, for the public entry point or a tiled launcher."""
    ref = md.routing_metadata_reference(ids_TK, E, B)
    if tiles:
        got = md._routing_metadata_triton(ids_TK, E, B, **tiles)
    else:
        assert md.use_triton(ids_TK), "the public path should launch Triton here"
        got = md.routing_metadata(ids_TK, E, B)
    assert (got.num_tokens, got.top_k, got.num_experts, got.block_size) == \
        (ref.num_tokens, ref.top_k, ref.num_experts, ref.block_size)
    assert_same(got, ref, ROUTING_TENSORS)
    for F in columns:
        t_ref = md.block_topology_reference(ref, F)
        t_got = md.block_topology(got, F)
        assert t_got.blocks_per_row == t_ref.blocks_per_row
        assert_same(t_got, t_ref, TOPOLOGY_TENSORS)
    return ref


# (T, K, E, B, kind): kind picks how the expert ids are drawn
CASES = {
    "random_top2": (200, 2, 8, 16, "distinct"),
    "random_dup": (150, 3, 6, 16, "dup"),  # repeated experts within a token keep their k order
    "one_expert": (50, 1, 1, 16, "distinct"),
    "e64_top1": (300, 1, 64, 16, "distinct"),
    "topk_eq_E": (40, 4, 4, 16, "distinct"),
    "empty_experts": (90, 2, 32, 16, "subset"),
    "all_to_one": (70, 1, 16, 16, "one"),
    "all_to_last": (33, 2, 5, 16, "last"),
    "n_not_multiple": (37, 1, 3, 16, "distinct"),
    "n_below_block": (5, 2, 4, 128, "distinct"),
    "block128": (130, 2, 8, 128, "distinct"),
    "e256_top8": (64, 8, 256, 16, "distinct"),
    "empty_batch": (0, 2, 8, 16, "distinct"),
}


def make_ids(T, K, E, kind, seed=0, device="cpu"):
    if kind == "distinct":
        return random_ids(T, K, E, seed, device=device)
    if kind == "dup":
        return random_ids(T, K, E, seed, distinct=False, device=device)
    if kind == "subset":  # only experts 3, 17 and 30 receive anything
        pick = torch.tensor([3, 17, 30])[random_ids(T, K, 3, seed, distinct=False)]
        return pick.to(device)
    if kind == "one":
        return torch.full((T, K), 5, dtype=torch.int64, device=device)
    if kind == "last":
        return torch.full((T, K), E - 1, dtype=torch.int64, device=device)
    raise ValueError(kind)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_equals_reference(case, device):
    T, K, E, B, kind = CASES[case]
    check_triton(make_ids(T, K, E, kind, device=device), E, B)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("case", ["random_top2", "random_dup", "e64_top1", "empty_experts", "all_to_last",
                                  "n_below_block", "block128", "empty_batch"])
def test_triton_equals_reference_small_tiles(case, method, device):
    """Both chunk-statistics methods, forced, with many chunks, E tiles and scan steps."""
    T, K, E, B, kind = CASES[case]
    check_triton(make_ids(T, K, E, kind, seed=1, device=device), E, B, pairwise=METHODS[method], **SMALL_TILES)


@pytest.mark.parametrize("method", list(METHODS))
def test_triton_default_tiles_other_method(method, device):
    """Each method at its own default chunk size, also where E would pick the other one."""
    for T, K, E, B, kind in [CASES["random_top2"], CASES["e256_top8"]]:
        check_triton(make_ids(T, K, E, kind, seed=6, device=device), E, B, pairwise=METHODS[method])


def test_int32_and_strided_input(device):
    ids = random_ids(120, 2, 8, seed=2, device=device)
    check_triton(ids.to(torch.int32), 8, 16)
    strided = random_ids(2, 120, 8, seed=3, distinct=False, device=device).t()  # [120, 2], not contiguous
    assert not strided.is_contiguous()
    check_triton(strided, 8, 16)


@pytest.mark.parametrize("case", ["random_top2", "empty_experts"])
@pytest.mark.parametrize("F", [1, 16, 17, 53, 128])
def test_topology_column_counts(case, F, device):
    """Fb = 1, a partial last column block, several column blocks (B = 16)."""
    T, K, E, B, kind = CASES[case]
    routing = md.routing_metadata_reference(make_ids(T, K, E, kind, device=device), E, B)
    assert_same(md.block_topology(routing, F), md.block_topology_reference(routing, F), TOPOLOGY_TENSORS)


@pytest.mark.gpu
def test_no_host_sync():
    ids = random_ids(4096, 8, 64, seed=4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routing = md.routing_metadata(ids, 64, 128)
        md.block_topology(routing, 1408)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_large_gpu():
    """A few million assignments, E = 256, against the reference."""
    ids = random_ids(1 << 19, 8, 256, seed=5, device="cuda")
    check_triton(ids, 256, 128, columns=(2048,))


# ----------------------------------------------------------------------------------------------
# The reference against an independent loop
# ----------------------------------------------------------------------------------------------


def loop_routing(ids_N, E, B):
    """Per-assignment Python loop: buckets in assignment order, padded bins, row-block experts."""
    buckets = [[] for _ in range(E)]
    for a, e in enumerate(ids_N):
        buckets[e].append(a)
    counts = [len(b) for b in buckets]
    padded = [0]
    for n in counts:
        padded.append(padded[-1] + -(-n // B) * B)
    order = [a for b in buckets for a in b]
    padded_row = [0] * len(ids_N)
    for e, bucket in enumerate(buckets):
        for i, a in enumerate(bucket):
            padded_row[a] = padded[e] + i
    row_expert = []
    for e in range(E):
        row_expert += [e] * ((padded[e + 1] - padded[e]) // B)
    return counts, padded, order, padded_row, row_expert


@pytest.mark.parametrize("case", ["random_top2", "random_dup", "one_expert", "e64_top1", "topk_eq_E",
                                  "empty_experts", "all_to_last", "n_below_block", "block128", "empty_batch"])
def test_reference_properties(case):
    T, K, E, B, kind = CASES[case]
    ids_TK = make_ids(T, K, E, kind)
    r = md.routing_metadata_reference(ids_TK, E, B)
    ids_N = ids_TK.reshape(-1).tolist()
    N = len(ids_N)
    counts, padded, order, padded_row, row_expert = loop_routing(ids_N, E, B)

    # every assignment appears once in the (stable) sorted order
    assert sorted(r.sort_order_N.tolist()) == list(range(N))
    assert r.sort_order_N.tolist() == order
    assert r.tokens_per_expert_E.tolist() == counts
    assert r.expert_offsets_E1.tolist() == [sum(counts[:e]) for e in range(E + 1)]
    assert r.padded_offsets_E1.tolist() == padded
    assert r.sorted_token_N.tolist() == [a // K for a in order]
    assert [r.sorted_row_N.tolist()[a] for a in order] == list(range(N))  # the inverse of the order

    # padded rows of an expert lie inside its padded bin, before its padding
    assert r.padded_row_N.tolist() == padded_row
    for a, e in enumerate(ids_N):
        p = padded_row[a]
        assert padded[e] <= p < padded[e] + counts[e] <= padded[e + 1]
    src = r.padded_src_P.tolist()
    R_max = md.max_row_blocks(N, E, B)
    assert len(src) == R_max * B >= padded[E]
    for p, a in enumerate(src):
        assert a == (padded_row.index(p) if p in padded_row else -1)

    # row blocks: the expert of each used block, -1 past the used rows
    assert r.row_block_expert_R.tolist() == row_expert + [-1] * (R_max - len(row_expert))


@pytest.mark.parametrize("case,F", [("random_top2", 40), ("empty_experts", 16), ("all_to_last", 5),
                                    ("e64_top1", 33), ("empty_batch", 20)])
def test_reference_topology_properties(case, F):
    T, K, E, B, kind = CASES[case]
    r = md.routing_metadata_reference(make_ids(T, K, E, kind), E, B)
    t = md.block_topology_reference(r, F)
    Fb = -(-F // B)
    assert t.blocks_per_row == Fb
    row_expert = r.row_block_expert_R.tolist()
    rows, cols = t.row_indices_Z.tolist(), t.column_indices_Z.tolist()
    assert len(rows) == len(row_expert) * Fb
    for z in range(len(rows)):
        rb, j = divmod(z, Fb)
        e = row_expert[rb]
        assert (rows[z], cols[z]) == ((rb, e * Fb + j) if e >= 0 else (-1, -1))

    # transposed order: column block g lists exactly its blocks, in increasing row order
    offsets_t, blocks_t = t.offsets_t_C1.tolist(), t.block_offsets_t_Z.tolist()
    assert len(offsets_t) == E * Fb + 1 and offsets_t[0] == 0
    for g in range(E * Fb):
        expected = [z for z in range(len(rows)) if cols[z] == g]
        assert blocks_t[offsets_t[g]:offsets_t[g + 1]] == expected
    used = offsets_t[-1]
    assert used == sum(c >= 0 for c in cols)
    assert blocks_t[used:] == [-1] * (len(blocks_t) - used)
