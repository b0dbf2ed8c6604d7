"""benchmarks/proto_gelu_up.py's kernel (a top-1 GELU up projection over sorted rows with its epilogue in
warps of its own, a prototype: docs/performance.md, "A GELU up projection with its epilogue in warps of
its own") compiles for Hopper (sm_90) on a machine without a GPU, with and without the router weight and act
stored whole or in staged parts,
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
    lines = re.findall(r"(staged \w+, act_scale \w+): compiled for sm_90, (\d+) bytes of shared memory; "
                       r".*ptxas: (.*)", out)
    assert [v for v, _, _ in lines] == ["staged False, act_scale True", "staged False, act_scale False",
                                        "staged True, act_scale True"], out
    for variant, smem, ptxas in lines:
        assert int(smem) <= SMEM_PER_BLOCK, f"{variant}: {smem} bytes of shared memory"
        assert " 0 bytes spilled" in ptxas and "SERIALISED" not in ptxas, f"{variant}: {ptxas}"
