"""The exact-size token exchange with no host synchronisation (``a2a_splits='symmetric'``).

Every rank of the expert-parallel group holds buffers that all the others can read: PyTorch's
symmetric memory on CUDA (peer memory mapped over NVLink: the ranks of one node), shared-memory
files on the CPU (gloo; how the tests run it). The dispatcher moves rows between two layouts:

- sorted [N, H] on the sender: its assignments sorted by expert, hence by destination rank; the
  rows for rank q are [first_P[q], first_P[q] + send_P[q]);
- blocks [P * C, H] on the expert rank: block p holds, from row p * C, the recv_P[p] rows that
  rank p sent (C = N, the most one rank can send; rows past the count are undefined and the
  experts skip them).

Each direction is one exchange: write this rank's rows into its own buffer, barrier, read from
every peer's buffer the rows meant for this rank:

    dispatch, forward (sorted -> blocks):   the token gather writes the sorted rows straight into
        the own buffer; rank r reads peer p's rows [start_in_P[p], + recv_P[p]) (start_in_P:
        the peers' first_P[r], sent with the counts) into its block p;
    combine, forward (blocks -> sorted):    the experts' block rows are copied into the own
        buffer; rank r reads block r of every peer p, send_P[p] rows, to its rows from first_P[p];
        the weighted sum over k follows on those rows;
    and each backward the other direction (the combine's backward writes the weighted gather of
    dy straight into the own buffer, the dispatch's backward sums over k after its reads).

The counts stay on the device (the copies are :func:`megatron_moe.kernels.copy_rows.copy_row_blocks`,
which reads counts, block starts and the buffers' addresses from the device: one launch reads
every peer's buffer), so a CUDA graph can hold the exchange, and only the valid rows move: the
bytes of the exact exchange ('host'), without its host read, where 'padded' sends whole blocks
(P times the bytes).

One barrier per exchange: each rank has two buffers and the four exchanges of a layer alternate
between them (dispatch forward and combine backward write buffer 0, combine forward and dispatch
backward buffer 1), so a forward, a backward or a whole micro-batch, in any order, never writes
the buffer of the exchange just before it. A buffer is written again two exchanges later, when
every peer has passed the barrier of the exchange in between and so has finished reading it.
Where two exchanges in a row would use one buffer (a layer's backward skipped), a second barrier
is put in first.

Legend: P ranks of the group, N = T * K rows a rank sends (T tokens, top_k K), C = N rows per
block, H hidden.
"""
from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels import switches
from .kernels._common import use_triton
from .kernels.copy_rows import copy_row_blocks
from .kernels.metadata import Routing
from .kernels.permute import gather_rows, scatter_rows, scatter_rows_weight_grad


