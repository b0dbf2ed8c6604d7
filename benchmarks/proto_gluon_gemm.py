"""Prototype: the row-grouped GEMM without a gather in Gluon, the structure of
kernels/gluon_wgrad.py (issue #35; not used by the layer).

    python benchmarks/proto_gluon_gemm.py --compile-only   # compile for sm_90 without a GPU
    python benchmarks/proto_gluon_gemm.py                  # GPU: check, then time against ours and CUTLASS

y[s] = a[s] @ w[e] for sorted rows s of expert e, bf16 in and out: the layer's down projection
(wact @ w2[e]) and, with ``w_transposed``, its input gradient before the sum over k
(dpre @ w1[e]ᵀ, w1 [E, N, K]). Both have contiguous sorted rows, so every load is TMA's. At
qwen3 the down projection took 0.767 ms against SonicMoE's 0.582 (docs/performance.md): its
reduction is short (K = 768: 12 steps of 64), so the store after each tile weighs, as it did for
the weight gradient.

One program per SM walks output tiles (128 sorted rows of one expert x 256 columns); a producer
warp issues the TMA loads of a three-slot ring (a's rows and w's block per step), two MMA
warpgroups multiply. A tile of full rows is stored by TMA through shared memory, waited for only
before the buffer's next use; an expert's last, partial tile by masked stores from registers
(a TMA store would write the next expert's rows). The tiles are listed on the device: per
128-row tile its expert and first row (``tile_table``, torch ops, no host sync).
"""
from __future__ import annotations

