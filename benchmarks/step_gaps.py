"""Where a profiled training step leaves the GPU idle: the gaps between its kernels, from the
Chrome trace that ``MEGATRON_MOE_PROFILE_STEP=N`` writes (megatron_moe/training/metrics.py).

    python benchmarks/step_gaps.py runs/NAME/profile_step6_rank0.json
    python benchmarks/step_gaps.py TRACE --top 20 --min-us 20

Prints the GPU's span (first kernel's start to the last one's end), its busy time (the union of
kernels, copies and memsets), the idle time in gap-size classes (gaps of a few µs are the
launch latency between the kernels of one CUDA graph; long ones wait for the host), then the
longest gaps: where they fall, the kernels on either side, and the host call that launched the
kernel after the gap with how long after the gap's start the host made it (a launch made after
the GPU went idle: the host was the limit there).
"""
from __future__ import annotations

import argparse
import json
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
CLASSES = [(0.0, 5.0), (5.0, 50.0), (50.0, 500.0), (500.0, float("inf"))]  # µs


def load(path: str) -> tuple[list[dict], dict[int, dict]]:
    """(GPU events sorted by start, host runtime/driver events by correlation id)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
    return gpu, launches


def gaps(gpu: list[dict]) -> tuple[float, float, list[tuple[float, float, int]]]:
    """(span µs, busy µs, [(gap start µs, gap length µs, index of the event after the gap)])."""
    if not gpu:
        return 0.0, 0.0, []
    start, busy = gpu[0]["ts"], 0.0
    cur_lo, cur_hi = gpu[0]["ts"], gpu[0]["ts"] + gpu[0].get("dur", 0.0)
    out = []
    for i, e in enumerate(gpu[1:], 1):
        lo, hi = e["ts"], e["ts"] + e.get("dur", 0.0)
        if lo > cur_hi:
            busy += cur_hi - cur_lo
            out.append((cur_hi, lo - cur_hi, i))
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    busy += cur_hi - cur_lo
    return cur_hi - start, busy, out


def report(path: str, top: int = 12, min_us: float = 50.0) -> str:
    gpu, launches = load(path)
    if not gpu:
        return f"{path}: no GPU events (a CPU run, or the profiler saw no CUDA activity)"
    span, busy, gs = gaps(gpu)
    t0 = gpu[0]["ts"]
    lines = [f"{path}", f"GPU events {len(gpu)}, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
             f"({100 * busy / span:.1f}%), idle {(span - busy) / 1e3:.2f} ms in {len(gs)} gaps"]
    for lo, hi in CLASSES:
        sel = [g for g in gs if lo <= g[1] < hi]
        name = f"{lo:g}-{hi:g} µs" if hi != float("inf") else f">= {lo:g} µs"
        lines.append(f"  gaps {name:<14} {len(sel):>6}  {sum(g[1] for g in sel) / 1e3:8.2f} ms")
    lines.append(f"longest gaps (>= {min_us:g} µs): at ms, length µs, before -> after, the launch of 'after'")
    for at, length, i in sorted((g for g in gs if g[1] >= min_us), key=lambda g: -g[1])[:top]:
        before, after = gpu[i - 1]["name"][:48], gpu[i]["name"][:48]
        host = launches.get(gpu[i].get("args", {}).get("correlation"))
        how = (f"{host['name']} at {host['ts'] - at:+.0f} µs from the gap's start" if host else "launch not traced")
        lines.append(f"  {(at - t0) / 1e3:9.2f} {length:9.0f}  {before} -> {after}  [{how}]")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+", help="Chrome trace JSON of a profiled step")
    ap.add_argument("--top", type=int, default=12, help="how many of the longest gaps to list")
    ap.add_argument("--min-us", type=float, default=50.0, help="list only gaps at least this long")
    args = ap.parse_args(argv)
    for path in args.trace:
        try:
            print(report(path, args.top, args.min_us), flush=True)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: cannot read the trace ({type(e).__name__}: {e})", file=sys.stderr)


if __name__ == "__main__":
    main()