class _Workspace:
    """Two buffers per rank (one allocation, buffer 0 then buffer 1), readable by every rank of
    ``group``; grown (collectively: every rank asks for the same size, as every rank exchanges the
    same [P * C, H]) before use."""

    def __init__(self, group):
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.nbytes = 0  # of one buffer
        self.buffers: list[torch.Tensor] = []  # [P] uint8 of 2 * nbytes, this rank's own at self.rank
        self.handle = None  # CUDA: the rendezvous of the buffers (their barrier's signal pads)
        self._outgrown: list = []  # earlier buffers, kept: a CUDA graph captured may still read them
        self.last = None  # the buffer the last exchange wrote (0 or 1)
        self.ptrs: list[torch.Tensor] = []  # per buffer (0, 1): int64 [P] on the device, every rank's address

    def view(self, which: int, peer: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``peer``'s buffer ``which`` (0 or 1) as [rows, width]."""
        n = rows * width * dtype.itemsize
        return self.buffers[peer][which * self.nbytes:which * self.nbytes + n].view(dtype).view(rows, width)

    def reserve(self, nbytes: int, device: torch.device) -> None:
        if nbytes > self.nbytes:
            if self.buffers:
                self._outgrown.append((self.buffers, self.handle, self.ptrs))
            nbytes = -(-nbytes // 256) * 256  # buffer 1 as aligned as buffer 0
            self._allocate(2 * nbytes, device)
            self.nbytes = nbytes
            addrs = [[b.data_ptr() + which * nbytes for b in self.buffers] for which in (0, 1)]
            if any(a % 16 for a in addrs[0]):  # (the row copy's vector loads take them as 16-byte aligned)
                raise RuntimeError(f"model.moe.a2a_splits=symmetric: a buffer is not 16-byte aligned ({addrs[0]})")
            self.ptrs = [torch.tensor(a, dtype=torch.int64, device=device) for a in addrs]

    def use(self, which: int) -> int:
        """Start an exchange that writes buffer ``which``: if the exchange before wrote it too,
        its readers may not be done; a barrier waits for them."""
        if self.last == which:
            self.barrier()
        self.last = which
        return which

    def barrier(self) -> None:
        raise NotImplementedError

    def _allocate(self, nbytes: int, device: torch.device) -> None:
        raise NotImplementedError


class _CudaWorkspace(_Workspace):
    """torch.distributed._symmetric_memory: one rendezvous per size; peer buffers are views of
    peer GPUs' memory; the barrier is a kernel (a CUDA graph holds it)."""

    def _allocate(self, nbytes, device):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"model.moe.a2a_splits=symmetric: the exchange buffer must grow to {nbytes} bytes "
                               "inside a CUDA-graph capture; run one eager micro-batch of this size first")
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            handle = symm_mem.rendezvous(buf, self.group)
        except Exception as e:
            raise RuntimeError(f"model.moe.a2a_splits=symmetric needs the ranks of each expert-parallel group "
                               f"to share GPU memory (one node, peer access): the rendezvous failed ({e}); use "
                               f"a2a_splits=padded or host") from e
        self.handle = handle
        self.buffers = [buf if p == self.rank else handle.get_buffer(p, (nbytes,), torch.uint8)
                        for p in range(self.num_ranks)]

    def barrier(self):
        self.handle.barrier(channel=0)


class _SharedFileWorkspace(_Workspace):
    """The CPU's stand-in: each rank's buffer is a file in shared memory that every rank maps;
    the barrier is the group's (gloo). Files are unlinked once mapped."""

    def _allocate(self, nbytes, device):
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0), group=self.group)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(root, f"megatron_moe_a2a_{token[0]}_{{}}")
        with open(path.format(self.rank), "wb") as f:
            f.truncate(nbytes)
        dist.barrier(group=self.group)
        self.buffers = [torch.from_file(path.format(p), shared=True, size=nbytes, dtype=torch.uint8)
                        for p in range(self.num_ranks)]
        dist.barrier(group=self.group)
        os.unlink(path.format(self.rank))

    def barrier(self):
        dist.barrier(group=self.group)


_WORKSPACES: dict = {}


def workspace(group, device: torch.device) -> _Workspace:
    """The group's workspace (one per group and device kind, shared by every layer: the
    exchanges run one after another, alternating between its two buffers)."""
    key = (id(group), device.type)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.group is not group:  # (another group at a freed one's address: start anew)
        ws = _WORKSPACES[key] = (_CudaWorkspace if device.type == "cuda" else _SharedFileWorkspace)(group)
    return ws


def _sorted_to_blocks(ws: _Workspace, which: int, write_own, N: int, H: int, dtype: torch.dtype,
                      plan: "ExchangePlan") -> torch.Tensor:
    """Sorted rows -> blocks. ``write_own(view)`` fills this rank's [N, H] sorted rows into its own
    buffer ``which`` (and may complete ``plan``); returns [P * N, H]: block p holds rows
    [plan.start_in_P[p], + plan.recv_P[p]) of rank p's sorted rows (the rest undefined)."""
    from .dispatch import ExchangeTimer  # (dispatch imports this module)

    dev = plan.send_P.device
    P = ws.num_ranks
    ws.reserve(P * N * H * dtype.itemsize, dev)
    write_own(ws.view(which, ws.rank, N, H, dtype))
    ev = ExchangeTimer.start(dev)  # (the gather above is the layer's own work, not the exchange's)
    ws.barrier()
    out_PNH = torch.empty(P * N, H, dtype=dtype, device=dev)
    _read_peers(ws, which, N, out_PNH, plan.recv_P, N, src_starts_P=plan.start_in_P)
    ExchangeTimer.stop(ev)
    return out_PNH


