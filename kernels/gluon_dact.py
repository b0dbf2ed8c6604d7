"""The activation's backward GEMM for Hopper in Gluon, with two MMA warpgroups taking turns (ping-pong):
while one multiplies a tile, the other runs its epilogue.

    dpre_SX, dscale_S = grouped_gemm_dact_pingpong(dy_TH, w2_EKN, offsets_E1, pre_SX, "swiglu",
                                                   gather_S=token_S, scale_S=weight_S, inplace=True)

g[s] = dy[gather(s)] @ w2[e]ᵀ (w_EKN the transposed view of a contiguous [E, N, K] tensor), then
dpre = scale(s)·g·act'(pre) written over pre (swiglu: [d gate | d up]) and Σ_n g·act(pre) per row:
what kernels/grouped.py's ``grouped_gemm_dact`` computes (its ``grouped_gemm_dact_reference`` is the
reference), and where it sends the calls :func:`supported` takes (sm_90; MEGATRON_MOE_GLUON_DACT=0:
never).

Why (docs/performance.md, "The ping-pong kernel of the activation's backward"): the Triton kernel's
epilogue (the pre-activation's read and dpre's write, 0.5-0.8 GB at the SwiGLU shapes) never overlaps
its MMAs. Here it does: 1.00-1.30x the Triton kernel at seven shapes, sonic-4096 level, sonic-1536
1.30x (``benchmarks/bench_gluon.py --only dact``, H200, 2026-12-03).
Each program (one per SM) walks its tiles i = pid, pid + grid, ...:
  producer (4 warps): per tile, per step of the reduction (64 deep; gelu 128 where K allows: TILE),
      the TMA load of w's [128, step] block of its [E * N, K] storage and the cp.async of a's 128
      gathered rows into a ring of slots; with sorted rows (no gather: a top-1 layer's backward
      permutes dy once) one warp loads a's blocks by TMA too (kernels/gluon_gemm.py's
      ``tma_producer``; an expert's last tile then reads rows past the expert's end, whose
      results are not stored): at dmoe-small's shape on an H200 1.877 ms against 2.018 by
      cp.async and 2.090 gathered, each call with a ~0.35 ms copy of pre (docs/performance.md,
      "dmoe-small's layer at micro-batch 128");
  consumer c (one warpgroup each, c = 0, 1): the tiles i with i % 2 == c, a [128, 128] fp32
      accumulator. The consumers take turns at the ring: c multiplies tile i only once the other's
      MMAs of tile i - 1 are done, so the ring's slots are read in step order (a parity wait on a
      slot's barrier is only sound within one phase of it). They also take turns at one
      pre-activation buffer (swiglu: gate and up, 64 KB): after its MMAs, c loads its tile's
      pre-activation there by TMA, runs the epilogue in place and stores dpre from it (TMA; the
      expert's last, partial tile from registers, its rows masked), all under the other's MMAs. One
      buffer rather than one per consumer leaves room for a ring of 5 slots (swiglu; gelu 3 of
      128-deep steps), which is where the speed came from: with two buffers and 3 slots of 64-deep
      steps the kernel was 0.91-1.12x Triton's.
"""
from __future__ import annotations

import torch

from . import switches
from ._common import cdiv
from ._gluon import (TensorDescriptor, available, barrier, fence_async_shared, gl, gluon, maxnreg, mbarrier, num_sms,
                     on_sm90, rows_ok, tma, tma_load, tma_store, warpgroup_mma, warpgroup_mma_wait)
from .gluon_gemm import shared_layout, tile_table, transposed_view
from .launcher import launch

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # what every call's shape must divide (K by BLOCK_K, N by BLOCK_N)
# a consumer's tile and the ring: (rows, columns, reduction step, slots), 224 KB of shared memory
# each (smem_bytes). GELU takes 128-deep steps where K allows: 1.01-1.05x the 64-deep ring of six
# slots at its three shapes (H100, docs/performance.md, "The activation backward's tile"); SwiGLU's
# 64 KB pre-activation leaves room for two such slots only.
TILE = {"swiglu": (128, 128, 64, 5), "gelu": (128, 128, 128, 3)}
TILE_K64 = {"swiglu": (128, 128, 64, 5), "gelu": (128, 128, 64, 6)}  # K an odd multiple of 64
PRODUCER_WARPS, PRODUCER_REGS, CONSUMER_REGS = 4, 80, 208
TMA_PRODUCER_WARPS, TMA_PRODUCER_REGS = 1, 40  # rows sorted: one warp issues a's and w's TMA loads


