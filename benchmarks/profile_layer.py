"""Where the layer's time goes: per-kernel GPU time, host-bound check, and a tile sweep per GEMM.

    python benchmarks/profile_layer.py                          # profile + sweep, all configs
    python benchmarks/profile_layer.py --configs paper-moe-m --no-sweep
    python benchmarks/profile_layer.py --providers torch_grouped_mm --no-gemms  # only the step profile
    python benchmarks/profile_layer.py --out benchmarks/results/profile.json
    python benchmarks/profile_layer.py --cprofile --providers triton_grouped   # host Python time per function
    python benchmarks/profile_layer.py --host --providers triton_grouped    # host ms per step, fast launch on / off
    python benchmarks/profile_layer.py --host --switch MEGATRON_MOE_ROUTER_GEMM  # ... another switch on / off
    python benchmarks/profile_layer.py --order --configs qwen3-30b-a3b --providers sonicmoe,triton_grouped
                                                 # one step's kernels in launch order, then exit
    python benchmarks/profile_layer.py --configs dmoe-small --no-profile --no-sweep --skew 0.9 \
        --gemms-only "wgrad dw2 actT@dy[t] +=fp32"     # some GEMMs only, 90% of the tokens on expert 0

Three views (the layer benchmark's configs and providers, bench_layer.py):
  1. profile: one step's kernels from torch.profiler (GPU time per kernel name, summed), the GPU
     busy time per step against the wall time per step (wall >> busy: the host is the limit);
  2. gemms: the six grouped GEMMs of the triton_grouped MLP timed one by one (autotuned), the weight
     gradients also accumulating into fp32 (training's gradient-accumulation fusion; through
     TMA's reduce-add, and "ldst": the kernel's own load-add-store), two
     ablations of the backward GEMM; beside them the same six on torch._grouped_mm (CUTLASS)
     over pre-sorted rows, the gather and the fp32 add_ that path needs, one dense torch.mm;
  3. sweep: each grouped GEMM with every tile config of an extended list, one at a time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import CONFIGS, DEFAULT_CONFIGS, canonical_providers, make_step  # noqa: E402


def _bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def profile_provider(provider, shape, device, steps=5):
    from torch.profiler import ProfilerActivity, profile

    step, model, x = make_step(provider, shape, device)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # host wall time per step, steps queued back to back
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 20 * 1e3
    # host time to enqueue one step (no sync inside the step when this is << wall)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    enqueue_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    # host side: self CPU time per op (what the enqueue time is made of)
    with profile(activities=[ProfilerActivity.CPU]) as cprof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    host = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in cprof.key_averages()),
                  key=lambda r: -r[1])[:18]
    per_kernel = collections.defaultdict(float)
    counts = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time_total / steps / 1e3  # ms per step
            counts[ev.name] += 1
    busy_ms = sum(per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:14]
    del model, x, step
    torch.cuda.empty_cache()
    return dict(provider=provider, wall_ms=wall_ms, enqueue_ms=enqueue_ms, gpu_busy_ms=busy_ms,
                launches_per_step=sum(counts.values()) / steps,
                host=[(name[:70], round(ms, 4), n) for name, ms, n in host],
                top=[(name[:90], round(ms, 4), counts[name] // steps) for name, ms in top])


def kernel_order(provider, shape, device, reps=5, min_ms=0.02):
    """One step's GPU kernels in launch order, each the median of ``reps`` profiled steps: with
    the forward and backward's order known, this tells one GEMM from another where kernel names
    do not (another library's, or ours, whose four row-grouped GEMMs share one name). Returns
    [(index in the step, ms, name)] for kernels of at least ``min_ms``."""
    from torch.profiler import ProfilerActivity, profile

    step, model, x = make_step(provider, shape, device)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
        runs.append([(e.name, e.device_time_total / 1e3) for e in events])
    del model, x, step
    torch.cuda.empty_cache()
    rows = []
    for i, (name, _) in enumerate(runs[0]):
        times = sorted(r[i][1] for r in runs if len(r) > i)
        ms = times[len(times) // 2]
        if ms >= min_ms:
            rows.append((i, ms, name))
    return rows


def gemm_problems(shape, device, skew=0.0):
    """The six grouped GEMMs of the triton_grouped MLP with a router-like random routing; ``skew``:
    that fraction of the tokens sends its first choice to expert 0 (a collapsed router, as early
    in training). X: the up projection's width (2F for swiglu)."""
    from megatron_moe.kernels.activation import pre_width_factor
    from megatron_moe.kernels.metadata import routing_metadata

    T, H, F, E, K, activation = shape
    X = pre_width_factor(activation) * F
    torch.manual_seed(0)
    logits = torch.randn(T, E, device=device)
    logits[: int(skew * T), 0] = 1e4
    ids_TK = torch.topk(logits, K, dim=-1).indices
    r = routing_metadata(ids_TK, E, 128)
    off = r.expert_offsets_E1
    tok = r.sorted_token_N
    order = r.sort_order_N
    S = T * K
    bf = torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=bf)
    dy = torch.randn(T, H, device=device, dtype=bf)
    w1 = torch.randn(E, H, X, device=device, dtype=bf) * 0.02
    w2 = torch.randn(E, F, H, device=device, dtype=bf) * 0.02
    act = torch.randn(S, F, device=device, dtype=bf)
    pre = torch.randn(S, X, device=device, dtype=bf)
    scale = torch.rand(S, device=device)
    # fp32 master gradients for the accumulating weight-gradient calls (gradient-accumulation fusion)
    g1 = torch.zeros(E, H, X, device=device)
    g2 = torch.zeros(E, F, H, device=device)
    return dict(T=T, H=H, F=F, X=X, E=E, K=K, S=S, activation=activation, off=off, tok=tok, order=order,
                x=x, dy=dy, w1=w1, w2=w2, act=act, pre=pre, scale=scale, g1=g1, g2=g2, routing=r,
                dys=dy[tok.long()].contiguous(), xs=x[tok.long()].contiguous())


