"""Experiment (issue #35): Gluon kernels in two-CTA clusters that load w's block once and multicast it
into both CTAs' shared memory, a third fewer L2 bytes a tile than our single-CTA kernels (the lever
the performance notes name for the gathered and short-reduction GEMMs: docs/performance.md, "TMA
multicast in the Triton of torch 2.12 to 2.14").

    python benchmarks/proto_multicast.py --compile-only   # any machine, Triton >= 3.8: compiles the three
                                                          #   kernels for sm_90, prints the PTX lines that matter
    python benchmarks/proto_multicast.py                  # an sm_90 GPU: the smoke GEMM checked and timed
    python benchmarks/proto_multicast.py --grouped        # an sm_90 GPU: the pair kernels against the
                                                          #   single-CTA Gluon kernels at the layer's shapes

A program is a cluster; a's (or the gathered x's) 256-row block is sharded over its two CTAs
(``cga_layout=[[1, 0]]``: 128 rows each), w's block is held whole by both (``cga_layout=[[0, 0]]``)
and loaded by ``multicast=True``, which the CTA of rank 0 issues for both.
  smoke (``cluster_gemm``): c = a @ w, one slot, a cluster barrier after each step (Triton >= 3.7).
  pair (``grouped_gemm_pair``): the plain row-grouped GEMM (sorted rows, both operands by TMA: the
      down projection at top-k > 1), persistent and warp-specialised as kernels/gluon_gemm.py's,
      over 256-row pairs of one expert's tiles; a ring slot is released to the multicasting CTA by a
      two-CTA mbarrier (``mbarrier.allocate_mbarrier(two_ctas=True)``: each consumer arrives on the
      lead CTA's barrier, the lead's producer waits), and to its own rows' producer by one a CTA.
  swiglu (``swiglu_pair``): the SwiGLU up projection the same way, each CTA gathering its 128 rows of
      x by ``cp.async``, the gate's and the up projection's blocks multicast.
The pair kernels need Triton >= 3.8 (torch >= 2.14): 3.7 (torch 2.12, 2.13) compiles the two-CTA
barrier's arrive as a local one (a race), and 3.6 (torch 2.11, the GPU machines') has no multicast;
on those machines a stripped Triton 3.8 travels with the call (benchmarks/triton_bundle.sh). They
store whole pairs only (an expert's rows a multiple of 256, ``pair_offsets``): Triton 3.8's
``gl.store`` refuses a cluster layout, so a partial tile needs a TMA store through a descriptor
clipped at the expert's end.
"""
from __future__ import annotations

import argparse
import re

import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megatron_moe.kernels._gluon import async_copy, async_load, tma_load, tma_store  # either release's names
from megatron_moe.kernels.gluon_gemm import program_tiles, tile_mn  # a program is a cluster here: gl.program_id's

BM, BN, BK, NUM_WARPS = 256, 256, 64, 8  # a cluster's tile (128 rows a CTA), w's block, the step
PAIR = [[1, 0]]  # CTA bit 0 -> the second half of dim 0: each CTA its own rows
BROADCAST = [[0, 0]]  # both CTAs hold the whole block


