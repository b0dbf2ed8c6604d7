"""Overlapped gradient reduction (train.overlap_grad_reduce) on the CPU, gloo processes.

The gradients GradReducer gives with overlap (buckets all-reduced during the last backward)
equal the plain reduction's, and both equal a single-process loop over every rank's data:
data parallelism (world 2 and 4) and expert parallelism (world 4, EP 2: expert gradients over
the expert-data-parallel pairs), with a parameter that only one rank uses.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _reducer_worker import Toy  # noqa: E402
from _util import run_gloo_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_reducer_worker.py")


def run_ranks(tmp_path, world, ep):
    return run_gloo_ranks(WORKER, [str(tmp_path), str(ep)], world, tmp_path)


def expected(world, ep):
    """Plain loop in float64: dense gradients averaged over all ranks; an expert gradient is the
    sum over the ranks holding that expert copy (rank % ep the same), divided by the world size."""
    per_rank = []
    for rank in range(world):
        model = Toy().double()
        gen = torch.Generator().manual_seed(100 + rank)
        batches = [torch.randn(6, 8, generator=gen).double() for _ in range(2)]
        for x in batches:
            (model(x, rank) / len(batches)).backward()
        per_rank.append({n: (p.grad if p.grad is not None else torch.zeros_like(p))
                         for n, p in model.named_parameters()})
    want = []
    for rank in range(world):
        g = {}
        for n in per_rank[0]:
            if n == "expert" and ep > 1:
                peers = [r for r in range(world) if r % ep == rank % ep]
            else:
                peers = range(world)
            g[n] = sum(per_rank[r][n] for r in peers) / world
        want.append(g)
    return want


@pytest.mark.parametrize("world, ep", [(2, 1), (4, 1), (4, 2)])
def test_overlapped_reduction_equals_plain_and_reference(tmp_path, world, ep):
    got = run_ranks(tmp_path, world, ep)
    want = expected(world, ep)
    for rank, (res, ref) in enumerate(zip(got, want)):
        assert res["buckets"] > 2  # several buckets, some in flight while others start
        assert res["started"] >= res["buckets"] - 1  # all but the unused parameter's began in the backward
        for n, g in ref.items():
            assert torch.allclose(res["overlap"][n].double(), g, atol=1e-6, rtol=1e-5), (rank, n)
            assert torch.allclose(res["plain"][n], res["overlap"][n], atol=1e-7, rtol=1e-6), (rank, n)
