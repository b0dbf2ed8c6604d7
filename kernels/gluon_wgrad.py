"""The grouped weight gradient for Hopper in Gluon (Triton's lower-level language): warp-specialised
and persistent, its output tiles stored by the tensor-memory unit while the next tile multiplies.

    dw_EKN = grouped_wgrad_gluon(x_TK, dpre_SN, offsets_E1, gather_a_S=token_S)   # dw1 of the layer
    dw_EKN = grouped_wgrad_gluon(wact_SK, dy_TN, offsets_E1, gather_b_S=token_S)  # dw2

    grouped_wgrad_gluon(x_TK, dpre_SN, offsets_E1, gather_a_S=token_S, out=master_grad_EKN,
                        accumulate=True)                                    # the trainer's: out += dw1

dw[e] = Σ_{s in e} a[ga(s)]ᵀ · b[gb(s)], bf16 in, fp32 sums; out bf16, or fp32 written or added
into a given tensor (the trainer's master gradients: a step's first micro-batch writes them, the
rest add): what kernels/grouped.py's ``grouped_wgrad`` computes without its scale or activation
prologue. ``grouped_wgrad`` sends the calls this kernel takes here (:func:`supported`, and the
switches ``MEGATRON_MOE_GLUON_WGRAD`` and ``MEGATRON_MOE_GLUON_WGRAD_FP32``, kernels/switches.py)
and the rest to its Triton kernel; its plain-PyTorch ``grouped_wgrad_reference`` is the reference
of both.

One program per SM walks output tiles t = pid, pid + #SMs, ... (tile = expert, 128 rows of a's
columns, 256 of b's). Two partitions share a ring of three shared-memory slots, each one block of
64 sorted rows of both operands:
  producer (4 warps): per block, wait for a free slot, ``cp.async`` the block's rows (gathered:
      Hopper's TMA cannot gather rows) with the rows past the expert's end zero-filled, and arrive
      on the slot's ready barrier when the copies land. One 64-bit address per row, the columns
      constant offsets from it; the tile's columns and step count worked out once per tile. It
      loads the next block's gather indices and the next tile's row range a step ahead.
  consumer (8 warps, two warpgroups of 64 tile rows): per block, wait for the slot, one
      asynchronous ``warpgroup_mma`` (one in flight), free the slot of the block before; per tile,
      bf16: the sum into a shared-memory tile and out by a TMA store that runs on during the next
      tile's MMAs (waited for only before the buffer is written again); fp32: straight from the
      registers, 8-byte stores or relaxed atomic adds (``red.global.add.v2.f32``: one per element
      and tile, so out + dw rounded once, as TMA's reduce-add; PTX's fp32 atomic add flushes
      subnormal results to zero), which no one waits for. An added tile's lines are first
      prefetched into L2 (``cp.async.bulk.prefetch``, one half-row a consumer thread) four row
      blocks before its last MMA (MEGATRON_MOE_WGRAD_ADD), so its adds find them there: 1.11-1.17x
      at 256 rows an expert, 1.00-1.03x at 1,024 (prefetched as the tile starts, 0.9x there; H100,
      docs/performance.md, "The fp32 weight gradient's adds prefetched into L2"). A tile's steps
      run in loops of their own (two, split where the prefetch goes): with the epilogue behind a
      branch in the same loop, ptxas waited for every MMA before the next (its note C7517;
      tests/kernels/test_compile_hopper.py checks for such notes).
An expert without rows runs one all-masked block: its tiles get exact zeros.

Measured on an H200 (docs/performance.md, "A Gluon weight gradient" and "The weight gradient's
MMAs drained at every step"): 1.17-1.32x the Triton kernel as first written, and since 2026-12-03
1.04-1.14x that. Takes bf16 a, b with unit column stride and 16-byte aligned rows, K a multiple
of 128 (a tile never spans two experts in the [E * K, N] view the store describes), N and the
row strides multiples of 16. Written against Triton 3.6's Gluon; the names Triton 3.9 renamed
are looked up either way (kernels/_gluon.py). Gluon does not run under the interpreter: on the
CPU the kernel is only compiled (tests/kernels/_compile_sm90.py); tests/kernels/test_gluon_wgrad.py
runs it on a GPU.
"""
from __future__ import annotations

