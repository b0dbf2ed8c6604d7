"""The Gluon kernels at the layer's shapes, beside our Triton kernels and CUTLASS's grouped GEMM
(``torch._grouped_mm``, over rows already sorted: no gather, no epilogue), on one sm_90 GPU:
the weight gradient (kernels/gluon_wgrad.py), the row-grouped GEMM's up and down projections
(kernels/gluon_gemm.py) and the activation's backward GEMM (kernels/gluon_dact.py).

    python benchmarks/bench_gluon.py                       # the table
    python benchmarks/bench_gluon.py --only dact           # one kind (wgrad, wgrad-fp32, gemm, dact)
    python benchmarks/bench_gluon.py --out gluon.json      # and the rows as JSON
    python benchmarks/bench_gluon.py --only dact --dact-tiles 128x128x128x3,64x256x64x4  # tiles beside the default
    python benchmarks/bench_gluon.py --only depth          # the down projection's time against its depth K

Weight gradients: dw[e] = a[gather(s)]ᵀ b[s] over expert e's rows, bf16 in and out, each expert an
equal share of the rows (tokens x top-k); dw1 = x[t]ᵀ dpre (gather on a), dw2 = wactᵀ dy[t]
(gather on b). ``wgrad-fp32``: the trainer's weight gradients at its models' shapes (micro-batch
64), fp32, written into its master gradients (a step's first micro-batch) or added to them (the
rest), against the Triton kernel's TMA reduce-add or load-add-store (its autotuner's choice), with
the largest difference between the two kernels' results. Up projections: pre[s] = x[t(s)] @ w1[e]
with swiglu times the router weight in the epilogue (the tokens t(s) in a random order). Down
projections: y[s] = wact[s] @ w2[e], sorted rows; input gradients dx[s] = dpre[s] @ w1[e]ᵀ, sorted
rows (w1's storage read transposed). ``depth``: the plain kernel and CUTLASS at sonic-1536's down
projection (262,144 sorted rows, 128 experts, N 1536) with K from 64 to 2048, beside a write of its
output's bytes alone (``zero_``): a time that grows by the MMAs' time over the store's, not the
larger of the two, says the tiles' stores and the next tiles' MMAs do not overlap.
The activation's backward: g[s] = dy[t(s)] @ w2[e]ᵀ, then dpre = scale·g·act'(pre) written over pre
and Σ g·act(pre) per row (the tokens t(s) random, each tile's pre read and dpre written: CUTLASS's
column is the plain product over rows already gathered, without that epilogue). (A Gluon kernel of
one tile at a time, measured here on 2026-12-02 and slower than the Triton kernel, is in commit
0023104; the ping-pong kernel now in kernels/gluon_dact.py replaced it.)
Median of ``triton.testing.do_bench``; TFLOP/s = 2 S K N / time. Correctness: tests/kernels/test_gluon_*.py
(run them first: ``pytest tests/kernels/test_gluon_wgrad.py tests/kernels/test_gluon_gemm.py -m gpu``).
"""
from __future__ import annotations

import argparse
import json
import os

WGRAD_SHAPES = {  # name: (rows S = tokens x top-k, experts E, K, N, the gathered operand)
    "qwen3 dw1": (131072, 128, 2048, 1536, "a"), "qwen3 dw2": (131072, 128, 768, 2048, "b"),
    "olmoe dw1": (131072, 64, 2048, 2048, "a"), "olmoe dw2": (131072, 64, 1024, 2048, "b"),
    "sonic-1536 dw2": (262144, 128, 256, 1536, "b"),
    "dmoe-small dw1": (32768, 64, 768, 3072, "a"), "dmoe-small dw2": (32768, 64, 3072, 768, "b"),
}
WGRAD_FP32_SHAPES = {  # the trainer's models at micro-batch 64 (65,536 rows, top-1), and an OLMoE-like one
    "dmoe-xs dw1": (65536, 64, 512, 2048, "a"), "dmoe-xs dw2": (65536, 64, 2048, 512, "b"),
    "dmoe-small dw1": (65536, 64, 768, 3072, "a"), "dmoe-small dw2": (65536, 64, 3072, 768, "b"),
    "olmoe dw1": (131072, 64, 2048, 2048, "a"), "olmoe dw2": (131072, 64, 1024, 2048, "b"),
}
# ... and dmoe-small at an 80 GB GPU's micro-batch 16 (256 rows an expert)
WGRAD_ADD_SHAPES = dict(WGRAD_FP32_SHAPES, **{
    "dmoe-small16 dw1": (16384, 64, 768, 3072, "a"), "dmoe-small16 dw2": (16384, 64, 3072, 768, "b")})
