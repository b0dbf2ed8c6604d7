"""The optimizer step alone: the fused AdamW kernel (kernels/adamw.py) against the three passes it
replaces (clipping multiply, torch's fused AdamW, bf16 copy refresh), on dmoe-small's parameter
shapes; a launch-shape sweep of the kernel; and the host time of each step call.

    python benchmarks/bench_adamw.py                       # 6 of dmoe-small's 12 layers (~33 GB)
    python benchmarks/bench_adamw.py --layers 12 --out benchmarks/results/adamw.json

Bytes per parameter: the fused step reads p, g, m, v (16) and writes p, m, v and the bf16 copy
(14); the three passes move 8 + 28 + 6 = 42. With moments in bf16 (the kernel and the optimizer
rows, ``train.adam_moments_dtype=bf16``) the fused step moves 22. GB/s is those bytes over the
median GPU time.

    python benchmarks/bench_adamw.py --blocks 1024 --warps 8   # fp32 and bf16 moments, one shape
A device-to-device copy of a 2 GB tensor is timed beside them as the reachable bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.kernels.adamw import adamw_step_, hyperparameters  # noqa: E402
from megatron_moe.training.optimizer import AdamW  # noqa: E402


def dmoe_small_shapes(layers: int, hidden=768, ffn=3072, experts=64, vocab=51200, seq=1024):
    """Parameter shapes of dmoe-small's GPT (megatron-core's local layer spec, our MoE MLP)."""
    shapes = [(vocab, hidden), (seq, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                   (hidden,), (hidden,), (experts, hidden), (experts, hidden, ffn), (experts, ffn, hidden)]
    return shapes + [(hidden,), (hidden,)]


def gpu_ms(fn, reps: int) -> float:
    """Median GPU milliseconds of fn over reps (after two warm-ups), CUDA events (also
    benchmarks/bench_layer_norm.py's)."""
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


COPY_BYTES = 2 ** 31  # the reachable bandwidth: a device-to-device copy of 2 GB


def copy_ms(reps: int) -> float:
    """Median GPU milliseconds of copying COPY_BYTES on the current GPU into another buffer (read +
    write: 2 x COPY_BYTES moved; also benchmarks/bench_layer_norm.py's)."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return gpu_ms(lambda: dst.copy_(src), reps)


def _host_ms(fn, reps: int) -> float:
    """Median host milliseconds of one call (the GPU drained before each)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--blocks", default="1024,2048,4096,8192,16384")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = dmoe_small_shapes(args.layers)
    masters = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
    for p in masters:
        p.grad = torch.randn_like(p) * 1e-3
    copies = [p.detach().to(torch.bfloat16) for p in masters]
    n = sum(p.numel() for p in masters)
    scale = torch.tensor(0.5, device=dev)
    rows = []

    def report(name, ms, nbytes, host=None):
        row = {"name": name, "ms": round(ms, 3), "GB/s": round(nbytes * n / ms / 1e6, 1)}
        if host is not None:
            row["host_ms"] = round(host, 3)
        rows.append(row)
        print(f"{name:34s} {ms:8.3f} ms {row['GB/s']:8.1f} GB/s" + (f"  host {host:.3f} ms" if host else ""),
              flush=True)

    ms = copy_ms(args.reps)
    rows.append({"name": "copy 2 GB (read + write)", "ms": round(ms, 3), "GB/s": round(2 * COPY_BYTES / ms / 1e6, 1)})
    print(f"{'copy 2 GB (read + write)':34s} {ms:8.3f} ms {rows[-1]['GB/s']:8.1f} GB/s")

    print(f"{len(masters)} parameters, {n / 1e9:.2f}B elements ({args.layers} layers)")
    # the unfused sequence, through torch.optim.AdamW(fused=True)
    ref = torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    grads = [p.grad for p in masters]

    def unfused():
        torch._foreach_mul_(grads, scale)
        ref.step()
        torch._foreach_copy_(copies, masters)

    report("unfused: mul + torch fused + copy", gpu_ms(unfused, args.reps), 42, _host_ms(unfused, args.reps))
    report("  torch fused AdamW alone", gpu_ms(ref.step, args.reps), 28)
    ref = None  # free its state (m, v)
    torch.cuda.empty_cache()

    # the kernel alone, each launch shape, with fp32 and with bf16 moments
    hyper = [hyperparameters(1e-4, 0.1, 0.9, 0.95, 1e-8, 10)] * len(masters)
    best = {}
    for state_dtype, nbytes in ((torch.float32, 30), (torch.bfloat16, 22)):
        ms_ = [torch.zeros_like(p, dtype=state_dtype) for p in masters]
        vs_ = [torch.zeros_like(p, dtype=state_dtype) for p in masters]
        tag = "bf16 moments" if state_dtype == torch.bfloat16 else "fp32 moments"
        for block in (int(b) for b in args.blocks.split(",")):
            for warps in (int(w) for w in args.warps.split(",")):
                if block // (32 * warps) < 4:
                    continue
                bm = [None]

                def fused(block=block, warps=warps, bm=bm, ms_=ms_, vs_=vs_):
                    bm[0] = adamw_step_(masters, grads, ms_, vs_, hyper, copies=copies, grad_scale=scale,
                                        block_map=bm[0], block=block, num_warps=warps)

                t = gpu_ms(fused, args.reps)
                report(f"fused kernel, {tag}, block {block} warps {warps}", t, nbytes)
                if tag not in best or t < best[tag][0]:
                    best[tag] = (t, block, warps)
        ms_ = vs_ = None
        torch.cuda.empty_cache()
        # the optimizer object (default launch shape): GPU and host time per step
        opt = AdamW([{"params": masters, "weight_decay": 0.1}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                    state_dtype=state_dtype)
        opt.set_copies(masters, copies)
        step = lambda opt=opt: opt.step(grad_scale=scale)  # noqa: E731
        report(f"optim.AdamW.step, {tag} (default shape)", gpu_ms(step, args.reps), nbytes,
               _host_ms(step, args.reps))
        opt = step = None
        torch.cuda.empty_cache()
    for tag, (t, block, warps) in best.items():
        print(f"best launch shape, {tag}: block {block} warps {warps} ({t:.3f} ms)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "layers": args.layers, "elements": n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
