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
      subnormal results to zero), which no one waits for. A tile's steps run in a
      loop of their own: with the epilogue behind a branch in the same loop, ptxas waited for
      every MMA before the next (its note C7517; tests/kernels/test_compile_hopper.py checks for
      such notes).
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
from ._common import cdiv, next_power_of_2
from ._gluon import (TensorDescriptor, async_copy, async_load, available, barrier, fence_async_shared, gl, gluon,
                     maxnreg, mbarrier, num_sms, on_sm90, rows_ok, tma, tma_store, warpgroup_mma, warpgroup_mma_wait)
from .launcher import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover  (Gluon is not there either: nothing here runs)
    triton = None

BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF = 128, 256, 64, 3
NUM_WARPS, PRODUCER_WARPS, PRODUCER_REGS = 8, 4, 80
SPLIT_ROUNDS, MIN_CHUNK = 4, 8  # the plan's chunks (_chunk_steps)
FIXUP_ROWS = 32  # rows of a split tile _fixup_kernel adds up at a time


if gluon is not None:
    # ------------------------------------------------------------------------------------------
    # Kernel
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _plan(offsets_ptr, E, tiles_e, CH, ADD: gl.constexpr, E_PAD: gl.constexpr, BLOCK_S: gl.constexpr,
              layout: gl.constexpr):
        """The work items, worked out once from the experts' row offsets, kept per expert in
        registers (each warp a copy): items run expert by expert, tile by tile, chunk by chunk; an
        expert of `steps` 64-row blocks has C = cdiv(steps, CH) chunks of CH blocks per output tile
        (none without rows when ADD; otherwise at least one, which writes the tile's zeros).
        Returns per expert its first item, C, steps, first and end row, first workspace slot (the
        split experts' items numbered in the same order), and the number of items in all."""
        idx = gl.arange(0, E_PAD, layout=layout)
        m = idx < E
        lo = gl.load(offsets_ptr + idx, mask=m, other=0)
        hi = gl.load(offsets_ptr + idx + 1, mask=m, other=0)
        steps = (hi - lo + BLOCK_S - 1) // BLOCK_S
        if not ADD:
            steps = gl.maximum(steps, 1)
        steps = gl.where(m, steps, 0)
        chunks = (steps + CH - 1) // CH
        items = chunks * tiles_e
        first = gl.associative_scan(items, 0, _add) - items
        split = gl.where(chunks > 1, items, 0)
        slot0 = gl.associative_scan(split, 0, _add) - split
        return idx, first, chunks, steps, lo, hi, slot0, gl.sum(items, axis=0)

    @gluon.jit
    def _pick(t, idx, first, chunks, steps, lo, hi, slot0, tiles_e, tiles_n, CH, BLOCK_S: gl.constexpr):
        """Work item t of the plan: its expert, (k, n) tile, first sorted row, the expert's end row,
        its number of blocks, the expert's C and the item's workspace slot (register work only)."""
        e = gl.sum((first + chunks * tiles_e <= t).to(gl.int32), axis=0)  # the expert whose items hold t
        sel = idx == e
        c_e = gl.maximum(gl.sum(gl.where(sel, chunks, 0), axis=0), 1)
        r = t - gl.sum(gl.where(sel, first, 0), axis=0)
        tile = r // c_e
        c = r % c_e
        n_steps = gl.minimum(gl.sum(gl.where(sel, steps, 0), axis=0) - c * CH, CH)
        row0 = gl.sum(gl.where(sel, lo, 0), axis=0) + c * CH * BLOCK_S
        slot = gl.sum(gl.where(sel, slot0, 0), axis=0) + r
        return e, tile // tiles_n, tile % tiles_n, row0, gl.sum(gl.where(sel, hi, 0), axis=0), n_steps, c_e, slot

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
                  E, K, N, CH, stride_am, stride_bm,
                  HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, EVEN_N: gl.constexpr, ADD: gl.constexpr,
                  E_PAD: gl.constexpr, SPT_E: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
                  PRODUCER_WARPS: gl.constexpr):
        """Every row block of this program's items into the ring. What changes per item (its
        columns, rows, step count) is worked out once per item, from the plan in registers."""
        # 8 contiguous bf16 (16 bytes, one cp.async) per thread along a row
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        plan_layout: gl.constexpr = gl.BlockedLayout([SPT_E], [32], [PRODUCER_WARPS], [0])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        tiles_e = gl.cdiv(K, BLOCK_K) * tiles_n
        idx, first, chunks, steps, lo, hi, slot0, total = _plan(offsets_ptr, E, tiles_e, CH, ADD, E_PAD, BLOCK_S,
                                                                plan_layout)
        _, pk, pn, p_row, p_end, p_steps, _, _ = _pick(pid, idx, first, chunks, steps, lo, hi, slot0, tiles_e,
                                                       tiles_n, CH, BLOCK_S)
        rows_a, rows_b, mask = _block_rows(p_row, p_end, gather_a_ptr, gather_b_ptr, HAS_GATHER_A,
                                           HAS_GATHER_B, BLOCK_S, load_layout)
        t = pid
        p_s = 0
        count = 0
        while t < total:
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
                t += nprog
                _, pk, pn, p_row, p_end, p_steps, _, _ = _pick(t, idx, first, chunks, steps, lo, hi, slot0, tiles_e,
                                                               tiles_n, CH, BLOCK_S)
            rows_a, rows_b, mask = _block_rows(p_row + p_s * BLOCK_S, p_end, gather_a_ptr, gather_b_ptr,
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
        if EVEN_N:
            if ADD:
                gl.atomic_add(ptrs, acc, sem="relaxed")
            else:
                gl.store(ptrs, acc)
        else:
            mask = (cols < N)[None, :]
            if ADD:
                gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
            else:
                gl.store(ptrs, acc, mask=mask)

    @gluon.jit
    def _consumer(out, out_smem, ws_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars, E, K, N, CH,
                  OUT_MODE: gl.constexpr, EVEN_N: gl.constexpr, E_PAD: gl.constexpr, SPT_E: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
                  NUM_WARPS: gl.constexpr):
        """The MMAs and the items' stores. A whole tile's sum (C == 1) goes to out (OUT_MODE: 0
        rounded to out's dtype through shared memory and TMA, out a descriptor; 1 fp32 written, 2
        fp32 added, out a pointer); a chunk of a split tile's rows (C > 1) leaves its fp32 sum in
        its workspace slot, for _fixup_kernel to add up in chunk order."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        plan_layout: gl.constexpr = gl.BlockedLayout([SPT_E], [32], [NUM_WARPS], [0])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        tiles_e = gl.cdiv(K, BLOCK_K) * tiles_n
        idx, first, chunks, steps, lo, hi, slot0, total = _plan(offsets_ptr, E, tiles_e, CH, OUT_MODE == 2, E_PAD,
                                                                BLOCK_S, plan_layout)
        e, pk, pn, _, _, c_steps, c_e, c_slot = _pick(pid, idx, first, chunks, steps, lo, hi, slot0, tiles_e,
                                                      tiles_n, CH, BLOCK_S)
        acc = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
        count = 0
        t = pid
        # a while loop: Triton 3.6's Gluon did not carry values reassigned in the body through a for
        # loop here, and every tile ran the first tile's step count
        while t < total:
            # the steps in a loop of their own: with the tile's epilogue behind a branch in the same
            # loop, ptxas drained the MMAs at every step (its C7517 note: a wait injected at the loop's end)
            for c_s in range(c_steps):
                slot = count % NUM_BUF
                mbarrier.wait(ready_bars.index(slot), (count // NUM_BUF) & 1)
                fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores
                a_t = a_bufs.index(slot).permute((1, 0))  # [BLOCK_K, BLOCK_S]
                acc = warpgroup_mma(a_t, b_bufs.index(slot), acc, use_acc=c_s > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])  # the block before is multiplied: its slot is free
                barrier()  # both warpgroups', before the one arrival
                mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=c_s > 0)
                count += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
            if c_e > 1:
                _store_fp32(ws_ptr, acc, c_slot * BLOCK_K, 0, BLOCK_N, False, True, BLOCK_K, BLOCK_N, acc_layout)
            elif OUT_MODE == 0:
                tma.store_wait(0)  # the last tile's store has read the buffer
                out_smem.store(acc.to(out.dtype))
                fence_async_shared()
                tma_store(out, [e * K + pk * BLOCK_K, pn * BLOCK_N], out_smem)
            else:
                _store_fp32(out, acc, e * K + pk * BLOCK_K, pn * BLOCK_N, N, OUT_MODE == 2, EVEN_N, BLOCK_K, BLOCK_N,
                            acc_layout)
            t += nprog
            e, pk, pn, _, _, c_steps, c_e, c_slot = _pick(t, idx, first, chunks, steps, lo, hi, slot0, tiles_e,
                                                          tiles_n, CH, BLOCK_S)
        if OUT_MODE == 0:
            tma.store_wait(0)

    @gluon.jit
    def _grouped_wgrad_gluon_kernel(
        a_ptr, b_ptr, out, ws_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr,
        E, K, N, CH, stride_am, stride_bm,
        HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, EVEN_N: gl.constexpr, OUT_MODE: gl.constexpr,
        E_PAD: gl.constexpr, SPT_E: gl.constexpr,
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
            (_consumer, (out, out_smem, ws_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars, empty_bars, E, K, N, CH,
                         OUT_MODE, EVEN_N, E_PAD, SPT_E, BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF, NUM_WARPS)),
            (_producer, (a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, ready_bars,
                         empty_bars, E, K, N, CH, stride_am, stride_bm, HAS_GATHER_A, HAS_GATHER_B, EVEN_N,
                         OUT_MODE == 2, E_PAD, SPT_E, BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF, PRODUCER_WARPS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


if triton is not None:
    @triton.jit
    def _fixup_kernel(ws_ptr, out_ptr, offsets_ptr, E, K, N, CH, tiles_n, tiles_e,
                      ADD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
        """Program (tile, e): if expert e's tiles were split (C > 1 chunks, the plan of _plan), its
        tile's C fp32 partial sums from the workspace, added in chunk order, into out (written, or
        with ADD added to it), rounded once to out's dtype; otherwise nothing."""
        tile = tl.program_id(0)
        e = tl.program_id(1)
        idx = tl.arange(0, E_PAD)
        m = idx < E
        lo = tl.load(offsets_ptr + idx, mask=m, other=0)
        hi = tl.load(offsets_ptr + idx + 1, mask=m, other=0)
        steps = (hi - lo + BLOCK_S - 1) // BLOCK_S
        if not ADD:
            steps = tl.maximum(steps, 1)
        steps = tl.where(m, steps, 0)
        chunks = (steps + CH - 1) // CH
        c_e = tl.sum(tl.where(idx == e, chunks, 0))
        if c_e > 1:
            slot = tl.sum(tl.where((idx < e) & (chunks > 1), chunks * tiles_e, 0)) + tile * c_e
            pk = tile // tiles_n
            pn = tile % tiles_n
            cols = tl.arange(0, BLOCK_N)
            out_cols = pn * BLOCK_N + cols
            for r0 in tl.static_range(0, BLOCK_K, ROWS):
                rows = r0 + tl.arange(0, ROWS)
                ws = ws_ptr + (slot * BLOCK_K + rows).to(tl.int64)[:, None] * BLOCK_N + cols[None, :]
                acc = tl.load(ws)
                for c in range(1, c_e):
                    acc += tl.load(ws + c * (BLOCK_K * BLOCK_N))
                ptrs = out_ptr + (e * K + pk * BLOCK_K + rows).to(tl.int64)[:, None] * N + out_cols[None, :]
                mask = (out_cols < N)[None, :]
                if ADD:
                    acc = tl.load(ptrs, mask=mask) + acc
                tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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