def _switched(name, on, fn):
    """fn run with the kernel switch ``name`` on or off (kernels/switches.py's ``setting``)."""
    from megatron_moe.kernels import switches

    def run():
        with switches.setting(name, on):
            return fn()
    return run


def _no_tma(fn):
    """fn with MEGATRON_MOE_TMA_ADD=0: accumulating weight gradients load, add and store in the kernel."""
    return _switched("MEGATRON_MOE_TMA_ADD", False, fn)


def gemm_calls(p):
    from megatron_moe.kernels import grouped as G
    from megatron_moe.kernels.permute import gather_rows

    a = p["activation"]
    return {
        f"fwd1 x[t]@w1 +{a}*w": lambda: G.grouped_gemm(p["x"], p["w1"], p["off"], gather_S=p["tok"],
                                                       activation=a, act_scale_S=p["scale"]),
        "fwd2 wact@w2 ->scatter": lambda: G.grouped_gemm(p["act"], p["w2"], p["off"], scatter_S=p["order"]),
        # the activation backward in place, as the layer runs it (pre overwritten by dpre; with
        # inplace=False the call would first copy pre, 2·S·X·2 more bytes; until 2026-12-07 it did)
        f"bwd dy[t]@w2T +d{a}": lambda: G.grouped_gemm_dact(p["dy"], p["w2"].transpose(1, 2), p["off"], p["pre"],
                                                             a, gather_S=p["tok"], scale_S=p["scale"], inplace=True),
        "wgrad dw2 actT@dy[t]": lambda: G.grouped_wgrad(p["act"], p["dy"], p["off"], gather_b_S=p["tok"]),
        f"wgrad dw2 w*{a}(pre)T@dy[t]": lambda: G.grouped_wgrad(p["pre"], p["dy"], p["off"], gather_b_S=p["tok"],
                                                               a_activation=a, a_scale_S=p["scale"]),
        "wgrad dw1 x[t]T@dpre": lambda: G.grouped_wgrad(p["x"], p["pre"], p["off"], gather_a_S=p["tok"]),
        "wgrad dw2 actT@dy[t] +=fp32": lambda: G.grouped_wgrad(p["act"], p["dy"], p["off"], gather_b_S=p["tok"],
                                                              out=p["g2"], accumulate=True),
        "wgrad dw1 x[t]T@dpre +=fp32": lambda: G.grouped_wgrad(p["x"], p["pre"], p["off"], gather_a_S=p["tok"],
                                                              out=p["g1"], accumulate=True),
        # the same two with the fp32 read-add-write in the kernel's registers instead of TMA's reduce-add
        "wgrad dw2 actT@dy[t] +=fp32 ldst": _no_tma(lambda: G.grouped_wgrad(
            p["act"], p["dy"], p["off"], gather_b_S=p["tok"], out=p["g2"], accumulate=True)),
        "wgrad dw1 x[t]T@dpre +=fp32 ldst": _no_tma(lambda: G.grouped_wgrad(
            p["x"], p["pre"], p["off"], gather_a_S=p["tok"], out=p["g1"], accumulate=True)),
        "dx dpre@w1T ->scatter": lambda: G.grouped_gemm(p["pre"], p["w1"].transpose(1, 2), p["off"],
                                                       scatter_S=p["order"]),
        # an ablation of the bwd GEMM: without its epilogue
        "abl bwd dy[t]@w2T plain": lambda: G.grouped_gemm(p["dy"], p["w2"].transpose(1, 2), p["off"],
                                                          gather_S=p["tok"]),
        # each gathered operand sorted beforehand (x[t] as xs, dy[t] as dys): what the GEMMs give
        # when the rows are permuted once (a top-1 layer's copies, "perm" below) rather than gathered
        f"sorted fwd1 xs@w1 +{a}*w": lambda: G.grouped_gemm(p["xs"], p["w1"], p["off"], activation=a,
                                                            act_scale_S=p["scale"]),
        f"sorted bwd dys@w2T +d{a}": lambda: G.grouped_gemm_dact(p["dys"], p["w2"].transpose(1, 2), p["off"],
                                                                  p["pre"], a, scale_S=p["scale"], inplace=True),
        f"sorted bwd dys@w2T +d{a} cp.async": _switched("MEGATRON_MOE_GLUON_DACT_TMA", False, lambda: (
            G.grouped_gemm_dact(p["dys"], p["w2"].transpose(1, 2), p["off"], p["pre"], a, scale_S=p["scale"],
                                inplace=True))),
        "sorted wgrad dw2 actT@dys +=fp32": lambda: G.grouped_wgrad(p["act"], p["dys"], p["off"], out=p["g2"],
                                                                   accumulate=True),
        "sorted wgrad dw1 xsT@dpre +=fp32": lambda: G.grouped_wgrad(p["xs"], p["pre"], p["off"], out=p["g1"],
                                                                   accumulate=True),
        "perm x -> xs (gather_rows, sorted)": lambda: gather_rows(p["x"], p["routing"], layout="sorted"),
        # the up projection without its activation epilogue (one [S, X] output): gathered (Triton),
        # over sorted rows by the Gluon plain kernel (TMA-fed, persistent) and by the Triton kernel
        "abl fwd1 x[t]@w1 plain": lambda: G.grouped_gemm(p["x"], p["w1"], p["off"], gather_S=p["tok"]),
        "abl sorted fwd1 xs@w1 plain": lambda: G.grouped_gemm(p["xs"], p["w1"], p["off"]),
        "abl sorted fwd1 xs@w1 plain triton": _switched("MEGATRON_MOE_GLUON_GEMM", False, lambda: (
            G.grouped_gemm(p["xs"], p["w1"], p["off"]))),
    }


