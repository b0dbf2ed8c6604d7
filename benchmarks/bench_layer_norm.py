"""LayerNorm alone on the GPU: kernels/layer_norm.py's forward and backward against torch's, and a
sweep of the backward's launch shape (programs, warps, rows per loop iteration).

    python benchmarks/bench_layer_norm.py                         # the model's shapes, bf16
    python benchmarks/bench_layer_norm.py --out bench_layer_norm.json

Shapes: [tokens, hidden] of a micro-batch of 32 x 1024 tokens at hidden 512 (xs), 768 (small)
and 1024 (medium), and 16 x 1024 at 2048. Bytes: the forward reads x and writes y; the backward
reads x and dy and writes dx (the fp32 mean, rstd and partial sums are left out: a few MB);
TB/s is those bytes over the median GPU time, from replays of a CUDA graph of 20 calls
(benchmarks/bench_column_sum.py's ``graph_ms``: timed eagerly, these tens of microseconds would
measure the host's launch). A device-to-device copy of a 2 GB tensor is timed beside them as the
reachable bandwidth. Every swept backward is checked against the default launch's dx, dweight
and dbias first (a launch shape that changes the result is an error). Prints a table per shape,
the fastest backward last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.kernels.layer_norm import (_blocks, bwd_launch, layer_norm_bwd_triton,  # noqa: E402
                                             layer_norm_fwd_triton)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adamw import COPY_BYTES, copy_ms  # noqa: E402
from bench_column_sum import graph_ms  # noqa: E402

SHAPES = [(32768, 512), (32768, 768), (32768, 1024), (16384, 2048)]


def bench_shape(M: int, N: int, dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    dy = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(dtype)
    b = (0.1 * torch.randn(N, device="cuda", generator=g)).to(dtype)
    io = M * N * x.element_size()
    rows = {"shape": [M, N]}

    y, mean, rstd = layer_norm_fwd_triton(x, w, b, 1e-5)
    rows["fwd_ms"] = graph_ms(lambda: layer_norm_fwd_triton(x, w, b, 1e-5))
    rows["torch_fwd_ms"] = graph_ms(lambda: F.layer_norm(x, (N,), w, b, 1e-5))
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(x, (N,), w, b, 1e-5)
    rows["torch_bwd_ms"] = graph_ms(lambda: torch.ops.aten.native_layer_norm_backward(
        dy, x, (N,), mean_t, rstd_t, w, b, [True, True, True]))

    ref = layer_norm_bwd_triton(dy, x, w, mean, rstd)
    sweep = []
    block_ms = sorted({_blocks(N)[0], 16, 32})  # rows per loop iteration: _blocks's, 16, 32
    for programs, warps, block_m in itertools.product((256, 512, 1024, 2048, 4096), (4, 8), block_ms):
        if block_m * N > 16384 and block_m != _blocks(N)[0]:  # at most 16K values per tile
            continue
        got = layer_norm_bwd_triton(dy, x, w, mean, rstd, programs=programs, num_warps=warps, block_m=block_m)
        # the same arithmetic in another order (tile shape, partials): rounding only
        for a, r in zip(got, ref):
            torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-2)
        ms = graph_ms(lambda: layer_norm_bwd_triton(dy, x, w, mean, rstd, programs=programs, num_warps=warps,
                                                    block_m=block_m))
        sweep.append({"programs": programs, "num_warps": warps, "block_m": block_m, "bwd_ms": ms,
                      "tb_s": 3 * io / ms / 1e9})
    default = next(s for s in sweep if (s["programs"], s["num_warps"], s["block_m"]) == bwd_launch(N))
    rows["bwd_ms"] = default["bwd_ms"]
    rows["best_bwd"] = min(sweep, key=lambda s: s["bwd_ms"])
    rows["sweep"] = sweep
    rows["fwd_tb_s"] = 2 * io / rows["fwd_ms"] / 1e9
    rows["bwd_tb_s"] = 3 * io / rows["bwd_ms"] / 1e9
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_tb_s = 2 * COPY_BYTES / copy_ms(20) / 1e9  # read + write
    print(f"{torch.cuda.get_device_name()}: device copy {copy_tb_s:.2f} TB/s (read + write)")
    results = {"device": torch.cuda.get_device_name(), "copy_tb_s": copy_tb_s, "shapes": []}
    print("| shape | fwd us (TB/s) | torch fwd us | bwd us (TB/s) | torch bwd us "
          "| best bwd: programs, warps, rows | us (TB/s) |")
    print("|---|---|---|---|---|---|---|")
    for M, N in SHAPES:
        r = bench_shape(M, N)
        results["shapes"].append(r)
        best = r["best_bwd"]
        print(f"| {M} x {N} | {r['fwd_ms'] * 1e3:.1f} ({r['fwd_tb_s']:.2f}) | {r['torch_fwd_ms'] * 1e3:.1f} | "
              f"{r['bwd_ms'] * 1e3:.1f} ({r['bwd_tb_s']:.2f}) | {r['torch_bwd_ms'] * 1e3:.1f} | "
              f"{best['programs']}, {best['num_warps']}, {best['block_m'] or 'default'} | "
              f"{best['bwd_ms'] * 1e3:.1f} ({best['tb_s']:.2f}) |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
