"""one-off: the row-grouped GEMMs with the weights through pointers (W_TMA 0) and through a tensor descriptor."""
import os, sys
sys.path.insert(0, "benchmarks")
import torch, triton
from profile_layer import gemm_problems, gemm_calls, _bench, CONFIGS
from megatron_moe.kernels import grouped as G

SETS = {
    "fwd1": [(128, 256, 64, 8, 4, 0, 0), (128, 256, 64, 8, 3, 0, 0)],
    "fwd2": [(128, 256, 64, 8, 3, 0, 0), (128, 256, 64, 8, 4, 0, 0), (128, 256, 64, 8, 3, 0, 1)],
    "dx": [(128, 256, 64, 8, 3, 0, 0), (128, 256, 64, 8, 4, 0, 0), (128, 256, 64, 8, 3, 0, 1)],
    "bwd": [(128, 128, 64, 8, 4, 0, 1), (64, 128, 64, 4, 3, 0, 0, 168), (128, 128, 64, 8, 3, 0, 0)],
}
for cname in sys.argv[1].split(","):
    p = gemm_problems(CONFIGS[cname], "cuda")
    flops = 2 * p["S"] * p["H"] * p["F"]
    calls = gemm_calls(p)
    for prefix, cfgs in SETS.items():
        name = next(k for k in calls if k.startswith(prefix))
        fn = calls[name]
        want = None
        for m, n, k, w, s, pf, ps, *reg in cfgs:
            for mode in ("0", "1"):
                os.environ["MEGATRON_MOE_W_TMA"] = mode
                cfg = triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, PREFETCH=pf, PERSISTENT=ps), num_warps=w,
                                    num_stages=s, maxnreg=(reg or [None])[0], pre_hook=G._size_w_desc)
                G._grouped_gemm_kernel.configs = [cfg]
                G.clear_tuning_cache()
                try:
                    got = fn()
                    ms = _bench(fn, warmup=10, rep=50)
                except Exception as e:
                    print(f"{cname:<14} {prefix:<5} {m}x{n}x{k} w{w} s{s} ps{ps} mr {reg} tma {mode}: {type(e).__name__} {str(e)[:100]}", flush=True)
                    continue
                got = got if isinstance(got, tuple) else (got,)
                got = torch.cat([g.float().flatten()[:2000000] for g in got])
                want = got if want is None else want
                err = ((got - want).abs().max() / want.abs().max()).item()
                print(f"{cname:<14} {prefix:<5} {m}x{n}x{k} w{w} s{s} ps{ps} mr {str(reg):<6} tma {mode}: {ms:.3f} ms "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s  err {err:.1e}", flush=True)
