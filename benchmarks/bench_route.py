"""The router's small kernels (kernels/router.py: the forward, the one-program sum of its partials,
the backward) at the layer's router shapes, each launch's tile and warps swept, on a GPU:

    python benchmarks/bench_route.py
    python benchmarks/bench_route.py --shapes sonic-1536

Prints per shape and kernel the shipped launch's time and the four fastest of the sweep (µs,
triton.testing.do_bench medians), each marked with whether its outputs equal the shipped launch's
bits (the forward's ids and weights, the sum's counts, the backward's dL/dlogits). Shapes are
(tokens, experts, top-k). docs/performance.md, "The router's small kernels swept".
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from megatron_moe.kernels import router as R
from megatron_moe.kernels._common import cdiv, next_power_of_2

SHAPES = {"sonic-1536": (32768, 128, 8), "qwen3": (16384, 128, 8), "dmoe-small-mb128": (131072, 64, 1)}
TILES, WARPS = (2048, 4096, 8192), (2, 4, 8)  # the forward's and the backward's [BLOCK_T, BLOCK_E] elements
SUM_STEPS, SUM_WARPS, SUM_STAGES = (16384, 65536), (8, 16), (1, 3)


def us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200)


def forward(logits_TE, K, elements, warps):
    """A launch of the forward kernel with this tile and warps: (run, its partials, its ids and weights)."""
    T, E = logits_TE.shape
    BT, BE, BK = R._blocks(E, K, elements)
    G, dev = cdiv(T, BT), logits_TE.device
    ids_TK = torch.empty(T, K, device=dev, dtype=torch.int64)
    w_TK = torch.empty(T, K, device=dev)
    part = torch.empty(G * (2 * BE + 1), device=dev, dtype=torch.int32)
    probs, lse2 = part[G * BE:].view(torch.float32).split([G * BE, G])
    parts = (part[:G * BE], probs, lse2, G, BE)

    def run():
        R._route_fwd_kernel[(G,)](logits_TE, w_TK, ids_TK, w_TK, *parts[:3], T, E, logits_TE.stride(0), K=K,
                                  SOFTMAX=True, NORMALIZE=False, HAS_BIAS=False, BLOCK_T=BT, BLOCK_E=BE, BLOCK_K=BK,
                                  num_warps=warps)
    return run, parts, (ids_TK, w_TK)


def partial_sum(parts, E, step_elements, warps, stages):
    counts_part, probs_part, lse2_part, G, BE = parts
    dev = counts_part.device
    counts_E = torch.empty(E, device=dev, dtype=torch.int64)
    aux, z = torch.empty((), device=dev), torch.empty((), device=dev)
    BG = max(2, min(step_elements // BE, next_power_of_2(G)))

    def run():
        R._route_sum_kernel[(1,)](counts_part, probs_part, lse2_part, counts_E, aux, z, G, E, 1e-3, 1e-3, BLOCK_G=BG,
                                  BLOCK_E=BE, num_warps=warps, num_stages=stages)
    return run, counts_E


def backward(logits_TE, ids_TK, counts_E, elements, warps):
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    BT, BE, _ = R._blocks(E, K, elements)
    dw_TK = torch.randn(T, K, device=logits_TE.device, generator=torch.Generator(logits_TE.device).manual_seed(0))
    d = torch.ones((), device=logits_TE.device)
    dlogits_TE = torch.empty_like(logits_TE)

    def run():
        R._route_bwd_kernel[(cdiv(T, BT),)](logits_TE, ids_TK, dw_TK, counts_E, d, d, dlogits_TE, T, E,
                                            logits_TE.stride(0), 1e-3, 1e-3, K=K, SOFTMAX=True, NORMALIZE=False,
                                            HAS_DW=True, HAS_AUX=True, HAS_Z=True, BLOCK_T=BT, BLOCK_E=BE,
                                            num_warps=warps)
    return run, dlogits_TE


def report(shape, kernel, rows, shipped):
    """rows: (µs, label, outputs); the shipped row's outputs are the bits the others are compared with."""
    ship = next(r for r in rows if r[1] == shipped)
    best = sorted(rows, key=lambda r: r[0])[:4]
    same = lambda r: all(torch.equal(a, b) for a, b in zip(r[2], ship[2]))  # noqa: E731
    print(f"{shape:<18} {kernel:<4} shipped {ship[0]:6.1f} us ({shipped}); fastest: "
          + "; ".join(f"{t:.1f} us {label} {'same' if same((t, label, o)) else 'other bits'}" for t, label, o in best),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        T, E, K = SHAPES[shape]
        logits_TE = torch.randn(T, E, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        rows = []
        for elements, warps in itertools.product(TILES, WARPS):
            run, _, outs = forward(logits_TE, K, elements, warps)
            rows.append((us(run), f"tile {elements} warps {warps}", [o.clone() for o in outs]))
        report(shape, "fwd", rows, "tile 4096 warps 4")
        run, parts, (ids_TK, _) = forward(logits_TE, K, 4096, 4)
        run()
        rows = []
        for step, warps, stages in itertools.product(SUM_STEPS, SUM_WARPS, SUM_STAGES):
            srun, counts_E = partial_sum(parts, E, step, warps, stages)
            rows.append((us(srun), f"step {step} warps {warps} stages {stages}", [counts_E.clone()]))
        report(shape, "sum", rows, f"step {R.SUM_ELEMENTS} warps {R.SUM_WARPS} stages 3")
        rows = []
        for elements, warps in itertools.product(TILES, WARPS):
            brun, dlogits_TE = backward(logits_TE, ids_TK, counts_E, elements, warps)
            rows.append((us(brun), f"tile {elements} warps {warps}", [dlogits_TE.clone()]))
        report(shape, "bwd", rows, f"tile {R.BWD_TILE[0]} warps {R.BWD_TILE[1]}")


if __name__ == "__main__":
    main()
