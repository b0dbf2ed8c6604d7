"""Process groups for expert + data parallelism.

With world size W and expert-parallel size P (``model.moe.expert_parallel_size``):
  - expert-parallel (EP) groups: consecutive ranks {i*P, ..., i*P + P-1} (inside a node first, so
    the all-to-all runs over NVLink); experts are split evenly over the ranks of a group;
  - expert-data-parallel (EDP) groups: the ranks holding the same experts {j, j+P, j+2P, ...};
    expert parameters are replicated over them;
  - dense parameters are replicated over all W ranks (the data-parallel group is the world).

Gradient reduction for an update equal to the single-GPU update on the same global batch
(every rank's loss is the mean over its own tokens, the objective the mean over ranks):
  dense:  all-reduce SUM over the world, / W
  expert: all-reduce SUM over the EDP group, / W (an expert's local gradient already sums the
          contributions of the P ranks of its EP group)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelGroups:
    world_size: int
    rank: int
    ep_size: int
    ep_rank: int
    ep_group: object | None  # None when ep_size == 1
    edp_group: object | None  # None when it would be the world
    edp_size: int


_GROUPS: dict[int, ParallelGroups] = {}


def validate_parallel_sizes(world_size: int, expert_parallel_size: int, num_experts: int | None) -> None:
    P = expert_parallel_size
    if isinstance(P, bool) or not isinstance(P, int) or P < 1:
        raise ValueError(f"model.moe.expert_parallel_size={P!r} is invalid: expected a positive int")
    if world_size % P:
        raise ValueError(f"model.moe.expert_parallel_size={P} does not divide the world size {world_size}: "
                         f"launch a multiple of {P} processes or choose a divisor of {world_size}")
    if num_experts is not None and num_experts % P:
        raise ValueError(f"model.moe.expert_parallel_size={P} does not divide model.moe.num_experts="
                         f"{num_experts}: choose a divisor of {num_experts}")


def init_parallel_groups(expert_parallel_size: int = 1, num_experts: int | None = None) -> ParallelGroups:
    """Create (once per size) the EP and EDP groups. Every rank must call it, in the same order."""
    if expert_parallel_size in _GROUPS:
        return _GROUPS[expert_parallel_size]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    validate_parallel_sizes(world, expert_parallel_size, num_experts)
    P = expert_parallel_size
    ep_group = edp_group = None
    if P > 1:
        for i in range(world // P):
            g = dist.new_group(list(range(i * P, (i + 1) * P)))
            if rank // P == i:
                ep_group = g
    if 1 < P < world:
        for j in range(P):
            g = dist.new_group(list(range(j, world, P)))
            if rank % P == j:
                edp_group = g
    groups = ParallelGroups(world, rank, P, rank % P, ep_group, edp_group, world // P)
    _GROUPS[P] = groups
    return groups


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def reduce_gradients(params, groups: ParallelGroups) -> None:
    """Average gradients as described in the module docstring (one flattened all-reduce per group).

    Expert parameters reduce over the EDP group when expert parallelism is on, over the world
    otherwise; either way every gradient ends up divided by the world size.
    """
    W = groups.world_size
    if W == 1:
        return
    params = [p for p in params if p.grad is not None]
    dense = [p for p in params if not is_expert_param(p)]
    expert = [p for p in params if is_expert_param(p)]
    _all_reduce_scaled(dense, None, W)
    if groups.ep_size == 1:
        _all_reduce_scaled(expert, None, W)
    elif groups.edp_size > 1:
        _all_reduce_scaled(expert, groups.edp_group, W)
    else:  # EP over the whole world: no replica to reduce with, only the 1/W scaling
        for p in expert:
            p.grad.div_(W)


def _all_reduce_scaled(params, group, world_size: int) -> None:
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(world_size)
    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(r)