DEPTH_SHAPE, DEPTHS = (262144, 128, 1536), (64, 128, 256, 512, 1024, 2048)  # 'depth': (rows S, E, N), the Ks
GEMM_SHAPES = {  # name: (rows S, experts E, K, N, tokens gathered from (0: none), activation)
    # (the top-1 down projection, scattered, (32768, 64, 3072, 768) at dmoe-small, measured 0.489 ms
    # against the Triton kernel's 0.246 on 2026-12-02 and was left to it: supported() refuses a scatter)
    "qwen3 up": (131072, 128, 2048, 1536, 16384, "swiglu"),
    "olmoe up": (131072, 64, 2048, 2048, 16384, "swiglu"),
    "sonic-1536 up": (262144, 128, 1536, 512, 32768, "swiglu"),
    "sonic-4096 up": (131072, 64, 4096, 2048, 32768, "swiglu"),
    "qwen3 down": (131072, 128, 768, 2048, 0, None), "olmoe down": (131072, 64, 1024, 2048, 0, None),
    "sonic-1536 down": (262144, 128, 256, 1536, 0, None), "sonic-4096 down": (131072, 64, 1024, 4096, 0, None),
    # the input gradient dx = dpre @ w1[e]ᵀ (w1's [E, N, K] storage read transposed), top-k > 1
    "qwen3 dx": (131072, 128, 1536, 2048, 0, "t"), "olmoe dx": (131072, 64, 2048, 2048, 0, "t"),
    "sonic-1536 dx": (262144, 128, 512, 1536, 0, "t"), "sonic-4096 dx": (131072, 64, 2048, 4096, 0, "t"),
    "fine-64e dx": (65536, 64, 1024, 2048, 0, "t"),
}
DACT_SHAPES = {  # name: (rows S, experts E, K = hidden, N = ffn, tokens T, activation): bench_layer's configs
    "sonic-1536": (262144, 128, 1536, 256, 32768, "swiglu"), "qwen3": (131072, 128, 2048, 768, 16384, "swiglu"),
    "olmoe": (131072, 64, 2048, 1024, 16384, "swiglu"), "sonic-4096": (131072, 64, 4096, 1024, 32768, "swiglu"),
    "fine-64e-top8": (65536, 64, 2048, 1024, 8192, "gelu"), "paper-moe-m": (16384, 64, 1024, 4096, 16384, "gelu"),
    "dmoe-small": (32768, 64, 768, 3072, 32768, "gelu"),  # configs/dmoe-small.yaml at micro-batch 32, top-1
}


