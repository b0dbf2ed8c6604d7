"""Experiment (issue #33): a top-1 GELU layer's up projection over x permuted once into expert order,
as a persistent Gluon kernel whose epilogue runs in warps of its own, under the next tile's MMAs.

    python benchmarks/proto_gelu_up.py --compile-only   # any machine: compiles for sm_90, prints its shared
                                                        #   memory, registers and spills
    python benchmarks/proto_gelu_up.py                  # an sm_90 GPU: checked against float64 (small
                                                        #   shapes, partial tiles, empty experts), then timed
                                                        #   against the layer's Triton kernel (gathered) at
                                                        #   dmoe-small's shape, micro-batches 32 and 128

pre[s] = xs[s] @ w1[e] and act[s] = act_scale(s)·gelu(pre[s]) (of the rounded pre, with the hardware's
tanh, as kernels/grouped.py's GELU epilogue computes it) for the sorted rows s of expert e; bf16 in and
out, fp32 sums; w1 [E, K, N] contiguous, K a multiple of 64, N of 256.

Why: at dmoe-small's micro-batch 128 the layer's GELU up projection (Triton, x gathered) takes 1.53 ms
against CUTLASS's 1.10 for the bare product over sorted rows (docs/performance.md, "dmoe-small's layer at
micro-batch 128"); kernels/gluon_gemm.py's cooperative kernel with a GELU epilogue over gathered rows
(cp.async) ran slower than the Triton kernel (its epilogue never overlaps the MMAs), and a ping-pong
one with 128 x 128 tiles per consumer only 1.02-1.04x (L2 bytes a FLOP). Here the 128 x 256 tile
stays (two MMA warpgroups, as the plain kernel) and its epilogue moves out of their way:
  producer (one warp): kernels/gluon_gemm.py's ``tma_producer``: per tile, per 64-deep step, the TMA
      loads of xs's [128, 64] block and w1's [64, 256] block into a ring of 3 slots;
  consumers (two warpgroups, the default partition): the MMAs (one in flight), then the tile rounded
      to bf16 into one 64 KB hand-off buffer, once the epilogue is done with it; then the next tile;
  epilogue (two warps): pre stored from the hand-off buffer by TMA; once the store has read it,
      act computed in place, 16 columns at a time, and stored by TMA; then the buffer is released.
      An expert's last, partial tile goes out from registers, its rows masked.
Measured on an H100 (2026-12-07 and 12-08, docs/performance.md, "A GELU up projection with its epilogue
in warps of its own" and "x sorted once"): its float64 checks pass and pre and act are the same bits as
the Triton kernel's, but it runs 0.91-0.98x that kernel: its two epilogue warps take ~18 µs a tile
against the MMAs' ~10. ``staged`` (act's [128, 16] parts through two 4 KB buffers of their own, so the
epilogue no longer waits for pre's store before its GELU; 221.5 KB of shared memory) ran 1.01-1.02x.
What went into the library instead is simpler: kernels/gluon_gemm.py's plain kernel with the GELU in
its MMA warpgroups, act computed while pre's TMA store reads the buffer (1.09-1.17x the Triton kernel;
timed here beside these as "library sorted", with its variants that store act in 16- or 32-column
parts, ``gluon_gemm.GELU_ACT_PART``). This script's kernels stay out of the library.
Shared memory: the ring 3 x 48 KB, the hand-off buffer 64 KB: 208 KB. Registers (Triton 3.6, sm_90):
the kernel's cap 168 (12 warps: the epilogue's two and the producer share a padded warpgroup at 104
each; the GPU run above had 96, which Triton 3.9 spills 4 bytes at in the staged epilogue), the MMA
warpgroups raised to 200, 0 bytes spilled; with four epilogue warps (16 in all) the cap would be 128,
below what ptxas needs for the 128 x 256 accumulator (154).
"""
from __future__ import annotations

import argparse

