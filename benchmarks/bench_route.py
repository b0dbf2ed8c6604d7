"""The router after its logits (kernels/router.py: the forward, the one-program sum of its partials,
the backward) at the layer's router shapes, each launch's tile and warps swept, on a GPU:

    python benchmarks/bench_route.py
    python benchmarks/bench_route.py --shapes sonic-1536

Each candidate is set in the module (``FWD_TILE``, ``SUM_ELEMENTS`` / ``SUM_WARPS``, ``BWD_TILE``
or, at 65-128 experts, ``BWD_TILE_128``; as benchmarks/bench_router_gemm.py --sweep does with its
tables) and timed through the entry points: ``route_fwd_triton`` (the forward and its sum, one
swept at a time, the other shipped) and ``route_bwd_triton``. Prints per shape the shipped launch's
time and the four fastest of the sweep (µs, triton.testing.do_bench medians), each marked with
whether its outputs equal the shipped launch's bits. Shapes are (tokens, experts, top-k).
docs/performance.md, "The router's small kernels swept".
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from megatron_moe.kernels import router as R

SHAPES = {"sonic-1536": (32768, 128, 8), "qwen3": (16384, 128, 8), "dmoe-small-mb128": (131072, 64, 1)}
TILES = list(itertools.product((2048, 4096, 8192), (2, 4, 8)))  # the forward's and the backward's (elements, warps)
SUMS = list(itertools.product((16384, 65536), (8, 16)))  # the sum's (elements a step, warps)
LOSSES = dict(aux_coeff=1e-2, z_coeff=1e-3)


def us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200)


def sweep(name, fn, set_launch, candidates, shipped):
    """Time ``fn`` with each candidate launch set (``set_launch(c)``) and print the shipped one's time
    and the four fastest (the shipped launch timed too where the candidates lack it, and set again at
    the end)."""
    rows = []
    try:
        for c in dict.fromkeys([shipped, *candidates]):
            set_launch(c)
            rows.append((us(fn), c, [t.clone() for t in fn()]))
    finally:
        set_launch(shipped)
    ship = next(r for r in rows if r[1] == shipped)
    same = lambda outs: all(torch.equal(a, b) for a, b in zip(outs, ship[2]))  # noqa: E731
    print(f"{name:<28} shipped {ship[0]:6.1f} us {shipped}; fastest: "
          + "; ".join(f"{t:.1f} us {c} {'same' if same(o) else 'other bits'}"
                      for t, c, o in sorted(rows, key=lambda r: r[0])[:4]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        T, E, K = SHAPES[shape]
        gen = torch.Generator("cuda").manual_seed(0)
        logits_TE = torch.randn(T, E, device="cuda", generator=gen)
        dweights_TK = torch.randn(T, K, device="cuda", generator=gen)
        daux, dz = torch.ones((), device="cuda"), torch.ones((), device="cuda")

        def forward():
            return R.route_fwd_triton(logits_TE, None, K, **LOSSES)

        def set_fwd(c):
            R.FWD_TILE = c

        def set_sum(c):
            R.SUM_ELEMENTS, R.SUM_WARPS = c

        bwd_attr = "BWD_TILE_128" if R.bwd_tile(E) is R.BWD_TILE_128 else "BWD_TILE"  # the one route_bwd_triton takes

        def set_bwd(c):
            setattr(R, bwd_attr, c)

        sweep(f"{shape} forward (+ sum)", forward, set_fwd, TILES, R.FWD_TILE)
        sweep(f"{shape} sum (+ forward)", forward, set_sum, SUMS, (R.SUM_ELEMENTS, R.SUM_WARPS))
        ids_TK, _, counts_E, _, _ = forward()
        sweep(f"{shape} backward", lambda: [R.route_bwd_triton(logits_TE, ids_TK, counts_E, dweights_TK, daux, dz,
                                                               **LOSSES)], set_bwd, TILES, getattr(R, bwd_attr))


if __name__ == "__main__":
    main()
