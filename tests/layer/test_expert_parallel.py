"""Expert parallelism on the CPU: several gloo processes against the single-process layer.

The layer's output and every gradient with EP = 2 and 4 equal EP = 1 on the same inputs and
weights; a rank that receives no tokens; all tokens to one rank's experts; the gradient
reduction gives every rank the single-process gradient of the mean loss.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _ep_worker import TOKENS_PER_RANK, full_layer_and_batch  # noqa: E402
from _util import run_gloo_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_ep_worker.py")


def run_ranks(tmp_path, case, impl, ep, world):
    return run_gloo_ranks(WORKER, [str(tmp_path), case, impl, str(ep)], world, tmp_path, timeout=600,
                          local_rank=True)


def reference(case, impl, world):
    full, x, dy = full_layer_and_batch(case, impl, world)
    x = x.clone().requires_grad_(True)
    y = full(x)
    (y * dy).sum().backward()
    return full, y.detach(), x.grad


@pytest.mark.parametrize("world, ep, impl, case", [
    (2, 2, "reference", "random"),
    (2, 2, "triton_grouped", "random"),
    (4, 4, "reference", "random"),
    (4, 2, "reference", "random"),
    (2, 2, "reference", "empty_rank"),
    (4, 4, "reference", "all_to_one_rank"),
    (2, 2, "capacity", "random"),
    (2, 2, "triton_grouped+padded", "random"),   # the no-host-sync exchange: fixed blocks, padding skipped
    (4, 4, "reference+padded", "random"),
    (4, 2, "triton_grouped+padded", "random"),
    (4, 2, "triton_grouped", "random"),
    (2, 2, "triton_grouped+padded", "empty_rank"),
    (4, 4, "reference+padded", "all_to_one_rank"),
    # the exact exchange without a host read: valid rows only, read from the peers' buffers
    (2, 2, "triton_grouped+symmetric", "random"),
    (4, 4, "reference+symmetric", "random"),
    (4, 2, "triton_grouped+symmetric", "random"),
    (2, 2, "triton_grouped+symmetric", "empty_rank"),
    (4, 4, "reference+symmetric", "all_to_one_rank"),
])
def test_ep_matches_single_process(tmp_path, world, ep, impl, case):
    results = run_ranks(tmp_path, case, impl, ep, world)
    full, y_ref, dx_ref = reference(case, impl, world)
    El = 8 // ep
    tol = dict(rtol=1e-5, atol=1e-6)
    for rank, res in enumerate(results):
        rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        torch.testing.assert_close(res["y"], y_ref[rows], **tol)
        torch.testing.assert_close(res["dx"], dx_ref[rows], **tol)
    # local router gradients sum to the full one; local expert gradients sum over the ranks that
    # hold the same experts (the EDP group) to the full one's slice
    # (a sum of per-rank fp32 partial gradients: 2e-6 absolute where entries cancel to ~1e-3)
    torch.testing.assert_close(sum(r["local"]["router.weight"] for r in results), full.router.weight.grad,
                               rtol=1e-5, atol=2e-6)
    for name in ("w1", "w2"):
        full_grad = getattr(full.experts, name).grad
        for j in range(ep):
            got = sum(r["local"][f"experts.{name}"] for r in results if r["ep_rank"] == j)
            torch.testing.assert_close(got, full_grad[j * El:(j + 1) * El], **tol)
    # reduced: every rank holds (full gradient) / world, i.e. the gradient of the mean loss
    for res in results:
        torch.testing.assert_close(res["reduced"]["router.weight"], full.router.weight.grad / world, **tol)
        j = res["ep_rank"]
        for name in ("w1", "w2"):
            full_grad = getattr(full.experts, name).grad[j * El:(j + 1) * El]
            torch.testing.assert_close(res["reduced"][f"experts.{name}"], full_grad / world, **tol)
    if case == "empty_rank":  # experts 0, 1 live on EP rank 0: rank 1's experts get nothing
        assert all(r["tokens_per_expert"][2:].sum() == 0 for r in results)
        assert all(r["local"]["experts.w1"].abs().sum() == 0 for r in results if r["ep_rank"] == 1)


def test_invalid_sizes_raise():
    from megatron_moe.parallel import validate_parallel_sizes

    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the world size 4"):
        validate_parallel_sizes(4, 3, 6)
    with pytest.raises(ValueError, match="does not divide model.moe.num_experts=6"):
        validate_parallel_sizes(8, 4, 6)
    with pytest.raises(ValueError, match="expected a positive int"):
        validate_parallel_sizes(4, 0, 8)


def test_the_symmetric_exchange_needs_each_group_on_one_node():
    from megatron_moe.parallel import check_symmetric_exchange

    check_symmetric_exchange(4, 8)  # two groups per node of 8
    check_symmetric_exchange(8, 8)
    check_symmetric_exchange(1, 3)  # no exchange
    with pytest.raises(ValueError) as e:
        check_symmetric_exchange(8, 4)  # a group over two nodes of 4
    assert str(e.value) == ("model.moe.a2a_splits=symmetric with model.moe.expert_parallel_size=8: each "
                            "expert-parallel group must sit on one node, which runs 4 ranks here (8 must divide 4); "
                            "use model.moe.a2a_splits=padded or host, or an expert_parallel_size dividing 4")
    with pytest.raises(ValueError, match="expert_parallel_size=4: each expert-parallel group must sit on one node"):
        check_symmetric_exchange(4, 6)  # groups straddle the nodes' boundaries