import torch
import triton

from megatron_moe.kernels._gluon import (TensorDescriptor, barrier, fence_async_shared, gl, gluon, maxnreg,
                                         mbarrier, tma, tma_store, warpgroup_mma, warpgroup_mma_wait)
from megatron_moe.kernels.gluon_gemm import (program_tiles, shared_layout, store_rows, tanh_approx, tile_mn,
                                             tile_table, tma_producer)

BM, BN, BK, NUM_BUF, NUM_WARPS = 128, 256, 64, 3, 8
EPI_WARPS, EPI_REGS, PRODUCER_REGS, PART = 2, 104, 40, 16  # 4 epilogue warps would leave the MMAs 128 registers


@gluon.jit
def _consumer(hand_smem, hand_ready, hand_empty, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars, K, N,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The MMAs of each tile (one in flight; the slot of the step before freed), then the tile rounded to
    bf16 into the hand-off buffer once the epilogue has released it."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BN, 16])
    pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, N, BN)
    k_steps = gl.cdiv(K, BK)
    count = 0
    for i in range(my_tiles):
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
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
        mbarrier.wait(hand_empty, (i & 1) ^ 1)  # the epilogue's stores of the tile before have read it
        hand_smem.store(acc.to(gl.bfloat16))
        fence_async_shared()  # these writes before the epilogue's TMA store of them
        barrier()
        mbarrier.arrive(hand_ready)


@gluon.jit
def _gelu(h):
    """kernels/activation.py's gelu_and_grad (its activation) with the hardware's tanh."""
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    return 0.5 * h * (1.0 + tanh_approx(u))


