"""Process groups for expert + data parallelism.

With world size W and expert-parallel size P (``model.moe.expert_parallel_size``):
  - expert-parallel (EP) groups: consecutive ranks {i*P, ..., i*P + P-1} (inside a node first, so
    the all-to-all runs over NVLink); experts are split evenly over the ranks of a group;
  - expert-data-parallel (EDP) groups: the ranks holding the same experts {j, j+P, j+2P, ...};
    expert parameters are replicated over them;
  - dense parameters are replicated over all W ranks (the data-parallel group is the world).

The training program reduces gradients over these groups (megatron_moe/training/grad_reduce.py).
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


_GROUPS: dict[tuple, ParallelGroups] = {}  # (P, the default process group) -> groups


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


def check_symmetric_exchange(expert_parallel_size: int, local_world_size: int) -> None:
    """``a2a_splits='symmetric'`` maps peer GPUs' memory, so every expert-parallel group (P
    consecutive ranks) must lie inside one node (``local_world_size`` consecutive ranks)."""
    P, L = expert_parallel_size, local_world_size
    if P > 1 and L % P:
        raise ValueError(f"model.moe.a2a_splits=symmetric with model.moe.expert_parallel_size={P}: each "
                         f"expert-parallel group must sit on one node, which runs {L} ranks here ({P} must divide "
                         f"{L}); use model.moe.a2a_splits=padded or host, or an expert_parallel_size dividing {L}")


def init_parallel_groups(expert_parallel_size: int = 1, num_experts: int | None = None) -> ParallelGroups:
    """Create (once per size and world) the EP and EDP groups. Every rank must call it, in the
    same order."""
    key = (expert_parallel_size, id(dist.group.WORLD) if dist.is_initialized() else None)
    if key in _GROUPS:
        return _GROUPS[key]
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
    _GROUPS[key] = groups
    return groups


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "expert_parallel", False))
