"""How fast can a kernel add fp32 tiles into a large fp32 tensor? The ways the weight gradient's
epilogue could add its [128, 256] tiles into the trainer's fp32 master gradients, each over a 1.07 GB
tensor (paper-moe-m's dw1 in fp32), one program per tile, beside a 2 GB copy:

    python benchmarks/bench_fp32_add.py

atomic_add (relaxed, PTX's red/atom), load + add + store, store only, TMA's reduce-add, a TMA load +
add + TMA store; bytes moved (read + write) per ms. Measured on an H100 (2026-12-06): atomics
2.2 TB/s, load + add + store 3.0, the copy 3.0: atomics that miss L2 reach 73% of the copy's rate
(docs/performance.md, "The fp32 weight gradient's adds prefetched into L2").
"""
import re
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _rmw(out_ptr, desc, N, tiles_n, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    pm = pid // tiles_n
    pn = pid % tiles_n
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    v = (rows[:, None] + cols[None, :]).to(tl.float32) * 1e-3
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    if MODE == 0:
        tl.atomic_add(ptrs, v, sem="relaxed")
    elif MODE == 1:
        x = tl.load(ptrs)
        tl.store(ptrs, x + v)
    elif MODE == 2:
        tl.store(ptrs, v)
    elif MODE == 3:
        desc.atomic_add([pm * BM, pn * BN], v)
    elif MODE == 4:
        x = desc.load([pm * BM, pn * BN])
        desc.store([pm * BM, pn * BN], x + v)


OPS = re.compile(r"\b(red\.[\w.]+|atom\.[\w.]+|cp\.reduce\.async\.bulk[\w.:]*|st\.global[\w.]*|ld\.global[\w.]*)")
WAYS = {0: "atomic_add relaxed (red)", 1: "load + add + store", 2: "store only", 3: "TMA reduce-add",
        4: "TMA load + add + TMA store"}


def main():
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    M, N = 64 * 1024, 4096  # paper-moe-m's dw1 in fp32: 1.07 GB
    out = torch.zeros(M, N, device=dev)
    gb = out.numel() * 4 / 1e9
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    for BM, BN in ((128, 256), (64, 256)):
        desc = TensorDescriptor.from_tensor(out, [BM, BN])
        grid = (M // BM) * (N // BN)
        for mode, name in WAYS.items():
            for warps in (4, 8):
                args, kw = (out, desc, N, N // BN), dict(MODE=mode, BM=BM, BN=BN, num_warps=warps)
                try:
                    kernel = _rmw.warmup(*args, grid=(grid,), **kw)
                    ms = triton.testing.do_bench(lambda: _rmw[(grid,)](*args, **kw), warmup=10, rep=100,
                                                 return_mode="median")
                except Exception as exc:  # noqa: BLE001  (one way failing: the others still run)
                    print(f"{BM}x{BN} w{warps} {name:<28} failed: {str(exc).splitlines()[0][:150]}", flush=True)
                    continue
                ops = " ".join(sorted(set(OPS.findall(kernel.asm["ptx"]))))[:100]
                moved = gb * (1 if mode == 2 else 2)
                print(f"{BM}x{BN} w{warps} {name:<28} {ms:7.3f} ms  {moved / ms:5.2f} TB/s (r+w)  {ops}", flush=True)
    src = torch.empty(2 * 1024**3 // 4, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    print(f"2 GiB copy {ms:.3f} ms {2 * src.numel() * 4 / 1e9 / ms:.2f} TB/s (r+w)")


if __name__ == "__main__":
    sys.exit(main())