@gluon.jit
def _epilogue(pre_ptr, act_ptr, pre_desc, act_desc, hand_smem, stage_smem, hand_ready, hand_empty, act_scale_ptr,
              tile_row_ptr, tile_end_ptr, num_m_ptr, N, stride_pm, stride_am, HAS_ACT_SCALE: gl.constexpr,
              STAGED: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, PART: gl.constexpr,
              EPI_WARPS: gl.constexpr):
    """Each tile from the hand-off buffer: pre stored, then act = act_scale·gelu(pre) computed PART
    columns at a time and stored; the buffer released. Full tiles by TMA: STAGED, each part of act
    through one of two small buffers of its own (act_desc's [BM, PART] box), so that nothing waits for
    pre's store until the buffer is released; else act written over pre in the hand-off buffer once
    pre's store has read it, then stored whole. An expert's last tile from registers, its rows masked."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (PART // 8), PART // 8], [EPI_WARPS, 1], [1, 0])
    pid, nprog, tiles_n, my_tiles, _ = program_tiles(num_m_ptr, N, BN)
    for i in range(my_tiles):
        m, n0 = tile_mn(pid + i * nprog, tiles_n, BN)
        row0 = gl.load(tile_row_ptr + m)
        row_end = gl.load(tile_end_ptr + m)  # the expert's end: rows from it on are another's
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        scale = gl.load(act_scale_ptr + rows, mask=rows < row_end, other=0.0)
        full = row0 + BM <= row_end
        mbarrier.wait(hand_ready, i & 1)
        if full:
            fence_async_shared()
            tma_store(pre_desc, [row0, n0], hand_smem)
            if not STAGED:
                tma.store_wait(0)  # read: act may overwrite it
        for j in gl.static_range(BN // PART):
            part = hand_smem.slice(j * PART, PART, dim=1)
            h = part.load(layout)
            act = _gelu(h.to(gl.float32))
            if HAS_ACT_SCALE:
                act = act * scale[:, None]
            act = act.to(gl.bfloat16)
            if full:
                if STAGED:
                    tma.store_wait(1)  # all but the last part's store have read their buffers (pre's too)
                    stage = stage_smem.index(j % 2)
                    stage.store(act)
                    fence_async_shared()
                    barrier()  # every epilogue thread's share of the part written
                    tma_store(act_desc, [row0, n0 + j * PART], stage)
                else:
                    part.store(act)
            else:
                store_rows(pre_ptr, h, row0, row_end, n0 + j * PART, N, stride_pm, BM, PART, layout)
                store_rows(act_ptr, act, row0, row_end, n0 + j * PART, N, stride_am, BM, PART, layout)
        if full:
            if not STAGED:
                fence_async_shared()
                barrier()  # every epilogue thread's part written
                tma_store(act_desc, [row0, n0], hand_smem)
            tma.store_wait(0)
        barrier()  # every epilogue thread's reads done
        mbarrier.arrive(hand_empty)


@gluon.jit
def _gelu_up_kernel(a_desc, w_desc, pre_desc, act_desc, pre_ptr, act_ptr, act_scale_ptr, tile_e_ptr, tile_row_ptr,
                    tile_end_ptr, num_m_ptr, K, N, stride_pm, stride_am, HAS_ACT_SCALE: gl.constexpr,
                    STAGED: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr,
                    NUM_WARPS: gl.constexpr, PART: gl.constexpr, EPI_WARPS: gl.constexpr, EPI_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
    hand_smem = gl.allocate_shared_memory(pre_desc.dtype, pre_desc.block_type.shape, pre_desc.layout)
    # STAGED: act's parts through two [BM, PART] buffers (act_desc's box); else act goes through the
    # hand-off buffer (act_desc's box is the whole tile) and these 2 x 4 KB stay unused
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, PART], gl.bfloat16)  # staged act_desc's
    stage_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM, PART], stage_layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    hand_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; TMA's bytes complete it
        mbarrier.init(empty_bars.index(i), count=1)
    mbarrier.init(hand_bars.index(0), count=1)  # ready: the consumers' one arrival
    mbarrier.init(hand_bars.index(1), count=1)  # empty: the epilogue's one arrival
    gl.warp_specialize([
        (_consumer, (hand_smem, hand_bars.index(0), hand_bars.index(1), num_m_ptr, a_bufs, w_bufs, ready_bars,
                     empty_bars, K, N, BM, BN, BK, NUM_BUF, NUM_WARPS)),
        (_epilogue, (pre_ptr, act_ptr, pre_desc, act_desc, hand_smem, stage_smem, hand_bars.index(0),
                     hand_bars.index(1), act_scale_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, N, stride_pm,
                     stride_am, HAS_ACT_SCALE, STAGED, BM, BN, PART, EPI_WARPS)),
        (tma_producer, (a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_bufs, ready_bars, empty_bars,
                        K, N, BN, BK, NUM_BUF, False)),
    ], [EPI_WARPS, 1], [EPI_REGS, PRODUCER_REGS])


def gelu_up(xs_SK, w_EKN, offsets_E1, act_scale_S=None, num_sms=132, warmup=False, staged=False):
    """(pre [S, N], act [S, N]) over the sorted rows xs_SK (bf16; rows past offsets_E1[-1] not written);
    ``staged``: act stored in [128, 16] parts through buffers of their own (see ``_epilogue``)."""
    S, K = xs_SK.shape
    E, _, N = w_EKN.shape
    if K % BK or N % BN or not w_EKN.is_contiguous() or xs_SK.stride(1) != 1:
        raise ValueError(f"proto_gelu_up: K a multiple of {BK}, N of {BN}, w contiguous; got K {K}, N {N}")
    dev = xs_SK.device
    pre = torch.empty(S, N, device=dev, dtype=torch.bfloat16)
    act = torch.empty(S, N, device=dev, dtype=torch.bfloat16)
    tile_e, tile_row, tile_end, num_m = tile_table(offsets_E1, S)
    a_desc = TensorDescriptor(xs_SK, [S, K], [xs_SK.stride(0), 1], [BM, BK], shared_layout(BM, BK))
    w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BK, BN], shared_layout(BK, BN))
    pre_desc = TensorDescriptor(pre, [S, N], [N, 1], [BM, BN], shared_layout(BM, BN))
    act_box = [BM, PART] if staged else [BM, BN]
    act_desc = TensorDescriptor(act, [S, N], [N, 1], act_box, shared_layout(*act_box))
    args = (a_desc, w_desc, pre_desc, act_desc, pre, act, act_scale_S if act_scale_S is not None else pre, tile_e,
            tile_row, tile_end, num_m, K, N, pre.stride(0), act.stride(0))
    kw = dict(HAS_ACT_SCALE=act_scale_S is not None, STAGED=staged, BM=BM, BN=BN, BK=BK, NUM_BUF=NUM_BUF,
              NUM_WARPS=NUM_WARPS, PART=PART, EPI_WARPS=EPI_WARPS, EPI_REGS=EPI_REGS, PRODUCER_REGS=PRODUCER_REGS,
              num_warps=NUM_WARPS, maxnreg=maxnreg(NUM_WARPS, EPI_WARPS + 1))
    if warmup:
        return _gelu_up_kernel.warmup(*args, grid=(num_sms,), **kw)
    _gelu_up_kernel[(num_sms,)](*args, **kw)
    return pre, act


def compile_only():
    """Compile for sm_90 on any machine; print the shared memory, registers and spills."""
    from proto_wstat import ptxas_report  # a sibling script: benchmarks/ is first on the path
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from megatron_moe.kernels import gluon_gemm
    from megatron_moe.kernels.tuning import _CompileOnly
    driver.set_active(_CompileOnly(0, GPUTarget("cuda", 90, 32)))
    use_triton = gluon_gemm.use_triton
    gluon_gemm.use_triton = lambda *t: False  # the tile table by torch ops on the CPU
    try:
        for staged, scaled in ((False, True), (False, False), (True, True)):
            offsets = torch.tensor([0, 100, 100, 356], dtype=torch.int32)
            xs, w = torch.zeros(400, 192, dtype=torch.bfloat16), torch.zeros(3, 192, 512, dtype=torch.bfloat16)
            kernel = gelu_up(xs, w, offsets, torch.zeros(400) if scaled else None, warmup=True, staged=staged)
            ptx = kernel.asm["ptx"]
            regs = sorted({line.split()[-1].rstrip(";") for line in ptx.splitlines() if "setmaxnreg" in line})
            print(f"Triton {triton.__version__}, staged {staged}, act_scale {scaled}: compiled for sm_90, "
                  f"{kernel.metadata.shared} bytes of shared memory; setmaxnreg {' '.join(regs)}; ptxas: "
                  f"{ptxas_report(ptx)}", flush=True)
    finally:
        gluon_gemm.use_triton = use_triton


CHECKS = {  # name: (rows per expert, K, N): the float64 checks
    "empty experts, partial tiles": ([0, 100, 0, 200, 129], 256, 512),
    "one expert, many tiles": ([2000], 192, 256),
    "K 64, one row": ([1, 0, 300], 64, 768),
    "no rows": ([0, 0, 0], 128, 256),
}
SHAPES = {"dmoe-small (micro-batch 32)": 32768, "dmoe-small-128": 131072}  # tokens; H 768, F 3072, 64 experts


def _reference(xs, w, offsets, scale):
    """pre and act in float64 from the float64 product rounded to bf16 (pre as the kernel stores it)."""
    bounds = offsets.tolist()
    pre = torch.cat([xs[s:t].double() @ w[i].double() for i, (s, t) in enumerate(zip(bounds, bounds[1:]))])
    h = pre.to(torch.bfloat16).double()
    act = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))
    return pre, act * scale[: h.shape[0], None].double()


def run(do_bench):
    from proto_multicast import alternated  # a sibling script: benchmarks/ is first on the path

    from megatron_moe.kernels import gluon_gemm
    from megatron_moe.kernels.gluon_gemm import grouped_gemm_gluon
    from megatron_moe.kernels.grouped import grouped_gemm
    from megatron_moe.kernels.metadata import routing_metadata
    from megatron_moe.kernels.permute import gather_rows

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    for name, (counts, K, N) in CHECKS.items():
        offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).to(dev)
        S = sum(counts)
        xs = torch.randn(S + 9, K, generator=gen).to(torch.bfloat16).to(dev)
        w = (torch.randn(len(counts), K, N, generator=gen) / K ** 0.5).to(torch.bfloat16).to(dev)
        scale = torch.rand(S + 9, generator=gen).to(dev)
        for programs, variant in [(p, v) for v in ("split", "staged") for p in (132, 5, 1)]:
            pre, act = gelu_up(xs, w, offsets, scale, num_sms=programs, staged=variant == "staged")
            want_pre, want_act = _reference(xs, w, offsets, scale)
            ok = True
            for got, want in ((pre[:S].double(), want_pre), (act[:S].double(), want_act)):
                bound = want.abs() * 2.0 ** -7 + 1e-3 * (want.abs().max().item() if want.numel() else 0.0)
                ok &= bool(((got - want).abs() <= bound).all())
            print(f"check {name}, {programs} programs, {variant}: {'ok' if ok else 'FAILED'}",
                  flush=True)
    H, F, E = 768, 3072, 64
    for name, T in SHAPES.items():
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w1 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * 0.02
        ids = torch.topk(torch.randn(T, E, device=dev), 1, dim=-1).indices
        r = routing_metadata(ids, E, 128)
        tok, off = r.sorted_token_N, r.expert_offsets_E1
        scale = torch.rand(T, device=dev)
        xs = gather_rows(x, r, layout="sorted")
        want_pre, want_act = grouped_gemm(x, w1, off, gather_S=tok, activation="gelu", act_scale_S=scale)
        same = []
        def library(a, part=0):  # kernels/gluon_gemm.py's GELU epilogue, act whole or in parts of `part` columns
            gluon_gemm.GELU_ACT_PART = part
            try:
                return grouped_gemm_gluon(a, w1, off, activation="gelu", act_scale_S=scale)
            finally:
                gluon_gemm.GELU_ACT_PART = 0

        for run_it in (lambda: gelu_up(xs, w1, off, scale), lambda: gelu_up(xs, w1, off, scale, staged=True),
                       lambda: library(xs), lambda: library(xs, 16), lambda: library(xs, 32)):
            pre, act = run_it()
            same.append(torch.equal(pre, want_pre) and torch.equal(act, want_act))
        med = alternated(do_bench, {
            "triton gathered": lambda: grouped_gemm(x, w1, off, gather_S=tok, activation="gelu", act_scale_S=scale),
            "gluon sorted": lambda: gelu_up(xs, w1, off, scale),
            "gluon staged": lambda: gelu_up(xs, w1, off, scale, staged=True),
            "library sorted": lambda: library(xs),
            "library, act in 16-column parts": lambda: library(xs, 16),
            "library, act in 32-column parts": lambda: library(xs, 32),
            "perm + library": lambda: library(gather_rows(x, r, layout="sorted")),
            "gluon plain (pre only)": lambda: grouped_gemm_gluon(xs, w1, off),
            "cutlass bare": lambda: torch._grouped_mm(xs, w1, offs=off[1:].contiguous())})
        ref = med["triton gathered"]
        print(f"{name:<28} " + "  ".join(f"{k} {v:.3f} ms ({ref / v:.2f}x)" for k, v in med.items())
              + f"  same bits as Triton (split, staged, library whole, 16, 32): {same}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args()
    if args.compile_only:
        return compile_only()
    run(lambda f: triton.testing.do_bench(f, warmup=25, rep=100))


if __name__ == "__main__":
    main()