def gemm_flops(p, name) -> int:
    """FLOPs of GEMM ``name``: 2 * S * H * width, the width X of the up projection for the products
    with w1 or its gradient (fwd1, dw1, dx), F for the others."""
    return 2 * p["S"] * p["H"] * (p["X"] if "w1" in name or "dpre" in name else p["F"])


def selected(name: str, only) -> bool:
    """Whether GEMM ``name`` is one of ``only`` (prefixes; one ending in '$' names a GEMM exactly);
    every GEMM when ``only`` is empty."""
    return not only or any(name == o[:-1] if o.endswith("$") else name.startswith(o) for o in only)


def gemm_rows(shape, device, skew=0.0, only=None):
    """Each GEMM of gemm_calls (those whose name starts with one of ``only``, if given), then the
    CUTLASS and dense comparisons (not with ``only``)."""
    p = gemm_problems(shape, device, skew)
    from megatron_moe.kernels import grouped as G

    rows = []
    for name, fn in gemm_calls(p).items():
        if not selected(name, only):
            continue
        flops = gemm_flops(p, name)
        G.clear_tuning_cache()  # tune here, so best_config is this GEMM's
        kern = G._grouped_wgrad_kernel if "wgrad" in name else G._grouped_gemm_kernel
        kern.best_config = None  # stays None where a Gluon kernel (or no Triton kernel) runs the call
        fn()
        best = kern.best_config
        ms = _bench(fn)
        rows.append(dict(gemm=name, ms=ms, tflops=flops / ms / 1e9,
                         config=None if best is None else dict(best.kwargs, warps=best.num_warps,
                                                               stages=best.num_stages, maxnreg=best.maxnreg)))
    if only:
        return rows, p
    # the same six products on torch._grouped_mm (CUTLASS on Hopper) over pre-sorted rows, the
    # gathers they need timed on their own, and the fp32 accumulation a bf16 weight gradient needs
    tok = p["tok"].long()
    xs, dys = p["x"][tok].contiguous(), p["dys"]
    offs = p["off"][1:].contiguous()
    gmm = torch._grouped_mm
    dw2 = gmm(p["act"].t(), dys, offs=offs)
    vendor = {
        "tgm fwd1 xs@w1": lambda: gmm(xs, p["w1"], offs=offs),
        "tgm fwd2 act@w2": lambda: gmm(p["act"], p["w2"], offs=offs),
        "tgm bwd dys@w2T": lambda: gmm(dys, p["w2"].transpose(1, 2), offs=offs),
        "tgm wgrad dw2 actT@dys": lambda: gmm(p["act"].t(), dys, offs=offs),
        "tgm wgrad dw1 xsT@dpre": lambda: gmm(xs.t(), p["pre"], offs=offs),
        "tgm dx dpre@w1T": lambda: gmm(p["pre"], p["w1"].transpose(1, 2), offs=offs),
        "tgm wgrad dw2 + fp32 add_": lambda: p["g2"].add_(gmm(p["act"].t(), dys, offs=offs)),
    }
    for name, fn in vendor.items():
        ms = _bench(fn)
        rows.append(dict(gemm=name, ms=ms, tflops=gemm_flops(p, name) / ms / 1e9))
    for name, fn in {"gather x[t] (torch index)": lambda: p["x"][tok],
                     "fp32 add_ of a bf16 dw2": lambda: p["g2"].add_(dw2)}.items():
        ms = _bench(fn)
        rows.append(dict(gemm=name, ms=ms, tflops=0.0))
    ad = torch.randn(p["S"], p["H"], device=device, dtype=torch.bfloat16)
    wd = torch.randn(p["H"], p["F"], device=device, dtype=torch.bfloat16)
    ms = _bench(lambda: ad @ wd)
    rows.append(dict(gemm="dense torch.mm [S,H]@[H,F]", ms=ms, tflops=gemm_flops(p, "dense") / ms / 1e9))
    return rows, p


