"""A/B of the bf16-out weight gradient's store: TMA bulk store vs pointer stores (one mode per
process). Needs tma_store.patch (reverted: it did not pay); from the repository root:

    git apply benchmarks/results/wgrad-tma-store-h100-2026-11-23/tma_store.patch
    MEGATRON_MOE_TMA_STORE=0 python benchmarks/results/wgrad-tma-store-h100-2026-11-23/ab_tma_store.py  # pointer stores (8 configs)
    python benchmarks/results/wgrad-tma-store-h100-2026-11-23/ab_tma_store.py  # the autotuner picks among both (16)
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from profile_layer import CONFIGS, gemm_calls, gemm_problems  # noqa: E402
from megatron_moe.kernels import grouped as G  # noqa: E402

mode = "pointer" if os.environ.get("MEGATRON_MOE_TMA_STORE") == "0" else "auto"
names = ["wgrad dw2 actT@dy[t]", "wgrad dw1 x[t]T@dpre", "wgrad dw2 w*gelu(pre)T@dy[t]"]
for cname in ("paper-moe-m", "fine-64e-top8", "dmoe-small"):
    p = gemm_problems(CONFIGS[cname], torch.device("cuda"))
    calls = gemm_calls(p)
    for name in names:
        fn = calls[name]
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        cfg = G._grouped_wgrad_kernel.best_config
        desc = f"{cfg.kwargs['BLOCK_K']}x{cfg.kwargs['BLOCK_N']}x{cfg.kwargs['BLOCK_S']} w{cfg.num_warps} s{cfg.num_stages}"
        desc += " TMA-store" if cfg.kwargs["TMA_ADD"] else " ptr-store"
        flops = 2 * p["S"] * p["H"] * p["F"]
        print(f"{mode:8s} {cname:14s} {name:30s} {ms:.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  {desc}", flush=True)
    del p, calls
    torch.cuda.empty_cache()
