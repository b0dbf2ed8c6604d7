"""One rank of the expert-parallel tests (run by tests/test_expert_parallel.py, gloo on the CPU).

    python tests/_ep_worker.py OUT_DIR CASE IMPL[+padded|+symmetric] EP   (with RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Builds the full layer from a fixed seed, keeps this rank's slice of the experts, runs its own
tokens of a global batch, and saves the output, the local gradients and the reduced gradients.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

from megatron_moe import DroplessMoE, MoEConfig
from megatron_moe.parallel import init_parallel_groups
from megatron_moe.training.grad_reduce import GradReducer

TOKENS_PER_RANK, H = 13, 16


def case_config(case, impl):
    """impl 'triton_grouped+padded' = mlp_impl triton_grouped with a2a_splits='padded' (no host sync;
    '+symmetric' likewise: the shared-memory stand-in of the peer-memory exchange on the CPU)."""
    impl, _, splits = impl.partition("+")
    return MoEConfig(hidden_size=H, ffn_hidden_size=24, num_experts=8, top_k=2, block_size=16,
                     aux_loss_coeff=0.0, mlp_impl=impl, capacity_factor=8.0, a2a_splits=splits or "host")


def full_layer_and_batch(case, impl, world):
    """The same on every rank and in the test: seeded weights, the global batch and its dy."""
    torch.manual_seed(0)
    layer = DroplessMoE(case_config(case, impl))
    with torch.no_grad():
        layer.experts.w1.normal_(0, 0.3)
        layer.experts.w2.normal_(0, 0.3)
        layer.router.weight.normal_(0, 1.0)
    x = torch.randn(world * TOKENS_PER_RANK, H)
    if case in ("all_to_one_rank", "empty_rank"):
        x = x.abs() + 0.1
        with torch.no_grad():
            layer.router.weight.zero_()
            hot = [6, 7] if case == "all_to_one_rank" else [0, 1]  # top-2 both on one rank
            layer.router.weight[hot[0]] = 0.2
            layer.router.weight[hot[1]] = 0.1
    dy = torch.randn(world * TOKENS_PER_RANK, H)
    return layer, x, dy


@contextlib.contextmanager
def no_host_reads(enabled):
    """The padded and symmetric exchanges read nothing back to the host: .tolist() / .item() raise inside."""
    if not enabled:
        yield
        return
    saved = torch.Tensor.tolist, torch.Tensor.item

    def refuse(*_, **__):
        raise AssertionError("a sync-free exchange (a2a_splits padded or symmetric) read a tensor on the host")

    torch.Tensor.tolist = torch.Tensor.item = refuse
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.item = saved


def main():
    out_dir, case, impl, ep = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full, x, dy = full_layer_and_batch(case, impl, world)
    groups = init_parallel_groups(ep, num_experts=8)
    layer = DroplessMoE(case_config(case, impl), ep_group=groups.ep_group)
    El = layer.num_local_experts
    sl = slice(groups.ep_rank * El, (groups.ep_rank + 1) * El)
    with torch.no_grad():
        layer.router.weight.copy_(full.router.weight)
        layer.experts.w1.copy_(full.experts.w1[sl])
        layer.experts.w2.copy_(full.experts.w2[sl])
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x_r = x[rows].clone().requires_grad_(True)
    if layer.cfg.a2a_splits == "symmetric":
        # a first pass sets up the exchange buffers (once per size: a collective that reads the
        # host); the checked pass below reuses them, as every step after the first does
        (layer(x_r) * dy[rows]).sum().backward()
        layer.zero_grad(set_to_none=True)
        x_r.grad = None
    with no_host_reads(enabled=layer.cfg.a2a_splits != "host"):
        y = layer(x_r)
        (y * dy[rows]).sum().backward()
    local = {n: p.grad.clone() for n, p in layer.named_parameters()}
    GradReducer.for_groups(list(layer.parameters()), groups).reduce()
    reduced = {n: p.grad.clone() for n, p in layer.named_parameters()}
    torch.save(dict(y=y.detach(), dx=x_r.grad, local=local, reduced=reduced, ep_rank=groups.ep_rank,
                    tokens_per_expert=layer.tokens_per_expert),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank done with the group before any tears it down (a gloo teardown aborted once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
