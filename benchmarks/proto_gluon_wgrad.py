"""Prototype: the grouped weight gradient in Gluon, its next tile's loads in flight during the
epilogue (issue #35; not used by the layer).

    python benchmarks/proto_gluon_wgrad.py --compile-only   # compile for sm_90 without a GPU (Triton 3.6)
    python benchmarks/proto_gluon_wgrad.py --check          # GPU: against the plain-PyTorch reference
    python benchmarks/proto_gluon_wgrad.py                  # GPU: check, then time against ours and CUTLASS

dw[e] = a[gather_a(s)]ᵀ b[gather_b(s)] over expert e's rows s (offsets), as
kernels/grouped.py's ``_grouped_wgrad_kernel``. The layer's weight gradients trail SonicMoE's by
1.36-1.46x (docs/performance.md, "SonicMoE measured beside our layer"): each expert has 1-2
thousand rows, so each output tile is 16-32 steps of 64 rows, and our Triton kernel pays the
pipeline's fill and the store on every tile. Here one persistent program per SM walks its tiles
with one ring of shared-memory buffers filled by ``cp.async`` (the rows are gathered, which
Hopper's TMA cannot do). The ring runs across tile boundaries: the next tile's first row blocks
load while this tile's last MMAs finish and its epilogue stores. The MMAs are asynchronous
``warpgroup_mma`` with one in flight. One warpgroup per program (4 warps).

Gluon kernels do not run under Triton's interpreter: this is tested on a GPU only. Written for
Triton 3.6, the GPU machines' (Gluon's API moves between releases: 3.9, the CPU tests', renames
the cp.async copy and drops ``thread_barrier``); ``--compile-only`` needs 3.6 too.
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _tile_kn(t, tiles_e, tiles_n):
    """Tile t's expert and its (k, n) tile indices."""
    r = t % tiles_e
    return t // tiles_e, r // tiles_n, r % tiles_n


@gluon.jit
def _segment(e, offsets_ptr):
    """Expert e's rows (loads: their values are used one tile later, so the loads are in flight
    meanwhile)."""
    return gl.load(offsets_ptr + e), gl.load(offsets_ptr + e + 1)


@gluon.jit
def _steps(seg_start, seg_end, BLOCK_S: gl.constexpr):
    """Row blocks of a tile: at least one (an expert without rows still writes its zeros)."""
    return gl.maximum(gl.cdiv(seg_end - seg_start, BLOCK_S), 1)


@gluon.jit
def _block_rows(s0, seg_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr,
                BLOCK_S: gl.constexpr, layout: gl.constexpr):
    """The source rows of sorted rows s0 .. s0 + BLOCK_S for a and b, and which are before
    seg_end; the gathers are loads whose values the next producer step uses."""
    rows = s0 + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, layout))
    mask = rows < seg_end
    rows_a = rows
    rows_b = rows
    if HAS_GATHER_A:
        rows_a = gl.load(gather_a_ptr + rows, mask=mask, other=0)
    if HAS_GATHER_B:
        rows_b = gl.load(gather_b_ptr + rows, mask=mask, other=0)
    return rows_a, rows_b, mask


@gluon.jit
def _copy_rows(buf, ptr, rows, mask_s, stride_m, col0, cols_total, BLOCK_C: gl.constexpr, layout: gl.constexpr):
    """cp.async of ``rows`` (those in mask_s; the rest zero-filled), columns col0 .. col0 + BLOCK_C,
    into ``buf``."""
    cols = col0 + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
    ptrs = ptr + rows.to(gl.int64)[:, None] * stride_m + cols[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, mask_s[:, None] & (cols < cols_total)[None, :])


