"""Helpers shared by tests of several tiers (tests/conftest.py puts this folder on sys.path)."""
import importlib.util
import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_ranks(worker: str, args: list[str], world: int, out_dir, *, timeout: int = 300,
                   local_rank: bool = False) -> list:
    """``python WORKER ARGS`` as ranks 0..world-1 of one gloo process group on this machine (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT set; LOCAL_RANK too with ``local_rank``; one thread each). Each
    must exit 0 (else AssertionError with its output's tail) having saved OUT_DIR/rank{r}.pt;
    returns those, loaded, in rank order."""
    import torch

    port = free_port()
    procs = [subprocess.Popen([sys.executable, worker, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                                       **({"LOCAL_RANK": str(r)} if local_rank else {})))
             for r in range(world)]
    outs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


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


def load_script(path):
    """A script that is not a package module (benchmarks/*.py), imported from its path."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_only_output(script: str) -> str:
    """``python benchmarks/SCRIPT --compile-only`` (a prototype's kernels compiled for sm_90) in a
    process without Triton's interpreter, the repository first on its path: its stdout (it must
    exit 0, else AssertionError with its output's tail)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", script), "--compile-only"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