def dact_tiles(gluon_dact, dy, w, offsets, pre, act, kw, tiles, do_bench):
    """Each tile's median ms over three rounds alternated with the default tile's, and its results'
    largest differences from the default's (dpre, Σ g·act(pre))."""
    import torch

    tiles = [gluon_dact.tile_for(act, dy.shape[1])] + tiles  # the default first
    names = ["x".join(map(str, tile)) for tile in tiles]
    fresh = torch.randn_like(pre)  # pre itself holds what the timed calls wrote over it (SwiGLU's overflows)
    ref = gluon_dact.grouped_gemm_dact_pingpong(dy, w, offsets, fresh, act, **kw)
    out = {}
    for name, tile in zip(names, tiles):
        got = gluon_dact.grouped_gemm_dact_pingpong(dy, w, offsets, fresh, act, tile=tile, **kw)
        out[name] = dict(ms=[], dpre_diff=(got[0].float() - ref[0].float()).abs().max().item(),
                         dscale_diff=(got[1] - ref[1]).abs().max().item())
    for _ in range(3):
        for name, tile in zip(names, tiles):
            out[name]["ms"].append(do_bench(lambda: gluon_dact.grouped_gemm_dact_pingpong(
                dy, w, offsets, pre, act, inplace=True, tile=tile, **kw)))
    base = sorted(out[names[0]]["ms"])[1]
    for name, r in out.items():
        r["median_ms"] = sorted(r["ms"])[1]
        print(f"    tile {name:<14} {r['median_ms']:8.3f} ms  {base / r['median_ms']:5.2f}x  "
              f"dpre diff {r['dpre_diff']:.3g}  dscale diff {r['dscale_diff']:.3g}", flush=True)
    torch.cuda.synchronize()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--only", help="wgrad, wgrad-fp32, wgrad-add, gemm, dact or depth, or a comma list (default: "
                                   "all but wgrad-add and depth)")
    ap.add_argument("--dact-tiles", default="", help="the activation's backward with these tiles too (rows x "
                    "columns x step x ring slots, a comma list), alternated with the default in three rounds; "
                    "each one's largest difference from the default's results")
    args = ap.parse_args(argv)
    kinds = set((args.only or "wgrad,wgrad-fp32,gemm,dact").split(","))

    import torch
    import triton.testing

    from megatron_moe.kernels import gluon_dact, gluon_gemm, gluon_wgrad
    from megatron_moe.kernels.grouped import grouped_gemm_dact_triton, grouped_gemm_triton, grouped_wgrad_triton

    device = torch.device("cuda")
    rows = []
    print(f"{'shape':<16} {'gluon ms':>9} {'triton ms':>10} {'cutlass ms':>11} {'gluon TF/s':>11} "
          f"{'triton TF/s':>12} {'cutlass TF/s':>13}")
    def wgrad_operands(S, E, K, N, side):
        """Equal experts; a, b bf16; the gathered side's rows in a random order."""
        counts = torch.full((E,), S // E, device=device)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(S, N, device=device, dtype=torch.bfloat16)
        rows_S = torch.randperm(S, device=device).to(torch.int32)
        return a, b, offsets, dict(gather_a_S=rows_S) if side == "a" else dict(gather_b_S=rows_S)

    for name, (S, E, K, N, side) in WGRAD_SHAPES.items() if "wgrad" in kinds else ():
        a, b, offsets, kw = wgrad_operands(S, E, K, N, side)
        assert gluon_wgrad.supported(a, b, offsets, **kw), f"{name}: the Gluon kernel does not take this shape"
        ms = {
            "gluon": triton.testing.do_bench(lambda: gluon_wgrad.grouped_wgrad_gluon(a, b, offsets, **kw)),
            "triton": triton.testing.do_bench(lambda: grouped_wgrad_triton(a, b, offsets, **kw)),
            "cutlass": triton.testing.do_bench(lambda: torch._grouped_mm(a.t(), b, offs=offsets[1:])),
        }
        tflops = {k: 2 * S * K * N / v / 1e9 for k, v in ms.items()}
        rows.append(dict(kind="wgrad", shape=name, rows=S, experts=E, K=K, N=N, gather=side, ms=ms, tflops=tflops))
        print(f"{name:<16} {ms['gluon']:9.3f} {ms['triton']:10.3f} {ms['cutlass']:11.3f} {tflops['gluon']:11.0f} "
              f"{tflops['triton']:12.0f} {tflops['cutlass']:13.0f}", flush=True)
    for name, (S, E, K, N, side) in WGRAD_FP32_SHAPES.items() if "wgrad-fp32" in kinds else ():
        a, b, offsets, kw = wgrad_operands(S, E, K, N, side)
        base = torch.randn(E, K, N, device=device)
        for mode, accumulate in (("written", False), ("added", True)):
            assert gluon_wgrad.supported(a, b, offsets, out=base, accumulate=accumulate, **kw), name
            outs = {k: base.clone() for k in ("gluon", "triton")}
            gluon_wgrad.grouped_wgrad_gluon(a, b, offsets, out=outs["gluon"], accumulate=accumulate, **kw)
            grouped_wgrad_triton(a, b, offsets, out=outs["triton"], accumulate=accumulate, **kw)
            diff = (outs["gluon"] - outs["triton"]).abs().max().item()
            scale = outs["triton"].abs().max().item()
            ms = {
                "gluon": triton.testing.do_bench(lambda: gluon_wgrad.grouped_wgrad_gluon(
                    a, b, offsets, out=outs["gluon"], accumulate=accumulate, **kw)),
                "triton": triton.testing.do_bench(lambda: grouped_wgrad_triton(
                    a, b, offsets, out=outs["triton"], accumulate=accumulate, **kw)),
            }
            tflops = {k: 2 * S * K * N / v / 1e9 for k, v in ms.items()}
            label = f"{name} {mode}"
            rows.append(dict(kind="wgrad-fp32", shape=label, rows=S, experts=E, K=K, N=N, gather=side, ms=ms,
                             tflops=tflops, max_diff=diff, max_abs=scale))
            print(f"{label:<16} {ms['gluon']:9.3f} {ms['triton']:10.3f} {'-':>11} {tflops['gluon']:11.0f} "
                  f"{tflops['triton']:12.0f} {'-':>13}  max |gluon - triton| {diff:.2e} of {scale:.1e}", flush=True)
    if "wgrad-add" in kinds:  # the Gluon kernel's fp32 add, each MEGATRON_MOE_WGRAD_ADD, beside bf16 and written
        from megatron_moe.kernels.switches import WGRAD_ADD_WAYS
        print(f"{'shape':<18} {'bf16 ms':>8} {'written':>8} " + " ".join(f"{w:>13}" for w in WGRAD_ADD_WAYS))
    for name, (S, E, K, N, side) in WGRAD_ADD_SHAPES.items() if "wgrad-add" in kinds else ():
        a, b, offsets, kw = wgrad_operands(S, E, K, N, side)
        base = torch.randn(E, K, N, device=device)
        out = base.clone()
        ms = {"bf16": triton.testing.do_bench(lambda: gluon_wgrad.grouped_wgrad_gluon(a, b, offsets, **kw)),
              "written": triton.testing.do_bench(lambda: gluon_wgrad.grouped_wgrad_gluon(a, b, offsets, out=out, **kw))}
        results = {}
        for way in WGRAD_ADD_WAYS:
            os.environ["MEGATRON_MOE_WGRAD_ADD"] = way
            results[way] = base.clone()
            gluon_wgrad.grouped_wgrad_gluon(a, b, offsets, out=results[way], accumulate=True, **kw)
            ms[way] = triton.testing.do_bench(lambda: gluon_wgrad.grouped_wgrad_gluon(
                a, b, offsets, out=out, accumulate=True, **kw))
        os.environ.pop("MEGATRON_MOE_WGRAD_ADD")
        same = all(torch.equal(results[w], results["atomic"]) for w in WGRAD_ADD_WAYS)
        rows.append(dict(kind="wgrad-add", shape=name, rows=S, experts=E, K=K, N=N, gather=side, ms=ms,
                         same_bits=same))
        print(f"{name:<18} {ms['bf16']:8.3f} {ms['written']:8.3f} " + " ".join(f"{ms[w]:13.3f}" for w in WGRAD_ADD_WAYS)
              + f"  {'same bits' if same else 'BITS DIFFER'}", flush=True)
    for name, (S, E, K, N, T, act) in GEMM_SHAPES.items() if "gemm" in kinds else ():
        offsets = torch.arange(0, S + 1, S // E, device=device, dtype=torch.int32)
        a = torch.randn(T or S, K, device=device, dtype=torch.bfloat16)
        if act == "t":  # w1ᵀ: the view of a contiguous [E, N, K]
            act, w = None, torch.randn(E, N, K, device=device, dtype=torch.bfloat16).transpose(1, 2)
        else:
            w = torch.randn(E, K, N, device=device, dtype=torch.bfloat16)
        kw = {}
        if T:
            kw.update(gather_S=torch.randint(0, T, (S,), device=device, dtype=torch.int32))
        if act:
            kw.update(activation=act, act_scale_S=torch.rand(S, device=device))
        assert gluon_gemm.supported(a, w, offsets, **kw), f"{name}: the Gluon kernel does not take this shape"
        a_sorted = a[kw["gather_S"]] if T else a
        ms = {
            "gluon": triton.testing.do_bench(lambda: gluon_gemm.grouped_gemm_gluon(a, w, offsets, **kw)),
            "triton": triton.testing.do_bench(lambda: grouped_gemm_triton(a, w, offsets, **kw)),
            "cutlass": triton.testing.do_bench(lambda: torch._grouped_mm(a_sorted, w, offs=offsets[1:])),
        }
        tflops = {k: 2 * S * K * N / v / 1e9 for k, v in ms.items()}
        rows.append(dict(kind="gemm", shape=name, rows=S, experts=E, K=K, N=N, gather=bool(T), activation=act, ms=ms,
                         tflops=tflops))
        print(f"{name:<16} {ms['gluon']:9.3f} {ms['triton']:10.3f} {ms['cutlass']:11.3f} {tflops['gluon']:11.0f} "
              f"{tflops['triton']:12.0f} {tflops['cutlass']:13.0f}", flush=True)
    for name, (S, E, K, N, T, act) in DACT_SHAPES.items() if "dact" in kinds else ():
        offsets = torch.arange(0, S + 1, S // E, device=device, dtype=torch.int32)
        dy = torch.randn(T, K, device=device, dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device=device) / K ** 0.5).to(torch.bfloat16).transpose(1, 2)  # w2ᵀ's view
        pre = torch.randn(S, 2 * N if act == "swiglu" else N, device=device, dtype=torch.bfloat16)
        kw = dict(gather_S=torch.randint(0, T, (S,), device=device, dtype=torch.int32),
                  scale_S=torch.rand(S, device=device))
        assert gluon_dact.supported(dy, w, offsets, pre, act, **kw), f"{name}: the Gluon kernel does not take it"
        dy_sorted = dy[kw["gather_S"]]
        ms = {  # in place, as the layer's backward calls it (pre's values change from call to call)
            "gluon": triton.testing.do_bench(lambda: gluon_dact.grouped_gemm_dact_pingpong(dy, w, offsets, pre, act,
                                                                                            inplace=True, **kw)),
            "triton": triton.testing.do_bench(lambda: grouped_gemm_dact_triton(dy, w, offsets, pre, act, inplace=True,
                                                                               **kw)),
            "cutlass": triton.testing.do_bench(lambda: torch._grouped_mm(dy_sorted, w, offs=offsets[1:])),
        }
        tflops = {k: 2 * S * K * N / v / 1e9 for k, v in ms.items()}
        rows.append(dict(kind="dact", shape=name, rows=S, experts=E, K=K, N=N, activation=act, ms=ms, tflops=tflops))
        print(f"{name + ' dact':<16} {ms['gluon']:9.3f} {ms['triton']:10.3f} {ms['cutlass']:11.3f} "
              f"{tflops['gluon']:11.0f} {tflops['triton']:12.0f} {tflops['cutlass']:13.0f}", flush=True)
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.dact_tiles.split(",") if t]
        tiles = [t for t in tiles if N % t[1] == 0 and K % t[2] == 0 and gluon_dact.smem_bytes(t, act) <= 227 * 1024]
        if tiles:
            rows[-1]["tiles"] = dact_tiles(gluon_dact, dy, w, offsets, pre, act, kw, tiles, triton.testing.do_bench)
    if "depth" in kinds:
        S, E, N = DEPTH_SHAPE
        offsets = torch.arange(0, S + 1, S // E, device=device, dtype=torch.int32)
        out = torch.empty(S, N, device=device, dtype=torch.bfloat16)
        store_ms = triton.testing.do_bench(out.zero_)
        print(f"depth: {S} rows, {E} experts, N {N}; writing the output's {S * N * 2 / 1e6:.0f} MB alone "
              f"{store_ms:.3f} ms\n{'K':>6} {'gluon ms':>9} {'cutlass ms':>11} {'gluon TF/s':>11} {'cutlass TF/s':>13}")
        for K in DEPTHS:
            a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
            w = torch.randn(E, K, N, device=device, dtype=torch.bfloat16)
            assert gluon_gemm.supported(a, w, offsets), f"depth K {K}: the Gluon kernel does not take it"
            ms = {"gluon": triton.testing.do_bench(lambda: gluon_gemm.grouped_gemm_gluon(a, w, offsets)),
                  "cutlass": triton.testing.do_bench(lambda: torch._grouped_mm(a, w, offs=offsets[1:]))}
            tflops = {k: 2 * S * K * N / v / 1e9 for k, v in ms.items()}
            rows.append(dict(kind="depth", shape=f"K {K}", rows=S, experts=E, K=K, N=N, ms=ms, tflops=tflops,
                             store_ms=store_ms))
            print(f"{K:6d} {ms['gluon']:9.3f} {ms['cutlass']:11.3f} {tflops['gluon']:11.0f} {tflops['cutlass']:13.0f}",
                  flush=True)
            del a, w
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
