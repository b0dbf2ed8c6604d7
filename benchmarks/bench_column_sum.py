"""The bias gradient's column sum alone on the GPU: kernels/column_sum.py against torch's
``dy.sum(0)`` and a sweep of the kernel's launch shape (rows per tile, columns per tile, warps,
programs).

    python benchmarks/bench_column_sum.py                          # gpt-small's shapes, bf16
    python benchmarks/bench_column_sum.py --out bench_column_sum.json

Shapes: [tokens, outputs] of a micro-batch of 32 x 1024 tokens for gpt-small's four biases
(hidden 768: the attention projection and fc2 768, QKV 2304, fc1 3072). Bytes: one read of dy
(the fp32 partials are left out: under 1 MB); TB/s is that over the median GPU time, from
replays of a CUDA graph of 20 calls (as the trainer runs them). A
device-to-device copy of a 2 GB tensor is timed beside them as the reachable bandwidth. Every
swept launch is checked against torch's fp32 sum first. Prints a table per shape, the default
launch and the fastest last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.kernels import column_sum as C  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adamw import COPY_BYTES, copy_ms  # noqa: E402

SHAPES = [(32768, 768), (32768, 2304), (32768, 3072)]
REPS = 50
GRAPH_CALLS = 20  # calls per CUDA-graph replay: the GPU's time, not the host's launch (tens of µs)
SWEEP = dict(block_m=(16, 32, 64), block_n=(128, 256, 512), num_warps=(4, 8), programs=(512, 1024, 2048))


def graph_ms(fn) -> float:
    """Median GPU milliseconds of one call of fn, from replays of a CUDA graph of GRAPH_CALLS calls
    (these kernels take less time than their Python launch: timed eagerly, the host is measured)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    ts = []
    for _ in range(REPS // 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / GRAPH_CALLS)
    return sorted(ts)[len(ts) // 2]


def bench_shape(M: int, N: int, dtype=torch.bfloat16) -> dict:
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    want = dy.float().sum(0)
    gb = M * N * dy.element_size() / 1e9
    rows = {"torch dy.sum(0)": graph_ms(lambda: dy.sum(0))}
    default = dict(block_m=C.BLOCK_M, block_n=C.BLOCK_N, num_warps=C.NUM_WARPS, programs=C.PROGRAMS)
    for combo in itertools.product(*SWEEP.values()):
        kw = dict(zip(SWEEP, combo))
        got = C.column_sum_triton(dy, torch.float32, **kw)
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > 1e-5:
            raise AssertionError(f"column_sum {kw} differs from torch's fp32 sum by {err:.2e}")
        name = " ".join(f"{k}={v}" for k, v in kw.items()) + (" (default)" if kw == default else "")
        rows[name] = graph_ms(lambda kw=kw: C.column_sum_triton(dy, **kw))
    return {"M": M, "N": N, "GB": gb, "ms": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    copy = copy_ms(REPS)
    copy_tbs = 2 * COPY_BYTES / copy / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy_tbs:.2f} TB/s")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbs": copy_tbs, "shapes": []}
    for M, N in SHAPES:
        r = bench_shape(M, N)
        results["shapes"].append(r)
        ms = r["ms"]
        kernel = {k: v for k, v in ms.items() if not k.startswith("torch")}
        best = min(kernel, key=kernel.get)
        default = next(k for k in kernel if k.endswith("(default)"))
        print(f"[{M}, {N}] bf16, {r['GB'] * 1e3:.0f} MB read")
        for name in ("torch dy.sum(0)", default, best):
            print(f"  {name:58s} {ms[name] * 1e3:7.1f} us  {r['GB'] / ms[name]:5.2f} TB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
