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

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _tile_rows(t, tiles_e, tiles_n, offsets_ptr, BLOCK_S: gl.constexpr):
    """Tile t's expert, its (k, n) tile indices, its rows' range and its number of row blocks
    (at least one: an expert without rows still writes its zeros)."""
    e = t // tiles_e
    r = t % tiles_e
    seg_start = gl.load(offsets_ptr + e)
    seg_end = gl.load(offsets_ptr + e + 1)
    steps = gl.maximum(gl.cdiv(seg_end - seg_start, BLOCK_S), 1)
    return e, r // tiles_n, r % tiles_n, seg_start, seg_end, steps


@gluon.jit
def _copy_rows(buf, ptr, gather_ptr, stride_m, s0, seg_end, col0, cols_total, HAS_GATHER: gl.constexpr,
               BLOCK_S: gl.constexpr, BLOCK_C: gl.constexpr, layout: gl.constexpr):
    """cp.async of rows s0 .. s0 + BLOCK_S (those before seg_end; the rest zero-filled), through
    the gather if any, columns col0 .. col0 + BLOCK_C, into ``buf``."""
    rows = s0 + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, layout))
    mask_s = rows < seg_end
    if HAS_GATHER:
        rows = gl.load(gather_ptr + rows, mask=mask_s, other=0)
    cols = col0 + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
    ptrs = ptr + rows.to(gl.int64)[:, None] * stride_m + cols[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, mask_s[:, None] & (cols < cols_total)[None, :])


@gluon.jit
def _issue(p_i, p_s, slot, my_tiles, pid, nprog, tiles_e, tiles_n,
           a_ptr, b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs,
           K, N, stride_am, stride_bm,
           HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr,
           BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, load_layout: gl.constexpr):
    """The producer: row block p_s of this program's tile p_i into ring slot ``slot`` (nothing
    once the tiles are done); one commit group either way, so the consumer's group count holds."""
    if p_i < my_tiles:
        e, pk, pn, seg_start, seg_end, steps = _tile_rows(pid + p_i * nprog, tiles_e, tiles_n, offsets_ptr, BLOCK_S)
        s0 = seg_start + p_s * BLOCK_S
        _copy_rows(a_bufs.index(slot), a_ptr, gather_a_ptr, stride_am, s0, seg_end, pk * BLOCK_K, K, HAS_GATHER_A,
                   BLOCK_S, BLOCK_K, load_layout)
        _copy_rows(b_bufs.index(slot), b_ptr, gather_b_ptr, stride_bm, s0, seg_end, pn * BLOCK_N, N, HAS_GATHER_B,
                   BLOCK_S, BLOCK_N, load_layout)
        p_s += 1
        if p_s == steps:
            p_s = 0
            p_i += 1
    async_copy.commit_group()
    return p_i, p_s


@gluon.jit
def _wgrad_gluon_kernel(
    a_ptr, b_ptr, out_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr,
    E, K, N, stride_am, stride_bm, stride_oe, stride_ok,
    HAS_GATHER_A: gl.constexpr, HAS_GATHER_B: gl.constexpr, ACCUMULATE: gl.constexpr,
    BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_BUF: gl.constexpr,
):
    gl.static_assert(NUM_BUF >= 3, "the MMA in flight, the one before it and a slot being filled")
    # cp.async layout of both operands: 8 contiguous bf16 (16 bytes) per thread along the rows
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_K], gl.bfloat16)
    b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_N], gl.bfloat16)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
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

    p_i = 0
    p_s = 0
    for j in gl.static_range(LEAD):
        p_i, p_s = _issue(p_i, p_s, j, my_tiles, pid, nprog, tiles_e, tiles_n, a_ptr, b_ptr, gather_a_ptr,
                          gather_b_ptr, offsets_ptr, a_bufs, b_bufs, K, N, stride_am, stride_bm, HAS_GATHER_A,
                          HAS_GATHER_B, BLOCK_K, BLOCK_N, BLOCK_S, load_layout)
    count = 0  # row blocks consumed
    c_i = 0
    c_s = 0
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
        p_i, p_s = _issue(p_i, p_s, (count + LEAD) % NUM_BUF, my_tiles, pid, nprog, tiles_e, tiles_n, a_ptr,
                          b_ptr, gather_a_ptr, gather_b_ptr, offsets_ptr, a_bufs, b_bufs, K, N, stride_am,
                          stride_bm, HAS_GATHER_A, HAS_GATHER_B, BLOCK_K, BLOCK_N, BLOCK_S, load_layout)
        count += 1
        e, pk, pn, seg_start, seg_end, steps = _tile_rows(pid + c_i * nprog, tiles_e, tiles_n, offsets_ptr, BLOCK_S)
        c_s += 1
        if c_s == steps:  # the tile's last block: its sum out while the next tile's first blocks load
            acc = warpgroup_mma_wait(0, deps=[acc])
            vals = gl.convert_layout(acc, out_layout)
            offs_k = pk * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, out_layout))
            offs_n = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
            ptrs = (out_ptr + e.to(gl.int64) * stride_oe + offs_k.to(gl.int64)[:, None] * stride_ok
                    + offs_n[None, :])
            mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
            if ACCUMULATE:
                vals += gl.load(ptrs, mask=mask, other=0.0)
            gl.store(ptrs, vals.to(out_ptr.dtype.element_ty), mask=mask)
            c_s = 0
            c_i += 1
    async_copy.wait_group(0)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

BLOCK_K, BLOCK_N, BLOCK_S, NUM_BUF = 128, 128, 64, 5