@gluon.jit
def _store_tile(acc, out_ptr, t, tiles_e, tiles_n, K, N, stride_oe, stride_ok, ACCUMULATE: gl.constexpr,
                BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, acc_layout: gl.constexpr):
    """Tile t's sum into out[e] (added to it when ACCUMULATE), straight from the MMA's registers."""
    e, pk, pn = _tile_kn(t, tiles_e, tiles_n)
    offs_k = pk * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, acc_layout))
    offs_n = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    ptrs = out_ptr + e.to(gl.int64) * stride_oe + offs_k.to(gl.int64)[:, None] * stride_ok + offs_n[None, :]
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    if ACCUMULATE:
        acc += gl.load(ptrs, mask=mask, other=0.0)
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _issue(state, slot, my_tiles, pid, nprog, last_tile, tiles_e, tiles_n,
           a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs,
           K, N, stride_am, stride_bm,
           HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr,
           BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, load_layout: gl.constexpr):
    """The producer: the block whose rows ``state`` holds into ring slot ``slot`` (nothing once
    the tiles are done), then the next block's rows and, at a new tile, the offsets of the tile
    after it: one step ahead, so no step waits on its own index loads. One commit group either
    way, so the consumer's group count holds."""
    p_i, p_s, p_start, p_end, nx_start, nx_end, rows_a, rows_b, mask = state
    if p_i < my_tiles:
        _, pk, pn = _tile_kn(pid + p_i * nprog, tiles_e, tiles_n)
        _copy_rows(a_bufs.index(slot), a_ptr, rows_a, mask, stride_am, pk * BLOCK_K, K, BLOCK_K, load_layout)
        _copy_rows(b_bufs.index(slot), b_ptr, rows_b, mask, stride_bm, pn * BLOCK_N, N, BLOCK_N, load_layout)
        p_s += 1
        if p_s == _steps(p_start, p_end, BLOCK_S):
            p_s = 0
            p_i += 1
            p_start = nx_start
            p_end = nx_end
            e_after, _, _ = _tile_kn(gl.minimum(pid + (p_i + 1) * nprog, last_tile), tiles_e, tiles_n)
            nx_start, nx_end = _segment(e_after, offsets_ptr)
        rows_a, rows_b, mask = _block_rows(p_start + p_s * BLOCK_S, p_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A,
                                           HAS_GATHER_B, BLOCK_S, load_layout)
    async_copy.commit_group()
    return p_i, p_s, p_start, p_end, nx_start, nx_end, rows_a, rows_b, mask


