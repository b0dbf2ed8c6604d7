"""The exact-size token exchange with no host synchronisation (``a2a_splits='symmetric'``).

Every rank of the expert-parallel group holds one buffer that all the others can read: PyTorch's
symmetric memory on CUDA (peer memory mapped over NVLink: the ranks of one node), shared-memory
files on the CPU (gloo; how the tests run it). An exchange of [P * C, H] row blocks, where block q
holds the rows for rank q and only its first n_out[q] rows are valid:

    1. each rank copies its valid rows into its own buffer (block q at rows q * C);
    2. barrier: every buffer is written;
    3. each rank reads block ``rank`` of every peer p's buffer, its first n_in[p] rows, into
       block p of its output (rows past n_in[p] are left undefined: the experts skip them);
    4. barrier: nobody writes its buffer again before every peer has read it.

The counts stay on the device (the copies are :func:`megatron_moe.kernels.copy_rows.copy_row_blocks`,
whose programs past a block's count return at once), so a CUDA graph can hold the exchange, and
only the valid rows move: the bytes of the exact exchange ('host'), without its host read, where
'padded' sends whole blocks (P times the bytes). The backward is the same exchange with the
counts swapped.

Legend: P ranks of the group, C rows per block (tokens * top_k), H hidden.
"""
from __future__ import annotations

import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from .kernels.copy_rows import copy_row_blocks


class _Workspace:
    """One buffer per rank, readable by every rank of ``group``; grown (collectively: every rank
    asks for the same size, as every rank exchanges the same [P * C, H]) before use."""

    def __init__(self, group):
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.nbytes = 0
        self.buffers: list[torch.Tensor] = []  # [P] uint8, this rank's own at self.rank
        self.handle = None  # CUDA: the rendezvous of the buffers (their barrier's signal pads)
        self._outgrown: list = []  # earlier buffers, kept: a CUDA graph captured may still read them

    def view(self, peer: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers[peer][:rows * width * dtype.itemsize].view(dtype).view(rows, width)

    def reserve(self, nbytes: int, device: torch.device) -> None:
        if nbytes > self.nbytes:
            if self.buffers:
                self._outgrown.append((self.buffers, self.handle))
            self._allocate(nbytes, device)
            self.nbytes = nbytes

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
    exchanges run one after another, each ending with a barrier)."""
    key = (id(group), device.type)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.group is not group:  # (another group at a freed one's address: start anew)
        ws = _WORKSPACES[key] = (_CudaWorkspace if device.type == "cuda" else _SharedFileWorkspace)(group)
    return ws


def _exchange(ws: _Workspace, x_PCH: torch.Tensor, n_out_P: torch.Tensor, n_in_P: torch.Tensor) -> torch.Tensor:
    from .dispatch import ExchangeTimer  # (dispatch imports this module)

    ev = ExchangeTimer.start(x_PCH.device)
    P, (rows, H) = ws.num_ranks, x_PCH.shape
    C = rows // P
    ws.reserve(rows * H * x_PCH.element_size(), x_PCH.device)
    x_PCH = x_PCH.contiguous()
    copy_row_blocks(x_PCH, ws.view(ws.rank, rows, H, x_PCH.dtype), n_out_P, C)
    ws.barrier()
    out_PCH = torch.empty_like(x_PCH)
    # rank r reads its own buffer, then r + 1, r + 2, ... (mod P): at every stage each buffer has
    # one reader, where reading the peers in the same order on every rank has P - 1 ranks read
    # rank 0's buffer at once, then rank 1's, sharing one GPU's links between them
    for p in [(ws.rank + i) % P for i in range(P)]:
        copy_row_blocks(ws.view(p, rows, H, x_PCH.dtype), out_PCH, n_in_P[p:p + 1], C,
                        src_row0=ws.rank * C, dst_row0=p * C)
    ws.barrier()
    ExchangeTimer.stop(ev)
    return out_PCH


class _SymmetricExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PCH, n_out_P, n_in_P, ws):
        ctx.ws = ws
        ctx.save_for_backward(n_out_P, n_in_P)
        return _exchange(ws, x_PCH, n_out_P, n_in_P)

    @staticmethod
    def backward(ctx, grad_PCH):
        n_out_P, n_in_P = ctx.saved_tensors
        return _exchange(ctx.ws, grad_PCH, n_in_P, n_out_P), None, None, None


def symmetric_exchange(x_PCH: torch.Tensor, n_out_P: torch.Tensor, n_in_P: torch.Tensor, group) -> torch.Tensor:
    """[P * C, H] blocks -> [P * C, H] blocks: rows [0, n_out_P[q]) of block q go to rank q, block p
    of the result holds rows [0, n_in_P[p]) from rank p (the rest undefined). Counts on the
    device; autograd runs the reverse exchange (the input gradient's rows past n_out_P are
    undefined too: the dispatchers read neither)."""
    return _SymmetricExchange.apply(x_PCH, n_out_P, n_in_P, workspace(group, x_PCH.device))
