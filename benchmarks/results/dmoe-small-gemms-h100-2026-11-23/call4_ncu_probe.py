"""ncu probe (one-off): the accumulating weight gradient, the bwd dact GEMM and their plain twins at dmoe-small."""
import sys, os, torch, triton
sys.path.insert(0, "benchmarks")
from profile_layer import gemm_problems
from megatron_moe.kernels import grouped as G
p = gemm_problems((32768, 768, 3072, 64, 1), torch.device("cuda"))
W = G._grouped_wgrad_kernel; R = G._grouped_gemm_kernel
wcfg = triton.Config(dict(BLOCK_K=128, BLOCK_N=128, BLOCK_S=64, EPI_CHUNKS=1), num_warps=4, num_stages=2)
ccfg = triton.Config(dict(BLOCK_K=128, BLOCK_N=128, BLOCK_S=64, EPI_CHUNKS=4), num_warps=4, num_stages=2)
c2cfg = triton.Config(dict(BLOCK_K=128, BLOCK_N=128, BLOCK_S=64, EPI_CHUNKS=2), num_warps=4, num_stages=2)
dcfg = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PREFETCH=0, PERSISTENT=1), num_warps=8, num_stages=4)
pcfg = triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, PREFETCH=0, PERSISTENT=1), num_warps=8, num_stages=3)
calls = [
  ("wgrad+=fp32 whole", W, wcfg, lambda: G.grouped_wgrad(p["act"], p["dy"], p["off"], gather_b_S=p["tok"], out=p["g2"], accumulate=True)),
  ("wgrad+=fp32 quarters", W, ccfg, lambda: G.grouped_wgrad(p["act"], p["dy"], p["off"], gather_b_S=p["tok"], out=p["g2"], accumulate=True)),
  ("wgrad+=fp32 halves", W, c2cfg, lambda: G.grouped_wgrad(p["act"], p["dy"], p["off"], gather_b_S=p["tok"], out=p["g2"], accumulate=True)),
]
for name, k, cfg, fn in calls:
    k.configs = [cfg]; G.clear_tuning_cache()
    fn(); fn(); torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    torch.cuda.profiler.start(); fn(); torch.cuda.synchronize(); torch.cuda.profiler.stop()
    torch.cuda.nvtx.range_pop()
    print("ran", name, flush=True)
