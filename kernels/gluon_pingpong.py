"""The row-grouped GEMM for Hopper in Gluon with two MMA warpgroups taking turns (ping-pong): while
one multiplies a tile, the other stores the tile before. The ring and the turns are shared with the
activation's backward (kernels/gluon_dact.py); the forward kernel here takes the GELU up projection
(gather fused, the pre-activation and the activation stored) and the plain product.

    pre_SF, wact_SF = grouped_gemm_pingpong(x_TH, w1_EHF, offsets_E1, gather_S=token_S,
                                            activation="gelu", act_scale_S=weight_S)   # GELU up projection
    y_SH = grouped_gemm_pingpong(wact_SF, w2_EFH, offsets_E1)                          # plain, sorted rows

out[s] = epilogue(a[gather(s)] @ w[e]) for the sorted rows s of expert e, bf16 in and out, fp32
sums: what kernels/grouped.py's ``grouped_gemm`` computes (its ``grouped_gemm_reference`` is the
reference), and where it sends the calls :func:`supported` takes (sm_90; MEGATRON_MOE_GLUON_PINGPONG=0:
never). The cooperative kernels of kernels/gluon_gemm.py (one 128 x 256 tile shared by both
warpgroups) keep the SwiGLU up projection and the plain product at long reductions.

Why: an epilogue that does not overlap the MMAs costs the most where a tile's reduction is short
or its epilogue long. GELU's (pre and act, 64 KB a 128 x 128 tile) made the cooperative kernel
slower than the Triton one (docs/performance.md, "A Gluon up projection"); ping-pong made the
activation's backward 1.00-1.30x the Triton kernel ("The ping-pong kernel of the activation's
backward"). Each program (one per SM) walks its tiles i = pid, pid + grid, ...:
  producer (4 warps): per tile, per 64-deep step, the TMA load of w's block (w [E, K, N]: its
      [64, 128] block; W_T, the transposed view of a contiguous [E, N, K]: a [128, 64] block of
      that storage) and the cp.async of a's 128 rows (gathered, or the tile's sorted rows) into a
      ring of NUM_BUF slots;
  consumer c (one warpgroup each, c = 0, 1): the tiles i with i % 2 == c, a [128, 128] fp32
      accumulator. c multiplies tile i only once the other's MMAs of tile i - 1 are done, so the
      ring's slots are read in step order (a parity wait on a slot's barrier is only sound within
      one phase of it: docs/performance.md on the bug this order fixed). Each consumer stores its
      tiles through a 32 KB buffer of its own (TMA; an expert's last, partial tile read back and
      stored from registers, its rows masked), under the other's MMAs.
"""
from __future__ import annotations

import torch

from . import switches
from ._gluon import (TensorDescriptor, async_copy, async_load, available, barrier, fence_async_shared, gl, gluon,
                     maxnreg, mbarrier, num_sms, on_sm90, rows_ok, tma, tma_load, tma_store, warpgroup_mma,
                     warpgroup_mma_wait)
from .gluon_gemm import shared_layout, tile_table, transposed_view
from .launcher import launch

BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF = 128, 128, 64, 5  # ring slots of 32 KB beside the two 32 KB store buffers
PRODUCER_WARPS, PRODUCER_REGS, CONSUMER_REGS = 4, 80, 208
# the plain product goes here up to this reduction (longer ones: gluon_gemm's cooperative kernel,
# whose 128 x 256 tile reads less of L2 per FLOP)
PLAIN_MAX_K = 512