import argparse
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, NUM_WARPS = 128, 256, 64, 3, 8

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _my_tiles(num_m_ptr, N, BLOCK_N: gl.constexpr):
    """This program's tiles t = pid, pid + nprog, ... of num_m x tiles_n (columns fastest)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    total = gl.load(num_m_ptr) * tiles_n
    return pid, nprog, tiles_n, gl.cdiv(gl.maximum(total - pid, 0), nprog)


@gluon.jit
def _producer(a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars, K, N,
              W_TRANSPOSED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              NUM_BUF: gl.constexpr):
    """Per tile, per step of BLOCK_K: wait for a free slot, TMA a's rows and w's block into it."""
    pid, nprog, tiles_n, my_tiles = _my_tiles(num_m_ptr, N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for i in range(my_tiles):
        t = pid + i * nprog
        m = t // tiles_n
        n0 = (t % tiles_n) * BLOCK_N
        e = gl.load(tile_e_ptr + m)
        row0 = gl.load(tile_row_ptr + m)
        for kk in range(k_steps):
            slot = count % NUM_BUF
            mbarrier.wait(empty_bars.index(slot), ((count // NUM_BUF) & 1) ^ 1)
            bar = ready_bars.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [row0, kk * BLOCK_K], bar, a_bufs.index(slot))
            if W_TRANSPOSED:  # w [E, N, K]: rows e * N + n0 .., columns k
                _tma_load(w_desc, [e * N + n0, kk * BLOCK_K], bar, w_bufs.index(slot))
            else:  # w [E, K, N]: rows e * K + k .., columns n0 ..
                _tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(out_ptr, out_desc, out_smem, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs,
              ready_bars, empty_bars, K, N, stride_om,
              W_TRANSPOSED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The MMAs (one in flight) and each tile's store."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    pid, nprog, tiles_n, my_tiles = _my_tiles(num_m_ptr, N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for i in range(my_tiles):
        t = pid + i * nprog
        m = t // tiles_n
        n0 = (t % tiles_n) * BLOCK_N
        row0 = gl.load(tile_row_ptr + m)
        row_end = gl.load(tile_end_ptr + m)  # the expert's end: rows from it on are another's
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            slot = count % NUM_BUF
            mbarrier.wait(ready_bars.index(slot), (count // NUM_BUF) & 1)
            if W_TRANSPOSED:
                w_t = w_bufs.index(slot).permute((1, 0))  # [BLOCK_K, BLOCK_N], K contiguous
            else:
                w_t = w_bufs.index(slot)
            acc = warpgroup_mma(a_bufs.index(slot), w_t, acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            _barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=kk > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
        vals = acc.to(gl.bfloat16)
        if row0 + BLOCK_M <= row_end:  # every row this expert's: TMA, left running
            tma.store_wait(0)
            out_smem.store(vals)
            fence_async_shared()
            _tma_store(out_desc, [row0, n0], out_smem)
        else:  # the expert's last tile: its rows only
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.store(ptrs, vals, mask=(rows < row_end)[:, None] & (cols < N)[None, :])
    tma.store_wait(0)


@gluon.jit
def _gemm_kernel(a_desc, w_desc, out_desc, out_ptr, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, K, N,
                 stride_om, W_TRANSPOSED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (out_ptr, out_desc, out_smem, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs,
                     ready_bars, empty_bars, K, N, stride_om, W_TRANSPOSED, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF,
                     NUM_WARPS)),
        (_producer, (a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars,
                     K, N, W_TRANSPOSED, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF)),
    ], [1], [40])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _tables(offsets_E1, max_rows, block_m=BLOCK_M):
    """Per 128-row tile (each expert's from its first row, experts in order): its expert, first
    row and the expert's end, over a bound of cdiv(S, block_m) + E tiles; and the number of tiles,
    on the device (torch ops, no host read)."""
    import torch

    E = offsets_E1.shape[0] - 1
    counts = (offsets_E1[1:] - offsets_E1[:-1]).long()
    m_tiles = (counts + block_m - 1) // block_m
    size = triton.cdiv(max_rows, block_m) + E  # a bound on the tiles, known without a host read
    ends = torch.cumsum(m_tiles, 0)  # each expert's tiles end here
    first = ends - m_tiles
    idx = torch.arange(size, device=offsets_E1.device)
    tile_e = torch.searchsorted(ends, idx, right=True).clamp_max(E - 1)  # past the last tile: unused
    tile_row = offsets_E1[:-1].long()[tile_e] + (idx - first[tile_e]) * block_m
    tile_end = offsets_E1[1:].long()[tile_e]
    num_m = m_tiles.sum().to(torch.int32).reshape(1)
    return tile_e.to(torch.int32), tile_row.to(torch.int32), tile_end.to(torch.int32), num_m


def gemm_gluon(a_SK, w, offsets_E1, *, w_transposed=False, num_sms=None):
    """y_SN = a[s] @ w[e] (w [E, K, N]; with ``w_transposed`` w [E, N, K], y = a @ w[e]ᵀ), bf16."""
    import torch

    S, K = a_SK.shape
    E = w.shape[0]
    N = w.shape[1] if w_transposed else w.shape[2]
    out = torch.empty(S, N, device=a_SK.device, dtype=torch.bfloat16)
    tile_e, tile_row, tile_end, num_m = _tables(offsets_E1, S)
    lay = gl.NVMMASharedLayout.get_default_for
    a_desc = TensorDescriptor(a_SK, [S, K], [a_SK.stride(0), 1], [BLOCK_M, BLOCK_K],
                              lay([BLOCK_M, BLOCK_K], gl.bfloat16))
    if w_transposed:
        w_desc = TensorDescriptor(w, [E * N, K], [K, 1], [BLOCK_N, BLOCK_K], lay([BLOCK_N, BLOCK_K], gl.bfloat16))
    else:
        w_desc = TensorDescriptor(w, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N], lay([BLOCK_K, BLOCK_N], gl.bfloat16))
    out_desc = TensorDescriptor(out, [S, N], [N, 1], [BLOCK_M, BLOCK_N], lay([BLOCK_M, BLOCK_N], gl.bfloat16))
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a_SK.device).multi_processor_count
    maxnreg = min(256, 65536 // (32 * (NUM_WARPS + 4))) // 8 * 8  # the worker's warp rounds up to a warpgroup
    _gemm_kernel[(num_sms,)](a_desc, w_desc, out_desc, out, tile_e, tile_row, tile_end, num_m, K, N, out.stride(0),
                             W_TRANSPOSED=w_transposed, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             NUM_BUF=NUM_BUF, NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS, maxnreg=maxnreg)
    return out


def reference(a_SK, w, offsets_E1, *, w_transposed=False):
    """fp32 products of the bf16 inputs, per expert, in float64."""
    import torch

    bounds = offsets_E1.tolist()
    N = w.shape[1] if w_transposed else w.shape[2]
    out = torch.zeros(a_SK.shape[0], N, dtype=torch.float64, device=a_SK.device)
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        we = w[e].t() if w_transposed else w[e]
        out[lo:hi] = (a_SK[lo:hi].float() @ we.float()).double()
    return out


# ----------------------------------------------------------------------------------------------
# Compile check, GPU check and timing
# ----------------------------------------------------------------------------------------------


def compile_only() -> None:
    """Compile both variants for sm_90 on CPU tensors, without a GPU (a launch made a compile)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, ".")
    from megatron_moe.kernels.tuning import _CompileOnly

    driver.set_active(_CompileOnly(0, GPUTarget("cuda", 90, 32)))
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        print(f"compiled {self.fn.__name__} W_TRANSPOSED={kwargs.get('W_TRANSPOSED')}: shared memory "
              f"{k.metadata.shared} B", flush=True)
        return k

    JITFunction.run = compile_launch
    offsets = torch.tensor([0, 100, 100, 256], dtype=torch.int32)
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    gemm_gluon(a, torch.zeros(3, 128, 512, dtype=torch.bfloat16), offsets, num_sms=132)
    gemm_gluon(a, torch.zeros(3, 512, 128, dtype=torch.bfloat16), offsets, w_transposed=True, num_sms=132)


