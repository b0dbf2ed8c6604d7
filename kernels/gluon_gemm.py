"""The row-grouped GEMM's plain case for Hopper in Gluon: sorted rows in and out, no gather, scatter,
scale or epilogue; warp-specialised and persistent, full tiles stored by the tensor-memory unit
while the next tile multiplies.

    y_SH = grouped_gemm_gluon(wact_SF, w2_EFH, offsets_E1)   # the layer's down projection, top-k > 1

y[s] = a[s] @ w[e] for the sorted rows s of expert e, bf16 in and out, fp32 sums: what
kernels/grouped.py's ``grouped_gemm`` computes without its options. With
``MEGATRON_MOE_GLUON_GEMM=1`` (kernels/switches.py; off by default until measured in the layer)
``grouped_gemm`` sends the calls this kernel takes here (:func:`supported`) and the rest to its
Triton kernel; its plain-PyTorch ``grouped_gemm_reference`` is the reference of both.

One program per SM walks output tiles (128 sorted rows of one expert x 256 columns, columns
fastest); the tiles are listed on the device (:func:`_tile_table`: per 128-row tile its expert,
first row and the expert's end; torch ops, no host read). A producer warp issues the TMA loads of
a three-slot ring, a's 128 rows and w's 64 x 256 block per step; two MMA warpgroups multiply with
one asynchronous ``warpgroup_mma`` in flight. A tile whose rows are all its expert's is stored by
TMA through shared memory and waited for only before the buffer's next use; an expert's last,
partial tile by masked stores from registers (a TMA store would write the next expert's rows).
Rows a tile reads past its expert's end multiply into output rows that are not stored.

Measured on an H200 as a prototype whose compiled instructions are this kernel's
(docs/performance.md, "A Gluon down projection"): 1.09-1.26x the Triton kernel at the layer's
down projections. Takes bf16 a with 16-byte aligned rows (row stride a
multiple of 16), contiguous w [E, K, N] with K a multiple of 64 (a step never reads another
expert's w) and N of 16. Gluon does not run under the interpreter: on the CPU the kernel is only
compiled (tests/kernels/_compile_sm90.py); tests/kernels/test_gluon_gemm.py runs it on a GPU.
"""
from __future__ import annotations

import functools

import torch
import triton

from . import switches
from ._gluon import (TensorDescriptor, available, barrier, fence_async_shared, gl, gluon, maxnreg, mbarrier, num_sms,
                     on_sm90, rows_ok, tma, tma_load, tma_store, warpgroup_mma, warpgroup_mma_wait)

BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, NUM_WARPS = 128, 256, 64, 3, 8