if gluon is not None:
    from .gluon_gemm import program_tiles, store_rows, tanh_approx, tile_mn, tile_rows

    # ------------------------------------------------------------------------------------------
    # The ring and the turns (the activation's backward in gluon_dact.py uses them too)
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def pingpong_producer(a_ptr, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs,
                          w_bufs, a_ready, w_ready, empty_bars, K, N, stride_am, HAS_GATHER: gl.constexpr,
                          W_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          NUM_BUF: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
        """Per tile, per step: wait for a free slot, the TMA load of w's block (W_T: a
        [BLOCK_N, BLOCK_K] block of its [E * N, K] storage; else [BLOCK_K, BLOCK_N] of [E * K, N])
        and the cp.async of a's rows (the next tile's rows looked up a tile ahead)."""
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
                mbarrier.expect(bar, w_desc.block_type.nbytes)
                if W_T:
                    tma_load(w_desc, [e * N + n0, kk * BLOCK_K], bar, w_bufs.index(slot))  # storage [E * N, K]
                else:
                    tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(slot))  # w as [E * K, N]
                cols = kk * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, load_layout))
                ptrs = a_ptr + rows.to(gl.int64)[:, None] * stride_am + cols[None, :]
                async_load(a_bufs.index(slot), ptrs, mask[:, None] & (cols < K)[None, :])
                async_copy.mbarrier_arrive(a_ready.index(slot), increment_count=False)  # when they land
                count += 1
            rows, mask = tile_rows(pid + (i + 1) * nprog, total, tiles_n, tile_row_ptr, tile_end_ptr, gather_ptr,
                                   HAS_GATHER, BLOCK_M, BLOCK_N, load_layout)

    @gluon.jit
    def pingpong_mma(C: gl.constexpr, i, k_steps, turn_bars, a_bufs, w_bufs, a_ready, w_ready, empty_bars,
                     W_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                     acc_layout: gl.constexpr):
        """Consumer C's turn at the ring for this program's tile i (i % 2 == C): wait until the other
        consumer's MMAs of tile i - 1 are done (consumer 0's first tile waits for nothing), multiply
        (one MMA a step in flight, the slot of the step before freed), hand the turn over once this
        tile's MMAs are done. Returns the fp32 accumulator."""
        count = i * k_steps  # the ring's steps are taken in tile order
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        # this tile's first step is k_steps past the other's first: waiting on its slot before the
        # other is done could pass a phase early
        mbarrier.wait(turn_bars.index(C), ((i // 2) & 1) ^ (1 - C))
        for kk in range(k_steps):
            slot = count % NUM_BUF
            phase = (count // NUM_BUF) & 1
            mbarrier.wait(w_ready.index(slot), phase)
            mbarrier.wait(a_ready.index(slot), phase)
            fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores
            w_tile = w_bufs.index(slot)
            if W_T:  # the [BLOCK_N, BLOCK_K] block read as [BLOCK_K, BLOCK_N]
                w_tile = w_tile.permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(slot), w_tile, acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # the step before is done: its slot free
            barrier()  # this warpgroup's warps, before the one arrival
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=kk > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        barrier()
        mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
        mbarrier.arrive(turn_bars.index(1 - C))  # the other consumer's turn to multiply
        return acc

    # ------------------------------------------------------------------------------------------
    # The forward kernel: plain, or GELU's pre-activation and activation
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _put(vals, desc, ptr, buf, row0, row_end, col0, N, stride_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Store a [BLOCK_M, BLOCK_N] bf16 tile through this consumer's buffer: by TMA where every row
        is the expert's (left running), else read back 16 bytes a thread and stored with its rows
        before row_end masked."""
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        tma.store_wait(0)  # the buffer's last TMA store has read it
        barrier()  # and every thread its last read-back
        buf.store(vals)
        if row0 + BLOCK_M <= row_end:
            fence_async_shared()
            tma_store(desc, [row0, col0], buf)
        else:
            barrier()
            store_rows(ptr, buf.load(store_layout), row0, row_end, col0, N, stride_m, BLOCK_M, BLOCK_N, store_layout)

    @gluon.jit
    def _gelu_act(pre, act_scale, HAS_ACT_SCALE: gl.constexpr):
        """act_scale(s)·gelu(pre) of the rounded pre-activation in fp32 with the hardware's tanh
        (kernels/activation.py's gelu_and_grad, its FAST path, as the Triton kernel's epilogue),
        rounded to bf16."""
        h = pre.to(gl.float32)
        t = tanh_approx(0.7978845608028654 * (h + 0.044715 * h * h * h))
        act = 0.5 * h * (1.0 + t)
        if HAS_ACT_SCALE:
            act = act * act_scale[:, None]
        return act.to(gl.bfloat16)

    @gluon.jit
    def _fwd_consumer(C: gl.constexpr, out_ptr, act_ptr, out_desc, act_desc, out_smem, act_scale_ptr, turn_bars,
                      tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready, empty_bars, K, N,
                      stride_om, stride_actm, GELU: gl.constexpr, HAS_ACT_SCALE: gl.constexpr, W_T: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr):
        """Consumer C's tiles: its turn at the ring, then the tile stored (GELU: pre, then act)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        buf = out_smem.index(C)
        for i in range(C, my_tiles, 2):
            m, n0 = tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            row0 = gl.load(tile_row_ptr + m)
            row_end = gl.load(tile_end_ptr + m)  # the expert's end: rows from it on are another's
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            act_scale = rows  # unused without HAS_ACT_SCALE
            if HAS_ACT_SCALE:  # in flight during the MMAs
                act_scale = gl.load(act_scale_ptr + rows, mask=rows < row_end, other=0.0)
            acc = pingpong_mma(C, i, k_steps, turn_bars, a_bufs, w_bufs, a_ready, w_ready, empty_bars, W_T,
                               BLOCK_M, BLOCK_N, NUM_BUF, acc_layout)
            pre = acc.to(gl.bfloat16)  # GELU: the activation is computed from the rounded value
            _put(pre, out_desc, out_ptr, buf, row0, row_end, n0, N, stride_om, BLOCK_M, BLOCK_N)
            if GELU:
                _put(_gelu_act(pre, act_scale, HAS_ACT_SCALE), act_desc, act_ptr, buf, row0, row_end, n0, N,
                     stride_actm, BLOCK_M, BLOCK_N)
        tma.store_wait(0)

    @gluon.jit
    def _grouped_gemm_pingpong_kernel(
        a_ptr, gather_ptr, w_desc, out_desc, act_desc, out_ptr, act_ptr, act_scale_ptr, tile_e_ptr, tile_row_ptr,
        tile_end_ptr, num_m_ptr, K, N, stride_am, stride_om, stride_actm,
        GELU: gl.constexpr, HAS_GATHER: gl.constexpr, HAS_ACT_SCALE: gl.constexpr, W_T: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], a_layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
        out_smem = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(a_ready.index(i), count=PRODUCER_WARPS * 32)  # each producer thread's copies
            mbarrier.init(w_ready.index(i), count=1)  # the producer's expect; TMA's bytes complete it
            mbarrier.init(empty_bars.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn_bars.index(i), count=1)
        gl.warp_specialize([
            (_fwd_consumer, (gl.constexpr(0), out_ptr, act_ptr, out_desc, act_desc, out_smem, act_scale_ptr,
                             turn_bars, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready,
                             empty_bars, K, N, stride_om, stride_actm, GELU, HAS_ACT_SCALE, W_T, BLOCK_M, BLOCK_N,
                             BLOCK_K, NUM_BUF)),
            (_fwd_consumer, (gl.constexpr(1), out_ptr, act_ptr, out_desc, act_desc, out_smem, act_scale_ptr,
                             turn_bars, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready,
                             empty_bars, K, N, stride_om, stride_actm, GELU, HAS_ACT_SCALE, W_T, BLOCK_M, BLOCK_N,
                             BLOCK_K, NUM_BUF)),
            (pingpong_producer, (a_ptr, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr,
                                 a_bufs, w_bufs, a_ready, w_ready, empty_bars, K, N, stride_am, HAS_GATHER, W_T,
                                 BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, PRODUCER_WARPS)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def supported(a_MK, w_EKN, offsets_E1, *, gather_S=None, scatter_S=None, scale_S=None, activation=None,
              act_scale_S=None, out_dtype=None) -> bool:
    """Whether ``grouped_gemm`` with these arguments runs here: bf16 a and w and a bf16 result, no
    ``scale_S``, no scatter, K a multiple of 64 and N of 128; either GELU (w [E, K, N] contiguous,
    a gathered or not, an fp32 ``act_scale_S`` or none) or the plain product of sorted rows with K
    at most PLAIN_MAX_K (w contiguous or the transposed view of a contiguous [E, N, K]); on an sm_90
    GPU, Gluon available, neither MEGATRON_MOE_GLUON_GEMM nor MEGATRON_MOE_GLUON_PINGPONG 0."""
    if not (switches.gluon_gemm() and switches.gluon_pingpong() and available()):
        return False
    if scale_S is not None or scatter_S is not None or activation not in (None, "gelu"):
        return False
    if activation is None and (gather_S is not None or act_scale_S is not None):
        return False
    if any(t.dtype != torch.bfloat16 for t in (a_MK, w_EKN)) or (out_dtype or a_MK.dtype) != torch.bfloat16:
        return False
    if a_MK.dim() != 2 or w_EKN.dim() != 3 or offsets_E1.dim() != 1:  # grouped_gemm's checks say what is wrong
        return False
    if offsets_E1.shape[0] != w_EKN.shape[0] + 1 or w_EKN.shape[0] == 0:
        return False
    for idx in (gather_S, act_scale_S):
        if idx is not None and (idx.dim() != 1 or not idx.is_contiguous()):
            return False
    if act_scale_S is not None and act_scale_S.dtype != torch.float32:
        return False
    S = gather_S.shape[0] if gather_S is not None else a_MK.shape[0]
    K, N = a_MK.shape[1], w_EKN.shape[2]
    if min(S, K, N) == 0 or K % BLOCK_K or N % BLOCK_N or w_EKN.data_ptr() % 16:
        return False
    if activation is None and K > PLAIN_MAX_K:
        return False
    if not (w_EKN.is_contiguous() or (activation is None and transposed_view(w_EKN))):
        return False
    return rows_ok(a_MK) and on_sm90(a_MK)


def grouped_gemm_pingpong(a_MK, w_EKN, offsets_E1, *, gather_S=None, activation=None, act_scale_S=None):
    """``grouped_gemm``'s result (bf16; gelu: (pre, act); rows past offsets_E1[-1] are not
    written), within what :func:`supported` takes (checked there, not here)."""
    S = gather_S.shape[0] if gather_S is not None else a_MK.shape[0]
    K = a_MK.shape[1]
    E, _, N = w_EKN.shape
    dev = a_MK.device
    gelu = activation == "gelu"
    out = torch.empty(S, N, device=dev, dtype=torch.bfloat16)
    act = torch.empty(S, N, device=dev, dtype=torch.bfloat16) if gelu else out
    tile_e, tile_row, tile_end, num_m = tile_table(offsets_E1, S)
    w_t = transposed_view(w_EKN)
    if w_t:  # its [E, N, K] storage, blocks of [BLOCK_N, BLOCK_K]
        w_desc = TensorDescriptor(w_EKN, [E * N, K], [K, 1], [BLOCK_N, BLOCK_K], shared_layout(BLOCK_N, BLOCK_K))
    else:
        w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N], shared_layout(BLOCK_K, BLOCK_N))
    tile = shared_layout(BLOCK_M, BLOCK_N)
    out_desc = TensorDescriptor(out, [S, N], [N, 1], [BLOCK_M, BLOCK_N], tile)
    act_desc = TensorDescriptor(act, [S, N], [N, 1], [BLOCK_M, BLOCK_N], tile) if gelu else out_desc
    launch(_grouped_gemm_pingpong_kernel, (num_sms(dev),),
           (a_MK, gather_S if gather_S is not None else offsets_E1, w_desc, out_desc, act_desc, out, act,
            act_scale_S if act_scale_S is not None else out, tile_e, tile_row, tile_end, num_m, K, N,
            a_MK.stride(0), out.stride(0), act.stride(0)),
           dict(GELU=gelu, HAS_GATHER=gather_S is not None, HAS_ACT_SCALE=act_scale_S is not None, W_T=w_t,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NUM_BUF=NUM_BUF, PRODUCER_WARPS=PRODUCER_WARPS,
                PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS, num_warps=4,
                maxnreg=maxnreg(4, 4 + PRODUCER_WARPS)))
    return (out, act) if gelu else out
