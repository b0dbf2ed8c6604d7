"""Data-parallel gradient reduction and clipping over the expert + data parallel groups.

    reducer = GradReducer.for_groups(params, init_parallel_groups(P), overlap=True)
    reducer.broadcast_params(model)        # every rank starts from rank 0's weights
    ...micro-batches; reducer.arm() before the last backward...
    reducer.reduce()
    norm = clip_grad_norm(params, 1.0, groups, scale=False)
    optimizer.step(grad_scale=clip_coefficient(norm, 1.0))

Gradient reduction (``GradReducer.for_groups``) for an update equal to the single-GPU update on
the same global batch (every rank's loss is the mean over its own tokens, the objective the
mean over ranks), with W ranks and expert-parallel size P:
  dense:  all-reduce SUM over the world, / W
  expert: all-reduce SUM over the expert-data-parallel group, / W (an expert's local gradient
          already sums the contributions of the P ranks of its expert-parallel group)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe.parallel import ParallelGroups, is_expert_param

BUCKET_NUMEL = 2 ** 25  # elements per all-reduce bucket (128 MiB of fp32 grads)


class GradReducer:
    """Data-parallel gradient averaging in flattened buckets, dense and expert params apart.

    ``dense_group``/``expert_group``: process groups (None = the world). Gradients are summed
    over the group and divided by ``dense_divisor``/``expert_divisor`` (default: the group's
    size). ``GradReducer.for_groups`` sets them for expert parallelism: the expert group is the
    expert-data-parallel group while both divisors stay the world size (module docstring).

    ``overlap=True`` (``train.overlap_grad_reduce``): call ``arm()`` before the step's last
    backward; each bucket's all-reduce then starts (async) as soon as the backward has
    accumulated every gradient in it, in a fixed bucket order (the same on every rank: buckets
    follow the parameters in reverse, about the order the backward produces them), while the
    backward goes on. At most ``IN_FLIGHT_BUCKETS`` flattened copies exist at a time: the oldest
    is then waited for (on a GPU, a stream dependency, not a host wait) and written back.
    ``reduce()`` finishes: it reduces what did not start (unused parameters) and writes the rest
    back. Same result as without overlap.
    """

    IN_FLIGHT_BUCKETS = 4

    def __init__(self, params: list[torch.nn.Parameter], *, dense_group=None, expert_group=None,
                 dense_divisor: int | None = None, expert_divisor: int | None = None,
                 bucket_numel: int = BUCKET_NUMEL, overlap: bool = False):
        self.dense = [p for p in params if not is_expert_param(p)]
        self.expert = [p for p in params if is_expert_param(p)]
        self.groups = []
        for ps, group, div in ((self.dense, dense_group, dense_divisor),
                               (self.expert, expert_group, expert_divisor)):
            size = _group_size(group)
            self.groups.append((ps, group, size, div or size))
        self.bucket_numel = bucket_numel
        self.overlap = overlap and any(size > 1 for _, _, size, _ in self.groups)
        self._armed = False
        if self.overlap:
            # one bucket order for both groups: the parameters in reverse (about the backward's
            # order), a new bucket at each change of group, dtype or past bucket_numel elements
            kind_of = {id(p): k for k, (ps, _, size, _) in enumerate(self.groups) if size > 1 for p in ps}
            self._plan: list[tuple[list[torch.nn.Parameter], int]] = []  # (bucket, index into groups)
            n = 0
            for p in reversed(params):
                if id(p) not in kind_of:
                    continue
                k = kind_of[id(p)]
                if self._plan:
                    bucket, last = self._plan[-1]
                    if last == k and p.dtype == bucket[0].dtype and n + p.numel() <= self.bucket_numel:
                        bucket.append(p)
                        n += p.numel()
                        continue
                self._plan.append(([p], k))
                n = p.numel()
            self._bucket_of = {id(p): i for i, (bucket, _) in enumerate(self._plan) for p in bucket}
            for p in params:
                if id(p) in self._bucket_of and p.requires_grad:
                    p.register_post_accumulate_grad_hook(self.grad_ready)

    @classmethod
    def for_groups(cls, params, groups: ParallelGroups, **kw) -> "GradReducer":
        if groups.ep_size == 1:
            return cls(params, **kw)
        W = groups.world_size
        if groups.edp_size == 1:  # EP over the whole world: no replica, only the 1/W scaling
            return cls(params, expert_group=_SelfGroup(), dense_divisor=W, expert_divisor=W, **kw)
        return cls(params, expert_group=groups.edp_group, dense_divisor=W, expert_divisor=W, **kw)

    def _buckets(self, params):
        bucket, n = [], 0
        for p in params:
            if bucket and (n + p.numel() > self.bucket_numel or p.grad.dtype != bucket[0].grad.dtype):
                yield bucket
                bucket, n = [], 0
            bucket.append(p)
            n += p.numel()
        if bucket:
            yield bucket

    # ------------------------------------------------------------------ overlapped reduction
    def arm(self) -> None:
        """The next backward is the step's last: start each bucket's all-reduce when it is ready."""
        if not self.overlap:
            return
        self._armed = True
        self._pending = [len(bucket) for bucket, _ in self._plan]
        self._in_flight: list[tuple[int, torch.Tensor, object]] = []  # (bucket, flat, work), oldest first
        self._next = 0  # buckets start in index order only (the same order on every rank)

    @torch.no_grad()
    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient is complete for this backward (its post-accumulate hook, or
        precision.BF16Params once it has added a bf16 copy's gradient into ``p.grad``)."""
        i = self._bucket_of.get(id(p)) if self._armed else None
        if i is None:  # not armed, or a parameter nothing is exchanged for (a group of one)
            return
        self._pending[i] -= 1
        while self._next < len(self._plan) and self._pending[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def _start(self, i: int) -> None:
        bucket, k = self._plan[i]
        group = self.groups[k][1]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        self._in_flight.append((i, flat, dist.all_reduce(flat, group=group, async_op=True)))
        while len(self._in_flight) > self.IN_FLIGHT_BUCKETS:
            self._complete()

    def _complete(self) -> None:
        """Wait for the oldest bucket in flight, divide, write it back into the grads."""
        i, flat, work = self._in_flight.pop(0)
        work.wait()
        bucket, k = self._plan[i]
        _unflatten_into([p.grad for p in bucket], flat.div_(self.groups[k][3]))

    @torch.no_grad()
    def reduce(self) -> None:
        if self._armed:
            return self._finish()
        for params, group, size, divisor in self.groups:
            for p in params:
                if p.grad is None:  # unused this step on this rank: still take part
                    p.grad = torch.zeros_like(p)
            if size == 1 and divisor == 1:
                continue
            for bucket in self._buckets(params):
                grads = [p.grad for p in bucket]
                flat = torch.cat([g.reshape(-1) for g in grads])
                if size > 1:
                    dist.all_reduce(flat, group=group)
                _unflatten_into(grads, flat.div_(divisor))

    def _finish(self) -> None:
        self._armed = False
        for params, _, size, divisor in self.groups:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if size == 1 and divisor != 1:  # nothing to exchange: only the scaling
                for p in params:
                    p.grad.div_(divisor)
        while self._next < len(self._plan):  # buckets with an unused parameter: now, in order
            self._start(self._next)
            self._next += 1
        while self._in_flight:
            self._complete()

    @torch.no_grad()
    def broadcast_params(self, model: torch.nn.Module) -> None:
        """Make every replica start from its group's first rank's parameters and buffers."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        for params, group, size, _ in self.groups:
            if size == 1:
                continue
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for p in params:
                dist.broadcast(p.data, src=src, group=group)
        nccl = dist.get_backend() == "nccl"
        for b in model.buffers():
            if not (nccl and not b.is_cuda):  # NCCL moves CUDA tensors only
                dist.broadcast(b, src=0)


def _unflatten_into(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of the flat bucket back into its gradients."""
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class _SelfGroup:
    """Stands for a group of one rank (no communication)."""


def _group_size(group) -> int:
    if isinstance(group, _SelfGroup):
        return 1
    return dist.get_world_size(group) if dist.is_initialized() else 1


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   groups: ParallelGroups | None = None, *, scale: bool = True) -> torch.Tensor:
    """Global L2 norm of the gradients, each parameter counted once; scale them to max_norm if
    above (max_norm 0 = only measure; ``scale=False``: only measure, and let the optimizer apply
    :func:`clip_coefficient`). Returns the norm before clipping (fp32 scalar tensor).

    Dense gradients are identical on every rank after the reduction and count once; under expert
    parallelism each EP rank holds different experts, so their squared norms are summed over
    the EP group.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    expert_ids = {id(p.grad) for p in params if p.grad is not None and is_expert_param(p)}
    sq = [n.float() ** 2 for n in torch._foreach_norm(grads, 2.0)]
    dense_sq = sum((s for g, s in zip(grads, sq) if id(g) not in expert_ids), torch.zeros((), device=grads[0].device))
    expert_sq = sum((s for g, s in zip(grads, sq) if id(g) in expert_ids), torch.zeros((), device=grads[0].device))
    if groups is not None and groups.ep_size > 1:
        dist.all_reduce(expert_sq, group=groups.ep_group)
    total = torch.sqrt(dense_sq + expert_sq)
    coef = clip_coefficient(total, max_norm) if scale else None
    if coef is not None:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """min(1, max_norm / (norm + 1e-6)) as a tensor on the norm's device (no host sync); None
    when max_norm is 0 (no clipping)."""
    if max_norm <= 0:
        return None
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