def check(device) -> None:
    import torch

    torch.manual_seed(0)
    cases = [  # rows, K, N, rows per expert
        (300, 128, 256, [0, 100, 0, 200]),      # empty experts, partial tiles
        (256, 192, 512, [256, 0, 0]),           # all rows to one expert, K not a multiple of 128
        (1000, 768, 768, [130, 1, 63, 64, 65, 677]),
        (4 * 128, 256, 256, [128] * 4),         # every tile full
    ]
    for S, K, N, counts in cases:
        offsets = torch.tensor([0] + counts, device=device).cumsum(0).to(torch.int32)
        a = torch.randn(S, K, device=device).to(torch.bfloat16)
        for wt in (False, True):
            w = torch.randn(len(counts), N, K, device=device).to(torch.bfloat16) if wt else \
                torch.randn(len(counts), K, N, device=device).to(torch.bfloat16)
            got = gemm_gluon(a, w, offsets, w_transposed=wt)
            want = reference(a, w, offsets, w_transposed=wt)
            err = (got.double() - want).abs()
            ok = bool((err <= want.abs() * 2.0 ** -8 + 1e-4 * want.abs().max()).all())
            print(f"check S={S} K={K} N={N} experts={counts} transposed={wt}: max err {err.max().item():.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                raise SystemExit(1)


def bench(device) -> None:
    import torch
    import triton.testing

    sys.path.insert(0, ".")
    from megatron_moe.kernels.grouped import grouped_gemm_triton

    shapes = {  # name: (rows, E, K, N, transposed): down = wact @ w2[e]; dx = dpre @ w1[e]ᵀ
        "qwen3 down": (131072, 128, 768, 2048, False), "qwen3 dx": (131072, 128, 1536, 2048, True),
        "olmoe down": (131072, 64, 1024, 2048, False), "olmoe dx": (131072, 64, 2048, 2048, True),
        "sonic-1536 down": (262144, 128, 256, 1536, False),
    }
    print(f"{'shape':<16} {'gluon ms':>9} {'triton ms':>10} {'cutlass ms':>11} {'gluon TF/s':>11} {'triton TF/s':>12}")
    for name, (S, E, K, N, wt) in shapes.items():
        offsets = torch.arange(0, S + 1, S // E, device=device, dtype=torch.int32)
        a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16) if wt else \
            torch.randn(E, K, N, device=device, dtype=torch.bfloat16)
        w_kn = w.transpose(1, 2) if wt else w
        flops = 2 * S * K * N
        g = triton.testing.do_bench(lambda: gemm_gluon(a, w, offsets, w_transposed=wt))
        o = triton.testing.do_bench(lambda: grouped_gemm_triton(a, w_kn, offsets))
        c = triton.testing.do_bench(lambda: torch._grouped_mm(a, w_kn, offs=offsets[1:]))
        print(f"{name:<16} {g:9.3f} {o:10.3f} {c:11.3f} {flops / g / 1e9:11.0f} {flops / o / 1e9:12.0f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check", action="store_true", help="only the check against the reference")
    args = ap.parse_args(argv)
    if args.compile_only:
        compile_only()
        return
    import torch

    device = torch.device("cuda")
    check(device)
    if not args.check:
        bench(device)


if __name__ == "__main__":
    main()
