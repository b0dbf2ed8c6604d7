"""Experiment (issue #5): does a TMA-fed grouped GEMM beat our pointer-load kernel on Hopper?

    python benchmarks/proto_tma.py                       # H100/H200; prints a table
    python benchmarks/proto_tma.py --configs paper-moe-m/fwd1 paper-moe-m/fwd2

A row-grouped GEMM out[s] = a[s] @ w[e(s)] over sorted rows (no gather, no scatter): the shape of
fwd2 and, with the rows gathered up front, fwd1. Tensor descriptors are made in the kernel per
launch (a over [S, K], w over [E*K, N]); a tile's rows past its expert's end are read from the
next expert and masked at the store. Variants: one program per tile, persistent (one per SM),
persistent with warp specialisation. Against: kernels.grouped.grouped_gemm on the same rows,
torch._grouped_mm, and the extra cost of gathering the rows first (index_select).
"""
from __future__ import annotations

import argparse
import itertools
import torch
import triton
import triton.language as tl

from megatron_moe.kernels.grouped import _expert_tiles, _tile_coords, grouped_gemm

CONFIGS = {  # tokens*top_k rows, K, N, experts
    "paper-moe-m/fwd1": (16384, 1024, 4096, 64),
    "paper-moe-m/fwd2": (16384, 4096, 1024, 64),
    "fine-64e/fwd1": (65536, 2048, 1024, 64),
    "fine-64e/fwd2": (65536, 1024, 2048, 64),
    "mixtral/fwd1": (16384, 4096, 14336, 8),
}


@triton.jit
def _tma_grouped_kernel(a_ptr, w_ptr, out_ptr, offsets_ptr, S, K, N, E, stride_om,
                        BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PERSISTENT: tl.constexpr, WS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[S, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    e_idx, tiles_E, tiles_cum_E = _expert_tiles(offsets_ptr, E, BLOCK_E, BLOCK_M)
    num_tiles = tl.sum(tiles_E, axis=0) * num_tiles_n
    if PERSISTENT:
        start, step = pid, tl.num_programs(0)
    else:
        start, step = pid, num_tiles + 1  # one tile, or none past the end
    for tile in tl.range(start, num_tiles, step, flatten=True, warp_specialize=WS):
        expert, row0, seg_end, pid_n = _tile_coords(tile, tiles_cum_E, tiles_E, e_idx, offsets_ptr,
                                                    num_tiles_n, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            w = w_desc.load([expert * K + k0, pid_n * BLOCK_N])
            acc = tl.dot(a, w, acc)
        offs_s = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_s < seg_end)[:, None] & (offs_n < N)[None, :]
        tl.store(out_ptr + offs_s[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def tma_grouped(a_SK, w_EKN, offsets_E1, cfg):
    BM, BN, BK, warps, stages, persistent, ws = cfg
    S, K = a_SK.shape
    E, _, N = w_EKN.shape
    out = torch.empty(S, N, device=a_SK.device, dtype=a_SK.dtype)
    sms = torch.cuda.get_device_properties(a_SK.device).multi_processor_count
    max_tiles = (triton.cdiv(S, BM) + E) * triton.cdiv(N, BN)
    grid = (min(sms * persistent, max_tiles),) if persistent else (max_tiles,)
    _tma_grouped_kernel[grid](a_SK, w_EKN, out, offsets_E1, S, K, N, E, out.stride(0),
                              BLOCK_E=triton.next_power_of_2(E), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                              PERSISTENT=persistent, WS=ws, num_warps=warps, num_stages=stages)
    return out


def tma_configs():
    out = []
    for (bm, bn, bk, warps), stages, (persistent, ws) in itertools.product(
            [(128, 128, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8)], [3, 4],
            [(0, False), (1, False), (1, True), (2, True)]):
        out.append((bm, bn, bk, warps, stages, persistent, ws))
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = ap.parse_args(argv)
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    rows = []
    for name in args.configs:
        S, K, N, E = CONFIGS[name]
        a = torch.randn(S, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        ids = torch.randint(0, E, (S,), device="cuda")
        counts = torch.bincount(ids, minlength=E)
        offsets = torch.zeros(E + 1, device="cuda", dtype=torch.int32)
        offsets[1:] = torch.cumsum(counts, 0)
        flop = 2.0 * S * K * N
        ref = grouped_gemm(a, w, offsets)
        t_ours = bench(lambda: grouped_gemm(a, w, offsets))
        t_tgm = bench(lambda: torch._grouped_mm(a, w, offs=offsets[1:]))
        perm = torch.randperm(S, device="cuda")
        t_gather = bench(lambda: a.index_select(0, perm))
        best = None
        for cfg in tma_configs():
            try:
                out = tma_grouped(a, w, offsets, cfg)
                err = (out.float() - ref.float()).abs().max().item()
                if err > 0.05:
                    print(f"{name} {cfg}: wrong (max err {err:.3g})", flush=True)
                    continue
                t = bench(lambda: tma_grouped(a, w, offsets, cfg))
            except Exception as exc:  # noqa: BLE001 - an experiment: report and go on
                print(f"{name} {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            print(f"{name} {cfg}: {t:.3f} ms {flop / t / 1e9:.0f} TFLOP/s", flush=True)
            if best is None or t < best[0]:
                best = (t, cfg)
        rows.append((name, t_ours, t_tgm, t_gather, best))
    print(f"\n{'GEMM':<18} {'ours ms':>8} {'TF/s':>5} {'tgm ms':>8} {'TF/s':>5} {'TMA ms':>8} {'TF/s':>5} "
          f"{'gather ms':>9}  best TMA config (BM, BN, BK, warps, stages, persistent, ws)")
    for name, t_ours, t_tgm, t_gather, best in rows:
        S, K, N, E = CONFIGS[name]
        flop = 2.0 * S * K * N
        tb, cb = best if best else (float("nan"), None)
        print(f"{name:<18} {t_ours:8.3f} {flop / t_ours / 1e9:5.0f} {t_tgm:8.3f} {flop / t_tgm / 1e9:5.0f} "
              f"{tb:8.3f} {flop / tb / 1e9:5.0f} {t_gather:9.3f}  {cb}")


if __name__ == "__main__":
    main()
