"""The trainer's process group (megatron_moe/training/distributed.py).

    python -m pytest -q tests/training/test_distributed.py

On a GPU the group is created with its device named (``device_id``), so neither NCCL nor
``barrier()`` guesses it from the rank (and warns on every run); a group setup_distributed
created is destroyed at exit if nobody did (torch warns at exit otherwise). The CPU test sees
``init_process_group``'s arguments through a stand-in; the subprocess test runs the real gloo
group to the end of a process.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_moe.training.distributed as distributed


def _setup_with(monkeypatch, cuda: bool, env: dict, gpus: int = 8) -> tuple[dict, list]:
    """setup_distributed with CUDA said to be there (with ``gpus`` GPUs) or not, and
    init_process_group and atexit recorded instead of run: (init_process_group's keyword
    arguments, the exit functions)."""
    calls, at_exit = {}, []
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus if cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: "backend" in calls)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "get_rank", lambda: int(env.get("RANK", 0)))
    monkeypatch.setattr(dist, "get_world_size", lambda: int(env.get("WORLD_SIZE", 1)))
    monkeypatch.setattr(distributed.atexit, "register", at_exit.append)
    di = distributed.setup_distributed()
    assert di.created_group and di.rank == int(env.get("RANK", 0))
    return calls, at_exit


def test_the_gpu_group_names_its_device(monkeypatch):
    calls, at_exit = _setup_with(monkeypatch, True, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "3"})
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 3)
    assert at_exit == [distributed._destroy]


def test_a_world_of_one_on_the_gpu_names_device_0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    calls, _ = _setup_with(monkeypatch, True, {})
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 0)
    assert calls["world_size"] == 1 and calls["rank"] == 0


def test_a_local_rank_without_its_gpu_is_refused_before_the_group(monkeypatch):
    """More processes per node than GPUs (torchrun --nproc-per-node=2 on one GPU): a one-line
    error naming LOCAL_RANK and the fix, before init_process_group (else CUDA's "invalid device
    ordinal" here, and the other ranks wait for this one until their timeout)."""
    with pytest.raises(ValueError) as e:
        _setup_with(monkeypatch, True, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, gpus=1)
    msg = str(e.value)
    assert "\n" not in msg and "LOCAL_RANK=1" in msg and "1 GPU(s)" in msg and "--nproc-per-node=1" in msg
    assert not dist.is_initialized()
    calls, _ = _setup_with(monkeypatch, True, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, gpus=1)
    assert calls["device_id"] == torch.device("cuda", 0)  # the rank that has its GPU starts


def test_the_cpu_group_has_no_device(monkeypatch):
    calls, at_exit = _setup_with(monkeypatch, False, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert calls["backend"] == "gloo" and "device_id" not in calls
    assert at_exit == [distributed._destroy]


def test_a_process_that_leaves_its_group_exits_quietly():
    """The real group (gloo here, NCCL on a GPU) left initialised at the end of a process: the
    exit function destroys it; the process prints nothing on stderr and exits 0."""
    code = ("import torch.distributed as dist\n"
            "from megatron_moe.training.distributed import setup_distributed\n"
            "di = setup_distributed(); dist.barrier(); assert dist.is_initialized()\n"
            "print(di.world_size, di.created_group)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["1", "True"], proc.stderr
    assert proc.stderr == ""
