"""The LM loss's kernels alone on the GPU (kernels/cross_entropy.py): the forward (loss and row
statistics), the in-place backward, and the two together as a training step runs them.

    python benchmarks/bench_cross_entropy.py                        # gpt-small's logits, bf16
    python benchmarks/bench_cross_entropy.py --out bench_cross_entropy.json

Shape: [tokens, vocabulary] of a micro-batch of 32 x 1024 tokens and gpt-small's vocabulary
(51200, configs/gpt-small.yaml). GB: the logits' bytes each moves (the forward: one read; the
backward: a read and a write; both: two reads and a write); TB/s is that over the median GPU
time, from replays of a CUDA graph of 20 calls (benchmarks/bench_column_sum.py's ``graph_ms``),
beside a device-to-device copy's. The loss is checked against float64 log-softmax on a slice of
rows first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.kernels import cross_entropy as CE  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adamw import COPY_BYTES, copy_ms  # noqa: E402
from bench_column_sum import REPS, graph_ms  # noqa: E402

SHAPE = (32768, 51200)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    copy_tbs = 2 * COPY_BYTES / copy_ms(REPS) / 1e9
    T, V = SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = 3 * torch.randn(T, V, device="cuda", dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    ones = torch.ones(T, device="cuda")
    loss, stats = CE.cross_entropy_fwd(logits, labels)
    want = -torch.log_softmax(logits[:256].double(), -1).gather(1, labels[:256, None])[:, 0]
    err = (loss[:256].double() - want).abs().max().item()
    if err > 1e-4:
        raise AssertionError(f"cross_entropy_fwd differs from float64 log-softmax by {err:.2e}")
    gb = T * V * logits.element_size() / 1e9
    work = logits.clone()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy_tbs:.2f} TB/s; "
          f"logits [{T}, {V}] bf16, {gb:.2f} GB")

    def fwd_bwd():
        loss, st = CE.cross_entropy_fwd(work, labels)
        CE.cross_entropy_bwd(work, labels, st, ones, inplace=True)

    rows = {"forward": (1, lambda: CE.cross_entropy_fwd(logits, labels)),
            "backward, in place": (2, lambda: CE.cross_entropy_bwd(work, labels, stats, ones, inplace=True)),
            "forward + backward": (3, fwd_bwd)}
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbs": copy_tbs,
               "shape": SHAPE, "ms": {}}
    for name, (moved, fn) in rows.items():
        ms = results["ms"][name] = graph_ms(fn)
        print(f"  {name:24s} {ms * 1e3:8.1f} us  {moved * gb / ms:5.2f} TB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
