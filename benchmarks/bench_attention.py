"""Core attention at the models' shapes: each of PyTorch SDPA's GPU backends (flash, cuDNN,
memory-efficient), forward + backward, causal, bf16, with q, k, v and the output laid out as
``SDPAttention`` (megatron_moe/megatron/attention.py) has them: views of megatron-core's fused
QKV projection [s, b, heads, 3 x head_dim] permuted to [b, heads, s, head_dim], the output
permuted back and flattened. Each backend's output and input gradient are checked against the
math backend in float32 first.

    python benchmarks/bench_attention.py                       # gpt-xs, gpt-small, gpt-medium
    python benchmarks/bench_attention.py 32,12,1024,64 gpt-small --out attention.json

A shape is a name above or micro-batch,heads,sequence,head_dim. Prints one table (ms per forward + backward,
median of --reps after --warmup, CUDA events; TFLOP/s counts the causal half of the scores'
FLOPs: 2 x 2 x b x heads x s^2 x d / 2 forward, 2.5x that backward).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"gpt-xs": (32, 8, 1024, 64), "gpt-small": (32, 12, 1024, 64), "gpt-medium": (16, 16, 1024, 64)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(qkv_SBN3D: torch.Tensor, d: int) -> torch.Tensor:
    """SDPAttention's layout around the kernel: [s, b, n, 3d] -> q, k, v [b, n, s, d] -> [s, b, n*d]."""
    s, b, n, _ = qkv_SBN3D.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv_SBN3D.split(d, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def step(backend, qkv, d, grad):
    qkv.grad = None
    with sdpa_kernel([backend]):
        attention(qkv, d).backward(grad)


def check(backend, d=64) -> float:
    """Max abs error of the output and the input gradient against the math backend in fp32."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 2, 4, 3 * d, device="cuda", generator=g)
    dy = torch.randn(256, 2, 4 * d, device="cuda", generator=g)
    ref = x.clone().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        y_ref = attention(ref, d)
    y_ref.backward(dy)
    xb = x.bfloat16().requires_grad_()
    with sdpa_kernel([backend]):
        y = attention(xb, d)
    y.backward(dy.bfloat16())
    return max((y.float() - y_ref).abs().max().item(), (xb.grad.float() - ref.grad).abs().max().item())


def time_one(backend, shape, warmup: int, reps: int) -> float:
    b, n, s, d = shape
    qkv = torch.randn(s, b, n, 3 * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(s, b, n * d, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        step(backend, qkv, d, grad)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step(backend, qkv, d, grad)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=list(SHAPES), help="names or b,heads,s,d")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    shapes = {x: SHAPES[x] if x in SHAPES else tuple(int(v) for v in x.split(",")) for x in a.shapes}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    errors = {}
    for name, backend in BACKENDS.items():
        try:
            errors[name] = check(backend)
        except RuntimeError as e:  # the backend refuses this GPU or layout
            errors[name] = f"unavailable: {str(e).splitlines()[0][:100]}"
        print(f"{name}: max abs error against math in fp32: {errors[name]}", flush=True)
    rows = []
    for label, shape in shapes.items():
        b, n, s, d = shape
        flops = 2 * 2 * b * n * s * s * d / 2 * 3.5
        for name, backend in BACKENDS.items():
            if isinstance(errors[name], str):
                continue
            ms = time_one(backend, shape, a.warmup, a.reps)
            rows.append({"shape": label, "b": b, "heads": n, "s": s, "d": d, "backend": name, "ms": ms,
                         "tflops": flops / ms / 1e9})
    print("\n| shape (b, heads, s, d) | backend | fwd+bwd ms | TFLOP/s |\n|---|---|---|---|")
    for r in rows:
        shape = f"{r['shape']} ({r['b']}, {r['heads']}, {r['s']}, {r['d']})"
        print(f"| {shape} | {r['backend']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"errors": errors, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