if gluon is not None:
    # ------------------------------------------------------------------------------------------
    # Kernel
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _my_tiles(num_m_ptr, N, BLOCK_N: gl.constexpr):
        """This program's tiles t = pid, pid + nprog, ... of num_m x tiles_n (columns fastest)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        total = gl.load(num_m_ptr) * tiles_n
        return pid, nprog, tiles_n, gl.cdiv(gl.maximum(total - pid, 0), nprog)

    @gluon.jit
    def _tile_mn(t, tiles_n, BLOCK_N: gl.constexpr):
        """Tile t's 128-row tile (an index into the tile list) and first column."""
        return t // tiles_n, (t % tiles_n) * BLOCK_N

    @gluon.jit
    def _producer(a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars,
                  K, N, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr):
        """Per tile, per step of BLOCK_K: wait for a free slot, TMA a's rows and w's block into it."""
        pid, nprog, tiles_n, my_tiles = _my_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        count = 0
        for i in range(my_tiles):
            m, n0 = _tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            e = gl.load(tile_e_ptr + m)
            row0 = gl.load(tile_row_ptr + m)
            for kk in range(k_steps):
                slot = count % NUM_BUF
                mbarrier.wait(empty_bars.index(slot), ((count // NUM_BUF) & 1) ^ 1)  # the first pass finds it free
                bar = ready_bars.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma_load(a_desc, [row0, kk * BLOCK_K], bar, a_bufs.index(slot))
                tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(slot))  # w as [E * K, N]
                count += 1

    @gluon.jit
    def _consumer(out_ptr, out_desc, out_smem, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars,
                  empty_bars, K, N, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The MMAs (one in flight; the slot of the step before freed) and each tile's store."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        pid, nprog, tiles_n, my_tiles = _my_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        count = 0
        for i in range(my_tiles):
            m, n0 = _tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            row0 = gl.load(tile_row_ptr + m)
            row_end = gl.load(tile_end_ptr + m)  # the expert's end: rows from it on are another's
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(k_steps):
                slot = count % NUM_BUF
                mbarrier.wait(ready_bars.index(slot), (count // NUM_BUF) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot), acc, use_acc=kk > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                barrier()  # both warpgroups', before the one arrival
                mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=kk > 0)
                count += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
            vals = acc.to(gl.bfloat16)
            if row0 + BLOCK_M <= row_end:  # every row this expert's: TMA, left running
                tma.store_wait(0)  # the last such store has read the buffer
                out_smem.store(vals)
                fence_async_shared()
                tma_store(out_desc, [row0, n0], out_smem)
            else:  # the expert's last tile: its rows only
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
                gl.store(ptrs, vals, mask=(rows < row_end)[:, None] & (cols < N)[None, :])
        tma.store_wait(0)

    @gluon.jit
    def _grouped_gemm_gluon_kernel(a_desc, w_desc, out_desc, out_ptr, tile_e_ptr, tile_row_ptr, tile_end_ptr,
                                   num_m_ptr, K, N, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                   BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
        out_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; TMA's bytes complete it
            mbarrier.init(empty_bars.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (out_ptr, out_desc, out_smem, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs,
                         ready_bars, empty_bars, K, N, stride_om, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, NUM_WARPS)),
            (_producer, (a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars,
                         K, N, BLOCK_N, BLOCK_K, NUM_BUF)),
        ], [1], [40])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def supported(a_MK, w_EKN, offsets_E1, *, gather_S=None, scatter_S=None, scale_S=None, activation=None,
              act_scale_S=None, out_dtype=None) -> bool:
    """Whether ``grouped_gemm`` with these arguments runs here: bf16 a and contiguous w [E, K, N]
    without gather, scatter, scale or epilogue, a bf16 result, K a multiple of 64 and N of 16, on
    an sm_90 GPU, Gluon available, the switch on (MEGATRON_MOE_GLUON_GEMM=1)."""
    if not (switches.gluon_gemm() and available()):
        return False
    if any(x is not None for x in (gather_S, scatter_S, scale_S, activation, act_scale_S)):
        return False
    if a_MK.dtype != torch.bfloat16 or w_EKN.dtype != torch.bfloat16 or (out_dtype or a_MK.dtype) != torch.bfloat16:
        return False
    if a_MK.dim() != 2 or w_EKN.dim() != 3 or offsets_E1.dim() != 1:  # grouped_gemm's checks say what is wrong
        return False
    if offsets_E1.shape[0] != w_EKN.shape[0] + 1 or w_EKN.shape[0] == 0:
        return False
    S, K = a_MK.shape
    N = w_EKN.shape[2]
    if min(S, K, N) == 0 or K % BLOCK_K or N % 16 or not w_EKN.is_contiguous() or w_EKN.data_ptr() % 16:
        return False
    return rows_ok(a_MK) and on_sm90(a_MK)


def _tile_table(offsets_E1, max_rows):
    """Per 128-row tile (each expert's from its first row, experts in order): its expert, first
    row and the expert's end, over a bound of cdiv(S, BLOCK_M) + E tiles; and the number of tiles,
    a one-element tensor. Torch ops on the device: no host read."""
    E = offsets_E1.shape[0] - 1
    bounds = offsets_E1.long()
    m_tiles = (bounds[1:] - bounds[:-1] + BLOCK_M - 1) // BLOCK_M
    ends = torch.cumsum(m_tiles, 0)  # each expert's tiles end here
    tile = torch.arange(triton.cdiv(max_rows, BLOCK_M) + E, device=offsets_E1.device)
    tile_e = torch.searchsorted(ends, tile, right=True).clamp_max(E - 1)  # past the last tile: unused
    tile_row = bounds[tile_e] + (tile - (ends - m_tiles)[tile_e]) * BLOCK_M
    return (tile_e.to(torch.int32), tile_row.to(torch.int32), bounds[tile_e + 1].to(torch.int32),
            ends[-1:].to(torch.int32))


@functools.lru_cache(maxsize=None)
def _layouts():
    lay = gl.NVMMASharedLayout.get_default_for
    return (lay([BLOCK_M, BLOCK_K], gl.bfloat16), lay([BLOCK_K, BLOCK_N], gl.bfloat16),
            lay([BLOCK_M, BLOCK_N], gl.bfloat16))


def grouped_gemm_gluon(a_MK, w_EKN, offsets_E1):
    """y [S, N] bf16: y[s] = a[s] @ w[e] for the sorted rows of expert e (rows past
    offsets_E1[-1] are not written); within what :func:`supported` takes (checked there)."""
    S, K = a_MK.shape
    E, _, N = w_EKN.shape
    out = torch.empty(S, N, device=a_MK.device, dtype=torch.bfloat16)
    tile_e, tile_row, tile_end, num_m = _tile_table(offsets_E1, S)
    a_layout, w_layout, out_layout = _layouts()
    a_desc = TensorDescriptor(a_MK, [S, K], [a_MK.stride(0), 1], [BLOCK_M, BLOCK_K], a_layout)
    w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N], w_layout)
    out_desc = TensorDescriptor(out, [S, N], [N, 1], [BLOCK_M, BLOCK_N], out_layout)
    _grouped_gemm_gluon_kernel[(num_sms(a_MK.device),)](
        a_desc, w_desc, out_desc, out, tile_e, tile_row, tile_end, num_m, K, N, out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NUM_BUF=NUM_BUF, NUM_WARPS=NUM_WARPS,
        num_warps=NUM_WARPS, maxnreg=maxnreg(NUM_WARPS, 1))
    return out
