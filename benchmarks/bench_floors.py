"""The floors under the expert GEMMs on one GPU, from rates measured on it: tensor-core FLOPs (a
large dense bf16 matmul), bytes out of L2 into the SMs (a read kernel over an L2-resident buffer),
and HBM bytes (bench_adamw.py's 2 GB device copy); then, for bench_gluon.py's shapes, each floor
in ms beside the times bench_gluon measured.

    python benchmarks/bench_gluon.py --out gluon.json
    python benchmarks/bench_floors.py --gluon gluon.json --out floors.json

Why L2: the Gluon kernels (kernels/gluon_wgrad.py, kernels/gluon_gemm.py) compute 128 x 256
output tiles, one per SM at a time, and load both operands' blocks of every tile from L2 (a
gathered operand by ``cp.async``, the rest by TMA; Triton 3.6 has no TMA multicast across a
cluster, so no two SMs share a load). A tile of the weight gradient dw[e] (128 of a's columns x
256 of b's) reads expert e's n_e rows of both: n_e (128 + 256) 2 bytes; a row tile of a grouped
GEMM (128 rows x 256 columns) reads 128 K + 256 K bf16. Summed over the tiles this is several
times the tensors' size (each operand block is read once per tile along the other dimension).
The L2 floor is that sum over the L2 read rate; the HBM floor the tensors read once and the
output written once over the copy's rate (its reads and writes); the MMA floor 2 S K N over the
dense matmul's rate.

L2 read rate: a persistent Triton kernel, 4 programs per SM, each summing 32 KB blocks of a
buffer of W bytes (loads with ``.cg``: L2, not L1), the blocks visited round-robin until
READ_BYTES are read; W from 4 MB (L2-resident on an H100 or H200, whose L2 is 50 MB) to 1 GB
(HBM). Median of ``triton.testing.do_bench``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adamw import COPY_BYTES, copy_ms  # noqa: E402
from bench_gluon import GEMM_SHAPES, WGRAD_SHAPES  # noqa: E402

from megatron_moe.kernels import gluon_gemm, gluon_wgrad  # noqa: E402

WORKING_SETS_MB = (4, 8, 16, 24, 32, 48, 1024)
READ_BYTES = 2 ** 33  # 8 GB read per measurement
BLOCK = 16384  # bf16 elements per block: 32 KB
MATMUL = 8192  # the dense matmul's M = N = K
# the Gluon kernels' output tiles (wgrad: a's columns x b's; the SwiGLU GEMM: two halves of columns)
TILE_ROWS, TILE_COLS = gluon_wgrad.BLOCK_K, gluon_wgrad.BLOCK_N
assert (gluon_gemm.BLOCK_M, gluon_gemm.BLOCK_N, 2 * gluon_gemm.HALF_N) == (TILE_ROWS, TILE_COLS, TILE_COLS), \
    "the floors assume one tile shape for all the Gluon kernels"


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_blocks, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(iters):
        blk = (pid + i * nprog) % n_blocks
        acc += tl.load(x_ptr + blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def l2_read_tbs(working_set_bytes: int) -> float:
    """TB/s of reads over a buffer of working_set_bytes, READ_BYTES in all."""
    n_blocks = working_set_bytes // (2 * BLOCK)
    x = torch.randn(n_blocks * BLOCK, device="cuda", dtype=torch.bfloat16)
    nprog = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    iters = READ_BYTES // (2 * BLOCK * nprog)
    out = torch.empty(nprog, device="cuda", dtype=torch.float32)

    def run():
        _read_kernel[(nprog,)](x, out, n_blocks, iters, BLOCK=BLOCK, num_warps=8)

    ms = triton.testing.do_bench(run, warmup=50, rep=300)
    return nprog * iters * 2 * BLOCK / ms / 1e9


def matmul_tflops() -> float:
    a = torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500)
    return 2 * MATMUL ** 3 / ms / 1e9


def copy_tbs() -> float:
    """bench_adamw's 2 GB device copy: TB/s of its reads and writes."""
    return 2 * COPY_BYTES / copy_ms(50) / 1e9