SWEEP_GEMM = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, PREFETCH, PERSISTENT (programs per SM)[, maxnreg]
    (64, 64, 64, 4, 4, 0, 0), (64, 128, 64, 4, 4, 0, 0), (128, 64, 64, 4, 4, 0, 0), (128, 128, 64, 8, 3, 0, 0),
    (128, 128, 64, 8, 4, 0, 0), (128, 256, 64, 8, 3, 0, 0), (128, 256, 64, 8, 4, 0, 0), (128, 256, 32, 8, 4, 0, 0),
    (64, 128, 64, 4, 4, 1, 0), (128, 64, 64, 4, 4, 1, 0), (128, 128, 64, 8, 3, 1, 0), (128, 128, 64, 8, 4, 1, 0),
    (64, 256, 64, 4, 3, 0, 0), (128, 128, 64, 4, 3, 0, 0),
    (128, 256, 64, 8, 3, 0, 1), (128, 256, 64, 8, 4, 0, 1), (128, 128, 64, 8, 3, 0, 1), (128, 128, 64, 8, 4, 0, 1),
    (128, 128, 64, 8, 3, 1, 1), (128, 128, 64, 8, 4, 1, 1), (128, 128, 64, 4, 3, 0, 2), (64, 128, 64, 4, 4, 0, 2),
    (128, 64, 64, 4, 4, 0, 2), (64, 128, 64, 4, 4, 1, 2),
    # an 8th entry caps the registers (maxnreg), so 2-3 programs share an SM
    (64, 128, 64, 4, 3, 0, 0, 168), (64, 128, 64, 4, 3, 0, 0, 160), (128, 128, 64, 8, 3, 1, 0, 128),
    (128, 128, 64, 8, 3, 0, 0, 128), (128, 128, 64, 8, 2, 0, 0, 128), (64, 128, 64, 4, 2, 0, 0, 128),
]
SWEEP_WGRAD = [  # BLOCK_K, BLOCK_N, BLOCK_S, warps, stages
    (64, 64, 64, 4, 4), (64, 64, 64, 4, 2), (64, 64, 128, 4, 2), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 4, 3), (128, 128, 64, 4, 2),
    (128, 256, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 2), (128, 256, 64, 8, 2),
    (64, 128, 64, 4, 2), (128, 128, 32, 4, 3), (128, 128, 128, 4, 2), (128, 128, 128, 8, 2),
    (64, 128, 128, 4, 3), (128, 256, 128, 8, 2), (128, 64, 128, 4, 3),
    (256, 128, 64, 8, 2), (128, 256, 64, 8, 4),
]


