"""kernels/tuning.py ``precompile`` without a GPU: a grouped GEMM's candidate configs compiled for
Hopper (sm_90) in forked processes, then found in Triton's file cache by the parent.

    python tests/kernels/_precompile_sm90.py CACHE_DIR check     # prints one JSON line (the test's)
    python tests/kernels/_precompile_sm90.py CACHE_DIR bench 4   # seconds: one by one, 4 processes

Uses tests/kernels/_compile_sm90.py's stand-in driver (compiles for a named target, launches
nothing). Counts the compiles that reach the last stage (ptxas: the cubin) in this process, so a
config loaded from the file cache counts 0. Must run in its own process, not under
TRITON_INTERPRET=1 (tests/kernels/test_tuning.py runs it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
sys.path.insert(0, str(Path(__file__).parent))
import _compile_sm90  # noqa: E402  (sets MEGATRON_MOE_AUTOTUNE=0 at import: the candidates need it on)

os.environ["MEGATRON_MOE_AUTOTUNE"] = "1"
_compile_sm90.compile_only()

import torch  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

import megatron_moe.kernels.grouped as grouped  # noqa: E402
from megatron_moe import DroplessMoE, MoEConfig  # noqa: E402
from megatron_moe.kernels import tuning  # noqa: E402

cubins = []
make_cubin = CUDABackend.make_cubin
CUDABackend.make_cubin = lambda self, *a, **k: (cubins.append(1), make_cubin(self, *a, **k))[1]


def first_gemm_launch():
    """The first row-grouped GEMM launch of a bf16 layer forward (dmoe-small's expert shape)."""
    seen = []
    launch = grouped._launch
    grouped._launch = lambda kernel, grid, args, meta, tune_key, hook_args: seen.append((kernel, args, meta))
    layer = DroplessMoE(MoEConfig(hidden_size=768, ffn_hidden_size=3072, num_experts=8, top_k=1,
                                  mlp_impl="triton_grouped")).to(torch.bfloat16)
    layer(torch.randn(64, 768, dtype=torch.bfloat16))
    grouped._launch = launch
    return seen[0]


def compile_here(kernel, args, meta, configs):
    """Compile ``configs`` in this process, as the autotuner does before timing each."""
    nargs = dict(zip(kernel.arg_names, args))
    for cfg in configs:
        kw = {**meta, **cfg.all_kwargs()}
        if cfg.pre_hook is not None:
            cfg.pre_hook({**nargs, **kw})
        kernel.fn.run(*args, grid=(1,), warmup=True, **kw)


kernel, args, meta = first_gemm_launch()
kernel.nargs = dict(zip(kernel.arg_names, args))
pruned = kernel.prune_configs(meta)
if sys.argv[2] == "check":
    out = {"candidates": len(pruned), "one_worker": tuning.precompile(kernel, args, meta, workers=1)}
    out["compiled_by_workers"] = tuning.precompile(kernel, args, meta, workers=2)
    out["cubins_in_parent"] = len(cubins)
    compile_here(kernel, args, meta, pruned)
    out["cubins_after_loading_all"] = len(cubins)
    # a worker whose compile fails: its share is left to the parent, which compiles it
    os.environ["TRITON_CACHE_DIR"] = sys.argv[1] + "-failing"
    kernel.fn.device_caches.clear()  # the parent's in-memory kernels: compile from the new cache dir
    run = type(kernel.fn).run

    first = pruned[0].all_kwargs()

    def failing(self, *a, **kw):  # the first candidate alone (in the first worker's share)
        if {k: kw.get(k) for k in first} == first:
            raise RuntimeError("a compile that fails")
        return run(self, *a, **kw)
    type(kernel.fn).run = failing
    out["compiled_with_a_failing_worker"] = tuning.precompile(kernel, args, meta, workers=2)
    type(kernel.fn).run = run
    print(json.dumps(out))
else:
    workers = int(sys.argv[3])
    t0 = time.perf_counter()
    tuning.precompile(kernel, args, meta, workers=workers)
    t1 = time.perf_counter()
    compile_here(kernel, args, meta, pruned)
    t2 = time.perf_counter()
    print(f"{len(pruned)} candidates: {workers} processes {t1 - t0:.1f} s, then this process {t2 - t1:.1f} s "
          f"({len(cubins)} compiled here)")
