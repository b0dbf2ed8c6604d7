"""The bias gradient's column sum alone on the GPU: kernels/column_sum.py against torch's
``dy.sum(0)``; then a dense MLP's GELU backward with fc1's bias gradient: torch's
``gelu_backward`` then a sum (torch's or ours) against our one pass (``dgelu_column_sum_triton``),
and torch's GELU forward for its bandwidth. With --sweep, every launch shape of SWEEP (rows per
tile, columns per tile, warps, programs) for the sums, the one pass, or both.

    python benchmarks/bench_column_sum.py                          # gpt-small's shapes, bf16
    python benchmarks/bench_column_sum.py --sweep --out bench_column_sum.json
    python benchmarks/bench_column_sum.py --sweep gelu              # the GELU's one pass only

Shapes: [tokens, outputs] of a micro-batch of 32 x 1024 tokens for gpt-small's four biases
(hidden 768: the attention projection and fc2 768, QKV 2304, fc1 3072). Bytes: one read of dy
(the fp32 partials are left out: under 1 MB); the GELU rows count each [M, N] tensor read or
written; TB/s is that over the median GPU time, from replays of a CUDA graph of 20 calls (as the
trainer runs them). A device-to-device copy of a 2 GB tensor is timed beside them as the
reachable bandwidth. Every timed launch is checked against torch's result first. Prints a table
per shape, the default launch and the fastest last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.kernels import column_sum as C  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adamw import COPY_BYTES, copy_ms, gpu_ms  # noqa: E402
from bench_layer import graphed  # noqa: E402

SHAPES = [(32768, 768), (32768, 2304), (32768, 3072)]
GELU_SHAPE = (32768, 3072)  # gpt-small's fc1 output at micro-batch 32
REPS = 50
GRAPH_CALLS = 20  # calls per CUDA-graph replay: the GPU's time, not the host's launch (tens of µs)
SWEEP = dict(block_m=(16, 32, 64), block_n=(128, 256, 512), num_warps=(4, 8), programs=(512, 1024, 2048))


def graph_ms(fn) -> float:
    """Median GPU milliseconds of one call of fn, from replays of a CUDA graph of GRAPH_CALLS calls
    (these kernels take less time than their Python launch: timed eagerly, the host is measured)."""
    replay = graphed(lambda: [fn() for _ in range(GRAPH_CALLS)])
    return gpu_ms(replay, REPS // 5) / GRAPH_CALLS


def _launches(default: dict, sweep: bool):
    """(launch kwargs, name) of every launch of SWEEP, or of ``default`` alone; the default's name
    says so."""
    for combo in itertools.product(*SWEEP.values()) if sweep else [tuple(default.values())]:
        kw = dict(zip(SWEEP, combo))
        yield kw, " ".join(f"{k}={v}" for k, v in kw.items()) + (" (default)" if kw == default else "")


def bench_shape(M: int, N: int, dtype=torch.bfloat16, sweep: bool = False) -> dict:
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    want = dy.float().sum(0)
    gb = M * N * dy.element_size() / 1e9
    rows = {"torch dy.sum(0)": graph_ms(lambda: dy.sum(0))}
    default = dict(block_m=C.BLOCK_M, block_n=C.BLOCK_N, num_warps=C.NUM_WARPS, programs=C.PROGRAMS)
    for kw, name in _launches(default, sweep):
        got = C.column_sum_triton(dy, torch.float32, **kw)
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > 1e-5:
            raise AssertionError(f"column_sum {kw} differs from torch's fp32 sum by {err:.2e}")
        rows[name] = graph_ms(lambda kw=kw: C.column_sum_triton(dy, **kw))
    return {"M": M, "N": N, "GB": gb, "ms": rows}


def bench_gelu(M: int, N: int, dtype=torch.bfloat16, sweep: bool = False) -> dict:
    """A GELU's backward and the bias gradient of the layer before it: torch's pass then a sum, or
    our one pass (each launch checked against torch's first); torch's forward. GB: [M, N] tensors
    moved."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    dact = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    dh_want = torch.ops.aten.gelu_backward(dact, h, approximate="tanh")
    db_want = dh_want.float().sum(0)
    mn = M * N * h.element_size() / 1e9
    rows = {
        "torch gelu_backward + dh.sum(0)": (4 * mn, lambda: torch.ops.aten.gelu_backward(dact, h, approximate="tanh")
                                            .sum(0)),
        "torch gelu_backward + column_sum": (4 * mn, lambda: C.column_sum_triton(
            torch.ops.aten.gelu_backward(dact, h, approximate="tanh"))),
        "torch gelu forward": (2 * mn, lambda: torch.nn.functional.gelu(h, approximate="tanh")),
    }
    default = dict(block_m=C.DGELU_BLOCK_M, block_n=C.DGELU_BLOCK_N, num_warps=C.DGELU_NUM_WARPS,
                   programs=C.DGELU_PROGRAMS)
    for kw, name in _launches(default, sweep):
        dh, db = C.dgelu_column_sum_triton(h, dact, **kw)
        err_dh = ((dh.float() - dh_want.float()).abs().max() / dh_want.float().abs().max()).item()
        err_db = ((db.float() - db_want).abs().max() / db_want.abs().max()).item()
        if err_dh > 1e-2 or err_db > 1e-2:
            raise AssertionError(f"dgelu_column_sum {kw} differs from torch's: dh {err_dh:.2e}, db {err_db:.2e}")
        rows["dgelu_column_sum " + name] = (3 * mn, lambda kw=kw: C.dgelu_column_sum_triton(h, dact, **kw))
    return {"M": M, "N": N, "rows": {k: {"GB": gb, "ms": graph_ms(fn)} for k, (gb, fn) in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--sweep", nargs="?", const="sums,gelu", default="",
                    help="time every launch shape of SWEEP, not the default only: for the sums, the GELU's "
                         "one pass, or both (the default with no value)")
    args = ap.parse_args()
    copy = copy_ms(REPS)
    copy_tbs = 2 * COPY_BYTES / copy / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy_tbs:.2f} TB/s")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbs": copy_tbs, "shapes": []}
    for M, N in SHAPES:
        r = bench_shape(M, N, sweep="sums" in args.sweep)
        results["shapes"].append(r)
        ms = r["ms"]
        kernel = {k: v for k, v in ms.items() if not k.startswith("torch")}
        best = min(kernel, key=kernel.get)
        default = next(k for k in kernel if k.endswith("(default)"))
        print(f"[{M}, {N}] bf16, {r['GB'] * 1e3:.0f} MB read")
        for name in ("torch dy.sum(0)", default, best):
            print(f"  {name:58s} {ms[name] * 1e3:7.1f} us  {r['GB'] / ms[name]:5.2f} TB/s")
    r = bench_gelu(*GELU_SHAPE, sweep="gelu" in args.sweep)
    results["gelu"] = r
    ours = {k: v["ms"] for k, v in r["rows"].items() if k.startswith("dgelu_column_sum")}
    best = min(ours, key=ours.get)
    print(f"[{r['M']}, {r['N']}] bf16: GELU backward + bias gradient; GELU forward")
    for name, row in r["rows"].items():
        if not name.startswith("dgelu_column_sum") or name == best or name.endswith("(default)"):
            print(f"  {name:58s} {row['ms'] * 1e3:7.1f} us  {row['GB'] / row['ms']:5.2f} TB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