def _blocks_to_sorted(ws: _Workspace, which: int, x_PNH: torch.Tensor, recv_P: torch.Tensor,
                      send_P: torch.Tensor, first_P: torch.Tensor) -> torch.Tensor:
    """Blocks -> sorted rows: the reverse of :func:`_sorted_to_blocks`. Rows [0, recv_P[p]) of
    block p go back to rank p; returns [N, H]: rows [first_P[p], + send_P[p]) from block ``rank``
    of rank p (every row written: the send_P sum to N)."""
    from .dispatch import ExchangeTimer

    ev = ExchangeTimer.start(x_PNH.device)
    P, (rows, H) = ws.num_ranks, x_PNH.shape
    N = rows // P
    ws.reserve(rows * H * x_PNH.element_size(), x_PNH.device)
    x_PNH = x_PNH.contiguous()
    copy_row_blocks(x_PNH, ws.view(which, ws.rank, rows, H, x_PNH.dtype), recv_P, N,
                    persistent=switches.peer_reads() == "one_launch")
    ws.barrier()
    out_NH = x_PNH.new_empty(N, H)
    _read_peers(ws, which, rows, out_NH, send_P, N, src_row0=ws.rank * N, dst_starts_P=first_P)
    ExchangeTimer.stop(ev)
    return out_NH


def _read_peers(ws: _Workspace, which: int, rows: int, out: torch.Tensor, counts_P: torch.Tensor,
                block_rows: int, src_row0: int = 0, src_starts_P: torch.Tensor | None = None,
                dst_starts_P: torch.Tensor | None = None) -> None:
    """After the barrier: from every rank p's buffer ``which`` (as [rows, H]), counts_P[p] rows from
    row src_row0 (+ src_starts_P[p]) into ``out`` from row p * block_rows (or dst_starts_P[p]).
    Rank r reads its own buffer, then r + 1, r + 2, ... (mod P): at every stage each buffer has one
    reader, where reading the peers in the same order on every rank has P - 1 ranks read rank 0's
    buffer at once, then rank 1's, sharing one GPU's links between them. One persistent launch over
    all of them (the buffers' addresses from the device), or one per buffer
    (``MEGATRON_MOE_PEER_READS=per_peer``, and wherever the kernel does not run)."""
    P, H = ws.num_ranks, out.shape[1]
    if switches.peer_reads() == "one_launch" and use_triton(out):
        copy_row_blocks(ws.view(which, ws.rank, rows, H, out.dtype), out, counts_P, block_rows, src_row0=src_row0,
                        src_starts_B=src_starts_P, dst_starts_B=dst_starts_P, src_ptrs_B=ws.ptrs[which],
                        first_block=ws.rank)
        return
    for p in [(ws.rank + i) % P for i in range(P)]:
        copy_row_blocks(ws.view(which, p, rows, H, out.dtype), out, counts_P[p:p + 1], block_rows,
                        src_row0=src_row0, dst_row0=0 if dst_starts_P is not None else p * block_rows,
                        src_starts_B=None if src_starts_P is None else src_starts_P[p:p + 1],
                        dst_starts_B=None if dst_starts_P is None else dst_starts_P[p:p + 1], persistent=False)