def _sweep_space(kern_is_wgrad, name):
    """The triton.Config of every config the sweep tries on GEMM ``name``, built as the kernels'
    own configs are (with the pre-hooks that size their TMA boxes)."""
    from megatron_moe.kernels import grouped as G

    if kern_is_wgrad:  # accumulating through TMA's reduce-add too, where the call makes a descriptor
        both = "+=" in name and "ldst" not in name
        return [G._wgrad_config(*c, tma_add=t) for c in SWEEP_WGRAD for t in ((False, True) if both else (False,))]
    return [G._gemm_config(*c) for c in SWEEP_GEMM
            if not c[5] or "bwd" in name]  # PREFETCH only changes the backward epilogues


def sweep(p, device, only=None):
    from megatron_moe.kernels import grouped as G

    calls = gemm_calls(p)
    out = []
    for kern in (G._grouped_gemm_kernel, G._grouped_wgrad_kernel):
        saved = kern.configs
        for name, fn in calls.items():
            if (kern is G._grouped_wgrad_kernel) != name.startswith("wgrad"):
                continue
            if not selected(name, only):
                continue
            best = None
            want = None
            for config in _sweep_space(kern is G._grouped_wgrad_kernel, name):
                cfg = (config.kwargs, config.num_warps, config.num_stages, config.maxnreg)
                kern.configs = [config]
                G.clear_tuning_cache()
                if "+=" in name:  # accumulating calls: compare one addition into zeros
                    p["g2" if "dw2" in name else "g1"].zero_()
                try:
                    got = fn()
                    got = [t.to(torch.float32, copy=True) for t in (got if isinstance(got, tuple) else (got,))]
                    ms = _bench(fn, warmup=10, rep=40)
                except Exception as e:  # out of shared memory etc.
                    out.append(dict(gemm=name, cfg=cfg, error=type(e).__name__))
                    continue
                # every config must compute the same thing (up to accumulation order)
                want = want or got
                err = max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))
                if not err < 1e-2:
                    print(f"  MISMATCH {name} {cfg}: rel err {err:.3g} against the first config", flush=True)
                out.append(dict(gemm=name, cfg=cfg, ms=ms, tflops=gemm_flops(p, name) / ms / 1e9, rel_err=err))
                if best is None or ms < best[1]:
                    best = (cfg, ms)
            print(f"  sweep {name:<28} best {best[0]} {gemm_flops(p, name) / best[1] / 1e9:6.1f} TFLOP/s", flush=True)
        kern.configs = saved
        G.clear_tuning_cache()
    return out


