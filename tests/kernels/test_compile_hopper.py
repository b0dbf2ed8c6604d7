"""Every Triton kernel the layer and the trainer launch compiles for Hopper (sm_90), checked on a
machine without a GPU (tests/kernels/_compile_sm90.py says how).

The CPU tests run the kernels under Triton's interpreter, which runs their Python but not their
compiler: what only the compiler refuses (a loop-carried value whose type changes, a layout it
cannot build, a tensor descriptor) would otherwise first show on a GPU machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("_compile_sm90.py")
KERNELS = ["_adamw_kernel", "_chunk_scan_kernel", "_column_sum_finish_kernel", "_column_sum_kernel",
           "_copy_row_blocks_kernel", "_cross_entropy_bwd_kernel", "_cross_entropy_fwd_kernel",
           "_dds_kernel", "_dsd_kernel", "_expert_scan_kernel", "_gather_rows_kernel", "_grouped_gemm_kernel",
           "_grouped_wgrad_kernel", "_grouped_wgrad_gluon_kernel", "_grouped_gemm_gluon_kernel",
           "_grouped_gemm_swiglu_kernel", "_grouped_gemm_dact_pingpong_kernel", "_histogram_kernel",
           "_ln_bwd_kernel", "_ln_fwd_kernel", "_logits_kernel", "_logits_dx_kernel", "_logits_dw_kernel",
           "_logits_bwd_kernel",
           "_route_bwd_kernel", "_route_fwd_kernel",
           "_route_sum_kernel", "_scatter_kernel", "_scatter_rows_kernel", "_scatter_weight_grad_kernel",
           "_sdd_kernel", "_tile_table_kernel", "_topology_kernel", "_tsd_kernel",
           "_grouped_gemm_kernel W_TMA", "_grouped_wgrad_kernel TMA_ADD", "_column_sum_kernel DGELU",
           "_grouped_gemm_gluon_kernel GELU"]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HARNESS)], capture_output=True, text=True, timeout=1200, env=env)
    out = proc.stdout
    assert proc.returncode == 0 and "FAILED" not in out, out[-3000:] + proc.stderr[-3000:]
    compiled = {line.split(" x")[0].removeprefix("compiled ") for line in out.splitlines()
                if line.startswith("compiled ")}
    missing = [k for k in KERNELS if k not in compiled]
    assert not missing, f"not compiled: {missing}\n{out[-3000:]}"
    # no kernel whose MMAs ptxas serialised, but the router's weight gradient alone (a small E x H
    # GEMM; its loop of split-precision dots is memory-bound, and the training path takes the fused
    # backward: docs/performance.md, "The router's backward in one pass")
    serialised = [line for line in out.splitlines() if line.startswith("wgmma-serialised ")
                  and not line.startswith("wgmma-serialised _logits_dw_kernel:")]
    assert not serialised, "ptxas serialised these kernels' MMAs:\n" + "\n".join(serialised)