import functools

import torch

from . import switches
from ._common import cdiv
from ._gluon import (TensorDescriptor, async_copy, async_load, available, barrier, fence_async_shared, gl, gluon,
                     maxnreg, mbarrier, num_sms, on_sm90, rows_ok, tma, tma_store, warpgroup_mma, warpgroup_mma_wait)
from .launcher import launch

BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF = 128, 256, 64, 3
NUM_WARPS, PRODUCER_WARPS, PRODUCER_REGS = 8, 4, 80


if gluon is not None:
    # ------------------------------------------------------------------------------------------
    # Kernel
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _tile_kn(t, tiles_e, tiles_n):
        """Tile t's expert and its (k, n) tile indices."""
        r = t % tiles_e
        return t // tiles_e, r // tiles_n, r % tiles_n

    @gluon.jit
    def _segment(e, offsets_ptr):
        """Expert e's rows (loads: used a tile later, so in flight meanwhile)."""
        return gl.load(offsets_ptr + e), gl.load(offsets_ptr + e + 1)

    @gluon.jit
    def _steps(seg_start, seg_end, BLOCK_S: gl.constexpr):
        """Row blocks of a tile: at least one (an expert without rows still writes its zeros)."""
        return gl.maximum(gl.cdiv(seg_end - seg_start, BLOCK_S), 1)

    @gluon.jit
    def _schedule(E, K, N, offsets_ptr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr):
        """This program's share of the E * tiles_e tiles (t = pid, pid + nprog, ...), and the rows
        of its first two tiles' experts (the second clamped to the last tile)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        tiles_e = gl.cdiv(K, BLOCK_K) * tiles_n
        last_tile = E * tiles_e - 1
        e0, _, _ = _tile_kn(pid, tiles_e, tiles_n)
        start, end = _segment(e0, offsets_ptr)
        e1, _, _ = _tile_kn(gl.minimum(pid + nprog, last_tile), tiles_e, tiles_n)
        nx_start, nx_end = _segment(e1, offsets_ptr)
        return pid, nprog, tiles_e, tiles_n, gl.cdiv(E * tiles_e - pid, nprog), last_tile, start, end, nx_start, nx_end

    @gluon.jit
    def _block_rows(s0, seg_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A: gl.constexpr,
                    HAS_GATHER_B: gl.constexpr, BLOCK_S: gl.constexpr, layout: gl.constexpr):
        """The source rows of a and b for sorted rows s0 .. s0 + BLOCK_S, and which are before
        seg_end (the gathers are loads the next producer step uses)."""
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
    def _copy_rows(buf, ptr, rows, mask_s, stride_m, col0, cols_total, BLOCK_C: gl.constexpr, EVEN: gl.constexpr,
                   layout: gl.constexpr):
        """cp.async of ``rows`` (those in mask_s; the rest zero-filled), columns col0 .. col0 +
        BLOCK_C, into ``buf``. One 64-bit address per row, the columns constant offsets from it;
        the columns are checked against cols_total only where the tile may pass it (not EVEN)."""
        row_ptrs = ptr + col0 + rows.to(gl.int64) * stride_m
        cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
        ptrs = row_ptrs[:, None] + cols[None, :]
        if EVEN:
            async_load(buf, ptrs, mask_s[:, None])
        else:
            async_load(buf, ptrs, mask_s[:, None] & (col0 + cols < cols_total)[None, :])

    @gluon.jit
    def _producer(a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars,
                  E, K, N, stride_am, stride_bm,
                  HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, EVEN_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
                  PRODUCER_WARPS: gl.constexpr):
        """Every row block of this program's tiles into the ring. What changes per tile (its
        columns, its step count) is worked out once per tile, not per step."""
        # 8 contiguous bf16 (16 bytes, one cp.async) per thread along a row
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        pid, nprog, tiles_e, tiles_n, my_tiles, last_tile, p_start, p_end, nx_start, nx_end = _schedule(
            E, K, N, offsets_ptr, BLOCK_K, BLOCK_N)
        _, pk, pn = _tile_kn(pid, tiles_e, tiles_n)
        p_steps = _steps(p_start, p_end, BLOCK_S)
        rows_a, rows_b, mask = _block_rows(p_start, p_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A,
                                           HAS_GATHER_B, BLOCK_S, load_layout)
        p_i = 0
        p_s = 0
        count = 0
        while p_i < my_tiles:
            slot = count % NUM_BUF
            mbarrier.wait(empty_bars.index(slot), ((count // NUM_BUF) & 1) ^ 1)  # the first pass finds it free
            _copy_rows(a_bufs.index(slot), a_ptr, rows_a, mask, stride_am, pk * BLOCK_K, K, BLOCK_K, True,
                       load_layout)  # K % BLOCK_K == 0
            _copy_rows(b_bufs.index(slot), b_ptr, rows_b, mask, stride_bm, pn * BLOCK_N, N, BLOCK_N, EVEN_N,
                       load_layout)
            async_copy.mbarrier_arrive(ready_bars.index(slot), increment_count=False)  # when they land
            count += 1
            p_s += 1
            if p_s == p_steps:
                p_s = 0
                p_i += 1
                p_start = nx_start
                p_end = nx_end
                p_steps = _steps(p_start, p_end, BLOCK_S)
                _, pk, pn = _tile_kn(pid + p_i * nprog, tiles_e, tiles_n)
                e_after, _, _ = _tile_kn(gl.minimum(pid + (p_i + 1) * nprog, last_tile), tiles_e, tiles_n)
                nx_start, nx_end = _segment(e_after, offsets_ptr)
            rows_a, rows_b, mask = _block_rows(p_start + p_s * BLOCK_S, p_end, gather_a_ptr, gather_b_ptr,
                                               HAS_GATHER_A, HAS_GATHER_B, BLOCK_S, load_layout)

    @gluon.jit
    def _store_fp32(out_ptr, acc, row0, col0, N, ADD: gl.constexpr, EVEN_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """The tile's fp32 sums from registers into out [E * K, N] at (row0, col0): written, or with
        ADD added to what is there (one relaxed atomic add per element, so out + dw rounded once, as
        TMA's reduce-add does). Neither waits: the next tile's MMAs start while they drain."""
        rows = row0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + (rows.to(gl.int64) * N)[:, None] + cols[None, :]
        mask = None  # full tiles: no column mask
        if not EVEN_N:
            mask = (cols < N)[None, :]
        if ADD:
            gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        else:
            gl.store(ptrs, acc, mask=mask)

    @gluon.jit
    def _prefetch_l2(out_ptr, row0, col0, N, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The lines of out's tile at (row0, col0) fetched into L2 (``cp.async.bulk.prefetch``, which
        nothing waits for), so that the tile's adds at its end find them there: one half-row (512
        bytes) per consumer thread. Only for full tiles (EVEN_N)."""
        gl.static_assert(BLOCK_N == 256, "the prefetch's size (512 bytes) is half a row of 256 fp32")
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        item = gl.arange(0, 2 * BLOCK_K, layout=layout)
        ptrs = out_ptr + (row0 + item // 2).to(gl.int64) * N + col0 + (item % 2) * (BLOCK_N // 2)
        gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 512;\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptrs.to(gl.int64)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _mma_steps(s0, s1, acc, count, a_bufs, b_bufs, ready_bars, empty_bars, NUM_BUF: gl.constexpr):
        """A tile's row blocks s0 .. s1 - 1 multiplied into acc, one MMA in flight; each block's slot
        freed once the block after it is issued (the tile's first block: none before it)."""
        for c_s in range(s0, s1):
            slot = count % NUM_BUF
            mbarrier.wait(ready_bars.index(slot), (count // NUM_BUF) & 1)
            fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores
            a_t = a_bufs.index(slot).permute((1, 0))  # [BLOCK_K, BLOCK_S]
            acc = warpgroup_mma(a_t, b_bufs.index(slot), acc, use_acc=c_s > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # the block before is multiplied: its slot is free
            barrier()  # both warpgroups', before the one arrival
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=c_s > 0)
            count += 1
        return acc, count

    @gluon.jit
    def _consumer(out, out_smem, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars, E, K, N,
                  OUT_MODE: gl.constexpr, EVEN_N: gl.constexpr, PREFETCH: gl.constexpr, AHEAD: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
                  NUM_WARPS: gl.constexpr):
        """The MMAs and the tiles' stores (OUT_MODE: 0 rounded to out's dtype through shared memory
        and TMA, out a descriptor; 1 fp32 written, 2 fp32 added, out a pointer)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        pid, nprog, tiles_e, tiles_n, my_tiles, last_tile, seg_start, seg_end, nx_start, nx_end = _schedule(
            E, K, N, offsets_ptr, BLOCK_K, BLOCK_N)
        acc = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
        count = 0
        c_i = 0
        # a while loop: Triton 3.6's Gluon did not carry seg_start / seg_end (reassigned in the body)
        # through a for loop here, and every tile ran the first tile's step count
        while c_i < my_tiles:
            # the steps in loops of their own: with the tile's epilogue behind a branch in the same
            # loop, ptxas drained the MMAs at every step (its C7517 note: a wait injected at the loop's end).
            # Two loops where the added tile's lines are prefetched into L2 AHEAD steps before its end
            steps = _steps(seg_start, seg_end, BLOCK_S)
            first = 0
            if PREFETCH:
                if AHEAD > 0:
                    first = gl.maximum(steps - AHEAD, 0)
            acc, count = _mma_steps(0, first, acc, count, a_bufs, b_bufs, ready_bars, empty_bars, NUM_BUF)
            if PREFETCH:
                e, pk, pn = _tile_kn(pid + c_i * nprog, tiles_e, tiles_n)
                _prefetch_l2(out, e * K + pk * BLOCK_K, pn * BLOCK_N, N, BLOCK_K, BLOCK_N, NUM_WARPS)
            acc, count = _mma_steps(first, steps, acc, count, a_bufs, b_bufs, ready_bars, empty_bars, NUM_BUF)
            acc = warpgroup_mma_wait(0, deps=[acc])
            barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
            e, pk, pn = _tile_kn(pid + c_i * nprog, tiles_e, tiles_n)
            if OUT_MODE == 0:
                tma.store_wait(0)  # the last tile's store has read the buffer
                out_smem.store(acc.to(out.dtype))
                fence_async_shared()
                tma_store(out, [e * K + pk * BLOCK_K, pn * BLOCK_N], out_smem)
            else:
                _store_fp32(out, acc, e * K + pk * BLOCK_K, pn * BLOCK_N, N, OUT_MODE == 2, EVEN_N, BLOCK_K, BLOCK_N,
                            acc_layout)
            c_i += 1
            seg_start = nx_start
            seg_end = nx_end
            e_after, _, _ = _tile_kn(gl.minimum(pid + (c_i + 1) * nprog, last_tile), tiles_e, tiles_n)
            nx_start, nx_end = _segment(e_after, offsets_ptr)
        if OUT_MODE == 0:
            tma.store_wait(0)

    @gluon.jit
    def _grouped_wgrad_gluon_kernel(
        a_ptr, b_ptr, out, gather_a_ptr, gather_b_ptr, offsets_ptr,
        E, K, N, stride_am, stride_bm,
        HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, EVEN_N: gl.constexpr, OUT_MODE: gl.constexpr,
        PREFETCH: gl.constexpr, AHEAD: gl.constexpr,
        BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
        NUM_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_K], gl.bfloat16)
        b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_N], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_S, BLOCK_K], a_smem)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_S, BLOCK_N], b_smem)
        if OUT_MODE == 0:
            out_smem = gl.allocate_shared_memory(out.dtype, out.block_type.shape, out.layout)
        else:
            out_smem = out  # no shared tile: the fp32 sums leave from registers
        ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready_bars.index(i), count=PRODUCER_WARPS * 32)  # each producer thread's copies
            mbarrier.init(empty_bars.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (out, out_smem, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars, E, K, N, OUT_MODE,
                         EVEN_N, PREFETCH, AHEAD, BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF, NUM_WARPS)),
            (_producer, (a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars,
                         empty_bars, E, K, N, stride_am, stride_bm, HAS_GATHER_A, HAS_GATHER_B, EVEN_N, BLOCK_K,
                         BLOCK_N, BLOCK_S, NUM_BUF, PRODUCER_WARPS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def supported(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, scale_S=None, a_activation=None,
              a_scale_S=None, out_dtype=None, out=None, accumulate=False) -> bool:
    """Whether ``grouped_wgrad`` with these arguments runs here: bf16 operands without scale or
    activation prologue, K a multiple of 128 and N of 16, on an sm_90 GPU, Gluon available, the
    switch on; the gradient a new bf16 or fp32 tensor, or written into or (``accumulate``) added
    to a given contiguous fp32 ``out`` (the trainer's master gradients; ``MEGATRON_MOE_GLUON_WGRAD_FP32=0``
    sends the fp32 gradients to the Triton kernel)."""
    if not (switches.gluon_wgrad() and available()):
        return False
    if scale_S is not None or a_activation is not None or a_scale_S is not None:
        return False
    if a_MK.dim() != 2 or b_MN.dim() != 2 or offsets_E1.dim() != 1:  # grouped_wgrad's checks say what is wrong
        return False
    if a_MK.dtype != torch.bfloat16 or b_MN.dtype != torch.bfloat16:
        return False
    K, N = a_MK.shape[1], b_MN.shape[1]
    if min(a_MK.shape[0], b_MN.shape[0], K, N) == 0 or K % BLOCK_K or N % 16 or offsets_E1.shape[0] < 2:
        return False
    dtype = out.dtype if out is not None else (out_dtype or a_MK.dtype)
    if dtype == torch.float32:
        if not switches.gluon_wgrad_fp32():
            return False
        if out is not None and (tuple(out.shape) != (offsets_E1.shape[0] - 1, K, N) or not out.is_contiguous()
                                or out.device != a_MK.device):
            return False  # grouped_wgrad's checks say what is wrong with a misshapen out
        if accumulate and out is None:
            return False  # grouped_wgrad's checks say what is wrong
    elif dtype != torch.bfloat16 or out is not None or accumulate:
        return False
    return rows_ok(a_MK) and rows_ok(b_MN) and on_sm90(a_MK)


@functools.lru_cache(maxsize=None)
def _out_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)


def grouped_wgrad_gluon(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, out_dtype=None, out=None,
                        accumulate=False):
    """dw_EKN [E, K, N] = Σ_{s in e} a[ga(s)]ᵀ · b[gb(s)]: a new bf16 (default) or fp32 tensor, or
    written into fp32 ``out``, or with ``accumulate`` added to it (out += dw, rounded once); the
    arguments as ``grouped_wgrad``'s, within what :func:`supported` takes (checked there, not here)."""
    E = offsets_E1.shape[0] - 1
    K, N = a_MK.shape[1], b_MN.shape[1]
    if out is None:
        out = torch.empty(E, K, N, device=a_MK.device, dtype=out_dtype or torch.bfloat16)
        accumulate = False
    if out.dtype == torch.float32:
        mode, out_arg = 2 if accumulate else 1, out  # stored from registers
    else:
        mode, out_arg = 0, TensorDescriptor(out, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N], _out_layout())  # [E * K, N]
    # an added tile's lines prefetched into L2 AHEAD row blocks before its end (0: as it starts);
    # whole 256-column tiles only (the prefetch moves half-rows)
    way = switches.wgrad_add() if mode == 2 and N % BLOCK_N == 0 else "atomic"
    prefetch, ahead = way != "atomic", int(way[len("prefetch"):] or 0) if way != "atomic" else 0
    tiles = E * (K // BLOCK_K) * cdiv(N, BLOCK_N)
    launch(_grouped_wgrad_gluon_kernel, (min(tiles, num_sms(a_MK.device)),),
           (a_MK, b_MN, out_arg, gather_a_S if gather_a_S is not None else offsets_E1,
            gather_b_S if gather_b_S is not None else offsets_E1, offsets_E1, E, K, N, a_MK.stride(0), b_MN.stride(0)),
           dict(HAS_GATHER_A=gather_a_S is not None, HAS_GATHER_B=gather_b_S is not None, EVEN_N=N % BLOCK_N == 0,
                OUT_MODE=mode, PREFETCH=prefetch, AHEAD=ahead,
                BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S, NUM_BUF=NUM_BUF,
                NUM_WARPS=NUM_WARPS, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                num_warps=NUM_WARPS, maxnreg=maxnreg(NUM_WARPS, PRODUCER_WARPS)))
    return out