def tile_for(activation, K):
    """The tile :func:`grouped_gemm_dact_pingpong` runs at reduction K (a multiple of BLOCK_K)."""
    tile = TILE[activation]
    return tile if K % tile[2] == 0 else TILE_K64[activation]


def smem_bytes(tile, activation):
    """The kernel's shared memory with tile (rows, columns, step, slots): the ring's slots of a's
    and w's blocks beside the one pre-activation buffer (swiglu: gate and up)."""
    rows, cols, step, slots = tile
    return slots * (rows + cols) * step * 2 + rows * cols * 2 * (2 if activation == "swiglu" else 1)

if gluon is not None:
    from .gluon_gemm import gathered_producer, program_tiles, store_rows, tanh_approx, tile_head, tile_mn, tma_producer

    @gluon.jit
    def _gelu_and_grad(h):
        """kernels/activation.py's gelu_and_grad with the hardware's tanh (its FAST path)."""
        t = tanh_approx(0.7978845608028654 * (h + 0.044715 * h * h * h))
        act = 0.5 * h * (1.0 + t)
        grad = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
        return act, grad

    @gluon.jit
    def _epilogue_part(acc, h_buf, up_buf, scale, SWIGLU: gl.constexpr, HAS_SCALE: gl.constexpr,
                       layout: gl.constexpr):
        """Some of a tile's columns: acc = g there, h_buf / up_buf the pre-activation's (shared
        memory), overwritten by dpre's (d gate, d up; gelu: dh); returns Σ_n g·act(pre)."""
        g = acc
        if HAS_SCALE:
            g = acc * gl.convert_layout(scale, gl.SliceLayout(1, layout))[:, None]
        h = h_buf.load(layout).to(gl.float32)
        if SWIGLU:  # kernels/activation.py's swiglu_bwd, its FAST path
            up = up_buf.load(layout).to(gl.float32)
            sig = 0.5 + 0.5 * tanh_approx(0.5 * h)
            silu = h * sig
            act = silu * up
            h_buf.store((g * up * sig * (1.0 + h * (1.0 - sig))).to(gl.bfloat16))
            up_buf.store((g * silu).to(gl.bfloat16))
        else:
            act, grad = _gelu_and_grad(h)
            h_buf.store((g * grad).to(gl.bfloat16))
        return gl.sum(acc * act, axis=1)

    @gluon.jit
    def _consumer(C: gl.constexpr, pre_ptr, pre_desc, pre_smem, pre_bars, turn_bars, pre_turn, dscale_ptr, scale_ptr,
                  tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready, empty_bars, K, N,
                  stride_pm, num_slots, SWIGLU: gl.constexpr, HAS_SCALE: gl.constexpr, A_TMA: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr):
        """Consumer C's tiles (i % 2 == C of this program's): its turn at the ring (one MMA a step in
        flight), then its turn at the pre-activation's buffer, the epilogue there, dpre stored from it."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 bytes a thread
        NUM_PRE: gl.constexpr = 2 if SWIGLU else 1
        pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        pre_bar = pre_bars.index(C)
        h_smem = pre_smem.index(0)
        up_smem = pre_smem.index(NUM_PRE - 1)  # swiglu's up block (gelu: the same as h's)
        for i in range(C, my_tiles, 2):
            count = i * k_steps  # the ring's steps are taken in tile order
            m, n0 = tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
            row0, row_end, rows, scale = tile_head(m, tile_row_ptr, tile_end_ptr, scale_ptr, HAS_SCALE, BLOCK_M,
                                                   acc_layout)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            # the other consumer's MMAs of the tile before are all done (its ring steps too): a parity
            # wait on a slot is only sound within one phase of the barrier, and this tile's first step
            # is k_steps past the other's first (consumer 0's first tile waits for nothing)
            mbarrier.wait(turn_bars.index(C), ((i // 2) & 1) ^ (1 - C))
            for kk in range(k_steps):
                slot = count % NUM_BUF
                phase = (count // NUM_BUF) & 1
                mbarrier.wait(w_ready.index(slot), phase)  # A_TMA: a's bytes too
                if not A_TMA:
                    mbarrier.wait(a_ready.index(slot), phase)
                    fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores
                acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, use_acc=kk > 0,
                                    is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])  # the step before is done: its slot free
                barrier()  # this warpgroup's warps, before the one arrival
                mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF), pred=kk > 0)
                count += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            barrier()
            mbarrier.arrive(empty_bars.index((count + NUM_BUF - 1) % NUM_BUF))
            mbarrier.arrive(turn_bars.index(1 - C))  # the other consumer's turn to multiply
            # the pre-activation's buffer once the other consumer's epilogue of the tile before is done
            # with it (consumer 0's first tile waits for nothing), its load under the other's MMAs
            mbarrier.wait(pre_turn.index(C), ((i // 2) & 1) ^ (1 - C))
            mbarrier.expect(pre_bar, NUM_PRE * pre_desc.block_type.nbytes)
            tma_load(pre_desc, [row0, n0], pre_bar, h_smem)
            if SWIGLU:
                tma_load(pre_desc, [row0, N + n0], pre_bar, up_smem)
            mbarrier.wait(pre_bar, (i // 2) & 1)
            # the epilogue in eighths of the columns, one after the other (registers: the whole tile's
            # gradient, gate and up beside the accumulator spilled kilobytes): the accumulator's parts
            # are its own registers, the pre-activation's parts slices of the buffers; each part's
            # dpre goes back over the slices it was read from (the same layout: each thread writes
            # what it read), which also keeps the next part's loads behind this part's stores
            a0, a1 = acc.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute((0, 2, 1)).split()
            b0, b1 = a0.reshape([BLOCK_M, 2, BLOCK_N // 4]).permute((0, 2, 1)).split()
            b2, b3 = a1.reshape([BLOCK_M, 2, BLOCK_N // 4]).permute((0, 2, 1)).split()
            c0, c1 = b0.reshape([BLOCK_M, 2, BLOCK_N // 8]).permute((0, 2, 1)).split()
            c2, c3 = b1.reshape([BLOCK_M, 2, BLOCK_N // 8]).permute((0, 2, 1)).split()
            c4, c5 = b2.reshape([BLOCK_M, 2, BLOCK_N // 8]).permute((0, 2, 1)).split()
            c6, c7 = b3.reshape([BLOCK_M, 2, BLOCK_N // 8]).permute((0, 2, 1)).split()
            P: gl.constexpr = BLOCK_N // 8
            p_layout: gl.constexpr = c0.type.layout
            parts = (c0, c1, c2, c3, c4, c5, c6, c7)
            row_sum = _epilogue_part(parts[0], h_smem.slice(0, P, dim=1), up_smem.slice(0, P, dim=1), scale, SWIGLU,
                                     HAS_SCALE, p_layout)
            for j in gl.static_range(1, 8):
                row_sum += _epilogue_part(parts[j], h_smem.slice(j * P, P, dim=1), up_smem.slice(j * P, P, dim=1),
                                          scale, SWIGLU, HAS_SCALE, p_layout)
            gl.store(dscale_ptr + rows.to(gl.int64) * num_slots + n0 // BLOCK_N,
                     gl.convert_layout(row_sum, rows.type.layout), mask=rows < row_end)
            if row0 + BLOCK_M <= row_end:  # every row this expert's: TMA
                fence_async_shared()
                tma_store(pre_desc, [row0, n0], h_smem)
                if SWIGLU:
                    tma_store(pre_desc, [row0, N + n0], up_smem)
            else:  # the expert's last tile: its rows only, read back 16 bytes a thread
                barrier()
                X = N * NUM_PRE
                store_rows(pre_ptr, h_smem.load(store_layout), row0, row_end, n0, X, stride_pm, BLOCK_M, BLOCK_N,
                           store_layout)
                if SWIGLU:
                    store_rows(pre_ptr, up_smem.load(store_layout), row0, row_end, N + n0, X, stride_pm, BLOCK_M,
                               BLOCK_N, store_layout)
            tma.store_wait(0)  # the stores have read the buffer
            fence_async_shared()  # this consumer's writes of it before the other's TMA load
            barrier()  # and each thread's reads
            mbarrier.arrive(pre_turn.index(1 - C))

    @gluon.jit
    def _producer(a_ptr, a_desc, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs,
                  a_ready, w_ready, empty_bars, K, N, stride_am, HAS_GATHER: gl.constexpr, A_TMA: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
                  PRODUCER_WARPS: gl.constexpr):
        """A_TMA: one warp's TMA loads of a's and w's blocks (w_ready counts both; a_ready unused);
        else the producer warps' cp.async of a's rows beside w's TMA loads."""
        if A_TMA:
            tma_producer(a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, w_ready, empty_bars, K, N,
                         BLOCK_N, BLOCK_K, NUM_BUF, True)
        else:
            gathered_producer(a_ptr, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs,
                              w_bufs, a_ready, w_ready, empty_bars, K, N, stride_am, HAS_GATHER, False, BLOCK_M,
                              BLOCK_N, BLOCK_K, NUM_BUF, PRODUCER_WARPS)

    @gluon.jit
    def _grouped_gemm_dact_pingpong_kernel(
        a_ptr, a_desc, gather_ptr, w_desc, pre_desc, pre_ptr, dscale_ptr, scale_ptr, tile_e_ptr, tile_row_ptr,
        tile_end_ptr, num_m_ptr, K, N, stride_am, stride_pm, num_slots,
        SWIGLU: gl.constexpr, HAS_GATHER: gl.constexpr, HAS_SCALE: gl.constexpr, A_TMA: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        # A_TMA (rows sorted, no gather): a's blocks by TMA beside w's, one barrier for both; an
        # expert's last tile then reads rows of the next expert (or zeros past a's end) into rows
        # whose results are never stored. Else a's rows by the producer warps' cp.async.
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], a_layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
        # the pre-activation's blocks (swiglu: gate and up), the consumers' epilogues' in turn
        pre_smem = gl.allocate_shared_memory(pre_desc.dtype, [2 if SWIGLU else 1] + pre_desc.block_type.shape,
                                             pre_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        pre_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pre_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(a_ready.index(i), count=PRODUCER_WARPS * 32)  # each producer thread's copies
            mbarrier.init(w_ready.index(i), count=1)  # the producer's expect; TMA's bytes complete it
            mbarrier.init(empty_bars.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(pre_bars.index(i), count=1)
            mbarrier.init(turn_bars.index(i), count=1)
            mbarrier.init(pre_turn.index(i), count=1)
        gl.warp_specialize([  # one consumer function, its index C a constexpr argument
            (_consumer, (gl.constexpr(0), pre_ptr, pre_desc, pre_smem, pre_bars, turn_bars, pre_turn, dscale_ptr,
                         scale_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready,
                         empty_bars, K, N, stride_pm, num_slots, SWIGLU, HAS_SCALE, A_TMA, BLOCK_M, BLOCK_N, BLOCK_K,
                         NUM_BUF)),
            (_consumer, (gl.constexpr(1), pre_ptr, pre_desc, pre_smem, pre_bars, turn_bars, pre_turn, dscale_ptr,
                         scale_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs, w_bufs, a_ready, w_ready,
                         empty_bars, K, N, stride_pm, num_slots, SWIGLU, HAS_SCALE, A_TMA, BLOCK_M, BLOCK_N, BLOCK_K,
                         NUM_BUF)),
            (_producer, (a_ptr, a_desc, gather_ptr, w_desc, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, a_bufs,
                         w_bufs, a_ready, w_ready, empty_bars, K, N, stride_am, HAS_GATHER, A_TMA, BLOCK_M, BLOCK_N,
                         BLOCK_K, NUM_BUF, PRODUCER_WARPS)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def supported(a_MK, w_EKN, offsets_E1, pre_SX, activation, *, gather_S=None, scale_S=None) -> bool:
    """Whether ``grouped_gemm_dact`` with these arguments runs here: bf16 a, w and pre, w the
    transposed view of a contiguous [E, N, K] tensor (the backward's w2ᵀ), K a multiple of 64,
    N of 128, pre's rows 16-byte aligned and contiguous, an fp32 ``scale_S``; on an sm_90 GPU,
    Gluon available, neither MEGATRON_MOE_GLUON_GEMM nor MEGATRON_MOE_GLUON_DACT 0."""
    if not (switches.gluon_gemm() and switches.gluon_dact() and available()) or activation not in ("gelu", "swiglu"):
        return False
    if any(t.dtype != torch.bfloat16 for t in (a_MK, w_EKN, pre_SX)):
        return False
    if a_MK.dim() != 2 or w_EKN.dim() != 3 or offsets_E1.dim() != 1 or pre_SX.dim() != 2:
        return False
    if offsets_E1.shape[0] != w_EKN.shape[0] + 1 or w_EKN.shape[0] == 0:
        return False
    for idx in (gather_S, scale_S):
        if idx is not None and (idx.dim() != 1 or not idx.is_contiguous()):
            return False
    if scale_S is not None and scale_S.dtype != torch.float32:
        return False
    S = gather_S.shape[0] if gather_S is not None else a_MK.shape[0]
    K, N = a_MK.shape[1], w_EKN.shape[2]
    if min(S, K, N) == 0 or K % BLOCK_K or N % BLOCK_N:
        return False
    if not transposed_view(w_EKN) or w_EKN.data_ptr() % 16:
        return False
    if pre_SX.shape != (S, N * (2 if activation == "swiglu" else 1)) or not rows_ok(pre_SX):
        return False
    return rows_ok(a_MK) and on_sm90(a_MK)


def grouped_gemm_dact_pingpong(a_MK, w_EKN, offsets_E1, pre_SX, activation, *, gather_S=None, scale_S=None,
                               inplace=False, tile=None):
    """``grouped_gemm_dact``'s result (dpre, Σ_n g·act(pre)), within what :func:`supported` takes
    (checked there, not here). Not ``inplace``: pre is copied first and the copy overwritten.
    ``tile``: (rows, columns, step, slots) in place of :func:`tile_for`'s (benchmarks; the columns
    must divide N, the step K)."""
    S, K = pre_SX.shape[0], a_MK.shape[1]
    E, _, N = w_EKN.shape
    tile = tile or tile_for(activation, K)
    block_m, block_n, block_k, num_buf = tile
    if N % block_n or K % block_k:
        raise ValueError(f"grouped_gemm_dact_pingpong: tile {tile} needs N ({N}) a multiple of {block_n} and K ({K}) "
                         f"of {block_k}; pick another tile")
    dev = a_MK.device
    dpre = pre_SX if inplace else pre_SX.clone()
    num_slots = cdiv(N, block_n)
    dscale_part = torch.empty(S, num_slots, device=dev, dtype=torch.float32)
    tile_e, tile_row, tile_end, num_m = tile_table(offsets_E1, S, block_m)
    w_desc = TensorDescriptor(w_EKN, [E * N, K], [K, 1], [block_n, block_k], shared_layout(block_n, block_k))
    pre_desc = TensorDescriptor(dpre, list(dpre.shape), [dpre.stride(0), 1], [block_m, block_n],
                                shared_layout(block_m, block_n))
    a_tma = gather_S is None and switches.gluon_dact_tma()
    if a_tma:  # sorted rows: a's blocks by TMA (a's own rows: S of them)
        a_desc = TensorDescriptor(a_MK, [a_MK.shape[0], K], [a_MK.stride(0), 1], [block_m, block_k],
                                  shared_layout(block_m, block_k))
        producer_warps, producer_regs = TMA_PRODUCER_WARPS, TMA_PRODUCER_REGS
    else:
        a_desc, producer_warps, producer_regs = w_desc, PRODUCER_WARPS, PRODUCER_REGS  # (a_desc unused)
    launch(_grouped_gemm_dact_pingpong_kernel, (num_sms(dev),),
           (a_MK, a_desc, gather_S if gather_S is not None else offsets_E1, w_desc, pre_desc, dpre, dscale_part,
            scale_S if scale_S is not None else dscale_part, tile_e, tile_row, tile_end, num_m, K, N, a_MK.stride(0),
            dpre.stride(0), num_slots),
           dict(SWIGLU=activation == "swiglu", HAS_GATHER=gather_S is not None, HAS_SCALE=scale_S is not None,
                A_TMA=a_tma, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_BUF=num_buf,
                PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs, CONSUMER_REGS=CONSUMER_REGS, num_warps=4,
                maxnreg=maxnreg(4, 4 + producer_warps)))
    return dpre, dscale_part.sum(1)
