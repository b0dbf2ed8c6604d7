"""One-off: where does capturing the grouped layer fail? Each case in its own process; the first op
after which the capture stream's status is no longer 'active' (cuStreamIsCapturing) is reported."""
import ctypes, os, subprocess, sys, traceback

CASES = [
    ("A default-first, instrumented", {"DEFAULT_FIRST": "1"}),
    ("B default-first", {"DEFAULT_FIRST": "1", "NOINSTR": "1"}),
    ("C side-only", {"NOINSTR": "1"}),
    ("D default-first, no autotune", {"DEFAULT_FIRST": "1", "NOINSTR": "1", "MEGATRON_MOE_AUTOTUNE": "0"}),
    ("E default-first, fp32 params", {"DEFAULT_FIRST": "1", "NOINSTR": "1", "PARAMS": "fp32"}),
    ("F default-first, instrumented, no autotune", {"DEFAULT_FIRST": "1", "MEGATRON_MOE_AUTOTUNE": "0"}),
]

def child():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    import triton.runtime.jit as tj
    from megatron_moe import DroplessMoE, MoEConfig
    libcuda = ctypes.CDLL("libcuda.so.1")
    def status():
        st = ctypes.c_int(-1)
        libcuda.cuStreamIsCapturing(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.byref(st))
        return st.value
    first = []
    armed = [False]
    def check(what):
        if armed[0] and not first and status() == 2:
            stack = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]
                     if "megatron_moe" in f.filename or "kernels" in f.filename or "dbg_graph" in f.filename]
            first.append(f"{what} | {' <- '.join(reversed(stack[-6:]))}")
    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            check(f"aten {func}")
            return out
    orig_run = tj.JITFunction.run
    def run(self, *a, **k):
        out = orig_run(self, *a, **k)
        check(f"triton {self.fn.__name__}")
        return out
    if not os.environ.get("NOINSTR"):
        tj.JITFunction.run = run
    T, H, F, E, K = 300, 32, 48, 8, 2
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, activation="gelu",
                    mlp_impl="grouped", aux_loss_coeff=float(os.environ.get("AUX", "0.01")))
    moe = DroplessMoE(cfg).to("cuda", torch.float32 if os.environ.get("PARAMS") == "fp32" else torch.bfloat16)
    x = torch.randn(T, H).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(T, H).to("cuda", torch.bfloat16)
    params = list(moe.parameters())
    def step():
        for p in params: p.grad = None
        x.grad = None
        moe(x).backward(dy)
    if os.environ.get("DEFAULT_FIRST"):
        step(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(); step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            armed[0] = True
            if os.environ.get("NOINSTR"):
                step()
            else:
                with Mode():
                    step()
            check("end of step")
            armed[0] = False
        g.replay(); torch.cuda.synchronize()
        print("RESULT ok", first)
    except Exception as e:
        print("RESULT fail", type(e).__name__, str(e).splitlines()[0], "|| first invalidating op:", first)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(); sys.exit()
    for name, env in CASES:
        try:
            r = subprocess.run([sys.executable, __file__, "child"], env={**os.environ, **env}, capture_output=True,
                               text=True, timeout=100)
            out = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            out = "timeout"
        lines = [l for l in out.splitlines() if l.startswith("RESULT")]
        print(name, lines[-1] if lines else out[-2000:], flush=True)