def launch_overhead(device, n=200):
    """Host microseconds per call of one small grouped GEMM, layer by layer of the launch path."""
    import triton

    from megatron_moe.kernels import grouped as G
    from megatron_moe.kernels.metadata import routing_metadata

    T, H, F, E = 512, 64, 64, 4
    r = routing_metadata(torch.randint(0, E, (T, 1), device=device), E, 128)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, H, F, device=device, dtype=torch.bfloat16)
    out = torch.empty(T, F, device=device, dtype=torch.bfloat16)
    off, tok = r.expert_offsets_E1, r.sorted_token_N
    cfg = G._gemm_configs()[0]

    def direct_args():
        return (x, w, out, out, out, off, off, off, tok, off, off, H, F, E, 0, x.stride(0), x.stride(1),
                w.stride(0), w.stride(1), w.stride(2), out.stride(0), 0, 0)

    meta = dict(EPILOGUE="none", HAS_GATHER=True, HAS_SCATTER=False, HAS_SCALE=False, HAS_ACT_SCALE=False,
                DOT_PRECISION="tf32", FAST_MATH=True, BLOCK_E=4, SLOT=G._DACT_SLOT, W_TMA=False)
    grid = (G.max_row_blocks(T, E, cfg.kwargs["BLOCK_M"]) * triton.cdiv(F, cfg.kwargs["BLOCK_N"]),)
    from megatron_moe.kernels import launcher
    from megatron_moe.kernels.router_gemm import mm_f32

    xr = torch.randn(16384, 1024, device=device, dtype=torch.bfloat16)
    wr = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)

    def public_fast_off():
        with launcher.fast_launches(False):
            G.grouped_gemm(x, w, off, gather_S=tok)

    calls = {
        "grouped_gemm (public)": lambda: G.grouped_gemm(x, w, off, gather_S=tok),
        "grouped_gemm (public, fast launch off)": public_fast_off,
        "autotuned kernel[grid]": lambda: G._grouped_gemm_kernel[grid](*direct_args(), **meta),
        "jit kernel.fn[grid] + config": lambda: G._grouped_gemm_kernel.fn[grid](
            *direct_args(), **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        "compiled kernel.run (no binder)": _direct_run(G._grouped_gemm_kernel.fn, grid, direct_args(),
                                                       {**meta, **cfg.all_kwargs()}, device),
        "router mm_f32 [16384,1024]x[1024,64]": lambda: mm_f32(xr, wr.t()),
        "torch.mm bf16, same shapes": lambda: torch.mm(xr, wr.t()),
        "torch.empty (reference op)": lambda: torch.empty(T, F, device=device),
        "torch add (reference op)": lambda: x.add(x),
    }
    rows = {}
    for name, fn in calls.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rows[name] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        print(f"  launch {name:<32} {rows[name]:8.1f} us/call (host)", flush=True)
    return rows


def _direct_run(fn, grid, args, kwargs, device):
    """The launch below Triton's JIT: the compiled kernel's own launcher, its arguments bound once
    (what a launch path that skips the binder, the cache key and the checks would cost)."""
    from triton import knobs
    from triton.runtime import driver

    kernel = fn[grid](*args, **kwargs)
    binder = fn.device_caches[driver.active.get_current_device()][4]
    values = list(binder(*args, **kwargs)[0].values())
    grid3 = tuple(grid) + (1,) * (3 - len(grid))

    def run():
        stream = driver.active.get_current_stream(device.index or 0)
        kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, None, knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *values)
    return run


def host_ab(provider, cname, shape, device, switch="MEGATRON_MOE_FAST_LAUNCH", reps=15, steps=5):
    """Host milliseconds to enqueue one step with the environment switch ``switch`` on and off
    (default: fast launches, kernels/launcher.py), interleaved in one process: the GPU is held by
    a sleep kernel first, so the enqueue never waits for it; medians over ``reps`` rounds of
    ``steps`` steps each."""
    from megatron_moe.kernels.switches import setting

    step, model, x = make_step(provider, shape, device)
    times = {True: [], False: []}
    for on in (True, False, True):  # warm-up: tuning, compiles, each key's first launch
        with setting(switch, on):
            step()
    for _ in range(reps):
        for on in (True, False):
            with setting(switch, on):
                torch.cuda.synchronize()
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: longer than the steps' enqueue
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                times[on].append((time.perf_counter() - t0) / steps * 1e3)
    torch.cuda.synchronize()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"[{cname}] {provider}: host ms/step {switch} on {med[True]:.3f}, off {med[False]:.3f} "
          f"(min {min(times[True]):.3f} / {min(times[False]):.3f}; {reps} rounds of {steps} steps)", flush=True)
    del model, x, step
    torch.cuda.empty_cache()
    return med


