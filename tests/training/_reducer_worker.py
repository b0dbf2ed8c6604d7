"""One rank of the overlapped gradient-reduction test (run by tests/training/test_grad_reduce.py, gloo).

    python tests/training/_reducer_worker.py OUT_DIR EP   (with RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

A toy model of dense layers, "expert" parameters (expert_parallel=True) and one parameter that
only rank 0 uses; two micro-batches of rank-specific data. The gradients are reduced once by
GradReducer without overlap and once with overlap=True (arm() before the last backward, tiny
buckets so that several start during the backward and the in-flight window fills); both are
saved for the test to compare.
"""
import os
import sys

import torch
import torch.distributed as dist

from megatron_moe.parallel import init_parallel_groups
from megatron_moe.training.grad_reduce import GradReducer


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # registered first, so last in the reduction order: the other buckets need not wait for it
        self.rank0_only = torch.nn.Parameter(torch.randn(8))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        self.expert = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
        self.expert.expert_parallel = True

    def forward(self, x, rank):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 2:
                x = x @ self.expert
        if rank == 0:
            x = x + self.rank0_only
        return x.square().mean()


def grads(overlap, groups, rank):
    model = Toy()
    params = list(model.parameters())
    red = GradReducer.for_groups(params, groups, overlap=overlap, bucket_numel=80)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(6, 8, generator=gen) for _ in range(2)]
    for i, x in enumerate(batches):
        if i == len(batches) - 1:
            red.arm()
        (model(x, rank) / len(batches)).backward()
    started = getattr(red, "_next", 0)  # buckets whose all-reduce began during the backward
    red.reduce()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(getattr(red, "_plan", [])), started


def main():
    out, ep = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = init_parallel_groups(ep, num_experts=None)
    plain, _, _ = grads(False, groups, rank)
    overlapped, buckets, started = grads(True, groups, rank)
    torch.save({"plain": plain, "overlap": overlapped, "buckets": buckets, "started": started},
               os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()  # every rank done with the group before any tears it down (a gloo teardown aborted once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