def _chunk_steps(rows: int, E: int, tiles_e: int, programs: int) -> int:
    """The plan's chunk, in 64-row blocks: an expert's tile of more blocks than this is summed in
    chunks by several programs (its partial sums added up by _fixup_kernel), so that an expert with
    most of the rows keeps every SM busy. Sized so each program gets ~SPLIT_ROUNDS chunks' worth
    of the largest plan (every row in one expert); equal experts are never split at the shapes
    measured. ``MEGATRON_MOE_WGRAD_SPLIT=0``: never split."""
    if not switches.wgrad_split():
        return 1 << 30
    blocks = cdiv(rows, BLOCK_S) + E  # bounds Σ_e max(cdiv(rows_e, 64), 1)
    return max(MIN_CHUNK, cdiv(tiles_e * blocks, programs * SPLIT_ROUNDS))


def _plan_sizes(rows: int, E: int, tiles_e: int, programs: int) -> tuple[int, int]:
    """The plan's chunk (blocks) and the workspace slots (128 x 256 fp32 tiles) that hold the split
    chunks' sums of any routing of ``rows`` sorted rows: Σ over split experts of tiles_e * C_e, and
    each C_e > 1 is under 2 * steps_e / chunk, so under tiles_e * 2 * blocks / chunk in all."""
    ch = _chunk_steps(rows, E, tiles_e, programs)
    return ch, tiles_e * (2 * (cdiv(rows, BLOCK_S) + E) // ch)


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
    # the sorted rows (an upper bound of offsets[-1]): what a gather indexes, else the sorted operand's rows
    gather = gather_a_S if gather_a_S is not None else gather_b_S
    rows = gather.shape[0] if gather is not None else a_MK.shape[0]
    tiles_n = cdiv(N, BLOCK_N)
    tiles_e = (K // BLOCK_K) * tiles_n
    programs = num_sms(a_MK.device)
    ch, slots = _plan_sizes(rows, E, tiles_e, programs)
    ws = torch.empty(slots * BLOCK_K, BLOCK_N, device=a_MK.device, dtype=torch.float32) if slots else offsets_E1
    e_pad = max(next_power_of_2(E), 32)
    launch(_grouped_wgrad_gluon_kernel, (min(programs, E * tiles_e + slots),),
           (a_MK, b_MN, out_arg, ws, gather_a_S if gather_a_S is not None else offsets_E1,
            gather_b_S if gather_b_S is not None else offsets_E1, offsets_E1, E, K, N, ch, a_MK.stride(0),
            b_MN.stride(0)),
           dict(HAS_GATHER_A=gather_a_S is not None, HAS_GATHER_B=gather_b_S is not None, EVEN_N=N % BLOCK_N == 0,
                OUT_MODE=mode, E_PAD=e_pad, SPT_E=e_pad // 32, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S,
                NUM_BUF=NUM_BUF, NUM_WARPS=NUM_WARPS, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                num_warps=NUM_WARPS, maxnreg=maxnreg(NUM_WARPS, PRODUCER_WARPS)))
    if slots:  # the split tiles' partial sums, in chunk order, into out
        launch(_fixup_kernel, (tiles_e, E),
               (ws, out, offsets_E1, E, K, N, ch, tiles_n, tiles_e),
               dict(ADD=mode == 2, E_PAD=e_pad, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S, ROWS=FIXUP_ROWS,
                    num_warps=4))
    return out
