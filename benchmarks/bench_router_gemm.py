"""The router's GEMMs: kernels/router_gemm.py's kernels against the torch path (the parts stacked
into torch GEMMs), GPU time and host time per call.

    python benchmarks/bench_router_gemm.py                      # the layer benchmark's router shapes
    python benchmarks/bench_router_gemm.py --shapes 32768x768x64 --w-dtypes bf16
    python benchmarks/bench_router_gemm.py --sweep --shapes dmoe-small,qwen3-30b-a3b   # each kernel's tiles

GPU ms: triton.testing.do_bench's median. "dx+dw" and "dx+dw+add" time the fused backward
(``logits_backward_triton``; with the experts' dx added in place) in the kernel column and the
separate kernels (and torch's add) in the torch column. Host µs: the median over 200 calls with the GPU held
busy by a sleep kernel (the enqueue alone). Shapes are T x H x E (tokens, hidden, experts).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

SHAPES = {"dmoe-small": (32768, 768, 64), "paper-moe-m": (16384, 1024, 64), "qwen3-30b-a3b": (16384, 2048, 128),
          "sonic-1536": (32768, 1536, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _shape(name):
    """(T, H, E) of a SHAPES name or of "TxHxE"."""
    return SHAPES[name] if name in SHAPES else tuple(int(v) for v in name.split("x"))


def host_us(fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _candidates(op):
    """Tile configs --sweep times per kernel (BLOCK_E: the most experts per tile)."""
    grid = {"logits": dict(BLOCK_T=(64, 128), BLOCK_H=(64, 128), BLOCK_E=(128,), num_warps=(4, 8), num_stages=(3, 4)),
            "dx": dict(BLOCK_T=(64, 128), BLOCK_H=(64, 128), BLOCK_E=(64,), num_warps=(4, 8), num_stages=(3,)),
            "dw": dict(BLOCK_T=(32, 64), BLOCK_H=(64, 128), BLOCK_E=(64,), num_warps=(4, 8), num_stages=(3,)),
            "bwd": dict(BLOCK_T=(32, 64), BLOCK_H=(64, 128), num_warps=(4, 8), num_stages=(2, 3),
                        PROGRAMS_PER_SM=(2, 4), DW_FIRST=(False, True))}[op]
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def sweep(shapes, w_dtypes, ops, dev):
    """GPU ms of every candidate config of each kernel at each shape (a config that does not fit
    the GPU's shared memory is skipped); the best per kernel and dtype (the sum over the shapes)
    last."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    from megatron_moe.kernels import router_gemm as rg

    tables = {"logits": rg.FWD_CONFIG, "dx": rg.DX_CONFIG, "dw": rg.DW_CONFIG, "bwd": rg.BWD_CONFIG}
    for wname in w_dtypes:
        wd = DTYPES[wname]
        inputs = []
        for name in shapes:
            T, H, E = _shape(name)
            w = (torch.randn(E, H, device=dev) * 0.02).to(wd)
            inputs.append((name, torch.randn(T, H, device=dev).bfloat16(), w, torch.randn(T, E, device=dev)))
        for op in ops:
            table = tables[op]
            shipped, totals = dict(table[wd]), []
            for cfg in _candidates(op):
                table[wd] = cfg
                ms = []
                try:
                    for name, x, w, g in inputs:
                        fn = {"logits": lambda: rg.logits_triton(x, w),
                              "dx": lambda: rg.logits_dx_triton(g, w, x.dtype),
                              "dw": lambda: rg.logits_dw_triton(g, x, w.dtype),
                              "bwd": lambda: rg.logits_backward_triton(g, x, w)}[op]
                        ms.append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
                except OutOfResources:
                    print(f"sweep {wname} {op:<7} skipped, out of shared memory: {cfg}", flush=True)
                    continue
                totals.append((sum(ms), cfg, ms))
                mark = " (shipped)" if cfg == shipped else ""
                print(f"sweep {wname} {op:<7} {' '.join(f'{m:.4f}' for m in ms)}  {cfg}{mark}", flush=True)
            table[wd] = shipped
            best = min(totals, key=lambda r: r[0])
            print(f"BEST {wname} {op:<7} {' '.join(f'{m:.4f}' for m in best[2])}  {best[1]}", flush=True)


def main(argv=None):
    import triton.testing

    from megatron_moe.kernels import router_gemm as rg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names of SHAPES or TxHxE, comma-separated")
    ap.add_argument("--w-dtypes", default="bf16,fp32")
    ap.add_argument("--sweep", action="store_true", help="time each kernel's candidate tile configs, then exit")
    ap.add_argument("--ops", default="logits,dx,dw,bwd", help="--sweep's kernels")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.sweep:
        sweep(args.shapes.split(","), args.w_dtypes.split(","), args.ops.split(","), dev)
        return
    print(f"{'shape':<16}{'w':<6}{'op':<8}{'kernel ms':>10}{'torch ms':>10}{'kernel µs host':>16}{'torch µs host':>15}")
    for name in args.shapes.split(","):
        T, H, E = _shape(name)
        for wname in args.w_dtypes.split(","):
            wd = DTYPES[wname]
            x = torch.randn(T, H, device=dev).bfloat16()
            w = (torch.randn(E, H, device=dev) * 0.02).to(wd)
            g = torch.randn(T, E, device=dev)
            into = torch.randn(T, H, device=dev).bfloat16()
            ops = {"logits": (lambda: rg.logits_triton(x, w), lambda: rg.logits_reference(x, w)),
                   "dx": (lambda: rg.logits_dx_triton(g, w, x.dtype),
                          lambda: rg.logits_backward_reference(g, x, w, need_dw=False)),
                   "dw": (lambda: rg.logits_dw_triton(g, x, w.dtype),
                          lambda: rg.logits_backward_reference(g, x, w, need_dx=False)),
                   # both gradients: the fused kernel against the two kernels
                   "dx+dw": (lambda: rg.logits_backward_triton(g, x, w),
                             lambda: (rg.logits_dx_triton(g, w, x.dtype), rg.logits_dw_triton(g, x, w.dtype))),
                   # and the experts' dx added: in the kernel against the two kernels and an add
                   "dx+dw+add": (lambda: rg.logits_backward_triton(g, x, w, dx_add_TH=into),
                                 lambda: (into.add_(rg.logits_dx_triton(g, w, x.dtype)),
                                          rg.logits_dw_triton(g, x, w.dtype)))}
            for op, (kern, ref) in ops.items():
                k_ms = triton.testing.do_bench(kern, warmup=25, rep=100, return_mode="median")
                r_ms = triton.testing.do_bench(ref, warmup=25, rep=100, return_mode="median")
                print(f"{name:<16}{wname:<6}{op:<8}{k_ms:>10.4f}{r_ms:>10.4f}{host_us(kern):>16.1f}{host_us(ref):>15.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
