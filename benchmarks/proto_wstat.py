"""Experiment (issue #35): the plain row-grouped GEMM of a short reduction (sonic-1536's down
projection, K 256) as a ping-pong kernel whose w block stays in shared memory across an expert's row
tiles, so that a's rows are all it reads from L2 a step (docs/performance.md, "A ping-pong with w's
block kept in shared memory": run on an H100 on 2026-12-07, the same bits as the cooperative kernel;
as first ordered 0.56-1.00x it, a read from DRAM again for each column block; with the grouped order
1.02-1.05x; not wired into the library).

    python benchmarks/proto_wstat.py --compile-only   # any machine: compiles for sm_90, prints its shared
                                                      #   memory, registers and spills
    python benchmarks/proto_wstat.py                  # an sm_90 GPU: checked against float64 (small shapes,
                                                      #   partial tiles, empty experts), then timed against
                                                      #   kernels/gluon_gemm.py's kernel at K 64-256

out[s] = a[s] @ w[e] for the sorted rows s of expert e (bf16 in and out, fp32 sums); w [E, K, N]
contiguous, K a multiple of 64 and at most 256, N of 16. Tiles are listed column block first, row
tile fastest, so consecutive tiles mostly share their expert and 128 columns, (e, n0), and with them
w's [K, 128] block (64 KB at K 256). Each program (one per SM) takes a contiguous range of that list:
an even share of it, or (``grouped``, where there are at least as many programs as column blocks)
column block p % tiles_n over the row tiles of its group p // tiles_n, so that a group's programs
read the same rows of a at about the same time.
  producer (one warp): per tile, where (e, n0) changes, waits until the tiles of the block before
      are done (``w_empty``) and loads the new block by TMA (``w_ready``); then a's [128, 64] blocks
      of the tile's rows into a ring of NUM_BUF slots;
  consumer c (one warpgroup each): the range's tiles j with j % 2 == c, a [128, 128] fp32
      accumulator, multiplied once the other's MMAs of tile j - 1 are done (the turn order of
      kernels/gluon_dact.py); the consumer of a block's last tile releases it after its MMAs; each
      stores its tile through a 32 KB buffer of its own (TMA; an expert's last, partial tile from
      registers, its rows masked) under the other's MMAs.
Shared memory at K 256: w's block 64 KB, a's ring 6 x 16 KB, the store buffers 2 x 32 KB: 224 KB.
"""
from __future__ import annotations

import argparse

import torch
import triton

from megatron_moe.kernels._gluon import (TensorDescriptor, barrier, fence_async_shared, gl, gluon, maxnreg,
                                         mbarrier, tma, tma_load, tma_store, warpgroup_mma, warpgroup_mma_wait)
from megatron_moe.kernels.gluon_gemm import shared_layout, store_rows, tile_table

BM, BN, BK, NUM_BUF, MAX_K = 128, 128, 64, 6, 256
CONSUMER_REGS, PRODUCER_REGS = 232, 40