def wgrad_gluon(a_MK, b_MN, offsets_E1, *, gather_a_S=None, gather_b_S=None, out=None, accumulate=False,
                out_dtype=None, block_k=BLOCK_K, block_n=BLOCK_N, block_s=BLOCK_S, num_buf=NUM_BUF):
    """dw[e] = a[gather_a(s)]ᵀ b[gather_b(s)] over expert e's rows, bf16 inputs; ``out`` [E, K, N]
    (row-major), added to when ``accumulate``."""
    import torch

    E = offsets_E1.shape[0] - 1
    K, N = a_MK.shape[1], b_MN.shape[1]
    assert a_MK.dtype == b_MN.dtype == torch.bfloat16 and a_MK.stride(1) == 1 and b_MN.stride(1) == 1
    if out is None:
        out = torch.empty(E, K, N, device=a_MK.device, dtype=out_dtype or a_MK.dtype)
    assert out.is_contiguous()
    tiles = E * triton.cdiv(K, block_k) * triton.cdiv(N, block_n)
    sms = torch.cuda.get_device_properties(a_MK.device).multi_processor_count
    dummy = offsets_E1
    _wgrad_gluon_kernel[(min(tiles, sms),)](
        a_MK, b_MN, out, gather_a_S if gather_a_S is not None else dummy,
        gather_b_S if gather_b_S is not None else dummy, offsets_E1,
        E, K, N, a_MK.stride(0), b_MN.stride(0), out.stride(0), out.stride(1),
        HAS_GATHER_A=gather_a_S is not None, HAS_GATHER_B=gather_b_S is not None, ACCUMULATE=bool(accumulate),
        BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_S=block_s, NUM_BUF=num_buf, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------------
# Compile check, GPU check and timing
# ----------------------------------------------------------------------------------------------


def compile_only() -> None:
    """Compile every variant for sm_90 without a GPU; prints each one's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    names = ["a_ptr", "b_ptr", "out_ptr", "gather_a_ptr", "gather_b_ptr", "offsets_ptr",
             "E", "K", "N", "stride_am", "stride_bm", "stride_oe", "stride_ok"]
    for out_ty in ("*fp32", "*bf16"):
        for ga, gb, acc in ((True, False, False), (False, True, True), (False, False, False)):
            if acc and out_ty != "*fp32":
                continue
            sig = dict(zip(names, ["*bf16", "*bf16", out_ty, "*i32", "*i32", "*i32"] + ["i32"] * 7))
            const = dict(HAS_GATHER_A=ga, HAS_GATHER_B=gb, ACCUMULATE=acc, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
                         BLOCK_S=BLOCK_S, NUM_BUF=NUM_BUF)
            sig.update({k: "constexpr" for k in const})
            # what a launch's specialisation gives: 16-byte aligned pointers, sizes and strides
            # divisible by 16
            aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in ("E",)}
            src = GluonASTSource(_wgrad_gluon_kernel, sig, constexprs={(list(sig).index(k),): v
                                                                      for k, v in const.items()}, attrs=aligned)
            k = triton.compile(src, target=target, options=dict(num_warps=4))
            print(f"compiled out={out_ty} gather_a={ga} gather_b={gb} accumulate={acc}: "
                  f"shared memory {k.metadata.shared} B")


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
        a = torch.randn(S + 7, K, device=device).to(torch.bfloat16)
        b = torch.randn(S, N, device=device).to(torch.bfloat16)
        ga = torch.randperm(S + 7, device=device)[:S].to(torch.int32)
        gb = torch.randperm(S, device=device).to(torch.int32)
        for kw in (dict(gather_a_S=ga), dict(gather_b_S=gb), dict(gather_a_S=ga, gather_b_S=gb)):
            want = grouped_wgrad_reference(a, b, offsets, out_dtype=torch.float64, **kw)
            got = wgrad_gluon(a, b, offsets, out_dtype=torch.float32, **kw)
            err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            start = torch.randn_like(got)
            acc = wgrad_gluon(a, b, offsets, out=start.clone(), accumulate=True, **kw)
            err_acc = (acc.double() - want - start.double()).abs().max().item() / max(want.abs().max().item(), 1)
            ok = err < 2e-2 and err_acc < 2e-2
            print(f"check S={S} K={K} N={N} experts={counts} {sorted(kw)}: rel err {err:.2e}, "
                  f"accumulating {err_acc:.2e} {'ok' if ok else 'FAIL'}", flush=True)
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
    print(f"{'shape':<16} {'gluon ms':>9} {'ours ms':>8} {'cutlass ms':>10} {'gluon TF/s':>10} {'ours TF/s':>9}")
    for name, (S, E, K, N) in shapes.items():
        counts = torch.full((E,), S // E, device=device)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(S, N, device=device, dtype=torch.bfloat16)
        gather = torch.randperm(S, device=device).to(torch.int32)
        flops = 2 * S * K * N
        g = triton.testing.do_bench(lambda: wgrad_gluon(a, b, offsets, gather_a_S=gather), warmup=25, rep=200)
        o = triton.testing.do_bench(lambda: grouped_wgrad_triton(a, b, offsets, gather_a_S=gather), warmup=25,
                                    rep=200)
        c = triton.testing.do_bench(lambda: torch._grouped_mm(a.t(), b, offs=offsets[1:]), warmup=25, rep=200)
        print(f"{name:<16} {g:9.3f} {o:8.3f} {c:10.3f} {flops / g / 1e9:10.1f} {flops / o / 1e9:9.1f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check", action="store_true", help="only the check against the reference")
    args = ap.parse_args(argv)
    if args.compile_only:
        compile_only()
        return
    import torch

    device = torch.device("cuda")
    check(device)
    if not args.check:
        bench(device)


if __name__ == "__main__":
    main()
