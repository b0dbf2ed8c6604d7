"""The fused router's kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compiler: a loop-carried
value whose type changes, or a shape the compiler cannot lay out, shows only when the kernel is
compiled. Triton compiles for a named target without a driver, so the CPU CI checks that too, in
a subprocess without TRITON_INTERPRET (the kernels must be defined as JIT functions).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import megatron_moe.kernels.router as R

    def compile_(fn, signature, constexprs):
        src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert kernel.asm["cubin"], fn.__name__

    FWD = dict(logits_ptr="*fp32", bias_ptr="*fp32", ids_ptr="*i64", weights_ptr="*fp32", part_counts_ptr="*i32",
               part_probs_ptr="*fp32", part_lse2_ptr="*fp32", T="i32", E="i32", stride_t="i32")
    SUM = dict(part_counts_ptr="*i32", part_probs_ptr="*fp32", part_lse2_ptr="*fp32", counts_ptr="*i64",
               aux_ptr="*fp32", z_ptr="*fp32", G="i32", E="i32", aux_scale="fp32", z_scale="fp32")
    BWD = dict(logits_ptr="*fp32", ids_ptr="*i64", dweights_ptr="*fp32", counts_ptr="*i64", daux_ptr="*fp32",
               dz_ptr="*fp32", dlogits_ptr="*fp32", T="i32", E="i32", stride_t="i32", aux_scale="fp32",
               z_scale="fp32")
    n = 0
    for (E, K), softmax, normalize in itertools.product([(64, 1), (128, 8), (3, 3), (256, 4)], [True, False],
                                                        [False, True]):
        bt, be, bk = R._blocks(E, K)
        compile_(R._route_fwd_kernel, FWD, dict(K=K, SOFTMAX=softmax, NORMALIZE=normalize, HAS_BIAS=not softmax,
                                                BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk))
        compile_(R._route_bwd_kernel, BWD, dict(K=K, SOFTMAX=softmax, NORMALIZE=normalize, HAS_DW=True,
                                                HAS_AUX=normalize, HAS_Z=True, BLOCK_T=bt, BLOCK_E=be))
        n += 2
    compile_(R._route_sum_kernel, SUM, dict(BLOCK_G=64, BLOCK_E=128))
    print("compiled", n + 1)
''')


@pytest.mark.slow
def test_router_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 33" in proc.stdout
