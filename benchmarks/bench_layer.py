"""Layer benchmark: forward + backward of one MoE layer in bf16 on a GPU.

    python benchmarks/bench_layer.py                       # the GELU configs, the default providers
    python benchmarks/bench_layer.py --configs olmoe,qwen3-30b-a3b,sonic-1536,sonic-4096,mixtral \
        --providers dense,plain_grouped_mm,triton_grouped,torch_grouped_mm --timing eager,graph  # SwiGLU
    python benchmarks/bench_layer.py --configs paper-moe-m --providers dense,triton_grouped
    python benchmarks/bench_layer.py --configs qwen3-30b-a3b --providers dense,triton_grouped,sonicmoe  # SonicMoE
    python benchmarks/bench_layer.py --out benchmarks/results/h100.json
    python benchmarks/bench_layer.py --timing eager,graph  # also replays of a CUDA graph of each step
    python benchmarks/bench_layer.py --configs dmoe-small-128 --providers dense,triton_grouped \
        --ab MEGATRON_MOE_SORTED_DY --rounds 2   # a kernel switch on, off, on, off in one process

Providers:
  dense             a dense MLP of the same FLOPs (ffn = ffn * top_k, the config's activation), no router
  plain_grouped_mm  the plain PyTorch baseline: sort -> torch._grouped_mm -> activation ->
                    torch._grouped_mm -> unsort (the same router)
  triton_grouped, torch_grouped_mm, blocksparse, capacity (capacity_factor 1):
                    DroplessMoE with that mlp_impl
  triton_grouped_recompute (not run by default): triton_grouped with recompute_activation
                    (one saved [N, F] tensor)
  sonicmoe (not run by default; SwiGLU only, eager only): SonicMoE's MoE module (`pip install
                    sonic-moe`: CuTe-DSL kernels, its softmax-over-top-k router; the aux loss it
                    returns is computed, not back-propagated). Its GEMMs autotune on first use
                    (QUACK_CACHE_DIR, QUACK_CACHE_AUTOTUNING=1 keep that on disk).
The old names grouped, grouped_mm and grouped_recompute are still accepted (with a notice).
(torch_grouped_mm used to name the baseline; it now names the mlp_impl, as everywhere else.)

Every MoE provider runs the whole layer (router, metadata, experts, combine). TFLOP/s counts
useful expert FLOPs only, 12 * tokens * top_k * hidden * ffn (three GEMMs of 2*T*K*H*F each for
the two matmuls, forward + backward; 18 * ... for SwiGLU, whose up projection is 2F wide), the
same for every provider. Median of do_bench; peak
memory is the allocator's high-water mark during one (eager) step, less the parameters and inputs.

--timing graph: each provider's forward + backward is captured once in a CUDA graph and the
replays are timed, so the host's Python and launch costs drop out and the GPU's own time per
step is what is measured (in training the host runs ahead, enqueueing later layers while the GPU
works, unless something synchronises). A provider that synchronises with the host cannot be
captured: its row says so. The MoE providers other than capacity have no host synchronisation.

--ab SWITCH (one of kernels/switches.py's variables, read at each launch or layer step): each
provider's step is timed with the switch on, then off, --rounds times over, on the same model and
inputs in one process (eager), so that machine and process differences drop out of the
comparison; each row names the setting (``switch``: "NAME=1" or "NAME=0") and its round. A switch
read only when a kernel is first tuned (MEGATRON_MOE_AUTOTUNE, MEGATRON_MOE_PERSISTENT) does not
take effect this way.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

CONFIGS = {  # name: (tokens, hidden, ffn, experts, top_k, activation)
    "paper-moe-m": (16384, 1024, 4096, 64, 1, "gelu"),
    "fine-64e-top8": (8192, 2048, 1024, 64, 8, "gelu"),
    "mixtral-ish": (8192, 4096, 14336, 8, 2, "gelu"),
    "dmoe-small": (32768, 768, 3072, 64, 1, "gelu"),  # configs/dmoe-small.yaml at micro-batch 32 (training)
    "dmoe-small-128": (131072, 768, 3072, 64, 1, "gelu"),  # the same at micro-batch 128 (issue #33's batch 512)
    # fine-grained SwiGLU (issue #35): OLMoE's and Qwen3-30B-A3B's expert shapes, SonicMoE's two
    # benchmark shapes (its README's 32768 tokens), Mixtral's
    "olmoe": (16384, 2048, 1024, 64, 8, "swiglu"),
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8, "swiglu"),
    "sonic-1536": (32768, 1536, 256, 128, 8, "swiglu"),
    "sonic-4096": (32768, 4096, 1024, 64, 4, "swiglu"),
    "mixtral": (8192, 4096, 14336, 8, 2, "swiglu"),
}
DEFAULT_CONFIGS = ["paper-moe-m", "fine-64e-top8", "mixtral-ish", "dmoe-small"]
"""The configs run by default (the GELU ones); name the others with --configs."""
PROVIDERS = ["dense", "plain_grouped_mm", "blocksparse", "triton_grouped", "torch_grouped_mm", "capacity"]
"""The providers run by default; triton_grouped_recompute and sonicmoe run when asked for."""
ALL_PROVIDERS = PROVIDERS + ["triton_grouped_recompute", "sonicmoe"]
EAGER_ONLY = {"sonicmoe": "not captured: its kernels are compiled and autotuned on the first call, "
                          "which synchronises"}
"""Providers whose --timing graph row is an error without a capture being tried (a failed capture
can leave the GPU unusable)."""
OLD_PROVIDER_NAMES = {"grouped": "triton_grouped", "grouped_mm": "torch_grouped_mm",
                      "grouped_recompute": "triton_grouped_recompute"}


def canonical_providers(names: str) -> list[str]:
    """The providers of a comma-separated list, old names replaced by the current ones (with a
    notice on stderr); an unknown name exits with the valid ones."""
    out = []
    for name in names.split(","):
        if name in OLD_PROVIDER_NAMES:
            print(f"provider {name!r} is now called {OLD_PROVIDER_NAMES[name]!r}", file=sys.stderr)
            name = OLD_PROVIDER_NAMES[name]
        if name not in ALL_PROVIDERS:
            sys.exit(f"unknown provider {name!r}: expected one of {', '.join(ALL_PROVIDERS)}")
        out.append(name)
    return out


def flops_of(tokens, hidden, ffn, top_k, activation) -> int:
    """Useful expert FLOPs of one forward + backward: three GEMMs per matmul (forward, input and
    weight gradients) of 2 * tokens * top_k * hidden * width each; the up projection is 2F wide
    for SwiGLU."""
    from megatron_moe.kernels.activation import pre_width_factor

    up = pre_width_factor(activation) * ffn
    return 6 * tokens * top_k * hidden * (up + ffn)


class DenseMLP(torch.nn.Module):
    def __init__(self, hidden, ffn, activation="gelu"):
        from megatron_moe.kernels.activation import pre_width_factor

        super().__init__()
        self.activation = activation
        self.w1 = torch.nn.Parameter(torch.randn(hidden, pre_width_factor(activation) * ffn) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(ffn, hidden) * 0.02)

    def forward(self, x):
        from megatron_moe.kernels.activation import activate

        return activate(x @ self.w1, self.activation) @ self.w2


class PlainGroupedMMMoE(torch.nn.Module):
    """The common pure-PyTorch dropless baseline: sort tokens, torch._grouped_mm, unsort (the
    layer's router and weights, none of its kernels)."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x_TH):
        from megatron_moe.kernels.activation import activate

        moe = self.moe
        r = moe.router(x_TH)
        T, K = r.expert_ids_TK.shape
        ids_N = r.expert_ids_TK.reshape(-1)
        order_N = torch.argsort(ids_N, stable=True)
        # counts without torch.bincount, which reads the largest id on the host (a sync)
        counts_E = ids_N.new_zeros(moe.cfg.num_experts).index_add_(0, ids_N, torch.ones_like(ids_N))
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        x_NH = x_TH[order_N // K]
        h = torch._grouped_mm(x_NH, moe.experts.w1, offs=offs_E)
        y_NH = torch._grouped_mm(activate(h, moe.cfg.activation), moe.experts.w2, offs=offs_E)
        y_NH = y_NH * r.weights_TK.reshape(-1)[order_N, None].to(y_NH.dtype)
        out = torch.empty_like(y_NH)
        out[order_N] = y_NH
        return out.view(T, K, -1).sum(1)


class SonicMoELayer(torch.nn.Module):
    """SonicMoE's own MoE module (router, experts, combine) with the layer's calling convention:
    returns the output only (the aux loss SonicMoE's forward computes is dropped)."""

    def __init__(self, hidden, ffn, experts, top_k, device):
        try:
            from sonicmoe import MoE
            from sonicmoe.enums import ActivationType
        except ImportError as e:
            raise ImportError(f"provider sonicmoe needs SonicMoE: pip install sonic-moe (Python 3.12+, Hopper or "
                              f"Blackwell; benchmarks/results/sonicmoe-h200-2026-11-29/README.md has an offline "
                              f"install) ({e})") from e

        super().__init__()
        with torch.device(device):  # its weights are drawn where they live (GBs at sonic-4096)
            self.moe = MoE(num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                           intermediate_size=ffn, activation_function=ActivationType.SWIGLU, add_bias=False,
                           std=0.02)

    def forward(self, x_TH):
        return self.moe(x_TH)[0]


def build(provider, tokens, hidden, ffn, experts, top_k, activation, device):
    from megatron_moe import DroplessMoE, MoEConfig

    if provider == "sonicmoe":
        if activation != "swiglu":
            raise ValueError(f"sonicmoe runs SwiGLU only, not {activation}")
        return SonicMoELayer(hidden, ffn, experts, top_k, device).to(device, torch.bfloat16)
    if provider == "dense":
        return DenseMLP(hidden, ffn * top_k, activation).to(device, torch.bfloat16)
    impl = "triton_grouped" if provider in ("plain_grouped_mm", "triton_grouped_recompute") else provider
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                    activation=activation, mlp_impl=impl, capacity_factor=1.0, aux_loss_coeff=0.01,
                    recompute_activation=provider == "triton_grouped_recompute")
    moe = DroplessMoE(cfg).to(device, torch.bfloat16)
    return PlainGroupedMMMoE(moe) if provider == "plain_grouped_mm" else moe


def make_step(provider, shape, device):
    """One forward + backward of ``provider`` on random bf16 input: returns (step, model, x)."""
    tokens, hidden = shape[0], shape[1]
    torch.manual_seed(0)
    model = build(provider, *shape, device)
    # drawn on the CPU: the GPU's generator is left unusable by a failed graph capture
    x = torch.randn(tokens, hidden).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, hidden).to(device, torch.bfloat16)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        model(x).backward(dy)

    return step, model, x


