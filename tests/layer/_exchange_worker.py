"""One rank of tests/layer/test_symmetric_exchange.py (gloo on the CPU).

    python tests/layer/_exchange_worker.py OUT_DIR   (with RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Runs the symmetric exchange (its CPU stand-in: shared-memory files) on float64 row blocks at
three sizes, the second larger than the first (the buffers grow) and the third smaller again,
with random valid counts per block (0 and full included), forward and backward; saves the
inputs, counts, outputs and input gradients for the test to check against a plain gather.
"""
import os
import sys

import torch
import torch.distributed as dist

from megatron_moe.symmetric import symmetric_exchange

H = 5


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    results = []
    for step, C in enumerate((4, 9, 3)):
        g = torch.Generator().manual_seed(100 * step + rank)
        n_out = torch.randint(0, C + 1, (P,), generator=g)
        n_out[rank % P] = C if step == 0 else n_out[rank % P]  # a full block
        n_out[(rank + 1) % P] = 0 if step == 1 else n_out[(rank + 1) % P]  # an empty one
        n_in = torch.empty_like(n_out)
        dist.all_to_all_single(n_in, n_out)
        x = torch.randn(P * C, H, generator=g, dtype=torch.float64).requires_grad_(True)
        y = symmetric_exchange(x, n_out, n_in, dist.group.WORLD)
        dy = torch.randn(P * C, H, generator=g, dtype=torch.float64)
        (y * dy).sum().backward()
        results.append(dict(C=C, x=x.detach(), n_out=n_out, n_in=n_in, y=y.detach(), dy=dy, dx=x.grad))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank done with the group before any tears it down (a gloo teardown aborted once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