@gluon.jit
def _wgrad_gluon_kernel(
    a_ptr, b_ptr, out_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr,
    E, K, N, stride_am, stride_bm, stride_oe, stride_ok,
    HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, ACCUMULATE: gl.constexpr,
    BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    gl.static_assert(NUM_BUF >= 3, "the MMA in flight, the one before it and a slot being filled")
    # cp.async layout of both operands: 8 contiguous bf16 (16 bytes) per thread along the rows
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_K], gl.bfloat16)
    b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_N], gl.bfloat16)
    # one warpgroup per 64 rows of the tile (NUM_WARPS = 8: two warpgroups share the tile's rows)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    # the producer runs LEAD row blocks ahead of the MMAs; it fills the slot of the MMA two blocks
    # back, which every warp has seen complete once all have passed this block's barrier
    LEAD: gl.constexpr = NUM_BUF - 2

    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_S, BLOCK_K], a_smem)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_S, BLOCK_N], b_smem)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_e = gl.cdiv(K, BLOCK_K) * tiles_n
    my_tiles = gl.cdiv(E * tiles_e - pid, nprog)
    last_tile = E * tiles_e - 1

    # producer state: its tile and block, the tile's rows, the next tile's, the block's source rows
    e0, _, _ = _tile_kn(pid, tiles_e, tiles_n)
    seg_start, seg_end = _segment(e0, offsets_ptr)
    e1, _, _ = _tile_kn(gl.minimum(pid + nprog, last_tile), tiles_e, tiles_n)
    nx_start, nx_end = _segment(e1, offsets_ptr)
    rows_a, rows_b, mask = _block_rows(seg_start, seg_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A, HAS_GATHER_B,
                                       BLOCK_S, load_layout)
    state = (0, 0, seg_start, seg_end, nx_start, nx_end, rows_a, rows_b, mask)
    for j in gl.static_range(LEAD):
        state = _issue(state, j, my_tiles, pid, nprog, last_tile, tiles_e, tiles_n, a_ptr, b_ptr, gather_a_ptr,
                       gather_b_ptr, offsets_ptr, a_bufs, b_bufs, K, N, stride_am, stride_bm, HAS_GATHER_A,
                       HAS_GATHER_B, BLOCK_K, BLOCK_N, BLOCK_S, load_layout)
    count = 0  # row blocks consumed
    c_i = 0
    c_s = 0
    c_steps = _steps(seg_start, seg_end, BLOCK_S)
    c_nx_start = nx_start  # the consumer's next tile's rows, loaded a tile ahead
    c_nx_end = nx_end
    acc = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
    while c_i < my_tiles:
        # groups committed: LEAD + count, one per block; block `count` is the oldest LEAD - 1 may pass
        async_copy.wait_group(LEAD - 1)  # this thread's copies of block `count` have landed
        gl.thread_barrier()  # ... and every thread's; every warp is past the last block's MMA wait
        fence_async_shared()  # visible to the tensor cores' reads
        slot = count % NUM_BUF
        a_t = a_bufs.index(slot).permute((1, 0))  # [BLOCK_K, BLOCK_S]
        acc = warpgroup_mma(a_t, b_bufs.index(slot), acc, use_acc=c_s > 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])  # the MMA before this one is done
        state = _issue(state, (count + LEAD) % NUM_BUF, my_tiles, pid, nprog, last_tile, tiles_e, tiles_n, a_ptr,
                       b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, K, N, stride_am, stride_bm,
                       HAS_GATHER_A, HAS_GATHER_B, BLOCK_K, BLOCK_N, BLOCK_S, load_layout)
        count += 1
        c_s += 1
        if c_s == c_steps:  # the tile's last block: its sum out while the next tile's first blocks load
            acc = warpgroup_mma_wait(0, deps=[acc])
            _store_tile(acc, out_ptr, pid + c_i * nprog, tiles_e, tiles_n, K, N, stride_oe, stride_ok, ACCUMULATE,
                        BLOCK_K, BLOCK_N, acc_layout)
            c_s = 0
            c_i += 1
            c_steps = _steps(c_nx_start, c_nx_end, BLOCK_S)
            e_after, _, _ = _tile_kn(gl.minimum(pid + (c_i + 1) * nprog, last_tile), tiles_e, tiles_n)
            c_nx_start, c_nx_end = _segment(e_after, offsets_ptr)
    async_copy.wait_group(0)


