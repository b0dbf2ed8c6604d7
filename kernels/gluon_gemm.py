"""The row-grouped GEMM for Hopper in Gluon: the layer's SwiGLU up projection (gather fused, the
activation in the epilogue), a top-1 GELU up projection over x permuted once (sorted rows, the
activation in the epilogue), its down projection and its input gradient at top-k > 1 (sorted rows);
warp-specialised and persistent, full tiles stored by the tensor-memory unit while the next tile
multiplies.

    pre_SX, wact_SF = grouped_gemm_gluon(x_TH, w1_EHX, offsets_E1, gather_S=token_S,
                                         activation="swiglu", act_scale_S=weight_S)  # up projection
    pre_SF, wact_SF = grouped_gemm_gluon(xs_SH, w1_EHF, offsets_E1, activation="gelu",
                                         act_scale_S=weight_S)                        # top-1 GELU, x sorted
    y_SH = grouped_gemm_gluon(wact_SF, w2_EFH, offsets_E1)                           # down, top-k > 1
    dx_SH = grouped_gemm_gluon(dpre_SX, w1_EHX.transpose(1, 2), offsets_E1)           # input gradient

out[s] = epilogue(a[gather(s)] @ w[e]) for the sorted rows s of expert e, bf16 in and
out, fp32 sums: what kernels/grouped.py's ``grouped_gemm`` computes, within :func:`supported`.
``grouped_gemm`` sends the calls these kernels take here (the switch ``MEGATRON_MOE_GLUON_GEMM``,
kernels/switches.py) and the rest to its Triton kernel; its plain-PyTorch
``grouped_gemm_reference`` is the reference of both.

One program per SM walks output tiles (128 sorted rows of one expert, columns fastest); the tiles
are listed on the device (:func:`tile_table`: per 128-row tile its expert, first row and the
expert's end; one Triton launch, no host read). Two kernels:
  plain (no gather, no activation; 256 columns a tile): a producer warp issues the TMA loads of a
      three-slot ring, a's 128 rows and w's 64 x 256 block per step (a transposed w, the view of a
      contiguous [E, N, K]: a 256 x 64 block of that storage, which the MMAs read transposed from
      shared memory); two MMA warpgroups multiply
      with one asynchronous ``warpgroup_mma`` in flight. A tile whose rows are all its expert's is
      stored by TMA through shared memory, waited for only before the buffer's next use; an
      expert's last, partial tile (a TMA store would write the next expert's rows) goes through
      the same buffer, read back so that each thread stores 16 bytes, its rows masked. With GELU
      (sorted rows, w contiguous) the tile's pre goes first; act_scale(s)·gelu(pre) of the rounded
      pre is computed in the MMA warpgroups while that store reads the buffer, then stored through
      it, left running under the next tile's MMAs.
  swiglu (128 activation columns a tile): four producer warps ``cp.async`` a's gathered rows
      (Hopper's TMA cannot gather rows; those past the expert's end zero-filled) and issue the TMA
      loads of w's gate columns [n, n + 128) and up columns [F + n, F + n + 128); two
      accumulators. The epilogue writes the rounded pre-activation's two blocks and
      act_scale(s)·silu(gate)·up of the rounded values, as the Triton kernel does (tanh.approx, its
      16-bit path): three [128, 128] TMA stores through two shared-memory buffers.
Rows a tile reads past its expert's end multiply into output rows that are not stored.

Measured on an H200 (docs/performance.md, "A Gluon down projection", "A Gluon up projection"):
the plain kernel 1.09-1.26x the Triton kernel at the layer's down projections, the swiglu kernel
0.96-1.07x at its up projections. GELU's epilogue over gathered rows (cp.async) measured slower than
the Triton kernel, and so did the top-1 scatter from the plain kernel (both stay there); over rows
sorted once, the plain kernel with GELU's epilogue ran 1.09-1.17x the Triton kernel's gathered GELU
up projection on an H100 (docs/performance.md, "x sorted once"); the plain
kernel on the input gradient's w1ᵀ ran 0.99-1.11x the Triton kernel, and a kernel of this
structure for the activation's backward (commit 0023104) 0.76-1.07x, so that GEMM stays in Triton.
Takes bf16 a with 16-byte aligned rows (row stride a multiple of 16 elements), w [E, K, N]
contiguous (the plain kernel: or the transposed view of a contiguous [E, N, K]) with K a multiple
of 64 (a step never reads another expert's w) and N of 16 (swiglu: of 256, so the gate's blocks lie
inside its half). Gluon does not run under the interpreter: on the CPU the kernels are
only compiled (tests/kernels/_compile_sm90.py); tests/kernels/test_gluon_gemm.py runs them on a GPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import switches
from ._common import cdiv, next_power_of_2, use_triton
from ._gluon import (TensorDescriptor, async_copy, async_load, available, barrier, fence_async_shared, gl, gluon,
                     maxnreg, mbarrier, num_sms, on_sm90, rows_ok, tma, tma_load, tma_store, warpgroup_mma,
                     warpgroup_mma_wait)
from .launcher import launch

BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, NUM_WARPS = 128, 256, 64, 3, 8
HALF_N, SWIGLU_PRODUCER_WARPS, SWIGLU_PRODUCER_REGS = 128, 4, 80  # the swiglu kernel's column blocks, producer
# GELU's act: 0 (measured, 1.17x the Triton kernel on an H100) whole through the tile's buffer once pre's
# store has read it; 16 or 32: in parts of that many columns through two buffers of their own, no wait for
# pre's store (compiled for sm_90, 229.6 KB at 32; not yet run on a GPU: benchmarks/proto_gelu_up.py times it)
GELU_ACT_PART = 0

# ----------------------------------------------------------------------------------------------
# The tile table (Triton: it runs under the interpreter too)
# ----------------------------------------------------------------------------------------------

_TABLE_BLOCK_T = 32  # tiles per program of the tile table


@triton.jit
def _tile_table_kernel(offsets_ptr, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, E, num_tiles,
                       BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program p: the experts' tile counts and their running sum (every program; the first stores
    the total), then for its BLOCK_T tiles t each one's expert (how many experts' tiles end at or
    before t, at most E - 1), first row and the expert's end, as :func:`tile_table_reference`
    computes them."""
    e = tl.arange(0, BLOCK_E)
    mask_e = e < E
    start = tl.load(offsets_ptr + e, mask=mask_e, other=0)
    end = tl.load(offsets_ptr + e + 1, mask=mask_e, other=0)
    m_tiles = (end - start + BLOCK_M - 1) // BLOCK_M  # 0 past E
    ends = tl.cumsum(m_tiles, 0)
    firsts = ends - m_tiles
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(num_m_ptr, tl.sum(m_tiles, 0))
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    te = tl.minimum(tl.sum(((ends[None, :] <= t[:, None]) & mask_e[None, :]).to(tl.int32), 1), E - 1)
    sel = te[:, None] == e[None, :]  # one expert per tile: its values picked by a sum
    row = tl.sum(tl.where(sel, start[None, :] - firsts[None, :] * BLOCK_M, 0), 1) + t * BLOCK_M
    mask_t = t < num_tiles
    tl.store(tile_e_ptr + t, te, mask=mask_t)
    tl.store(tile_row_ptr + t, row, mask=mask_t)
    tl.store(tile_end_ptr + t, tl.sum(tl.where(sel, end[None, :], 0), 1), mask=mask_t)


