"""The process group of a training run: torchrun's environment, or a world of one process.

    di = setup_distributed()     # NCCL with device LOCAL_RANK on GPUs, gloo on the CPU
    di.rank, di.world_size, di.device
    teardown(exit_code)          # the end of the CLI: destroy it, or exit if that never returns
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "setup_distributed", "set_deterministic", "world_size", "barrier", "teardown"]

TEARDOWN_DEADLINE_S = 120.0
"""How long :func:`teardown` waits for ``destroy_process_group`` before the process exits without
it. The run is over by then (its checkpoint written, its logs closed); a teardown that never
returns (NCCL waiting for a live CUDA graph that captured its collectives, pytorch/pytorch#115388,
or for a peer that is gone) would hold the job's GPUs until the scheduler's time limit."""


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    created_group: bool


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size() -> int:
    """The world size, before or after the process group exists (torchrun's WORLD_SIZE)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a world of one). Under NCCL the barrier names
    this process's GPU, so NCCL need not guess it from the rank (it warns when it does, and a
    guess is wrong where ranks and GPUs are mapped otherwise)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def teardown(exit_code: int, pending: BaseException | None = None) -> None:
    """Destroy the process group; if that has not returned after TEARDOWN_DEADLINE_S, say so in
    one line and end the process with ``exit_code`` (``pending``: an exception on its way out,
    whose traceback is printed first, as Python would have)."""
    if not dist.is_initialized():
        return
    done = threading.Event()

    def deadline() -> None:
        if done.wait(TEARDOWN_DEADLINE_S):
            return
        sys.stdout.flush()
        if pending is not None:
            sys.stderr.write("".join(traceback.format_exception(pending)))
        sys.stderr.write(f"megatron-moe-train: warning: torch.distributed.destroy_process_group() did not return "
                         f"in {TEARDOWN_DEADLINE_S:.0f} s; exiting without it (the run itself has ended)\n")
        sys.stderr.flush()
        os._exit(exit_code)

    threading.Thread(target=deadline, name="teardown-deadline", daemon=True).start()
    dist.destroy_process_group()
    done.set()


def setup_distributed() -> DistInfo:
    """Initialise torch.distributed: env:// under torchrun, else a world of one process.

    NCCL with device LOCAL_RANK when CUDA is available, gloo on the CPU. Idempotent. A
    LOCAL_RANK with no GPU of its own is a ValueError naming the fix.
    """
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:  # else CUDA's "invalid device ordinal", and the other ranks wait for this one
            raise ValueError(f"LOCAL_RANK={local_rank} but this machine shows {gpus} GPU(s): start at most {gpus} "
                             f"processes per node (torchrun --nproc-per-node={gpus}), or check CUDA_VISIBLE_DEVICES")
        torch.cuda.set_device(local_rank)
    created = False
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        # this process's GPU, named: NCCL and barrier() need not guess it (and warn)
        device_id = {"device_id": torch.device("cuda", local_rank)} if use_cuda else {}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, **device_id)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, **device_id)
        created = True
        atexit.register(_destroy)  # pretrain() called in a process that exits without destroying it
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, created)


def set_deterministic(on: bool = True) -> None:
    """Deterministic algorithms only (``train.deterministic``); call before CUDA/NCCL start.

    The environment variables are read when cuBLAS / NCCL initialise, so they are set only
    if the user has not chosen otherwise."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")  # a fixed reduction order
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