def traffic(kind: str, S: int, E: int, K: int, N: int, T: int = 0, act=None) -> dict:
    """FLOPs, bytes into the SMs out of L2, and HBM bytes (each tensor once) of one call at equal
    rows per expert (bench_gluon's shapes)."""
    n_e = S // E
    tiles_n = -(-N // TILE_COLS)
    if kind == "wgrad":  # dw[E, K, N] = a[S, K]ᵀ b[S, N] per expert
        l2 = E * (K // TILE_ROWS) * sum(n_e * (TILE_ROWS + min(TILE_COLS, N - j * TILE_COLS)) * 2
                                       for j in range(tiles_n))
        hbm = (S * K + S * N + E * K * N) * 2
    else:  # out[S, N] = a[S, K] @ w[e][K, N]: per 128-row tile, its rows and w's K x 256 blocks
        m_tiles = E * -(-n_e // TILE_ROWS)
        l2 = m_tiles * sum((TILE_ROWS * K + K * min(TILE_COLS, N - j * TILE_COLS)) * 2 for j in range(tiles_n))
        out = S * N + (S * N // 2 if act == "swiglu" else 0)  # swiglu: the pre-activation and the product
        hbm = ((T or S) * K + E * K * N + out) * 2
    return dict(flops=2 * S * K * N, l2_bytes=l2, hbm_bytes=hbm)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gluon", help="bench_gluon.py's JSON: its times beside the floors")
    ap.add_argument("--out", help="write the rates and rows as JSON here")
    args = ap.parse_args(argv)

    rates = dict(l2_tbs={}, matmul_tflops=matmul_tflops(), copy_tbs=copy_tbs())
    for mb in WORKING_SETS_MB:
        rates["l2_tbs"][mb] = l2_read_tbs(mb * 2 ** 20)
    print(f"dense bf16 matmul {MATMUL}^3: {rates['matmul_tflops']:.0f} TFLOP/s; "
          f"2 GB copy: {rates['copy_tbs']:.2f} TB/s (read + write)")
    print("reads over a working set of " + ", ".join(f"{mb} MB {v:.2f}" for mb, v in rates["l2_tbs"].items())
          + " TB/s")
    l2 = max(v for mb, v in rates["l2_tbs"].items() if mb <= 32)

    measured = {}
    if args.gluon:
        measured = {r["shape"]: r["ms"] for r in json.load(open(args.gluon))}
    shapes = [("wgrad", name, S, E, K, N, 0, None) for name, (S, E, K, N, _) in WGRAD_SHAPES.items()]
    shapes += [("gemm", name, S, E, K, N, T, act) for name, (S, E, K, N, T, act) in GEMM_SHAPES.items()]
    rows = []
    print(f"{'shape':<16} {'L2 GB':>6} {'MMA ms':>7} {'L2 ms':>6} {'HBM ms':>7} {'gluon ms':>9} "
          f"{'cutlass ms':>11} {'gluon L2 TB/s':>14}")
    for kind, name, S, E, K, N, T, act in shapes:
        t = traffic(kind, S, E, K, N, T, act)
        floors = dict(mma=t["flops"] / rates["matmul_tflops"] / 1e9, l2=t["l2_bytes"] / l2 / 1e9,
                      hbm=t["hbm_bytes"] / rates["copy_tbs"] / 1e9)  # reads + writes, as the copy's rate
        ms = measured.get(name, {})
        row = dict(kind=kind, shape=name, **t, floors_ms=floors, measured_ms=ms)
        rows.append(row)
        g, c = ms.get("gluon"), ms.get("cutlass")
        print(f"{name:<16} {t['l2_bytes'] / 1e9:6.2f} {floors['mma']:7.3f} {floors['l2']:6.3f} {floors['hbm']:7.3f} "
              f"{g if g is not None else float('nan'):9.3f} {c if c is not None else float('nan'):11.3f} "
              f"{t['l2_bytes'] / g / 1e9 if g else float('nan'):14.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rates=rates, l2_floor_tbs=l2, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