if gluon is not None:
    # ------------------------------------------------------------------------------------------
    # Kernels
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def program_tiles(num_m_ptr, N, BLOCK_N: gl.constexpr):
        """This program's tiles t = pid, pid + nprog, ... of num_m x tiles_n (columns fastest)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        total = gl.load(num_m_ptr) * tiles_n
        return pid, nprog, tiles_n, gl.cdiv(gl.maximum(total - pid, 0), nprog), total

    @gluon.jit
    def tile_mn(t, tiles_n, BLOCK_N: gl.constexpr):
        """Tile t's 128-row tile (an index into the tile list) and first column."""
        return t // tiles_n, (t % tiles_n) * BLOCK_N

    @gluon.jit
    def tile_head(m, tile_row_ptr, tile_end_ptr, scale_ptr, HAS_SCALE: gl.constexpr, BLOCK_M: gl.constexpr,
                  acc_layout: gl.constexpr):
        """Row tile m's first row, its expert's end (rows from it on are another's), its rows (in the
        accumulator's row layout) and, with HAS_SCALE, their fp32 scales (loaded here, in flight
        during the MMAs; without it the rows stand in, unused)."""
        row0 = gl.load(tile_row_ptr + m)
        row_end = gl.load(tile_end_ptr + m)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        scale = rows
        if HAS_SCALE:
            scale = gl.load(scale_ptr + rows, mask=rows < row_end, other=0.0)
        return row0, row_end, rows, scale

    @gluon.jit
    def store_rows(ptr, vals, row0, row_end, col0, N, stride_m, BLOCK_M: gl.constexpr, BLOCK_C: gl.constexpr,
                   layout: gl.constexpr):
        """Masked stores from registers of a tile's rows before row_end and its columns before N."""
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
        ptrs = ptr + rows.to(gl.int64)[:, None] * stride_m + cols[None, :]
        gl.store(ptrs, vals, mask=(rows < row_end)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _store_staged(ptr, vals, buf, row0, row_end, col0, N, stride_m, BLOCK_M: gl.constexpr, BLOCK_C: gl.constexpr,
                      NUM_WARPS: gl.constexpr):
        """store_rows through the shared-memory buffer ``buf``: read back in a layout whose threads
        hold 8 neighbouring columns (16-byte stores, a warp per row) rather than the MMA layout's
        pairs. The callers' next write of ``buf`` follows a thread barrier of their MMA loop."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
        tma.store_wait(0)  # the buffer's last TMA store has read it
        buf.store(vals)
        barrier()
        store_rows(ptr, buf.load(layout), row0, row_end, col0, N, stride_m, BLOCK_M, BLOCK_C, layout)

    # ---- plain: sorted a by TMA, one 128 x 256 accumulator ------------------------------------

    @gluon.jit
    def tma_producer(a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars,
                     K, N, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, W_T: gl.constexpr):
        """Per tile, per step of BLOCK_K: wait for a free slot, TMA a's rows and w's block into it
        (W_T: w's [BLOCK_N, BLOCK_K] block of its [E, N, K] storage)."""
        pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        count = 0
        for i in range(my_tiles):
            m, n0 = tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            e = gl.load(tile_e_ptr + m)
            row0 = gl.load(tile_row_ptr + m)
            for kk in range(k_steps):
                slot = count % NUM_BUF
                mbarrier.wait(empty_bars.index(slot), ((count // NUM_BUF) & 1) ^ 1)  # the first pass finds it free
                bar = ready_bars.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma_load(a_desc, [row0, kk * BLOCK_K], bar, a_bufs.index(slot))
                if W_T:
                    tma_load(w_desc, [e * N + n0, kk * BLOCK_K], bar, w_bufs.index(slot))  # storage [E * N, K]
                else:
                    tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(slot))  # w as [E * K, N]
                count += 1

    @gluon.jit
    def _consumer(out_ptr, out_desc, out_smem, act_ptr, act_desc, act_scale_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr,
                  a_bufs, w_bufs, ready_bars, empty_bars, K, N, stride_om, stride_am, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr,
                  W_T: gl.constexpr, GELU: gl.constexpr, HAS_ACT_SCALE: gl.constexpr, ACT_PART: gl.constexpr,
                  stage_smem):
        """The MMAs (one in flight; the slot of the step before freed) and each tile's store; GELU:
        then act = act_scale·gelu(the rounded tile): ACT_PART 0, computed in registers while the
        tile's store reads the buffer and stored through it after; else ACT_PART columns at a time
        from the buffer, each part stored through one of the two ``stage_smem`` buffers, so that
        nothing waits for the tile's store until the next tile."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        count = 0
        for i in range(my_tiles):
            m, n0 = tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            row0, row_end, rows, act_scale = tile_head(m, tile_row_ptr, tile_end_ptr, act_scale_ptr, HAS_ACT_SCALE,
                                                       BLOCK_M, acc_layout)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(k_steps):
                slot = count % NUM_BUF
                mbarrier.wait(ready_bars.index(slot), (count // NUM_BUF) & 1)
                w_tile = w_bufs.index(slot)
                if W_T:  # the [BLOCK_N, BLOCK_K] block read as [BLOCK_K, BLOCK_N] (an MN-major operand)
                    w_tile = w_tile.permute((1, 0))
                acc = warpgroup_mma(a_bufs.index(slot), w_tile, acc, use_acc=kk > 0, is_async=True)
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
                if GELU:
                    if ACT_PART == 0:  # act computed while pre's store reads the buffer, then stored through it
                        act = _gelu(vals, act_scale, HAS_ACT_SCALE)
                        tma.store_wait(0)
                        out_smem.store(act)
                        fence_async_shared()
                        tma_store(act_desc, [row0, n0], out_smem)
                    else:  # from the buffer, a part at a time, each through a stage buffer of its own
                        part_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ACT_PART // 8), ACT_PART // 8],
                                                                     [NUM_WARPS, 1], [1, 0])
                        part_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, part_layout))
                        part_scale = part_rows
                        if HAS_ACT_SCALE:
                            part_scale = gl.load(act_scale_ptr + part_rows, mask=part_rows < row_end, other=0.0)
                        for j in gl.static_range(BLOCK_N // ACT_PART):
                            part = _gelu(out_smem.slice(j * ACT_PART, ACT_PART, dim=1).load(part_layout), part_scale,
                                         HAS_ACT_SCALE)
                            if j >= 2:
                                tma.store_wait(1)  # all but the last part's store done: this part's buffer read
                            stage = stage_smem.index(j % 2)
                            stage.store(part)
                            fence_async_shared()
                            tma_store(act_desc, [row0, n0 + j * ACT_PART], stage)
            else:  # the expert's last tile: its rows only
                _store_staged(out_ptr, vals, out_smem, row0, row_end, n0, N, stride_om, BLOCK_M, BLOCK_N, NUM_WARPS)
                if GELU:
                    barrier()  # every thread's read of the buffer, before it is written again
                    _store_staged(act_ptr, _gelu(vals, act_scale, HAS_ACT_SCALE), out_smem, row0, row_end, n0, N,
                                  stride_am, BLOCK_M, BLOCK_N, NUM_WARPS)
        tma.store_wait(0)

    @gluon.jit
    def _grouped_gemm_gluon_kernel(a_desc, w_desc, out_desc, act_desc, out_ptr, act_ptr, act_scale_ptr, tile_e_ptr,
                                   tile_row_ptr, tile_end_ptr, num_m_ptr, K, N, stride_om, stride_am,
                                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                   NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr, W_T: gl.constexpr,
                                   GELU: gl.constexpr, HAS_ACT_SCALE: gl.constexpr, ACT_PART: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
        out_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        if GELU and ACT_PART > 0:  # act's parts (act_desc's box [BLOCK_M, ACT_PART])
            stage_smem = gl.allocate_shared_memory(act_desc.dtype, [2] + act_desc.block_type.shape, act_desc.layout)
        else:
            stage_smem = out_smem  # unused
        ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; TMA's bytes complete it
            mbarrier.init(empty_bars.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (out_ptr, out_desc, out_smem, act_ptr, act_desc, act_scale_ptr, tile_row_ptr, tile_end_ptr,
                         num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars, K, N, stride_om, stride_am, BLOCK_M,
                         BLOCK_N, BLOCK_K, NUM_BUF, NUM_WARPS, W_T, GELU, HAS_ACT_SCALE, ACT_PART, stage_smem)),
            (tma_producer, (a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars,
                            empty_bars, K, N, BLOCK_N, BLOCK_K, NUM_BUF, W_T)),
        ], [1], [40])

    # ---- swiglu: gathered a by cp.async, the gate's and the up projection's accumulators -----

    @gluon.jit
    def tile_rows(t, total, tiles_n, tile_row_ptr, tile_end_ptr, gather_ptr, HAS_GATHER: gl.constexpr,
                  BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, layout: gl.constexpr):
        """The rows of a that tile t (clamped into the list) reads, and which are its expert's."""
        m, _ = tile_mn(gl.maximum(gl.minimum(t, total - 1), 0), tiles_n, HALF_N)
        rows = gl.load(tile_row_ptr + m) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        mask = rows < gl.load(tile_end_ptr + m)
        if HAS_GATHER:
            rows = gl.load(gather_ptr + rows, mask=mask, other=0)
        return rows, mask

    @gluon.jit
    def gathered_producer(a_ptr, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs,
                          a_ready, w_ready, empty_bars, K, N, stride_am, HAS_GATHER: gl.constexpr,
                          GATE_UP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          NUM_BUF: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
        """Per tile of BLOCK_N columns, per step of BLOCK_K: wait for a free slot, the TMA loads of w's
        blocks and the cp.async of a's rows (gathered, or the tile's own; the next tile's rows looked
        up a tile ahead). GATE_UP (the swiglu kernel): w [E, K, 2N], the gate's and the up
        projection's [BLOCK_K, BLOCK_N] blocks, N apart, into slots 2·slot and 2·slot + 1; else
        (gluon_dact.py) a [BLOCK_N, BLOCK_K] block of the [E * N, K] storage of w's transposed view."""
        # 8 contiguous bf16 (16 bytes, one cp.async) per thread along a row
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        pid, nprog, tiles_n, my_tiles, total = program_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        rows, mask = tile_rows(pid, total, tiles_n, tile_row_ptr, tile_end_ptr, gather_ptr, HAS_GATHER, BLOCK_M,
                               BLOCK_N, load_layout)
        count = 0
        for i in range(my_tiles):
            m, n0 = tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            e = gl.load(tile_e_ptr + m)
            for kk in range(k_steps):
                slot = count % NUM_BUF
                mbarrier.wait(empty_bars.index(slot), ((count // NUM_BUF) & 1) ^ 1)  # the first pass finds it free
                bar = w_ready.index(slot)
                if GATE_UP:
                    mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
                    tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(2 * slot))  # w as [E * K, 2N]
                    tma_load(w_desc, [e * K + kk * BLOCK_K, N + n0], bar, w_bufs.index(2 * slot + 1))
                else:
                    mbarrier.expect(bar, w_desc.block_type.nbytes)
                    tma_load(w_desc, [e * N + n0, kk * BLOCK_K], bar, w_bufs.index(slot))  # storage [E * N, K]
                cols = kk * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, load_layout))
                ptrs = a_ptr + rows.to(gl.int64)[:, None] * stride_am + cols[None, :]
                async_load(a_bufs.index(slot), ptrs, mask[:, None] & (cols < K)[None, :])
                async_copy.mbarrier_arrive(a_ready.index(slot), increment_count=False)  # when they land
                count += 1
            rows, mask = tile_rows(pid + (i + 1) * nprog, total, tiles_n, tile_row_ptr, tile_end_ptr, gather_ptr,
                                   HAS_GATHER, BLOCK_M, BLOCK_N, load_layout)

    @gluon.jit
    def tanh_approx(x):
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _swiglu(gate, up, act_scale, HAS_ACT_SCALE: gl.constexpr):
        """act_scale(s)·silu(gate)·up of the rounded pre-activation, in fp32 with the hardware's
        tanh (the Triton kernel's 16-bit path, kernels/activation.py), rounded to bf16."""
        g = gate.to(gl.float32)
        act = g * (0.5 + 0.5 * tanh_approx(0.5 * g)) * up.to(gl.float32)
        if HAS_ACT_SCALE:
            act = act * act_scale[:, None]
        return act.to(gl.bfloat16)

    @gluon.jit
    def _gelu(pre, act_scale, HAS_ACT_SCALE: gl.constexpr):
        """act_scale(s)·gelu(pre) of the rounded pre-activation (tanh's form), in fp32 with the
        hardware's tanh (the Triton kernel's 16-bit path, kernels/activation.py), rounded to bf16."""
        h = pre.to(gl.float32)
        act = 0.5 * h * (1.0 + tanh_approx(0.7978845608028654 * (h + 0.044715 * h * h * h)))
        if HAS_ACT_SCALE:
            act = act * act_scale[:, None]
        return act.to(gl.bfloat16)

    @gluon.jit
    def _stage(j: gl.constexpr, vals, desc, row, col, out_smem):
        """The epilogue's j-th TMA store through buffer j % 2 (the store two before it, from the same
        buffer, waited for first; the tile's first two need no wait: see the caller)."""
        if j >= 2:
            tma.store_wait(1)
        buf = out_smem.index(j % 2)
        buf.store(vals)
        fence_async_shared()
        tma_store(desc, [row, col], buf)

    @gluon.jit
    def _swiglu_consumer(pre_ptr, act_ptr, pre_desc, act_desc, out_smem, act_scale_ptr, tile_row_ptr, tile_end_ptr,
                         num_m_ptr, a_bufs, w_bufs, a_ready, w_ready, empty_bars, K, F, stride_pm, stride_am_out,
                         HAS_ACT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
                         BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Two MMAs a step (one step in flight; the slot of the step before freed) and each tile's
        epilogue: pre's gate and up blocks, then the activation's."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, HALF_N, 16])
        pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, F, HALF_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        count = 0
        for i in range(my_tiles):
            m, n0 = tile_mn(pid + i * nprog, tiles_n, HALF_N)
            row0, row_end, rows, act_scale = tile_head(m, tile_row_ptr, tile_end_ptr, act_scale_ptr, HAS_ACT_SCALE,
                                                       BLOCK_M, acc_layout)
            acc_g = gl.zeros([BLOCK_M, HALF_N], gl.float32, acc_layout)
            acc_u = gl.zeros([BLOCK_M, HALF_N], gl.float32, acc_layout)
            for kk in range(k_steps):
                slot = count % NUM_BUF
                phase = (count // NUM_BUF) & 1
                mbarrier.wait(w_ready.index(slot), phase)
                mbarrier.wait(a_ready.index(slot), phase)
                fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores
                acc_g = warpgroup_mma(a_bufs.index(slot), w_bufs.index(2 * slot), acc_g, use_acc=kk > 0,
                                      is_async=True)
                acc_u = warpgroup_mma(a_bufs.index(slot), w_bufs.index(2 * slot + 1), acc_u, use_acc=kk > 0,
                                      is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(2, deps=[acc_g, acc_u])  # the step before is done: slot free
                barrier()  # both warpgroups', before the one arrival
                mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=kk > 0)
                count += 1
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
            barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
            gate = acc_g.to(gl.bfloat16)  # the pre-activation, rounded: the activation is computed from it
            up = acc_u.to(gl.bfloat16)
            if row0 + BLOCK_M <= row_end:  # every row this expert's: TMA, left running
                tma.store_wait(0)  # the last tile's stores have read both buffers (long done by now)
                _stage(0, gate, pre_desc, row0, n0, out_smem)
                _stage(1, up, pre_desc, row0, F + n0, out_smem)
                _stage(2, _swiglu(gate, up, act_scale, HAS_ACT_SCALE), act_desc, row0, n0, out_smem)
            else:  # the expert's last tile: its rows only
                store_rows(pre_ptr, gate, row0, row_end, n0, F, stride_pm, BLOCK_M, HALF_N,
                           acc_layout)
                store_rows(pre_ptr, up, row0, row_end, F + n0, 2 * F, stride_pm, BLOCK_M, HALF_N,
                           acc_layout)
                store_rows(act_ptr, _swiglu(gate, up, act_scale, HAS_ACT_SCALE), row0, row_end, n0, F,
                           stride_am_out, BLOCK_M, HALF_N, acc_layout)
        tma.store_wait(0)

    @gluon.jit
    def _grouped_gemm_swiglu_kernel(a_ptr, gather_ptr, w_desc, pre_desc, act_desc, pre_ptr, act_ptr, act_scale_ptr,
                                    tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, K, F, stride_am, stride_pm,
                                    stride_am_out, HAS_GATHER: gl.constexpr, HAS_ACT_SCALE: gl.constexpr,
                                    BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                    NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                                    PRODUCER_REGS: gl.constexpr):
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], a_layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
        out_smem = gl.allocate_shared_memory(pre_desc.dtype, [2] + pre_desc.block_type.shape, pre_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(a_ready.index(i), count=PRODUCER_WARPS * 32)  # each producer thread's copies
            mbarrier.init(w_ready.index(i), count=1)  # the producer's expect; TMA's bytes complete it
            mbarrier.init(empty_bars.index(i), count=1)
        gl.warp_specialize([
            (_swiglu_consumer, (pre_ptr, act_ptr, pre_desc, act_desc, out_smem, act_scale_ptr, tile_row_ptr,
                                tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready, empty_bars, K, F,
                                stride_pm, stride_am_out, HAS_ACT_SCALE, BLOCK_M, HALF_N, BLOCK_K, NUM_BUF,
                                NUM_WARPS)),
            (gathered_producer, (a_ptr, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr,
                                 a_bufs, w_bufs, a_ready, w_ready, empty_bars, K, F, stride_am, HAS_GATHER, True,
                                 BLOCK_M, HALF_N, BLOCK_K, NUM_BUF, PRODUCER_WARPS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def supported(a_MK, w_EKN, offsets_E1, *, gather_S=None, scatter_S=None, scale_S=None, activation=None,
              act_scale_S=None, out_dtype=None) -> bool:
    """Whether ``grouped_gemm`` with these arguments runs here: bf16 a and contiguous w [E, K, N],
    a bf16 result, no ``scale_S``, K a multiple of 64 and N of 16; either no gather and no
    activation (the plain kernel, which also takes w as the transposed view of a contiguous
    [E, N, K]), or gelu without a gather (the plain kernel with GELU's epilogue), or swiglu with N
    a multiple of 256 (the swiglu kernel); no scatter; on an sm_90 GPU, Gluon available, the switch
    on. (GELU's epilogue over gathered rows and the top-1 scatter, both measured slower than the
    Triton kernel, stay there: docs/performance.md.)"""
    if not (switches.gluon_gemm() and available()):
        return False
    if scale_S is not None or scatter_S is not None:
        return False
    if activation is None:  # the plain kernel
        if gather_S is not None or act_scale_S is not None:
            return False
    elif activation == "gelu":  # the plain kernel with GELU's epilogue: sorted rows only
        if gather_S is not None:
            return False
    elif activation != "swiglu":
        return False
    if a_MK.dtype != torch.bfloat16 or w_EKN.dtype != torch.bfloat16 or (out_dtype or a_MK.dtype) != torch.bfloat16:
        return False
    if a_MK.dim() != 2 or w_EKN.dim() != 3 or offsets_E1.dim() != 1:  # grouped_gemm's checks say what is wrong
        return False
    for idx in (gather_S, act_scale_S):
        if idx is not None and (idx.dim() != 1 or not idx.is_contiguous()):
            return False
    if offsets_E1.shape[0] != w_EKN.shape[0] + 1 or w_EKN.shape[0] == 0:
        return False
    S = gather_S.shape[0] if gather_S is not None else a_MK.shape[0]
    K, N = a_MK.shape[1], w_EKN.shape[2]
    if min(S, K, N) == 0 or K % BLOCK_K or N % 16 or w_EKN.data_ptr() % 16:
        return False
    if not (w_EKN.is_contiguous() or (activation is None and transposed_view(w_EKN))):
        return False
    if activation == "swiglu" and N % (2 * HALF_N):  # the gate's 128-column blocks inside its half
        return False
    return rows_ok(a_MK) and on_sm90(a_MK)


def transposed_view(w_EKN) -> bool:
    """w a transposed view of a contiguous [E, N, K] tensor (the input gradient's w1ᵀ), not also
    contiguous itself (a single row or column is both; the plain layout reads it then)."""
    return w_EKN.transpose(1, 2).is_contiguous() and not w_EKN.is_contiguous()


def tile_table(offsets_E1, max_rows, block_m=BLOCK_M):
    """Per block_m-row tile (each expert's from its first row, experts in order): its expert, first
    row and the expert's end, over a bound of cdiv(S, block_m) + E tiles; and the number of tiles,
    a one-element tensor. int32, on the device, no host read: one Triton launch, a program per
    _TABLE_BLOCK_T tiles (on the CPU without the interpreter, :func:`tile_table_reference`'s torch
    ops; on a GPU those were ~20 launches per call, measured in docs/performance.md)."""
    if not use_triton(offsets_E1):
        return tile_table_reference(offsets_E1, max_rows, block_m)
    E = offsets_E1.shape[0] - 1
    num_tiles = cdiv(max_rows, block_m) + E
    dev = offsets_E1.device
    tile_e, tile_row, tile_end = (torch.empty(num_tiles, device=dev, dtype=torch.int32) for _ in range(3))
    num_m = torch.empty(1, device=dev, dtype=torch.int32)
    launch(_tile_table_kernel, (cdiv(num_tiles, _TABLE_BLOCK_T),), (offsets_E1, tile_e, tile_row, tile_end, num_m,
                                                                    E, num_tiles),
           dict(BLOCK_M=block_m, BLOCK_E=max(2, next_power_of_2(E)), BLOCK_T=_TABLE_BLOCK_T))
    return tile_e, tile_row, tile_end, num_m


def tile_table_reference(offsets_E1, max_rows, block_m=BLOCK_M):
    """:func:`tile_table` in torch ops (about twenty of them)."""
    E = offsets_E1.shape[0] - 1
    bounds = offsets_E1.long()
    m_tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    ends = torch.cumsum(m_tiles, 0)  # each expert's tiles end here
    tile = torch.arange(cdiv(max_rows, block_m) + E, device=offsets_E1.device)
    tile_e = torch.searchsorted(ends, tile, right=True).clamp_max(E - 1)  # past the last tile: unused
    tile_row = bounds[tile_e] + (tile - (ends - m_tiles)[tile_e]) * block_m
    return (tile_e.to(torch.int32), tile_row.to(torch.int32), bounds[tile_e + 1].to(torch.int32),
            ends[-1:].to(torch.int32))


@functools.lru_cache(maxsize=None)
def shared_layout(rows, cols):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def grouped_gemm_gluon(a_MK, w_EKN, offsets_E1, *, gather_S=None, activation=None, act_scale_S=None):
    """``grouped_gemm``'s result (bf16; rows past offsets_E1[-1] are not written), within what
    :func:`supported` takes (checked there, not here)."""
    if activation == "swiglu":
        return _swiglu_gemm(a_MK, w_EKN, offsets_E1, gather_S, act_scale_S)
    S, K = a_MK.shape
    E, _, N = w_EKN.shape
    gelu = activation == "gelu"
    out = torch.empty(S, N, device=a_MK.device, dtype=torch.bfloat16)
    act = torch.empty_like(out) if gelu else out
    tile_e, tile_row, tile_end, num_m = tile_table(offsets_E1, S)
    a_desc = TensorDescriptor(a_MK, [S, K], [a_MK.stride(0), 1], [BLOCK_M, BLOCK_K], shared_layout(BLOCK_M, BLOCK_K))
    w_t = transposed_view(w_EKN)
    if w_t:  # its [E, N, K] storage, blocks of [BLOCK_N, BLOCK_K]
        w_desc = TensorDescriptor(w_EKN, [E * N, K], [K, 1], [BLOCK_N, BLOCK_K], shared_layout(BLOCK_N, BLOCK_K))
    else:
        w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N], shared_layout(BLOCK_K, BLOCK_N))
    out_desc = TensorDescriptor(out, [S, N], [N, 1], [BLOCK_M, BLOCK_N], shared_layout(BLOCK_M, BLOCK_N))
    act_desc = out_desc
    if gelu:  # act whole through the tile's buffer, or in GELU_ACT_PART-column parts
        box = [BLOCK_M, GELU_ACT_PART or BLOCK_N]
        act_desc = TensorDescriptor(act, [S, N], [N, 1], box, shared_layout(*box))
    launch(_grouped_gemm_gluon_kernel, (num_sms(a_MK.device),),
           (a_desc, w_desc, out_desc, act_desc, out, act, act_scale_S if act_scale_S is not None else out, tile_e,
            tile_row, tile_end, num_m, K, N, out.stride(0), act.stride(0)),
           dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NUM_BUF=NUM_BUF, NUM_WARPS=NUM_WARPS, W_T=w_t,
                GELU=gelu, HAS_ACT_SCALE=act_scale_S is not None, ACT_PART=GELU_ACT_PART if gelu else 0,
                num_warps=NUM_WARPS, maxnreg=maxnreg(NUM_WARPS, 1)))
    return (out, act) if gelu else out


def _swiglu_gemm(a_MK, w_EKN, offsets_E1, gather_S, act_scale_S):
    """The swiglu kernel's launch: (pre [S, 2F], act [S, F])."""
    S = gather_S.shape[0] if gather_S is not None else a_MK.shape[0]
    K = a_MK.shape[1]
    E, _, N = w_EKN.shape
    F = N // 2
    dev = a_MK.device
    pre = torch.empty(S, N, device=dev, dtype=torch.bfloat16)
    act = torch.empty(S, F, device=dev, dtype=torch.bfloat16)
    tile_e, tile_row, tile_end, num_m = tile_table(offsets_E1, S)
    half = shared_layout(BLOCK_M, HALF_N)
    w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BLOCK_K, HALF_N], shared_layout(BLOCK_K, HALF_N))
    pre_desc = TensorDescriptor(pre, [S, N], [N, 1], [BLOCK_M, HALF_N], half)
    act_desc = TensorDescriptor(act, [S, F], [F, 1], [BLOCK_M, HALF_N], half)
    launch(_grouped_gemm_swiglu_kernel, (num_sms(dev),),
           (a_MK, gather_S if gather_S is not None else offsets_E1, w_desc, pre_desc, act_desc, pre, act,
            act_scale_S if act_scale_S is not None else pre, tile_e, tile_row, tile_end, num_m, K, F, a_MK.stride(0),
            pre.stride(0), act.stride(0)),
           dict(HAS_GATHER=gather_S is not None, HAS_ACT_SCALE=act_scale_S is not None, BLOCK_M=BLOCK_M, HALF_N=HALF_N,
                BLOCK_K=BLOCK_K, NUM_BUF=NUM_BUF, NUM_WARPS=NUM_WARPS, PRODUCER_WARPS=SWIGLU_PRODUCER_WARPS,
                PRODUCER_REGS=SWIGLU_PRODUCER_REGS, num_warps=NUM_WARPS,
                maxnreg=maxnreg(NUM_WARPS, SWIGLU_PRODUCER_WARPS)))
    return pre, act

