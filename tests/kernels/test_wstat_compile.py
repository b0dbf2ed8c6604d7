"""benchmarks/proto_wstat.py's kernel (the plain row-grouped GEMM with w's block kept in shared
memory, a prototype: docs/performance.md, "A ping-pong with w's block kept in shared memory") compiles
for Hopper (sm_90) on a machine without a GPU, in both tile orders (the grouped one at K 192), within
an SM's shared memory, without spills or serialised MMAs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMEM_PER_BLOCK = 232448  # an H100's / H200's largest shared memory a CTA (227 KB)


@pytest.mark.slow
def test_the_kept_w_kernel_compiles_for_sm90_within_shared_memory_without_spills():
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "proto_wstat.py"), "--compile-only"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"K (\d+): compiled for sm_90, (\d+) bytes of shared memory; ptxas: (.*)", out)
    assert [k for k, _, _ in lines] == ["64", "192", "256"], out
    for K, smem, ptxas in lines:
        assert int(smem) <= SMEM_PER_BLOCK, f"K {K}: {smem} bytes of shared memory"
        assert " 0 bytes spilled" in ptxas and "SERIALISED" not in ptxas, f"K {K}: {ptxas}"
