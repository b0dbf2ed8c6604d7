"""Helpers shared by tests of several tiers (tests/conftest.py puts this folder on sys.path)."""
import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def triton_kernels_run() -> bool:
    """Whether the Triton kernels run in this process: on a GPU, or on the CPU under the interpreter
    (elsewhere each op takes its plain-PyTorch path)."""
    import torch

    from megatron_moe.kernels._common import use_triton

    return use_triton(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu"))


def needs_triton_kernels(test):
    """Skip ``test`` where the Triton kernels do not run (a CPU without the interpreter)."""
    import pytest

    return pytest.mark.skipif(not triton_kernels_run(),
                              reason="the Triton kernels run on GPUs or under the Triton interpreter")(test)