@gluon.jit
def _cluster_gemm_kernel(a_desc, w_desc, c_desc, K, TWO_CTA_BARRIER: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Cluster m (program m: a program is a cluster) computes c's rows [256 m, 256 m + 256)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    row0 = gl.program_id(0) * BLOCK_M
    a_s = gl.allocate_shared_memory(a_desc.dtype, [BLOCK_M, BLOCK_K], a_desc.layout)
    w_s = gl.allocate_shared_memory(w_desc.dtype, [BLOCK_K, BLOCK_N], w_desc.layout)
    ready = mbarrier.allocate_mbarrier()  # one a CTA
    mbarrier.init(ready, count=1)
    # what a warp-specialised kernel would release its slots with (see the docstring); a barrier
    # across CTAs is initialised before any use (Triton 3.9 refuses it otherwise)
    empty = mbarrier.allocate_mbarrier(two_ctas=True)
    mbarrier.init(empty, count=1)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16], cga_layout=[[1, 0]])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    phase = 0
    for k in range(0, K, BLOCK_K):
        # a CTA's bytes: its half of a's block and all of w's
        mbarrier.expect(ready, a_desc.block_type.nbytes // 2 + w_desc.block_type.nbytes)
        tma_load(a_desc, [row0, k], ready, a_s)
        tma_load(w_desc, [k, 0], ready, w_s, multicast=True)
        mbarrier.wait(ready, phase)
        acc = warpgroup_mma(a_s, w_s, acc, use_acc=k > 0, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.barrier(cluster=True)  # both CTAs done with w_s before the next multicast overwrites it
        phase ^= 1
    if TWO_CTA_BARRIER:
        mbarrier.arrive(empty)
        mbarrier.wait(empty, 0)
    c_s = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    c_s.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma_store(c_desc, [row0, 0], c_s)
    tma.store_wait(0)


def descriptors(a, w, c):
    layout = gl.NVMMASharedLayout.get_default_for
    return (TensorDescriptor.from_tensor(a, [BM, BK], layout([BM, BK], gl.bfloat16, cga_layout=PAIR)),
            TensorDescriptor.from_tensor(w, [BK, BN], layout([BK, BN], gl.bfloat16, cga_layout=BROADCAST)),
            TensorDescriptor.from_tensor(c, [BM, BN], layout([BM, BN], gl.bfloat16, cga_layout=PAIR)))


def cluster_gemm(a, w, two_cta_barrier=False, warmup=False):
    """c [M, 256] = a [M, K] @ w [K, 256], bf16, M a multiple of 256 and K of 64."""
    M, K = a.shape
    if not triton_at_least(3, 7):
        raise RuntimeError(f"proto_multicast: needs Triton >= 3.7 (TMA multicast in Gluon); this is "
                           f"{triton.__version__}")
    if M % BM or K % BK or tuple(w.shape) != (K, BN):
        raise ValueError(f"proto_multicast: needs M % {BM} == 0, K % {BK} == 0 and w [K, {BN}]; got a "
                         f"{tuple(a.shape)}, w {tuple(w.shape)}")
    c = torch.empty(M, BN, device=a.device, dtype=torch.bfloat16)
    args = (*descriptors(a, w, c), K)
    kw = dict(TWO_CTA_BARRIER=two_cta_barrier, NUM_WARPS=NUM_WARPS, grid=(M // BM,), num_warps=NUM_WARPS, num_ctas=2)
    if warmup:
        return _cluster_gemm_kernel.warmup(*args, **kw)
    _cluster_gemm_kernel[kw.pop("grid")](*args, **kw)
    return c


# ---- the row-grouped plain GEMM in two-CTA clusters (Triton >= 3.8: slots released across CTAs) ----

@gluon.jit
def _pair_tile(t, tiles_n, pair_row_ptr, pair_end_ptr, BLOCK_N: gl.constexpr):
    """Tile t's pair (an index into the pair table), first column, first row and its expert's end."""
    m, n0 = tile_mn(t, tiles_n, BLOCK_N)
    return m, n0, gl.load(pair_row_ptr + m), gl.load(pair_end_ptr + m)


@gluon.jit
def _release(empty_pair, empty_own, slot, pred):
    """A consumer done with a slot: to the CTA that multicasts into it (a remote arrive from the other
    CTA) and to this CTA's producer of a's rows."""
    mbarrier.arrive(empty_pair.index(slot), pred=pred)
    mbarrier.arrive(empty_own.index(slot), pred=pred)


@gluon.jit
def _acquire(empty_pair, empty_own, count, NUM_BUF: gl.constexpr):
    """A producer's slot for ring step ``count``, once it is free in both CTAs (empty_pair, waited on
    by the CTA that issues the multicast) and in this one (empty_own); the first pass finds every
    slot free."""
    slot = count % NUM_BUF
    phase = ((count // NUM_BUF) & 1) ^ 1
    mbarrier.wait(empty_pair.index(slot), phase)
    mbarrier.wait(empty_own.index(slot), phase)
    return slot


@gluon.jit
def _pair_producer(a_desc, w_desc, pair_e_ptr, pair_row_ptr, num_p_ptr, a_bufs, w_bufs, ready, empty_pair,
                   empty_own, K, N, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr):
    """Per step: a free slot (:func:`_acquire`), then each CTA's rows of a by TMA and w's block once,
    multicast into both CTAs."""
    pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_p_ptr, N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for i in range(my_tiles):
        m, n0 = tile_mn(pid + i * nprog, tiles_n, BLOCK_N)
        e = gl.load(pair_e_ptr + m)
        row0 = gl.load(pair_row_ptr + m)
        for kk in range(k_steps):
            slot = _acquire(empty_pair, empty_own, count, NUM_BUF)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes // 2 + w_desc.block_type.nbytes)
            tma_load(a_desc, [row0, kk * BLOCK_K], bar, a_bufs.index(slot))
            tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(slot), multicast=True)
            count += 1


@gluon.jit
def _pair_consumer(out_desc, out_smem, pair_row_ptr, pair_end_ptr, num_p_ptr, a_bufs, w_bufs, ready, empty_pair,
                   empty_own, K, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The MMAs (one in flight; the slot of the step before released in both CTAs) and each
    tile's TMA store; a pair whose rows run past its expert's end is not stored (the prototype
    times whole pairs only: see ``pair_offsets``)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16], cga_layout=[[1, 0]])
    pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_p_ptr, N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for i in range(my_tiles):
        m, n0, row0, row_end = _pair_tile(pid + i * nprog, tiles_n, pair_row_ptr, pair_end_ptr, BLOCK_N)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            slot = count % NUM_BUF
            mbarrier.wait(ready.index(slot), (count // NUM_BUF) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            gl.barrier()  # both warpgroups', before the arrivals
            _release(empty_pair, empty_own, (count + NUM_BUF - 1) % NUM_BUF, kk > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.barrier()
        _release(empty_pair, empty_own, (count + NUM_BUF - 1) % NUM_BUF, True)
        if row0 + BLOCK_M <= row_end:
            tma.store_wait(0)
            out_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            tma_store(out_desc, [row0, n0], out_smem)
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_pair_kernel(a_desc, w_desc, out_desc, pair_e_ptr, pair_row_ptr, pair_end_ptr, num_p_ptr, K, N,
                              NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BLOCK_K, BLOCK_N], w_desc.layout)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)  # one a CTA: its a rows and its copy of w landed
    empty_pair = mbarrier.allocate_mbarrier(batch=NUM_BUF, two_ctas=True)  # both consumers done (the lead's)
    empty_own = mbarrier.allocate_mbarrier(batch=NUM_BUF)  # this CTA's consumer done
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty_pair.index(i), count=1)  # an arrival from each CTA
        mbarrier.init(empty_own.index(i), count=1)
    gl.warp_specialize([
        (_pair_consumer, (out_desc, out_smem, pair_row_ptr, pair_end_ptr, num_p_ptr, a_bufs, w_bufs, ready,
                          empty_pair, empty_own, K, N, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, NUM_WARPS)),
        (_pair_producer, (a_desc, w_desc, pair_e_ptr, pair_row_ptr, num_p_ptr, a_bufs, w_bufs, ready, empty_pair,
                          empty_own, K, N, BLOCK_N, BLOCK_K, NUM_BUF)),
    ], [1], [40])
    gl.barrier(cluster=True)  # neither CTA leaves while the other may still arrive on its barriers


# ---- the SwiGLU up projection in two-CTA clusters: a's rows gathered by cp.async in each CTA,
# w's gate and up blocks multicast (the single-CTA kernel: kernels/gluon_gemm.py, swiglu) ----

@gluon.jit
def _pair_swiglu_producer(a_ptr, gather_ptr, w_desc, pair_e_ptr, pair_row_ptr, num_p_ptr, a_bufs, w_bufs, a_ready,
                          w_ready, empty_pair, empty_own, K, F, stride_am, BLOCK_M: gl.constexpr,
                          HALF_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
                          PRODUCER_WARPS: gl.constexpr):
    """Per step: the slot free in both CTAs and in this one, then w's gate and up blocks (multicast)
    and this CTA's 128 gathered rows of a (cp.async, arriving on a_ready when they land)."""
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0], cga_layout=[[1, 0]])
    pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_p_ptr, F, HALF_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for i in range(my_tiles):
        m, n0 = tile_mn(pid + i * nprog, tiles_n, HALF_N)
        e = gl.load(pair_e_ptr + m)
        rows = gl.load(gather_ptr + gl.load(pair_row_ptr + m) + gl.arange(0, BLOCK_M, gl.SliceLayout(1, load_layout)))
        for kk in range(k_steps):
            slot = _acquire(empty_pair, empty_own, count, NUM_BUF)
            bar = w_ready.index(slot)
            mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
            tma_load(w_desc, [e * K + kk * BLOCK_K, n0], bar, w_bufs.index(2 * slot), multicast=True)
            tma_load(w_desc, [e * K + kk * BLOCK_K, F + n0], bar, w_bufs.index(2 * slot + 1), multicast=True)
            cols = kk * BLOCK_K + gl.arange(0, BLOCK_K, gl.SliceLayout(0, load_layout))
            async_load(a_bufs.index(slot), a_ptr + rows.to(gl.int64)[:, None] * stride_am + cols[None, :])
            async_copy.mbarrier_arrive(a_ready.index(slot), increment_count=False)
            count += 1


@gluon.jit
def _pair_swiglu_consumer(pre_desc, act_desc, out_smem, pair_row_ptr, pair_end_ptr, num_p_ptr, a_bufs, w_bufs,
                          a_ready, w_ready, empty_pair, empty_own, K, F, BLOCK_M: gl.constexpr,
                          HALF_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
                          NUM_WARPS: gl.constexpr):
    """Two MMAs a step (gate, up), the slot of the step before released in both CTAs; per tile
    pre's gate and up blocks and silu(gate)·up by TMA (whole pairs only, as the plain pair kernel)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HALF_N, 16], cga_layout=[[1, 0]])
    pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_p_ptr, F, HALF_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for i in range(my_tiles):
        m, n0, row0, row_end = _pair_tile(pid + i * nprog, tiles_n, pair_row_ptr, pair_end_ptr, HALF_N)
        acc_g = gl.zeros([BLOCK_M, HALF_N], gl.float32, acc_layout)
        acc_u = gl.zeros([BLOCK_M, HALF_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            slot = count % NUM_BUF
            phase = (count // NUM_BUF) & 1
            mbarrier.wait(w_ready.index(slot), phase)
            mbarrier.wait(a_ready.index(slot), phase)
            fence_async_shared()  # the cp.async writes, seen through the barrier, to the tensor cores
            acc_g = warpgroup_mma(a_bufs.index(slot), w_bufs.index(2 * slot), acc_g, use_acc=kk > 0, is_async=True)
            acc_u = warpgroup_mma(a_bufs.index(slot), w_bufs.index(2 * slot + 1), acc_u, use_acc=kk > 0,
                                  is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(2, deps=[acc_g, acc_u])
            gl.barrier()
            _release(empty_pair, empty_own, (count + NUM_BUF - 1) % NUM_BUF, kk > 0)
            count += 1
        acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
        gl.barrier()
        _release(empty_pair, empty_own, (count + NUM_BUF - 1) % NUM_BUF, True)
        if row0 + BLOCK_M <= row_end:
            gate = acc_g.to(gl.bfloat16)
            up = acc_u.to(gl.bfloat16)
            tma.store_wait(0)
            out_smem.index(0).store(gate)
            out_smem.index(1).store(up)
            fence_async_shared()
            tma_store(pre_desc, [row0, n0], out_smem.index(0))
            tma_store(pre_desc, [row0, F + n0], out_smem.index(1))
            g = gate.to(gl.float32)
            act = (g / (1.0 + gl.exp(-g)) * up.to(gl.float32)).to(gl.bfloat16)
            tma.store_wait(1)  # the gate's store has read buffer 0
            out_smem.index(0).store(act)
            fence_async_shared()
            tma_store(act_desc, [row0, n0], out_smem.index(0))
    tma.store_wait(0)


@gluon.jit
def _pair_swiglu_kernel(a_ptr, gather_ptr, w_desc, pre_desc, act_desc, pair_e_ptr, pair_row_ptr, pair_end_ptr,
                        num_p_ptr, K, F, stride_am, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
                        NUM_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    BLOCK_M: gl.constexpr = pre_desc.block_type.shape[0]
    HALF_N: gl.constexpr = pre_desc.block_type.shape[1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16,
                                                                   cga_layout=[[1, 0]])
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
    out_smem = gl.allocate_shared_memory(pre_desc.dtype, [2] + pre_desc.block_type.shape, pre_desc.layout)
    a_ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    w_ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    empty_pair = mbarrier.allocate_mbarrier(batch=NUM_BUF, two_ctas=True)
    empty_own = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(a_ready.index(i), count=PRODUCER_WARPS * 32)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(empty_pair.index(i), count=1)
        mbarrier.init(empty_own.index(i), count=1)
    gl.warp_specialize([
        (_pair_swiglu_consumer, (pre_desc, act_desc, out_smem, pair_row_ptr, pair_end_ptr, num_p_ptr, a_bufs, w_bufs,
                                 a_ready, w_ready, empty_pair, empty_own, K, F, BLOCK_M, HALF_N, BLOCK_K, NUM_BUF,
                                 NUM_WARPS)),
        (_pair_swiglu_producer, (a_ptr, gather_ptr, w_desc, pair_e_ptr, pair_row_ptr, num_p_ptr, a_bufs, w_bufs,
                                 a_ready, w_ready, empty_pair, empty_own, K, F, stride_am, BLOCK_M, HALF_N, BLOCK_K,
                                 NUM_BUF, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [80])
    gl.barrier(cluster=True)


def swiglu_pair(x_TK, w_EKN, offsets_E1, gather_S, num_sms=132, warmup=False):
    """(pre [S, 2F], silu(gate)·up [S, F]) = x[gather(s)] @ w[e(s)] in clusters of two CTAs, bf16;
    whole 256-row pairs only (``pair_offsets``); no router weight (the single-CTA kernel's
    act_scale) and the exact sigmoid, so compare pre's bits and act to rounding."""
    from megatron_moe.kernels.gluon_gemm import tile_table

    if not triton_at_least(3, 8):
        raise RuntimeError(f"proto_multicast: the pair kernels need Triton >= 3.8 (torch >= 2.14); this is "
                           f"{triton.__version__}")
    S, K = gather_S.shape[0], x_TK.shape[1]
    E, _, N = w_EKN.shape
    F = N // 2
    pre = torch.empty(S, N, device=x_TK.device, dtype=torch.bfloat16)
    act = torch.empty(S, F, device=x_TK.device, dtype=torch.bfloat16)
    pair_e, pair_row, pair_end, num_p = tile_table(offsets_E1, S, block_m=BM)
    layout = gl.NVMMASharedLayout.get_default_for
    half = layout([BM, 128], gl.bfloat16, cga_layout=PAIR)
    w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BK, 128], layout([BK, 128], gl.bfloat16,
                                                                            cga_layout=BROADCAST))
    pre_desc = TensorDescriptor(pre, [S, N], [N, 1], [BM, 128], half)
    act_desc = TensorDescriptor(act, [S, F], [F, 1], [BM, 128], half)
    args = (x_TK, gather_S, w_desc, pre_desc, act_desc, pair_e, pair_row, pair_end, num_p, K, F, x_TK.stride(0))
    kw = dict(BLOCK_K=BK, NUM_BUF=3, NUM_WARPS=NUM_WARPS, PRODUCER_WARPS=4, num_warps=NUM_WARPS, num_ctas=2,
              grid=(num_sms // 2,))
    if warmup:
        return _pair_swiglu_kernel.warmup(*args, **kw)
    _pair_swiglu_kernel[kw.pop("grid")](*args, **kw)
    return pre, act


def triton_at_least(major, minor):
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (major, minor)


def grouped_gemm_pair(a_MK, w_EKN, offsets_E1, num_sms=132, warmup=False):
    """out[s] = a[s] @ w[e(s)] over sorted rows in clusters of two CTAs (256 rows of one expert, w's
    block multicast), bf16; experts' row counts multiples of 256 (``pair_offsets``)."""
    from megatron_moe.kernels.gluon_gemm import tile_table

    if not triton_at_least(3, 8):  # 3.7 compiles the two-CTA barrier's arrive as a local one: a race
        raise RuntimeError(f"proto_multicast: the pair kernel needs Triton >= 3.8 (torch >= 2.14); this is "
                           f"{triton.__version__}")

    S, K = a_MK.shape
    E, _, N = w_EKN.shape
    out = torch.empty(S, N, device=a_MK.device, dtype=torch.bfloat16)
    pair_e, pair_row, pair_end, num_p = tile_table(offsets_E1, S, block_m=BM)
    layout = gl.NVMMASharedLayout.get_default_for
    a_desc = TensorDescriptor(a_MK, [S, K], [K, 1], [BM, BK], layout([BM, BK], gl.bfloat16, cga_layout=PAIR))
    w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BK, BN], layout([BK, BN], gl.bfloat16, cga_layout=BROADCAST))
    out_desc = TensorDescriptor(out, [S, N], [N, 1], [BM, BN], layout([BM, BN], gl.bfloat16, cga_layout=PAIR))
    args = (a_desc, w_desc, out_desc, pair_e, pair_row, pair_end, num_p, K, N)
    kw = dict(NUM_BUF=3, NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS, num_ctas=2, grid=(num_sms // 2,))
    if warmup:
        return _grouped_gemm_pair_kernel.warmup(*args, **kw)
    _grouped_gemm_pair_kernel[kw.pop("grid")](*args, **kw)
    return out


def pair_offsets(S, E, device):
    """Equal experts of S // E rows, a multiple of 256 (the prototype stores whole pairs only)."""
    rows = S // E // BM * BM
    return torch.arange(0, E + 1, device=device, dtype=torch.int32) * rows


def compile_only():
    """Compile both kernels for sm_90 on any machine and print what the PTX says about the
    cluster's copies and barriers."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from megatron_moe.kernels import _common
    from megatron_moe.kernels.tuning import _CompileOnly
    driver.set_active(_CompileOnly(0, GPUTarget("cuda", 90, 32)))
    torch_empty = torch.empty
    torch.empty = lambda *a, **k: torch.zeros(*a, **k)
    use_triton = _common.use_triton
    try:
        a, w = torch.zeros(512, 256, dtype=torch.bfloat16), torch.zeros(256, BN, dtype=torch.bfloat16)
        kernels = {"smoke": cluster_gemm(a, w, two_cta_barrier=True, warmup=True)}
        from megatron_moe.kernels import gluon_gemm
        gluon_gemm.use_triton = lambda *t: False  # the tile table by torch ops on the CPU
        offsets = pair_offsets(2048, 4, "cpu")
        kernels["grouped"] = grouped_gemm_pair(torch.zeros(2048, 256, dtype=torch.bfloat16),
                                               torch.zeros(4, 256, 1024, dtype=torch.bfloat16), offsets, warmup=True)
        kernels["swiglu"] = swiglu_pair(torch.zeros(1024, 256, dtype=torch.bfloat16),
                                        torch.zeros(4, 256, 512, dtype=torch.bfloat16), offsets,
                                        torch.zeros(2048, dtype=torch.int32), warmup=True)
    finally:
        torch.empty = torch_empty
        gluon_gemm.use_triton = use_triton
    for name, kernel in kernels.items():
        ptx = kernel.asm["ptx"]
        print(f"Triton {triton.__version__}, {name}: compiled for sm_90, {len(ptx.splitlines())} PTX lines, "
              f"{kernel.metadata.shared} bytes of shared memory a CTA")
        for pattern, what in ((r"\.reqnctapercluster \d+", "cluster size"),
                              (r"cp\.async\.bulk\.tensor.*multicast::cluster.*", "w's multicast load"),
                              (r"mov\.u32\s+%r\d+, %cluster_ctarank;", "the CTA's rank, read (rank 0 multicasts)"),
                              (r"mbarrier\.arrive\.(?!expect).*", "arrives"),
                              (r"barrier\.cluster\.\w+.*", "cluster barrier")):
            hits = sorted(set(m.group(0).strip() for m in re.finditer(pattern, ptx)))
            print(f"  {what}: {hits[:3] if hits else 'none'}")


GROUPED_SHAPES = {  # rows (S = T k), experts, K, N: the layer's down projections (K = F) at top-k > 1
    "sonic-1536 down": (262144, 128, 256, 1536), "sonic-1536 dx": (262144, 128, 512, 1536),
    "qwen3 down": (131072, 128, 768, 2048), "olmoe down": (131072, 64, 1024, 2048),
}
SWIGLU_SHAPES = {  # rows, experts, K (hidden), N (2F), tokens: the layer's up projections, x gathered
    "sonic-1536 up": (262144, 128, 1536, 512, 32768), "qwen3 up": (131072, 128, 2048, 1536, 16384),
    "olmoe up": (131072, 64, 2048, 2048, 16384),
}


def alternated(do_bench, fns, rounds=3):
    """Each of ``fns`` (name: callable) timed once a round, in order, over ``rounds`` rounds: each
    one's median of its rounds' ``do_bench`` times (ms)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn))
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