@gluon.jit
def _range(num_m_ptr, N, BN: gl.constexpr, GROUPED: gl.constexpr):
    """This program's tiles: the contiguous range [start, start + count) of num_m x tiles_n (tile
    t = column block * num_m + row tile). GROUPED (nprog >= tiles_n): program p takes column block
    p % tiles_n over the row tiles of its group p // tiles_n, so the tiles_n programs of a group read
    the same rows of a at about the same time (a read from HBM once, as in the cooperative kernel's
    order); else an even share of the whole list."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_m = gl.load(num_m_ptr)
    tiles_n = gl.cdiv(N, BN)
    if GROUPED:
        groups = gl.maximum(nprog // tiles_n, 1)
        g = pid // tiles_n
        per = gl.cdiv(num_m, groups)
        start = (pid % tiles_n) * num_m + g * per
        count = gl.maximum(gl.minimum(num_m - g * per, per), 0) * (g < groups).to(gl.int32)
    else:
        total = num_m * tiles_n
        per = gl.cdiv(total, nprog)
        start = pid * per
        count = gl.maximum(gl.minimum(total - start, per), 0)
    return gl.maximum(num_m, 1), start, count


@gluon.jit
def _tile(t, num_m, tile_e_ptr, BN: gl.constexpr):
    """Tile t (column block first, row tile fastest): its row tile, first column and expert."""
    m = t % num_m
    return m, (t // num_m) * BN, gl.load(tile_e_ptr + m)


@gluon.jit
def _producer(a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_res, a_ready, a_empty, w_ready,
              w_empty, K, N, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr, K_STEPS: gl.constexpr,
              GROUPED: gl.constexpr):
    num_m, start, count = _range(num_m_ptr, N, BN, GROUPED)
    prev_e = -1
    prev_n = -1
    blocks = 0  # w blocks loaded so far
    step = 0
    for j in range(count):
        m, n0, e = _tile(start + j, num_m, tile_e_ptr, BN)
        if (e != prev_e) | (n0 != prev_n):
            # the block before released by the consumer of its last tile (the first block: at once)
            mbarrier.wait(w_empty, (blocks - 1) & 1, pred=blocks > 0)
            mbarrier.expect(w_ready, K_STEPS * w_desc.block_type.nbytes)
            for kk in gl.static_range(K_STEPS):
                tma_load(w_desc, [e * K + kk * BK, n0], w_ready, w_res.index(kk))
            blocks += 1
            prev_e = e
            prev_n = n0
        row0 = gl.load(tile_row_ptr + m)
        for kk in gl.static_range(K_STEPS):
            slot = step % NUM_BUF
            mbarrier.wait(a_empty.index(slot), ((step // NUM_BUF) & 1) ^ 1)  # the first pass finds it free
            mbarrier.expect(a_ready.index(slot), a_desc.block_type.nbytes)
            tma_load(a_desc, [row0, kk * BK], a_ready.index(slot), a_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(C: gl.constexpr, out_ptr, out_desc, out_smem, turn_bars, tile_e_ptr, tile_row_ptr, tile_end_ptr,
              num_m_ptr, a_bufs, w_res, a_ready, a_empty, w_ready, w_empty, N, stride_om, BM: gl.constexpr,
              BN: gl.constexpr, NUM_BUF: gl.constexpr, K_STEPS: gl.constexpr, GROUPED: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    num_m, start, count = _range(num_m_ptr, N, BN, GROUPED)
    buf = out_smem.index(C)
    m, n0, e = _tile(start, num_m, tile_e_ptr, BN)
    block = 0  # the index of tile j's w block in this program's sequence
    for j in range(count):
        next_m, next_n, next_e = _tile(start + j + 1, num_m, tile_e_ptr, BN)  # past the range: unused
        last_of_block = (j + 1 == count) | (next_e != e) | (next_n != n0)
        if j % 2 == C:
            row0 = gl.load(tile_row_ptr + m)
            row_end = gl.load(tile_end_ptr + m)  # the expert's end: rows from it on are another's
            step = j * K_STEPS  # the ring's steps are taken in tile order
            mbarrier.wait(turn_bars.index(C), ((j // 2) & 1) ^ (1 - C))  # consumer 0's first tile: at once
            mbarrier.wait(w_ready, block & 1)  # this tile's block loaded (it stays until its last tile is done)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            for kk in gl.static_range(K_STEPS):
                slot = step % NUM_BUF
                mbarrier.wait(a_ready.index(slot), (step // NUM_BUF) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), w_res.index(kk), acc, use_acc=kk > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                barrier()  # this warpgroup's warps, before the one arrival
                mbarrier.arrive(a_empty.index((step + NUM_BUF - 1) % NUM_BUF), pred=kk > 0)
                step += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            barrier()
            mbarrier.arrive(a_empty.index((step + NUM_BUF - 1) % NUM_BUF))
            mbarrier.arrive(w_empty, pred=last_of_block)  # every tile of the block done: the producer may reload
            mbarrier.arrive(turn_bars.index(1 - C))  # the other consumer's turn to multiply
            vals = acc.to(gl.bfloat16)
            tma.store_wait(0)  # the buffer's last TMA store has read it
            barrier()  # and every thread its last read-back
            buf.store(vals)
            if row0 + BM <= row_end:  # every row this expert's: TMA, left running
                fence_async_shared()
                tma_store(out_desc, [row0, n0], buf)
            else:  # the expert's last tile: its rows only, 16 bytes a thread
                barrier()
                store_rows(out_ptr, buf.load(store_layout), row0, row_end, n0, N, stride_om, BM, BN, store_layout)
        block += last_of_block.to(gl.int32)
        m = next_m
        n0 = next_n
        e = next_e
    tma.store_wait(0)


@gluon.jit
def _wstat_kernel(a_desc, w_desc, out_desc, out_ptr, tile_e_ptr, tile_row_ptr, tile_end_ptr, num_m_ptr, K, N,
                  stride_om, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr,
                  K_STEPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                  GROUPED: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    w_res = gl.allocate_shared_memory(w_desc.dtype, [K_STEPS] + w_desc.block_type.shape, w_desc.layout)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(a_ready.index(i), count=1)  # the producer's expect; TMA's bytes complete it
        mbarrier.init(a_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)
    mbarrier.init(w_ready, count=1)
    mbarrier.init(w_empty, count=1)
    gl.warp_specialize([
        (_consumer, (gl.constexpr(0), out_ptr, out_desc, out_smem, turn_bars, tile_e_ptr, tile_row_ptr, tile_end_ptr,
                     num_m_ptr, a_bufs, w_res, a_ready, a_empty, w_ready, w_empty, N, stride_om, BM, BN, NUM_BUF,
                     K_STEPS, GROUPED)),
        (_consumer, (gl.constexpr(1), out_ptr, out_desc, out_smem, turn_bars, tile_e_ptr, tile_row_ptr, tile_end_ptr,
                     num_m_ptr, a_bufs, w_res, a_ready, a_empty, w_ready, w_empty, N, stride_om, BM, BN, NUM_BUF,
                     K_STEPS, GROUPED)),
        (_producer, (a_desc, w_desc, tile_e_ptr, tile_row_ptr, num_m_ptr, a_bufs, w_res, a_ready, a_empty, w_ready,
                     w_empty, K, N, BN, BK, NUM_BUF, K_STEPS, GROUPED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def grouped_gemm_wstat(a_MK, w_EKN, offsets_E1, num_sms=132, warmup=False, grouped=False):
    """out = a @ w[e] over each expert's sorted rows (bf16; rows past offsets_E1[-1] not written);
    grouped: the grouped schedule of ``_range`` where num_sms >= N's column blocks."""
    S, K = a_MK.shape
    E, _, N = w_EKN.shape
    if K % BK or K > MAX_K or N % 16 or not w_EKN.is_contiguous() or a_MK.stride(1) != 1:
        raise ValueError(f"proto_wstat: K a multiple of {BK} up to {MAX_K}, N of 16, w contiguous; got K {K}, "
                         f"N {N}")
    out = torch.empty(S, N, device=a_MK.device, dtype=torch.bfloat16)
    tile_e, tile_row, tile_end, num_m = tile_table(offsets_E1, S)
    a_desc = TensorDescriptor(a_MK, [S, K], [a_MK.stride(0), 1], [BM, BK], shared_layout(BM, BK))
    w_desc = TensorDescriptor(w_EKN, [E * K, N], [N, 1], [BK, BN], shared_layout(BK, BN))
    out_desc = TensorDescriptor(out, [S, N], [N, 1], [BM, BN], shared_layout(BM, BN))
    args = (a_desc, w_desc, out_desc, out, tile_e, tile_row, tile_end, num_m, K, N, out.stride(0))
    kw = dict(BM=BM, BN=BN, BK=BK, NUM_BUF=NUM_BUF, K_STEPS=K // BK, CONSUMER_REGS=CONSUMER_REGS,
              PRODUCER_REGS=PRODUCER_REGS, GROUPED=grouped and num_sms >= triton.cdiv(N, BN), num_warps=4,
              maxnreg=maxnreg(4, 5))
    if warmup:
        return _wstat_kernel.warmup(*args, grid=(num_sms,), **kw)
    _wstat_kernel[(num_sms,)](*args, **kw)
    return out