@dataclass
class ExchangePlan:
    """Where one layer's rows go (all on the device). Built by the dispatcher from the routing
    and the count exchange; serves the dispatch, the combine and both backwards."""

    routing: Routing  # this rank's assignments sorted by global expert = by destination rank
    send_P: torch.Tensor  # rows this rank sends each rank
    first_P: torch.Tensor  # where they start in its sorted rows (exclusive cumsum of send_P)
    recv_P: torch.Tensor | None = None  # rows each rank sends this one
    start_in_P: torch.Tensor | None = None  # where they start in that rank's sorted rows


class _Dispatch(torch.autograd.Function):
    """x_TH -> blocks [P * N, H] (the token gather written straight into the own buffer)."""

    @staticmethod
    def forward(ctx, x_TH, plan, ws, counts_arrived):
        ctx.plan, ctx.ws = plan, ws
        N = plan.routing.num_assignments

        def write_own(own_NH):
            gather_rows(x_TH, plan.routing, out=own_NH, layout="sorted")
            if counts_arrived is not None:  # the count exchange ran beside the gather
                counts_arrived()

        return _sorted_to_blocks(ws, ws.use(0), write_own, N, x_TH.shape[1], x_TH.dtype, plan)

    @staticmethod
    def backward(ctx, dx_PNH):
        plan = ctx.plan
        dx_NH = _blocks_to_sorted(ctx.ws, ctx.ws.use(1), dx_PNH, plan.recv_P, plan.send_P, plan.first_P)
        return scatter_rows(dx_NH, None, plan.routing, layout="sorted"), None, None, None


class _Combine(torch.autograd.Function):
    """Blocks [P * N, H] -> y_TH: each token's K rows back, weighted and summed (fp32, one rounding)."""

    @staticmethod
    def forward(ctx, y_PNH, weights_TK, plan, ws):
        ctx.plan, ctx.ws = plan, ws
        y_NH = _blocks_to_sorted(ws, ws.use(1), y_PNH, plan.recv_P, plan.send_P, plan.first_P)
        ctx.save_for_backward(y_NH, weights_TK)
        return scatter_rows(y_NH, weights_TK, plan.routing, layout="sorted")

    @staticmethod
    def backward(ctx, dy_TH):
        y_NH, weights_TK = ctx.saved_tensors
        plan, ws = ctx.plan, ctx.ws
        dy_TH = dy_TH.to(y_NH.dtype).contiguous()
        dweights = None
        if ctx.needs_input_grad[1]:
            dweights = scatter_rows_weight_grad(dy_TH, y_NH, plan.routing, layout="sorted").to(weights_TK.dtype)

        def write_own(own_NH):
            gather_rows(dy_TH, plan.routing, weights_TK, out=own_NH, layout="sorted")

        dy_PNH = _sorted_to_blocks(ws, ws.use(0), write_own, y_NH.shape[0], y_NH.shape[1], y_NH.dtype, plan)
        return dy_PNH, dweights, None, None


def dispatch_rows(x_TH: torch.Tensor, plan: ExchangePlan, group, counts_arrived=None) -> torch.Tensor:
    """[T, H] tokens -> [P * N, H] blocks: block p holds, in order, the plan.recv_P[p] rows rank p
    sends this rank (rows past it undefined). ``counts_arrived()``, if given, is called once the
    own rows are written, before the barrier: it completes ``plan`` (its recv_P and start_in_P)
    from a count exchange that ran beside the gather. Autograd runs the reverse exchange, then
    the sum over k."""
    return _Dispatch.apply(x_TH, plan, workspace(group, x_TH.device), counts_arrived)


def combine_rows(y_PNH: torch.Tensor, weights_TK: torch.Tensor, plan: ExchangePlan, group) -> torch.Tensor:
    """[P * N, H] blocks (as :func:`dispatch_rows` returned them, computed) -> [T, H]: every row back
    to its sender, each token's K rows weighted by ``weights_TK`` and summed. Rows past the
    counts are never read."""
    return _Combine.apply(y_PNH, weights_TK, plan, workspace(group, y_PNH.device))
