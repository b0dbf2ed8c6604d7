"""How many host calls one layer step makes: torch ops and Triton launches, forward and backward.

    TRITON_INTERPRET=1 python benchmarks/count_launches.py                # CPU, small shape
    python benchmarks/count_launches.py --device cuda --shape 16384,1024,4096,64,1
    python benchmarks/count_launches.py --providers triton_grouped --list  # every op, in order

The eager layer is host-bound where its kernels are short (docs/performance.md, "The host"):
every torch op and Triton launch costs the host time whatever the tensor sizes. This
counts them, by part of the step (the router alone, then the whole layer), with a
``TorchDispatchMode`` (aten ops that are not views: views launch nothing) and a hook on
Triton's ``JITFunction.run`` (each kernel launch, autotuner or not). Allocations (``empty*``)
are counted apart: they launch nothing but cost host time. The counts do not depend on the
tensor sizes, so a small shape on the CPU (Triton's interpreter) gives the GPU's counts, except
for ops that differ by device (the router's fp32 logits: one ``mm`` with ``out_dtype`` on CUDA,
casts and an fp32 ``mm`` on the CPU).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ALLOCS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = 0  # inside a Triton launch: the interpreter's own copies are not the layer's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func.__name__ != "detach.default":
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_triton(names: list[str], log: _OpLog):
    """Appends each Triton kernel launched inside the block to ``names``; ``log`` ignores the
    torch ops the launch itself makes (the interpreter's copies on the CPU). Fast launches
    (kernels/launcher.py) are off inside: they skip ``JITFunction.run``, where the count is taken."""
    from triton.runtime import interpreter, jit

    from megatron_moe.kernels import launcher

    patched = []
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        run = cls.run

        def counted(self, *a, _run=run, **k):
            names.append(getattr(self, "__name__", None) or getattr(self.fn, "__name__", "?"))
            log.paused += 1
            try:
                return _run(self, *a, **k)
            finally:
                log.paused -= 1

        cls.run = counted
        patched.append((cls, run))
    try:
        with launcher.fast_launches(False):
            yield
    finally:
        for cls, run in patched:
            cls.run = run


def count(fn) -> dict:
    """Ops and launches of one call of ``fn``."""
    triton_names: list[str] = []
    log = _OpLog()
    with _count_triton(triton_names, log), log:
        fn()
    ops = [o for o in log.ops if o not in ALLOCS]
    return {"ops": len(ops), "allocs": len(log.ops) - len(ops), "triton": len(triton_names),
            "op_names": ops, "triton_names": triton_names}


def layer_counts(provider: str, shape, device: str, dtype: torch.dtype) -> dict[str, dict]:
    from megatron_moe import DroplessMoE, MoEConfig

    tokens, hidden, ffn, experts, top_k = shape
    act = "swiglu" if provider.endswith("swiglu") else "gelu"
    impl = provider.removesuffix("_swiglu")
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                    activation=act, mlp_impl=impl, z_loss_coeff=1e-3)
    layer = DroplessMoE(cfg).to(device=device, dtype=dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
    out: dict[str, dict] = {}

    def router_fwd():
        out["_r"] = layer.router(x)

    def router_bwd():
        r = out.pop("_r")
        (r.weights_TK.sum() + r.aux_loss + r.z_loss).backward()

    def layer_fwd():
        out["_y"] = layer(x)

    def layer_bwd():
        torch.autograd.backward([out.pop("_y"), layer.aux_loss], [dy, torch.ones_like(layer.aux_loss)])

    for _ in range(2):  # compile and autotune outside the count
        router_fwd(), router_bwd(), layer_fwd(), layer_bwd()
    res = {}
    for name, fn in (("router fwd", router_fwd), ("router bwd", router_bwd),
                     ("layer fwd", layer_fwd), ("layer bwd", layer_bwd)):
        res[name] = count(fn)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="triton_grouped,triton_grouped_swiglu,torch_grouped_mm,blocksparse")
    ap.add_argument("--shape", default="256,64,128,8,2", help="tokens,hidden,ffn,experts,top_k")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--list", action="store_true", help="print every op and launch, in order")
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"shape {shape}, {args.device}, {dtype}; ops (not views, not allocations) / allocations / Triton launches")
    print("| provider | router fwd | router bwd | layer fwd | layer bwd |")
    print("|---|---|---|---|---|")
    for provider in args.providers.split(","):
        if provider.startswith("torch_grouped_mm") and args.device != "cuda":
            continue  # bf16 on CUDA only
        res = layer_counts(provider, shape, args.device, dtype)
        cells = [f"{r['ops']} / {r['allocs']} / {r['triton']}" for r in res.values()]
        print(f"| {provider} | " + " | ".join(cells) + " |")
        if args.list:
            for part, r in res.items():
                ops = collections.Counter(r["op_names"])
                print(f"  {part}: {dict(ops)}\n    triton: {r['triton_names']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