def ptxas_report(ptx):
    """Triton's ptxas run again with -v over the PTX: registers, bytes spilled, serialised MMAs."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        err = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", str(src), "-o", str(src) + ".o"],
                             capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", err)
    spilled = max([int(n) for n in re.findall(r"(\d+) bytes spill stores", err)] or [0])
    serialised = any(code in err for code in ("C7509", "C7510", "C7515", "C7517"))
    return f"{max(map(int, regs)) if regs else '?'} registers, {spilled} bytes spilled" + (
        ", MMAs SERIALISED" if serialised else "")


def compile_only():
    """Compile for sm_90 on any machine; print the shared memory, registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from megatron_moe.kernels import gluon_gemm
    from megatron_moe.kernels.tuning import _CompileOnly
    driver.set_active(_CompileOnly(0, GPUTarget("cuda", 90, 32)))
    use_triton = gluon_gemm.use_triton
    gluon_gemm.use_triton = lambda *t: False  # the tile table by torch ops on the CPU
    try:
        for K in (64, 192, 256):
            offsets = torch.tensor([0, 100, 100, 356], dtype=torch.int32)
            kernel = grouped_gemm_wstat(torch.zeros(400, K, dtype=torch.bfloat16),
                                        torch.zeros(3, K, 272, dtype=torch.bfloat16), offsets, warmup=True,
                                        grouped=K == 192)  # the grouped schedule at K 192
            print(f"Triton {triton.__version__}, K {K}: compiled for sm_90, {kernel.metadata.shared} bytes of shared "
                  f"memory; ptxas: {ptxas_report(kernel.asm['ptx'])}", flush=True)
    finally:
        gluon_gemm.use_triton = use_triton


