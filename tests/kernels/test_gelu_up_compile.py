"""benchmarks/proto_gelu_up.py's kernel (a top-1 GELU up projection over sorted rows with its epilogue in
warps of its own, a prototype: docs/performance.md, "A GELU up projection with its epilogue in warps of
its own") compiles for Hopper (sm_90) on a machine without a GPU, with and without the router weight,
within an SM's shared memory, without spills or serialised MMAs."""
from __future__ import annotations

import re

import pytest
from _util import compile_only_output

SMEM_PER_BLOCK = 232448  # an H100's / H200's largest shared memory a CTA (227 KB)


@pytest.mark.slow
def test_the_gelu_up_kernel_compiles_for_sm90_within_shared_memory_without_spills():
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("triton.experimental.gluon")
    out = compile_only_output("proto_gelu_up.py")
    lines = re.findall(r"act_scale (\w+): compiled for sm_90, (\d+) bytes of shared memory; .*ptxas: (.*)", out)
    assert [s for s, _, _ in lines] == ["True", "False"], out
    for scaled, smem, ptxas in lines:
        assert int(smem) <= SMEM_PER_BLOCK, f"act_scale {scaled}: {smem} bytes of shared memory"
        assert " 0 bytes spilled" in ptxas and "SERIALISED" not in ptxas, f"act_scale {scaled}: {ptxas}"
