"""One rank of tests/layer/test_symmetric_exchange.py (gloo on the CPU).

    python tests/layer/_exchange_worker.py OUT_DIR   (with RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Runs the symmetric dispatcher (its CPU stand-in: shared-memory files) on float64 tokens through
five steps of different sizes and routings (the buffers grow, then serve smaller sizes): dispatch,
a stand-in expert that scales each row by its global expert id + 1, combine, and (in three of
them) the backward; one step with no backward at all, and one whose input needs no gradient, so
that the dispatch's backward is skipped and the next exchange writes the buffer of the one before
it. Saves every input and output, and the number of barriers the workspace ran, for the test.
"""
import os
import sys

import torch
import torch.distributed as dist

from megatron_moe.dispatch import SymmetricAllToAllDispatcher
from megatron_moe.symmetric import workspace

H, EL = 5, 2  # hidden, experts per rank
# (tokens, top_k, routing, what runs): "train" forward and backward, "eval" forward only,
# "frozen_input" backward with x needing no gradient (the dispatch's backward never runs)
STEPS = [(4, 1, "random", "train"), (9, 2, "all_to_rank0", "train"), (3, None, "every_expert", "eval"),
         (5, 2, "rank1_empty", "frozen_input"), (4, 1, "random", "train")]


def expert_ids(T, K, kind, P, g):
    E = P * EL
    if kind == "every_expert":  # top_k = num_experts
        return torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    pool = {"random": range(E), "all_to_rank0": range(EL), "rank1_empty": [e for e in range(E) if e // EL != 1]}[kind]
    pool = torch.tensor(list(pool))
    return torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)])


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    disp = SymmetricAllToAllDispatcher(dist.group.WORLD, P * EL)
    ws = workspace(dist.group.WORLD, torch.device("cpu"))
    barriers = [0]
    own_barrier = ws.barrier

    def counted_barrier():
        barriers[0] += 1
        own_barrier()

    ws.barrier = counted_barrier
    results = []
    for step, (T, K, kind, mode) in enumerate(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids_TK = expert_ids(T, K, kind, P, g)
        K = ids_TK.shape[1]
        x = torch.randn(T, H, generator=g, dtype=torch.float64).requires_grad_(mode == "train")
        w = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_(mode != "eval")
        with torch.set_grad_enabled(mode != "eval"):
            x_R, local_R1, ones_R1, ctx = disp.dispatch(x, ids_TK, w)
            scale_R1 = (local_R1 + rank * EL + 1).to(x_R.dtype)  # padding rows: never read back
            y = disp.combine(x_R * scale_R1 * ones_R1, ctx)
        dy = torch.randn(T, H, generator=g, dtype=torch.float64)
        if mode != "eval":
            (y * dy).sum().backward()
        results.append(dict(mode=mode, x=x.detach(), ids=ids_TK, w=w.detach(), x_R=x_R.detach(), local=local_R1[:, 0],
                            y=y.detach(), dy=dy, dx=x.grad, dw=w.grad, barriers=barriers[0]))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank done with the group before any tears it down (a gloo teardown aborted once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