CHECKS = {  # name: (rows per expert, K, N): the float64 checks
    "empty experts, partial tiles": ([0, 100, 0, 200, 129], 256, 512),
    "one expert, many tiles (blocks change by column only)": ([2000], 192, 384),
    "N not a multiple of 128, K 64": ([300, 7, 513], 64, 272),
    "no rows": ([0, 0, 0], 128, 256),
}
# sonic-1536's down projection (262,144 rows, 128 experts, N 1536) at each K
SHAPES = {"sonic-1536 down K 64": 64, "sonic-1536 down K 128": 128, "sonic-1536 down": 256}


def run(do_bench):
    from megatron_moe.kernels.gluon_gemm import grouped_gemm_gluon
    from proto_multicast import alternated  # a sibling script: benchmarks/ is first on the path

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    for name, (counts, K, N) in CHECKS.items():
        offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).to(dev)
        S = sum(counts)
        a = torch.randn(S + 9, K, generator=gen).to(torch.bfloat16).to(dev)
        w = (torch.randn(len(counts), K, N, generator=gen) / K ** 0.5).to(torch.bfloat16).to(dev)
        for programs, grouped in ((132, False), (5, False), (3, False), (132, True), (7, True), (3, True)):
            # one per SM; five and three, each program's range crossing blocks; grouped: 7 and 3 programs,
            # groups of several experts (3 programs at N 512: the range schedule)
            got = grouped_gemm_wstat(a, w, offsets, num_sms=programs, grouped=grouped)[:S].double()
            bounds = offsets.tolist()
            want = torch.cat([a[s:t].double() @ w[i].double() for i, (s, t) in enumerate(zip(bounds, bounds[1:]))])
            err = (got - want).abs()
            bound = want.abs() * 2.0 ** -8 + 1e-4 * (want.abs().max().item() if want.numel() else 0.0)
            ok = bool((err <= bound).all())
            print(f"check {name}, {programs} programs{', grouped' if grouped else ''}: "
                  f"{'ok' if ok else 'FAILED'} (max error "
                  f"{err.max().item() if err.numel() else 0.0:.3e})", flush=True)
    S, E, N = 262144, 128, 1536
    for rows in ("even", "uneven"):
        if rows == "even":
            offsets = torch.arange(0, S + 1, S // E, device=dev, dtype=torch.int32)
        else:  # each row's expert drawn at random: most experts end in a partial tile
            counts = torch.bincount(torch.randint(0, E, (S,), device=dev), minlength=E)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        for name, K in SHAPES.items():
            a = torch.randn(S, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5
            want = grouped_gemm_gluon(a, w, offsets)
            same = all(torch.equal(grouped_gemm_wstat(a, w, offsets, grouped=g), want) for g in (False, True))
            med = alternated(do_bench, {"wstat": lambda: grouped_gemm_wstat(a, w, offsets),
                                        "grouped": lambda: grouped_gemm_wstat(a, w, offsets, grouped=True),
                                        "cooperative": lambda: grouped_gemm_gluon(a, w, offsets)})
            print(f"{name:<22} {rows:<7} w kept {med['wstat']:.3f} ms  grouped {med['grouped']:.3f} ms  cooperative "
                  f"{med['cooperative']:.3f} ms  {med['cooperative'] / med['wstat']:.2f}x / "
                  f"{med['cooperative'] / med['grouped']:.2f}x  {'same bits' if same else 'BITS DIFFER'}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args()
    if args.compile_only:
        return compile_only()
    run(lambda f: triton.testing.do_bench(f, warmup=25, rep=100))


if __name__ == "__main__":
    main()
