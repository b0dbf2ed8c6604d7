"""The grouped weight gradient at the layer's shapes: the Gluon kernel (kernels/gluon_wgrad.py),
the Triton kernel (kernels/grouped.py's ``grouped_wgrad_triton``) and CUTLASS's grouped GEMM
(``torch._grouped_mm`` over rows already sorted: no gather), on one sm_90 GPU.

    python benchmarks/bench_wgrad.py                       # the table
    python benchmarks/bench_wgrad.py --out wgrad.json      # and the rows as JSON

dw[e] = a[gather(s)]ᵀ b[s] over expert e's rows, bf16 in and out, each expert an equal share of
the rows (tokens x top-k); dw1 = x[t]ᵀ dpre (gather on a), dw2 = wactᵀ dy[t] (gather on b). Median
of ``triton.testing.do_bench``; TFLOP/s = 2 S K N / time. The Gluon kernel's correctness is
tests/kernels/test_gluon_wgrad.py's (run it first: ``pytest tests/kernels/test_gluon_wgrad.py -m gpu``).
"""
from __future__ import annotations

import argparse
import json

SHAPES = {  # name: (rows S = tokens x top-k, experts E, K, N, the gathered operand)
    "qwen3 dw1": (131072, 128, 2048, 1536, "a"), "qwen3 dw2": (131072, 128, 768, 2048, "b"),
    "olmoe dw1": (131072, 64, 2048, 2048, "a"), "olmoe dw2": (131072, 64, 1024, 2048, "b"),
    "sonic-1536 dw2": (262144, 128, 256, 1536, "b"),
    "dmoe-small dw1": (32768, 64, 768, 3072, "a"), "dmoe-small dw2": (32768, 64, 3072, 768, "b"),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)

    import torch
    import triton.testing

    from megatron_moe.kernels import gluon_wgrad
    from megatron_moe.kernels.grouped import grouped_wgrad_triton

    device = torch.device("cuda")
    rows = []
    print(f"{'shape':<16} {'gluon ms':>9} {'triton ms':>10} {'cutlass ms':>11} {'gluon TF/s':>11} "
          f"{'triton TF/s':>12} {'cutlass TF/s':>13}")
    for name, (S, E, K, N, side) in SHAPES.items():
        counts = torch.full((E,), S // E, device=device)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        a = torch.randn(S, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(S, N, device=device, dtype=torch.bfloat16)
        rows_S = torch.randperm(S, device=device).to(torch.int32)
        kw = dict(gather_a_S=rows_S) if side == "a" else dict(gather_b_S=rows_S)
        assert gluon_wgrad.supported(a, b, offsets, **kw), f"{name}: the Gluon kernel does not take this shape"
        ms = {
            "gluon": triton.testing.do_bench(lambda: gluon_wgrad.grouped_wgrad_gluon(a, b, offsets, **kw)),
            "triton": triton.testing.do_bench(lambda: grouped_wgrad_triton(a, b, offsets, **kw)),
            "cutlass": triton.testing.do_bench(lambda: torch._grouped_mm(a.t(), b, offs=offsets[1:])),
        }
        tflops = {k: 2 * S * K * N / v / 1e9 for k, v in ms.items()}
        rows.append(dict(shape=name, rows=S, experts=E, K=K, N=N, gather=side, ms=ms, tflops=tflops))
        print(f"{name:<16} {ms['gluon']:9.3f} {ms['triton']:10.3f} {ms['cutlass']:11.3f} {tflops['gluon']:11.0f} "
              f"{tflops['triton']:12.0f} {tflops['cutlass']:13.0f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
