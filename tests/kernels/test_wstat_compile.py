"""benchmarks/proto_wstat.py's kernel (the plain row-grouped GEMM with w's block kept in shared
memory, a prototype: docs/performance.md, "A ping-pong with w's block kept in shared memory") compiles
for Hopper (sm_90) on a machine without a GPU, in both tile orders (the grouped one at K 192), within
an SM's shared memory, without spills or serialised MMAs."""
from __future__ import annotations

import re

import pytest
from _util import compile_only_output

SMEM_PER_BLOCK = 232448  # an H100's / H200's largest shared memory a CTA (227 KB)


@pytest.mark.slow
def test_the_kept_w_kernel_compiles_for_sm90_within_shared_memory_without_spills():
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("triton.experimental.gluon")
    out = compile_only_output("proto_wstat.py")
    lines = re.findall(r"K (\d+): compiled for sm_90, (\d+) bytes of shared memory; ptxas: (.*)", out)
    assert [k for k, _, _ in lines] == ["64", "192", "256"], out
    for K, smem, ptxas in lines:
        assert int(smem) <= SMEM_PER_BLOCK, f"K {K}: {smem} bytes of shared memory"
        assert " 0 bytes spilled" in ptxas and "SERIALISED" not in ptxas, f"K {K}: {ptxas}"
