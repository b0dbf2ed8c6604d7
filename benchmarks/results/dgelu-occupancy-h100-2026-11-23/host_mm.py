"""one-off: host time per call of the router's GEMM variants (small shapes: the GPU is not the limit)."""
import time, torch
dev = "cuda"
def host_us(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6
for T in (256, 16384):
    a = torch.randn(T, 1024, device=dev, dtype=torch.bfloat16)
    b = torch.randn(1024, 192, device=dev, dtype=torch.bfloat16)
    af, bf = a.float(), b.float()
    for name, fn in {
        "mm bf16": lambda: torch.mm(a, b),
        "mm out_dtype fp32": lambda: torch.mm(a, b, out_dtype=torch.float32),
        "mm fp32 (SIMT/TF32 off)": lambda: torch.mm(af, bf),
        "mm bf16 .float()": lambda: torch.mm(a, b).float(),
        "F.linear bf16": lambda: torch.nn.functional.linear(a, b.t()),
        "elementwise add": lambda: a.add(a),
    }.items():
        h, w = host_us(fn)
        print(f"T={T:<6} {name:<26} host {h:7.1f} us/call   wall {w:7.1f} us/call", flush=True)