def grouped(do_bench):
    """The pair kernels against the single-CTA Gluon kernels (one CTA a 128-row tile) and the float64
    reference: first a small shape, then the layer's shapes, each timed in three alternated rounds."""
    from megatron_moe.kernels.gluon_gemm import grouped_gemm_gluon

    dev = torch.device("cuda")
    offsets = pair_offsets(4096, 8, dev)
    a = torch.randn(4096, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(8, 256, 512, device=dev, dtype=torch.bfloat16) / 16
    bounds = offsets.tolist()  # each expert's rows, in float64
    ref = torch.cat([a[s:e].double() @ w[i].double() for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]).float()
    print(f"small (4096 rows, 8 experts, K 256, N 512): max |pair - float64| "
          f"{(grouped_gemm_pair(a, w, offsets).float() - ref).abs().max().item():.3e}, "
          f"max |plain - float64| {(grouped_gemm_gluon(a, w, offsets).float() - ref).abs().max().item():.3e}")
    for name, (S, E, K, N) in GROUPED_SHAPES.items():
        offsets = pair_offsets(S, E, dev)
        a = torch.randn(S, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5
        same = torch.equal(grouped_gemm_pair(a, w, offsets), grouped_gemm_gluon(a, w, offsets))
        med = alternated(do_bench, {"pair": lambda: grouped_gemm_pair(a, w, offsets),
                                    "plain": lambda: grouped_gemm_gluon(a, w, offsets)})
        tf = 2 * S * K * N / 1e9
        print(f"{name:<16} pair {med['pair']:.3f} ms ({tf / med['pair']:.0f} TFLOP/s)  plain {med['plain']:.3f} ms "
              f"({tf / med['plain']:.0f})  {med['plain'] / med['pair']:.2f}x  {'same bits' if same else 'BITS DIFFER'}",
              flush=True)
    for name, (S, E, K, N, T) in SWIGLU_SHAPES.items():
        offsets = pair_offsets(S, E, dev)
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5
        gather = torch.randint(0, T, (S,), device=dev, dtype=torch.int32)
        pre, act = swiglu_pair(x, w, offsets, gather)
        pre1, act1 = grouped_gemm_gluon(x, w, offsets, gather_S=gather, activation="swiglu")
        same = torch.equal(pre, pre1)
        act_diff = (act.float() - act1.float()).abs().max().item()
        med = alternated(do_bench, {
            "pair": lambda: swiglu_pair(x, w, offsets, gather),
            "plain": lambda: grouped_gemm_gluon(x, w, offsets, gather_S=gather, activation="swiglu")})
        tf = 2 * S * K * N / 1e9
        print(f"{name:<16} pair {med['pair']:.3f} ms ({tf / med['pair']:.0f} TFLOP/s)  single-CTA "
              f"{med['plain']:.3f} ms ({tf / med['plain']:.0f})  {med['plain'] / med['pair']:.2f}x  pre "
              f"{'same bits' if same else 'BITS DIFFER'}, act within {act_diff:.2g}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--grouped", action="store_true", help="the grouped pair kernel against the plain Gluon kernel")
    p.add_argument("--m", type=int, default=32768)
    p.add_argument("--k", type=int, default=1536)
    args = p.parse_args()
    if args.compile_only:
        return compile_only()
    torch.manual_seed(0)
    if args.grouped:
        return grouped(lambda f: triton.testing.do_bench(f, warmup=25, rep=100))
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.k, BN, device="cuda", dtype=torch.bfloat16) / args.k ** 0.5
    ref = (a.double() @ w.double()).float()
    err = (cluster_gemm(a, w).float() - ref).abs().max().item()
    print(f"max |c - a @ w (float64)|: {err:.3e} (bf16 rounding of |c| ~ {ref.abs().max().item() * 2 ** -8:.1e})")
    ms = triton.testing.do_bench(lambda: cluster_gemm(a, w), warmup=25, rep=100)
    ms_torch = triton.testing.do_bench(lambda: a @ w, warmup=25, rep=100)
    tflop = 2 * args.m * args.k * BN / 1e12
    print(f"cluster GEMM {ms:.3f} ms ({tflop / ms * 1e3:.0f} TFLOP/s); torch {ms_torch:.3f} ms")


if __name__ == "__main__":
    main()