def graphed(step):
    """``step`` captured once in a CUDA graph, as torch's whole-network capture does: warm-up runs
    (compile, autotune) on a side stream, then the capture; returns the graph's replay. Gradients
    set to None inside the step are allocated from the graph's pool at capture and rewritten by
    every replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")  # a failed capture can leave the GPU unusable: ask first
        try:
            step()
        except RuntimeError as e:
            raise RuntimeError(f"not capturable, it synchronises with the host ({str(e).splitlines()[0]})") from e
        finally:
            torch.cuda.set_sync_debug_mode("default")
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def bench_one(provider, shape, device, warmup_ms, rep_ms, timings=("eager",)):
    """One row per timing mode ('eager': the step as called; 'graph': replays of its CUDA graph),
    same model and inputs. Each row also has first_s: seconds from the model built to its first
    step done (compile and autotune, and with 'graph' the capture)."""
    import time

    import triton.testing

    tokens, hidden, ffn, experts, top_k, activation = shape
    step, model, x = make_step(provider, shape, device)
    flops = flops_of(tokens, hidden, ffn, top_k, activation)
    fns = {}
    t0 = time.perf_counter()
    if "graph" in timings:  # captured first, before any step on the default stream
        try:
            if provider in EAGER_ONLY:
                raise RuntimeError(EAGER_ONLY[provider])
            fns["graph"] = graphed(step)
        except Exception as e:  # e.g. a provider that cannot be captured: its eager row still counts
            fns["graph"] = e
    step()  # compile / autotune (if not done above)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_gb = (torch.cuda.max_memory_allocated() - base) / 2**30
    fns["eager"] = step
    rows = []
    for timing in timings:
        row = dict(config=None, provider=provider, timing=timing, tokens=tokens, hidden=hidden, ffn=ffn,
                   experts=experts, top_k=top_k, activation=activation, peak_mem_gb=peak_gb, first_s=first_s)
        fn = fns[timing]
        if isinstance(fn, Exception):
            row["error"] = f"{type(fn).__name__}: {fn}"[:300]
        else:
            ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
            row.update(median_ms=ms, tflops=flops / ms / 1e9)
        rows.append(row)
    del model, x, step
    torch.cuda.empty_cache()
    return rows


def bench_ab(provider, shape, device, warmup_ms, rep_ms, switch, rounds):
    """Rows of the eager step with kernel switch ``switch`` on and off in turn, ``rounds`` times,
    one model and one input (see --ab)."""
    import triton.testing

    from megatron_moe.kernels import switches

    tokens, hidden, ffn, experts, top_k, activation = shape
    step, model, x = make_step(provider, shape, device)
    flops = flops_of(tokens, hidden, ffn, top_k, activation)
    rows = []
    for rnd in range(rounds):
        for on in (True, False):
            with switches.setting(switch, on):
                step()  # compile / tune what this setting runs
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")
            rows.append(dict(config=None, provider=provider, timing="eager", switch=f"{switch}={int(on)}",
                             round=rnd, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                             activation=activation, peak_mem_gb=float("nan"), first_s=float("nan"),
                             median_ms=ms, tflops=flops / ms / 1e9))
    del model, x, step
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)} (default: {', '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help=f"comma-separated, of {', '.join(ALL_PROVIDERS)} (default: {', '.join(PROVIDERS)})")
    ap.add_argument("--warmup-ms", type=float, default=100)
    ap.add_argument("--rep-ms", type=float, default=500)
    ap.add_argument("--timing", default="eager",
                    help="eager, graph (replays of each step captured in a CUDA graph: the GPU's time, "
                         "not the host's) or eager,graph")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--ab", default=None, metavar="SWITCH",
                    help="time each step with this kernel switch (kernels/switches.py) on and off in turn")
    ap.add_argument("--rounds", type=int, default=2, help="--ab: how many on/off pairs (default 2)")
    args = ap.parse_args(argv)
    providers = canonical_providers(args.providers)
    if not torch.cuda.is_available():
        sys.exit("bench_layer.py needs a CUDA GPU")
    device = torch.device("cuda")
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(),
                date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv),
                timing=args.timing)
    timings = args.timing.split(",")
    if not set(timings) <= {"eager", "graph"}:
        sys.exit(f"--timing {args.timing!r}: expected eager, graph or eager,graph")
    if args.ab is not None:
        from megatron_moe.kernels import switches
        if f"| {args.ab} " not in switches.__doc__:
            sys.exit(f"--ab {args.ab!r}: not one of kernels/switches.py's variables (its table lists them)")
        if timings != ["eager"]:
            sys.exit("--ab times the eager step only: leave --timing out")
        if args.rounds < 1:
            sys.exit(f"--rounds {args.rounds}: expected 1 or more")
        meta["ab"] = args.ab
    rows = []
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"--configs: unknown {', '.join(unknown)}: expected some of {', '.join(CONFIGS)}")
    for name in names:
        shape = CONFIGS[name]
        for provider in providers:
            try:
                if args.ab is not None and provider != "dense":
                    new = bench_ab(provider, shape, device, args.warmup_ms, args.rep_ms, args.ab, args.rounds)
                else:
                    new = bench_one(provider, shape, device, args.warmup_ms, args.rep_ms, timings)
            except Exception as e:  # keep going: one failing provider must not hide the others
                new = [dict(provider=provider, timing=t, error=f"{type(e).__name__}: {e}"[:300]) for t in timings]
            for row in new:
                row["config"] = name
                rows.append(row)
                print(json.dumps(row), flush=True)
    # ratio to the dense MLP measured in the same run, with the same timing
    for r in rows:
        dense = next((d for d in rows if d["config"] == r["config"] and d["timing"] == r["timing"]
                      and d["provider"] == "dense" and "tflops" in d), None)
        if "tflops" in r and dense:
            r["vs_dense"] = r["tflops"] / dense["tflops"]
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, {meta['date']}")
    print(f"{'config':<14} {'provider':<34} {'timing':<6} {'ms':>8} {'TFLOP/s':>8} {'vs dense':>8} {'peak GB':>8} "
          f"{'first s':>8}")
    for r in rows:
        name = r["provider"] + (f" {r['switch'].removeprefix('MEGATRON_MOE_')}" if "switch" in r else "")
        head = f"{r['config']:<14} {name:<34} {r['timing']:<6}"
        if "error" in r:
            print(f"{head} ERROR {r['error'][:80]}")
        else:
            print(f"{head} {r['median_ms']:8.3f} {r['tflops']:8.1f} "
                  f"{r.get('vs_dense', float('nan')):8.2f} {r['peak_mem_gb']:8.2f} {r['first_s']:8.1f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