# ----------------------------------------------------------------------------------------------
# Kernel, warp-specialised: a producer warpgroup fills the ring, the MMA warps only wait and multiply
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _ws_producer(a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars,
                 E, K, N, stride_am, stride_bm,
                 HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, BLOCK_K: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """Every row block of this program's tiles into the ring: wait for its slot to be free, cp.async
    its rows (the next block's source rows and the next tile's offsets already loading), and have
    each thread arrive on the slot's ready barrier once its copies land."""
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_e = gl.cdiv(K, BLOCK_K) * tiles_n
    my_tiles = gl.cdiv(E * tiles_e - pid, nprog)
    last_tile = E * tiles_e - 1
    e0, _, _ = _tile_kn(pid, tiles_e, tiles_n)
    p_start, p_end = _segment(e0, offsets_ptr)
    e1, _, _ = _tile_kn(gl.minimum(pid + nprog, last_tile), tiles_e, tiles_n)
    nx_start, nx_end = _segment(e1, offsets_ptr)
    rows_a, rows_b, mask = _block_rows(p_start, p_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A, HAS_GATHER_B,
                                       BLOCK_S, load_layout)
    p_i = 0
    p_s = 0
    count = 0
    while p_i < my_tiles:
        slot = count % NUM_BUF
        mbarrier.wait(empty_bars.index(slot), ((count // NUM_BUF) & 1) ^ 1)  # the first pass finds it free
        _, pk, pn = _tile_kn(pid + p_i * nprog, tiles_e, tiles_n)
        _copy_rows(a_bufs.index(slot), a_ptr, rows_a, mask, stride_am, pk * BLOCK_K, K, BLOCK_K, load_layout)
        _copy_rows(b_bufs.index(slot), b_ptr, rows_b, mask, stride_bm, pn * BLOCK_N, N, BLOCK_N, load_layout)
        async_copy.mbarrier_arrive(ready_bars.index(slot), increment_count=False)
        count += 1
        p_s += 1
        if p_s == _steps(p_start, p_end, BLOCK_S):
            p_s = 0
            p_i += 1
            p_start = nx_start
            p_end = nx_end
            e_after, _, _ = _tile_kn(gl.minimum(pid + (p_i + 1) * nprog, last_tile), tiles_e, tiles_n)
            nx_start, nx_end = _segment(e_after, offsets_ptr)
        rows_a, rows_b, mask = _block_rows(p_start + p_s * BLOCK_S, p_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A,
                                           HAS_GATHER_B, BLOCK_S, load_layout)


@gluon.jit
def _ws_consumer(out_ptr, out_desc, out_smem, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars, E, K, N,
                 stride_oe, stride_ok, ACCUMULATE: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr, WARPS_N: gl.constexpr,
                 EPILOGUE: gl.constexpr):
    """The MMAs: per row block, wait for its slot, multiply (one MMA in flight), free the slot of
    the block before; per tile, the sum out while the producer keeps loading. EPILOGUE 0: stored
    from registers; 1: through shared memory by a TMA store that runs on during the next tile's
    MMAs (out bf16 [E * K, N], K a multiple of BLOCK_K); 2: not stored (a diagnosis: wrong results)."""
    # WARPS_N = 1: each warpgroup 64 rows of the tile, all its columns; 2: 128 rows, half the columns
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[NUM_WARPS // WARPS_N, WARPS_N],
                                                         instr_shape=[16, BLOCK_N // WARPS_N, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_e = gl.cdiv(K, BLOCK_K) * tiles_n
    my_tiles = gl.cdiv(E * tiles_e - pid, nprog)
    last_tile = E * tiles_e - 1
    e0, _, _ = _tile_kn(pid, tiles_e, tiles_n)
    seg_start, seg_end = _segment(e0, offsets_ptr)
    c_steps = _steps(seg_start, seg_end, BLOCK_S)
    e1, _, _ = _tile_kn(gl.minimum(pid + nprog, last_tile), tiles_e, tiles_n)
    nx_start, nx_end = _segment(e1, offsets_ptr)
    acc = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
    count = 0
    c_i = 0
    c_s = 0
    while c_i < my_tiles:
        slot = count % NUM_BUF
        mbarrier.wait(ready_bars.index(slot), (count // NUM_BUF) & 1)
        fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores' reads
        a_t = a_bufs.index(slot).permute((1, 0))  # [BLOCK_K, BLOCK_S]
        acc = warpgroup_mma(a_t, b_bufs.index(slot), acc, use_acc=c_s > 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])  # the block before is multiplied: its slot is free
        gl.thread_barrier()  # every warpgroup's, before the one arrival
        mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=c_s > 0)
        count += 1
        c_s += 1
        if c_s == c_steps:
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
            if EPILOGUE == 0:
                _store_tile(acc, out_ptr, pid + c_i * nprog, tiles_e, tiles_n, K, N, stride_oe, stride_ok,
                            ACCUMULATE, BLOCK_K, BLOCK_N, acc_layout)
            elif EPILOGUE == 1:
                e, pk, pn = _tile_kn(pid + c_i * nprog, tiles_e, tiles_n)
                tma.store_wait(0)  # the last tile's store has read the buffer
                out_smem.store(acc.to(out_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [e * K + pk * BLOCK_K, pn * BLOCK_N], out_smem)
            c_s = 0
            c_i += 1
            c_steps = _steps(nx_start, nx_end, BLOCK_S)
            e_after, _, _ = _tile_kn(gl.minimum(pid + (c_i + 1) * nprog, last_tile), tiles_e, tiles_n)
            nx_start, nx_end = _segment(e_after, offsets_ptr)
    if EPILOGUE == 1:
        tma.store_wait(0)


@gluon.jit
def _wgrad_ws_kernel(
    a_ptr, b_ptr, out_ptr, out_desc, gather_a_ptr, gather_b_ptr, offsets_ptr,
    E, K, N, stride_am, stride_bm, stride_oe, stride_ok,
    HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, ACCUMULATE: gl.constexpr,
    BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
    NUM_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, WARPS_N: gl.constexpr,
    EPILOGUE: gl.constexpr,
):
    a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_K], gl.bfloat16)
    b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_N], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_S, BLOCK_K], a_smem)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_S, BLOCK_N], b_smem)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    if EPILOGUE == 1:
        out_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    else:
        out_smem = a_bufs  # unused
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready_bars.index(i), count=PRODUCER_WARPS * 32)  # each producer thread's copies
        mbarrier.init(empty_bars.index(i), count=1)
    gl.warp_specialize([
        (_ws_consumer, (out_ptr, out_desc, out_smem, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars, E, K, N,
                        stride_oe, stride_ok, ACCUMULATE, BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF, NUM_WARPS, WARPS_N,
                        EPILOGUE)),
        (_ws_producer, (a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars,
                        empty_bars, E, K, N, stride_am, stride_bm, HAS_GATHER_A, HAS_GATHER_B, BLOCK_K, BLOCK_N,
                        BLOCK_S, NUM_BUF, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

class Config(NamedTuple):
    block_k: int = 128  # output tile rows (a's columns)
    block_n: int = 256  # output tile columns (b's columns)
    block_s: int = 64  # rows summed per MMA step
    num_buf: int = 4  # ring slots
    num_warps: int = 8  # the MMAs' warps (warpgroups of 4)
    ws: bool = True  # warp-specialised (a producer warpgroup besides); else one partition
    warps_n: int = 1  # warpgroups side by side along the tile's columns (ws only)
    epilogue: str = "regs"  # "regs", "tma" (bf16 out, K a multiple of block_k, else regs), "none" (diagnosis)


# the variants compiled and timed; the first is the default
CONFIGS = [
    Config(num_buf=3, epilogue="tma"),
    Config(epilogue="regs"),
    Config(num_buf=3, epilogue="regs"),
    Config(block_k=256, block_n=128, num_buf=3, epilogue="tma"),
    Config(epilogue="none"),
    Config(ws=False),
]
PRODUCER_WARPS, PRODUCER_REGS = 4, 80
_EPILOGUES = {"regs": 0, "tma": 1, "none": 2}


def _launch_options(num_warps, ws):
    """num_warps and the register cap: a warp-specialised kernel has the producer's warps besides,
    and 64K registers per SM to share."""
    if not ws:
        return dict(num_warps=num_warps)
    total = num_warps + PRODUCER_WARPS
    return dict(num_warps=num_warps, maxnreg=min(256, 65536 // (32 * total)) // 8 * 8)


def _out_desc(out, K, cfg, use_tma):
    """The TMA store's descriptor: out as [E * K, N] when the TMA epilogue runs, else a stand-in."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [cfg.block_k, cfg.block_n]
    if not use_tma:
        out = torch.empty(block, device=out.device, dtype=torch.bfloat16)
    dtype = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float32
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor.from_tensor(out.reshape(-1, out.shape[-1]), block, layout)


def wgrad_gluon(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, out=None, accumulate=False,
                out_dtype=None, config=CONFIGS[0]):
    """dw[e] = a[gather_a(s)]ᵀ b[gather_b(s)] over expert e's rows, bf16 inputs; ``out`` [E, K, N]
    (row-major), added to when ``accumulate``."""
    import torch

    cfg = config
    E = offsets_E1.shape[0] - 1
    K, N = a_MK.shape[1], b_MN.shape[1]
    assert a_MK.dtype == b_MN.dtype == torch.bfloat16 and a_MK.stride(1) == 1 and b_MN.stride(1) == 1
    if out is None:
        out = torch.empty(E, K, N, device=a_MK.device, dtype=out_dtype or a_MK.dtype)
    assert out.is_contiguous()
    tiles = E * triton.cdiv(K, cfg.block_k) * triton.cdiv(N, cfg.block_n)
    if tiles == 0:
        return out
    sms = torch.cuda.get_device_properties(a_MK.device).multi_processor_count
    dummy = offsets_E1
    epilogue = _EPILOGUES[cfg.epilogue]
    if epilogue == 1 and not (out.dtype == torch.bfloat16 and not accumulate and K % cfg.block_k == 0
                              and N % 8 == 0):
        epilogue = 0
    const = dict(HAS_GATHER_A=gather_a_S is not None, HAS_GATHER_B=gather_b_S is not None,
                 ACCUMULATE=bool(accumulate), BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
                 NUM_BUF=cfg.num_buf, NUM_WARPS=cfg.num_warps)
    ptrs = (gather_a_S if gather_a_S is not None else dummy, gather_b_S if gather_b_S is not None else dummy,
            offsets_E1)
    sizes = (E, K, N, a_MK.stride(0), b_MN.stride(0), out.stride(0), out.stride(1))
    if cfg.ws:
        const.update(PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS, WARPS_N=cfg.warps_n,
                     EPILOGUE=epilogue)
        args = (a_MK, b_MN, out, _out_desc(out, K, cfg, epilogue == 1), *ptrs, *sizes)
        kernel = _wgrad_ws_kernel
    else:
        args = (a_MK, b_MN, out, *ptrs, *sizes)
        kernel = _wgrad_gluon_kernel
    kernel[(min(tiles, sms),)](*args, **const, **_launch_options(cfg.num_warps, cfg.ws))
    return out


# ----------------------------------------------------------------------------------------------
# Compile check, GPU check and timing
# ----------------------------------------------------------------------------------------------


def compile_only(dump=None) -> None:
    """Compile every variant for sm_90 without a GPU; prints each one's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    variants = [(cfg, out_ty, ga, gb, acc) for cfg in CONFIGS for out_ty in ("*fp32", "*bf16")
                for ga, gb, acc in ((True, False, False), (False, True, True), (False, False, False))
                if not (acc and out_ty != "*fp32")]
    for cfg, out_ty, ga, gb, acc in variants:
        epilogue = _EPILOGUES[cfg.epilogue]
        if epilogue == 1 and (out_ty != "*bf16" or acc):
            epilogue = 0
        names = ["a_ptr", "b_ptr", "out_ptr"] + (["out_desc"] if cfg.ws else []) + [
            "gather_a_ptr", "gather_b_ptr", "offsets_ptr", "E", "K", "N", "stride_am", "stride_bm", "stride_oe",
            "stride_ok"]
        types = ["*bf16", "*bf16", out_ty] + ([_desc_type(cfg, out_ty if epilogue == 1 else "*bf16")]
                                              if cfg.ws else []) + ["*i32", "*i32", "*i32"] + ["i32"] * 7
        sig = dict(zip(names, types))
        const = dict(HAS_GATHER_A=ga, HAS_GATHER_B=gb, ACCUMULATE=acc, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
                     BLOCK_S=cfg.block_s, NUM_BUF=cfg.num_buf, NUM_WARPS=cfg.num_warps)
        if cfg.ws:
            const.update(PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS, WARPS_N=cfg.warps_n,
                         EPILOGUE=epilogue)
        sig.update({k: "constexpr" for k in const})
        # what a launch's specialisation gives: 16-byte aligned pointers, sizes and strides
        # divisible by 16
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in ("E", "out_desc")}
        kernel = _wgrad_ws_kernel if cfg.ws else _wgrad_gluon_kernel
        src = GluonASTSource(kernel, sig, constexprs={(list(sig).index(k),): v for k, v in const.items()},
                             attrs=aligned)
        k = triton.compile(src, target=target, options=_launch_options(cfg.num_warps, cfg.ws))
        if dump:
            open(dump, "w").write(k.asm["ptx"])
            dump = None
        print(f"compiled {tuple(cfg)} out={out_ty} gather_a={ga} gather_b={gb} accumulate={acc} "
              f"epilogue={epilogue}: shared memory {k.metadata.shared} B", flush=True)


def _desc_type(cfg, out_ty):
    """The signature string of the TMA store's descriptor, from a stand-in tensor (no GPU needed)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    class _Dtype:
        is_floating_point = True

        def __str__(self):
            return "torch.bfloat16" if out_ty == "*bf16" else "torch.float32"

    class _Base:
        dtype = _Dtype()

        def data_ptr(self):
            return 1 << 20

    block = [cfg.block_k, cfg.block_n]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if out_ty == "*bf16" else gl.float32)
    return mangle_type(TensorDescriptor(_Base(), [4096, 4096], [4096, 1], block, layout))


def check(device) -> None:
    """Against kernels/grouped.py's plain-PyTorch reference (fp32 products of the bf16 inputs,
    returned in float64): empty experts, all rows to one expert, sizes not multiples of the tiles,
    gathers on either side, accumulation into fp32."""
    import torch

    sys.path.insert(0, ".")
    from megatron_moe.kernels.grouped import grouped_wgrad_reference

    torch.manual_seed(0)
    cases = [  # rows, K, N, expert counts
        (300, 192, 160, [0, 100, 0, 200]),          # empty experts, partial row blocks and tiles
        (256, 128, 128, [256, 0, 0]),               # all rows to one expert
        (1000, 256, 384, [130, 1, 63, 64, 65, 677]),
        (0, 128, 128, [0, 0]),                      # no rows: zeros
    ]
    for S, K, N, counts in cases:
        offsets = torch.tensor([0] + counts, device=device).cumsum(0).to(torch.int32)
        a_all = torch.randn(S + 7, K, device=device).to(torch.bfloat16)
        b = torch.randn(S, N, device=device).to(torch.bfloat16)
        ga = torch.randperm(S + 7, device=device)[:S].to(torch.int32)
        gb = torch.randperm(S, device=device).to(torch.int32)
        for cfg in [c for c in CONFIGS if c.epilogue != "none"]:
            for kw in (dict(gather_a_S=ga), dict(gather_b_S=gb), dict(gather_a_S=ga, gather_b_S=gb)):
                a = a_all if "gather_a_S" in kw else a_all[:S]  # without a gather a has exactly S rows
                want = grouped_wgrad_reference(a, b, offsets, out_dtype=torch.float64, **kw)
                got = wgrad_gluon(a, b, offsets, out_dtype=torch.float32, config=cfg, **kw)
                err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                start = torch.randn_like(got)
                acc = wgrad_gluon(a, b, offsets, out=start.clone(), accumulate=True, config=cfg, **kw)
                err_acc = ((acc.double() - want - start.double()).abs().max().item()
                           / max(want.abs().max().item(), 1))
                bf = wgrad_gluon(a, b, offsets, config=cfg, **kw)
                err_bf = (bf.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                ok = err < 1e-4 and err_acc < 1e-4 and err_bf < 1e-2
                print(f"check {cfg} S={S} K={K} N={N} experts={counts} {sorted(kw)}: rel err fp32 {err:.1e}, "
                      f"accumulating {err_acc:.1e}, bf16 {err_bf:.1e} {'ok' if ok else 'FAIL'}", flush=True)
                if not ok:
                    raise SystemExit(1)


def bench(device) -> None:
    """The layer's weight-gradient shapes: this kernel against ours (autotuned) and CUDA's
    grouped GEMM over pre-sorted rows (no gather), bf16 out; ms and TFLOP/s."""
    import torch
    import triton.testing

    from megatron_moe.kernels.grouped import grouped_wgrad_triton

    shapes = {  # name: (tokens x top-k rows, E, K, N): dw1 = x[t]ᵀ dpre, dw2 = actᵀ dy[t]
        "qwen3 dw1": (131072, 128, 2048, 1536), "qwen3 dw2": (131072, 128, 768, 2048),
        "olmoe dw1": (131072, 64, 2048, 2048), "olmoe dw2": (131072, 64, 1024, 2048),
        "dmoe-small dw1": (65536, 64, 768, 3072), "dmoe-small dw2": (65536, 64, 3072, 768),
    }
    rows = []
    for name, (S, E, K, N) in shapes.items():
        counts = torch.full((E,), S // E, device=device)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(S, N, device=device, dtype=torch.bfloat16)
        gather = torch.randperm(S, device=device).to(torch.int32)
        flops = 2 * S * K * N
        o = triton.testing.do_bench(lambda: grouped_wgrad_triton(a, b, offsets, gather_a_S=gather), warmup=25,
                                    rep=200)
        c = triton.testing.do_bench(lambda: torch._grouped_mm(a.t(), b, offs=offsets[1:]), warmup=25, rep=200)
        g = {}
        for cfg in CONFIGS:
            g[cfg] = triton.testing.do_bench(lambda: wgrad_gluon(a, b, offsets, gather_a_S=gather, config=cfg),
                                             warmup=25, rep=200)
            print(f"{name} {cfg}: {g[cfg]:.3f} ms, {flops / g[cfg] / 1e9:.0f} TFLOP/s", flush=True)
        best = min(g, key=g.get)
        rows.append((name, g[best], best, o, c, flops))
    print(f"{'shape':<16} {'gluon ms':>9} {'ours ms':>8} {'cutlass ms':>10} {'gluon TF/s':>10} {'ours TF/s':>9}  best")
    for name, gb, best, o, c, flops in rows:
        print(f"{name:<16} {gb:9.3f} {o:8.3f} {c:10.3f} {flops / gb / 1e9:10.1f} {flops / o / 1e9:9.1f}  {best}")


def diag(device) -> None:
    """Where the time goes at qwen3 dw1 (K 2048, N 1536, 131072 rows): per-tile costs (8 experts:
    16x longer tiles than 128) and the gather (without: sorted rows)."""
    import torch
    import triton.testing

    from megatron_moe.kernels.grouped import grouped_wgrad_triton

    S, K, N = 131072, 2048, 1536
    a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(S, N, device=device, dtype=torch.bfloat16)
    flops = 2 * S * K * N
    for E in (128, 8):
        counts = torch.full((E,), S // E, device=device)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        for gather in (torch.randperm(S, device=device).to(torch.int32), None):
            tag = f"E={E:<3} {'gather' if gather is not None else 'sorted'}"
            o = triton.testing.do_bench(lambda: grouped_wgrad_triton(a, b, offsets, gather_a_S=gather), warmup=25,
                                        rep=200)
            c = triton.testing.do_bench(lambda: torch._grouped_mm(a.t(), b, offs=offsets[1:]), warmup=25, rep=200)
            print(f"diag {tag} ours {o:.3f} ms ({flops / o / 1e9:.0f} TF/s), cutlass (sorted) {c:.3f} ms "
                  f"({flops / c / 1e9:.0f})", flush=True)
            for cfg in CONFIGS:
                g = triton.testing.do_bench(lambda: wgrad_gluon(a, b, offsets, gather_a_S=gather, config=cfg),
                                            warmup=25, rep=200)
                print(f"diag {tag} {cfg}: {g:.3f} ms ({flops / g / 1e9:.0f} TF/s)", flush=True)


def once(device) -> None:
    """One launch of each kernel at qwen3 dw1 after a warm-up, for a profiler."""
    import torch

    from megatron_moe.kernels.grouped import grouped_wgrad_triton

    S, E, K, N = 131072, 128, 2048, 1536
    counts = torch.full((E,), S // E, device=device)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(S, N, device=device, dtype=torch.bfloat16)
    gather = torch.randperm(S, device=device).to(torch.int32)
    runs = [lambda: wgrad_gluon(a, b, offsets, gather_a_S=gather),
            lambda: grouped_wgrad_triton(a, b, offsets, gather_a_S=gather),
            lambda: torch._grouped_mm(a.t(), b, offs=offsets[1:])]
    for run in runs:  # compiled and tuned before the profiler starts (ncu --profile-from-start off)
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check", action="store_true", help="only the check against the reference")
    ap.add_argument("--diag", action="store_true", help="per-tile and gather costs at one shape")
    ap.add_argument("--once", action="store_true", help="one launch of each kernel, for a profiler")
    ap.add_argument("--dump-ptx", help="with --compile-only: the first variant's PTX into this file")
    args = ap.parse_args(argv)
    if args.compile_only:
        compile_only(args.dump_ptx)
        return
    import torch

    device = torch.device("cuda")
    if args.once:
        once(device)
        return
    if args.diag:
        diag(device)
        return
    check(device)
    if not args.check:
        bench(device)


if __name__ == "__main__":
    main()
