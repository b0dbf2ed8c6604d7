"""one-off: grouped GEMMs with extra configs (maxnreg: 2-4 programs per SM). argv: configs, gemm prefix, tag"""
import sys, os
sys.path.insert(0, "benchmarks")
import torch, triton
from profile_layer import gemm_problems, gemm_calls, _bench, CONFIGS
from megatron_moe.kernels import grouped as G

SETS = {
 "dact": [  # BM, BN, BK, warps, stages, PREFETCH, PERSISTENT, maxnreg
    (128, 128, 64, 8, 4, 0, 1, None), (64, 128, 64, 4, 4, 0, 0, None),
    (64, 128, 64, 4, 3, 0, 0, 168), (64, 128, 64, 4, 3, 1, 0, 168), (64, 128, 64, 4, 2, 0, 0, 128),
    (64, 128, 64, 4, 3, 0, 0, 160), (64, 128, 64, 4, 4, 0, 0, 168), (64, 64, 64, 4, 3, 0, 0, 128),
    (128, 128, 64, 8, 3, 1, 0, 128), (128, 64, 64, 4, 3, 0, 0, 168), (64, 128, 32, 4, 4, 0, 0, 168),
    (64, 128, 64, 4, 3, 0, 2, 168),
 ],
 "dact_old": [(128, 128, 64, 8, 4, 0, 1, None), (64, 128, 64, 4, 3, 0, 0, 168), (128, 128, 64, 8, 3, 1, 0, 128)],
 "fwd": [
    (128, 256, 64, 8, 4, 0, 0, None), (128, 256, 64, 8, 3, 0, 0, None),
    (128, 128, 64, 8, 3, 0, 0, 128), (64, 128, 64, 4, 3, 0, 0, 168), (64, 256, 64, 4, 3, 0, 0, None),
    (128, 128, 64, 4, 3, 0, 0, None),
 ],
}
cnames, prefix, tag = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
for cname in cnames:
    p = gemm_problems(CONFIGS[cname], "cuda")
    calls = {k: v for k, v in gemm_calls(p).items() if k.startswith(prefix)}
    flops = 2 * p["S"] * p["H"] * p["F"]
    for name, fn in calls.items():
        want = None
        for m, n, k, w, s, pf, ps, mr in SETS[tag]:
            cfg = triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, PREFETCH=pf, PERSISTENT=ps), num_warps=w,
                                num_stages=s, maxnreg=mr)
            G._grouped_gemm_kernel.configs = [cfg]
            G.clear_tuning_cache()
            try:
                got = fn()
                ms = _bench(fn, warmup=10, rep=50)
            except Exception as e:
                print(f"{tag} {cname:<14} {name[:12]} {m}x{n}x{k} w{w} s{s} pf{pf} ps{ps} mr {mr}: {type(e).__name__} {str(e)[:80]}")
                continue
            got = got if isinstance(got, tuple) else (got,)
            got = torch.cat([g.float().flatten()[:1000000] for g in got])
            want = got if want is None else want
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"{tag:<8} {cname:<14} {name[:12]} {m}x{n}x{k} w{w} s{s} pf{pf} ps{ps} mr {str(mr):>4}: {ms:.3f} ms "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s  err {err:.1e}", flush=True)
