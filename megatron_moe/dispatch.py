"""Dispatchers: move routed tokens to the ranks that own their experts and back.

router -> dispatcher.dispatch -> experts -> dispatcher.combine (as in torchtitan). The experts
never see communication: they get token rows, the local expert ids and combine weights of each
row's assignments, and return the weighted sum per row.

- LocalDispatcher: all experts live here; nothing moves (the gather/scatter is fused into the
  expert kernels).
- AllToAllDispatcher: experts split evenly over an expert-parallel group. Each (token, k)
  assignment travels as one row to the rank owning its expert (``all_to_all_single`` with
  variable splits), is computed there as a top-1 row, travels back, and is weighted and summed
  over k on the sender. Autograd runs through both exchanges.

- PaddedAllToAllDispatcher (``a2a_splits='padded'``): the same without reading the counts on
  the host: fixed worst-case blocks per peer, padding rows skipped by the experts.
- SymmetricAllToAllDispatcher (``a2a_splits='symmetric'``): the padded blocks on the receiver,
  but only valid rows move, read from the peers' symmetric-memory buffers up to counts on the
  device; the senders' rows stay sorted, written straight into (and read back from) the buffers.

Host synchronisation (AllToAllDispatcher): exactly one per forward and none in the backward (it
reuses the forward's split sizes): ``all_to_all_single`` needs the split sizes on the host, so
the exchanged token counts are read once. The assignments are sorted by expert with the routing
metadata's counting sort (which also yields the counts); the count exchange (per expert, so the
receiver rebuilds the rows' local expert ids from it) is launched asynchronously and overlaps the
permutation of the tokens into that order. Permutation and the weighted un-permutation are one
fused pass each, forward and backward (ops/permute.py).

Legend: T tokens, K top_k, N = T*K assignments, H hidden, P expert-parallel ranks,
R rows received by this rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .kernels.metadata import Routing, routing_metadata
from .ops.permute import permute_tokens, unpermute_tokens
from .symmetric import ExchangePlan, combine_rows, dispatch_rows


class Dispatcher:
    """Interface. ``dispatch`` returns (rows, local expert ids [R, k], weights [R, k], ctx) for the
    local experts; ``combine`` takes the experts' output rows [R, H] and returns [T, H].
    ``pads_rows``: some rows are padding, marked with the local expert id num_local_experts;
    the experts skip them (their output rows are never read)."""

    num_ranks: int = 1
    pads_rows: bool = False

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class LocalDispatcher(Dispatcher):
    def dispatch(self, x_TH, expert_ids_TK, weights_TK):
        return x_TH, expert_ids_TK, weights_TK, None

    def combine(self, y_TH, ctx):
        return y_TH


class ExchangeTimer:
    """GPU time of the token exchanges (forward and backward, all layers), from CUDA events around
    each all_to_all_single: no host synchronisation; read after the step's own sync with
    :func:`exchange_time_ms`. The time includes waiting for the slowest rank of the group. Not
    inside a CUDA-graph capture (an event recorded there only orders the stream; it cannot be
    timed): graphed exchanges go unmeasured."""

    _pairs: list = []

    @classmethod
    def start(cls, device):
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @classmethod
    def stop(cls, start) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            cls._pairs.append((start, end))


def exchange_time_ms() -> float | None:
    """Milliseconds spent in the token exchanges since the last call (None: no exchange ran).
    Call after a host synchronisation that follows them (e.g. the training step's loss read)."""
    pairs, ExchangeTimer._pairs = ExchangeTimer._pairs, []
    if not pairs:
        return None
    pairs[-1][1].synchronize()
    return sum(a.elapsed_time(b) for a, b in pairs)


def _timed_all_to_all(out, inp, out_splits, in_splits, group):
    ev = ExchangeTimer.start(inp.device)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    ExchangeTimer.stop(ev)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        _timed_all_to_all(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        _timed_all_to_all(grad_in, grad.contiguous(), in_splits, out_splits, ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class _A2AContext:
    routing: Routing  # the assignments sorted by global expert = by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    weights_TK: torch.Tensor


# Block size of the dispatcher's routing metadata: only its sorted layout is used, so any block
# size serves; the padded arrays it also fills are small (N + E*(B-1) int32).
_SORT_BLOCK = 128


class AllToAllDispatcher(Dispatcher):
    def __init__(self, group, num_experts: int):
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size "
                             f"{self.num_ranks}: choose expert_parallel_size dividing num_experts")
        self.num_local_experts = num_experts // self.num_ranks

    def _exchange_counts(self, expert_ids_TK):
        """Sorts the assignments by expert (hence by destination rank; the routing metadata's
        counting sort, no host sync) and starts the count exchange, which runs while the caller
        permutes the tokens. Counts are per global expert: chunk p of [E] goes to rank p, which
        gets [P, El] back (rows per source rank and local expert), enough to rebuild the received
        rows' local expert ids without exchanging them. Returns (routing, send_counts_E,
        recv_counts_PEl, work); ``work.wait()`` before reading recv_counts_PEl."""
        routing = routing_metadata(expert_ids_TK, self.num_ranks * self.num_local_experts, _SORT_BLOCK)
        send_counts_E = routing.tokens_per_expert_E.long()
        recv_counts_PEl = torch.empty_like(send_counts_E)
        work = dist.all_to_all_single(recv_counts_PEl, send_counts_E, group=self.group, async_op=True)
        return routing, send_counts_E, recv_counts_PEl, work

    def dispatch(self, x_TH, expert_ids_TK, weights_TK):
        P, El = self.num_ranks, self.num_local_experts
        routing, send_counts_E, recv_counts_PEl, work = self._exchange_counts(expert_ids_TK)
        x_send = permute_tokens(x_TH, routing)
        work.wait()
        send_recv_P = torch.stack([send_counts_E.view(P, El).sum(1), recv_counts_PEl.view(P, El).sum(1)])
        send_splits, recv_splits = send_recv_P.tolist()  # the host sync
        x_recv = all_to_all(x_send, recv_splits, send_splits, self.group)
        # rows from each source rank arrive sorted by local expert: ids from the counts, no sync
        local_ids = torch.arange(El, device=x_TH.device).repeat(P)
        ids_recv = torch.repeat_interleave(local_ids, recv_counts_PEl, output_size=sum(recv_splits))
        ones_R1 = torch.ones(ids_recv.shape[0], 1, device=x_TH.device, dtype=torch.float32)
        ctx = _A2AContext(routing, send_splits, recv_splits, weights_TK)
        return x_recv, ids_recv[:, None], ones_R1, ctx

    def combine(self, y_RH, ctx: _A2AContext):
        y_sorted = all_to_all(y_RH, ctx.send_splits, ctx.recv_splits, self.group)
        return unpermute_tokens(y_sorted, ctx.weights_TK, ctx.routing)


@dataclass
class _PaddedContext:
    routing: Routing
    slot_N: torch.Tensor  # sorted position -> row of the padded [P * C] exchange buffer
    weights_TK: torch.Tensor


def _block_expert_ids(recv_counts_PEl: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The local expert id of each row of P received blocks of C rows (rows from each peer sorted by
    local expert, padding after them: id El), from the rows per peer and local expert [P, El], on the
    device; and the rows' weights (ones: the combine applies the router's). [P * C, 1] each."""
    P = recv_counts_PEl.shape[0]
    dev = recv_counts_PEl.device
    # row j of peer p's block: the local expert whose cumulative count first exceeds j
    cum_PEl = torch.cumsum(recv_counts_PEl, 1)
    j_PC = torch.arange(C, device=dev).expand(P, C).contiguous()
    ids_R = torch.searchsorted(cum_PEl, j_PC, right=True).reshape(-1)  # El = padding
    return ids_R[:, None], torch.ones(P * C, 1, device=dev, dtype=torch.float32)


class PaddedAllToAllDispatcher(AllToAllDispatcher):
    """The same exchange without a host synchronisation: each peer gets a fixed block of
    C = T*K rows (the most one rank can send one peer, so nothing is ever dropped), valid rows
    first, sorted by local expert; the rest is padding that the experts skip. The row counts
    travel as before (per expert, asynchronously) but stay on the device: the receiver turns
    them into local expert ids, padding rows get id num_local_experts. Cost: P times the bytes
    of the exact exchange and P*C rows of expert activations (valid rows are computed only)."""

    pads_rows = True

    def dispatch(self, x_TH, expert_ids_TK, weights_TK):
        T, K = expert_ids_TK.shape
        P, El = self.num_ranks, self.num_local_experts
        N = C = T * K
        dev = x_TH.device
        routing, send_counts_E, recv_counts_PEl, work = self._exchange_counts(expert_ids_TK)
        ids_N = routing.expert_ids_N[routing.sort_order_N.long()]
        dest_N = torch.div(ids_N, El, rounding_mode="floor").long()  # sorted, so grouped by rank
        send_P = send_counts_E.view(P, El).sum(1)
        first_P = torch.cumsum(send_P, 0) - send_P
        slot_N = dest_N * C + torch.arange(N, device=dev) - first_P[dest_N]
        # padding rows travel too (whole blocks): zeros
        x_send = x_TH.new_zeros(P * C, x_TH.shape[1]).index_copy(0, slot_N, permute_tokens(x_TH, routing))
        work.wait()  # a stream dependency on the GPU, not a host wait
        x_recv = self._exchange(x_send)
        ids_R1, ones_R1 = _block_expert_ids(recv_counts_PEl.view(P, El), C)
        return x_recv, ids_R1, ones_R1, _PaddedContext(routing, slot_N, weights_TK)

    def combine(self, y_RH, ctx: _PaddedContext):
        return unpermute_tokens(self._exchange(y_RH)[ctx.slot_N], ctx.weights_TK, ctx.routing)

    def _exchange(self, x_PCH):
        """Whole blocks travel (the counts are not needed: padding rows go too)."""
        C = x_PCH.shape[0] // self.num_ranks
        return all_to_all(x_PCH, [C] * self.num_ranks, [C] * self.num_ranks, self.group)


@dataclass
class _SymmetricContext:
    plan: ExchangePlan
    weights_TK: torch.Tensor


class SymmetricAllToAllDispatcher(AllToAllDispatcher):
    """The padded dispatcher's blocks on the receiving side, but only valid rows move, and no host
    synchronisation: every rank reads its rows out of its peers' buffers up to counts kept on the
    device (:mod:`megatron_moe.symmetric`: PyTorch symmetric memory on one node's GPUs,
    shared-memory files on the CPU). The token gather writes straight into the own buffer and the
    reads back land in sorted order, so neither side builds a padded copy of its rows; the
    receiver's padded blocks (P * N rows of expert activations) stay. One barrier per exchange."""

    pads_rows = True

    def dispatch(self, x_TH, expert_ids_TK, weights_TK):
        T, K = expert_ids_TK.shape
        P, El = self.num_ranks, self.num_local_experts
        N = T * K
        routing = routing_metadata(expert_ids_TK, P * El, _SORT_BLOCK)
        send_PEl = routing.tokens_per_expert_E.long().view(P, El)
        send_P = send_PEl.sum(1)
        first_P = torch.cumsum(send_P, 0) - send_P
        # to rank q: the row counts of its experts and where its rows start among this rank's
        # sorted rows (it reads them from there); runs beside the token gather
        meta_send_P2 = torch.cat([send_PEl, first_P[:, None]], 1).contiguous()  # [P, El + 1]
        meta_recv_P2 = torch.empty_like(meta_send_P2)
        work = dist.all_to_all_single(meta_recv_P2, meta_send_P2, group=self.group, async_op=True)
        plan = ExchangePlan(routing, send_P, first_P)

        def counts_arrived():  # once the own rows are written, before the barrier
            work.wait()  # (on a GPU a stream dependency, not a host wait)
            plan.recv_P = meta_recv_P2[:, :El].sum(1)
            plan.start_in_P = meta_recv_P2[:, El].contiguous()

        x_recv = dispatch_rows(x_TH, plan, self.group, counts_arrived)
        ids_R1, ones_R1 = _block_expert_ids(meta_recv_P2[:, :El], N)
        return x_recv, ids_R1, ones_R1, _SymmetricContext(plan, weights_TK)

    def combine(self, y_RH, ctx: _SymmetricContext):
        return combine_rows(y_RH, ctx.weights_TK, ctx.plan, self.group)