def host_profile(provider, cname, shape, device, steps=50, top=25):
    """Where the host's time per step goes: cProfile over steps queued back to back (the GPU runs
    behind; a host-bound step shows here as Python time, not as waiting)."""
    import cProfile
    import pstats

    step, model, x = make_step(provider, shape, device)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    host_ms = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    print(f"[{cname}] {provider}: host {host_ms:.2f} ms/step under cProfile; top {top} by own time "
          f"(ms per step):", flush=True)
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (fname, line, func), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{os.path.basename(fname)}:{line}"
        print(f"   {tottime / steps * 1e3:7.3f} own {cumtime / steps * 1e3:7.3f} cum  x{ncalls // steps:<4} "
              f"{func} ({where})")
    del model, x, step
    torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)} (bench_layer.py's)")
    ap.add_argument("--providers", default="dense,plain_grouped_mm,triton_grouped,blocksparse",
                    help="comma-separated layer benchmark providers (bench_layer.py)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-gemms", action="store_true", help="only the per-kernel profile of the providers' steps")
    ap.add_argument("--sweep-only", default="",
                    help="comma-separated GEMM name prefixes (fwd1,fwd2,bwd,wgrad,dx); a name ending in '$' is "
                         "matched exactly")
    ap.add_argument("--gemms-only", default="",
                    help="comma-separated GEMM name prefixes (or exact names ending in '$'): time only these")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="fraction of the tokens routed to expert 0 in the GEMM problems (0: random routing)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--launch", action="store_true", help="host time per kernel launch, then exit")
    ap.add_argument("--order", action="store_true",
                    help="one step's kernels in launch order (median of 5 profiled steps), then exit")
    ap.add_argument("--host", action="store_true",
                    help="host time per step with --switch on and off (the GPU held busy), then exit")
    ap.add_argument("--switch", default="MEGATRON_MOE_FAST_LAUNCH",
                    help="--host's environment switch (kernels/switches.py), e.g. MEGATRON_MOE_ROUTER_GEMM")
    ap.add_argument("--cprofile", action="store_true",
                    help="host Python time of the providers' steps (cProfile, top functions), then exit")
    args = ap.parse_args(argv)
    providers = canonical_providers(args.providers)
    device = torch.device("cuda")
    if args.launch:
        launch_overhead(device)
        return
    if args.order:
        for cname in args.configs.split(","):
            for prov in providers:
                print(f"== {cname} {prov}")
                for i, ms, name in kernel_order(prov, CONFIGS[cname], device):
                    print(f"  {i:3d} {ms:7.3f}  {name[:150]}", flush=True)
        return
    if args.host:
        for cname in args.configs.split(","):
            for prov in providers:
                host_ab(prov, cname, CONFIGS[cname], device, args.switch)
        return
    if args.cprofile:
        for cname in args.configs.split(","):
            for prov in providers:
                host_profile(prov, cname, CONFIGS[cname], device)
        return
    result = {}
    for cname in args.configs.split(","):
        shape = CONFIGS[cname]
        res = result[cname] = {}
        if not args.no_profile:
            res["profile"] = []
            for prov in providers:
                row = profile_provider(prov, shape, device)
                res["profile"].append(row)
                print(f"[{cname}] {prov}: wall {row['wall_ms']:.2f} ms/step, enqueue {row['enqueue_ms']:.2f} ms, "
                      f"GPU busy {row['gpu_busy_ms']:.2f} ms, {row['launches_per_step']:.0f} kernels/step", flush=True)
                for name, ms, n in row["top"]:
                    print(f"      {ms:8.3f} ms  x{n:<3} {name}")
                if prov != "dense":
                    print("      host (self CPU per step):")
                    for name, ms, n in row["host"]:
                        print(f"      {ms:8.3f} ms  x{n:<3} {name}")
        if args.no_gemms:
            continue
        rows, p = gemm_rows(shape, device, args.skew, [o for o in args.gemms_only.split(",") if o])
        res["gemms"] = rows
        for r in rows:
            cfg = r.get("config") or {}
            tile = " ".join(f"{k[6:]}{cfg[k]}" for k in ("BLOCK_M", "BLOCK_S", "BLOCK_N", "BLOCK_K") if k in cfg)
            extra = f" {tile} w{cfg['warps']} s{cfg['stages']}" if cfg else ""
            extra += " persistent" * bool(cfg.get("PERSISTENT")) + " prefetch" * bool(cfg.get("PREFETCH"))
            extra += f" maxnreg {cfg['maxnreg']}" if cfg.get("maxnreg") else ""
            extra += " tma-add" * bool(cfg.get("TMA_ADD"))
            print(f"[{cname}] gemm {r['gemm']:<36} {r['ms']:.3f} ms {r['tflops']:6.1f} TFLOP/s{extra}", flush=True)
        if not args.no_sweep:
            res["sweep"] = sweep(p, device, [o for o in args.sweep_only.split(",") if o])
        del p
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
