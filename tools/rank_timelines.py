"""Per-rank GPU timelines of one profiled step, side by side: who waits in the collectives.

    MEGATRON_MOE_PROFILE_STEP=150 torchrun --nproc-per-node 4 -m megatron_moe.training \\
        --config dmoe-small model.moe.expert_parallel_size=4
    megatron-moe-rank-timelines runs/dmoe-small --step 150 --group-size 4 --merged merged.json

(``python tools/rank_timelines.py ...`` from a source checkout does the same.)

Reads the trainer's torch.profiler Chrome traces of that step, ``profile_step{N}_rank{R}.json``
(one per rank, ``MEGATRON_MOE_PROFILE_STEP``), and puts their GPU kernels on one clock (each
trace's ``baseTimeNanoseconds`` plus its ``ts``: the host's clock, so ranks of one host line
up). A collective's kernel spans the wait for the last rank of its group to arrive plus the
transfer; collectives are matched across a group's ranks by order (the i-th NCCL kernel of each
rank is the same collective), groups being contiguous blocks of ``--group-size`` ranks (the
trainer's expert-parallel groups; the default, all ranks, fits a run with EP = world size).

Per rank: ``busy`` (time with a kernel running, streams merged), ``idle`` (the step's span over
all ranks minus busy: the GPU waited for its host), ``nccl`` (time in NCCL kernels), ``barrier``
and ``copy`` (the symmetric exchange's, ``a2a_splits=symmetric``: PyTorch symmetric memory's
barrier kernels, which are collectives too, and the row copies, ``_copy_row_blocks_kernel``, the
peers' reads and the own buffer's writes), ``wait`` (for each collective, NCCL's and the
barriers' each matched by order, the last arrival's start minus this rank's start: the part of
``nccl`` and ``barrier`` spent waiting for another rank) and ``last`` (collectives this rank
reached last: the rank the others waited for). Where the run's metrics.jsonl has the step's
``a2a_gb`` (GB a rank received in the step's exchanges, the mean over ranks), ``copy GB/s`` is
that over the rank's copy time (own-buffer copies included: a lower bound of the links' rate).
``--merged`` writes one Chrome trace with a process per rank (Perfetto, chrome://tracing).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RankTimeline", "read_timeline", "compare", "main"]


@dataclass
class RankTimeline:
    rank: int
    kernels: list[tuple[float, float, str, object]] = field(default_factory=list)  # (start µs, end µs, name, stream)

    @property
    def nccl(self) -> list[tuple[float, float, str, object]]:
        return [k for k in self.kernels if k[2].startswith("nccl")]

    @property
    def barriers(self) -> list[tuple[float, float, str, object]]:
        """The symmetric exchange's barriers (torch's ``c10d::symmetric_memory::barrier_kernel``)."""
        return [k for k in self.kernels if "symmetric_memory::barrier" in k[2]]

    @property
    def copies(self) -> list[tuple[float, float, str, object]]:
        """The symmetric exchange's row copies (kernels/copy_rows.py)."""
        return [k for k in self.kernels if k[2].startswith("_copy_row_blocks_kernel")]


def read_timeline(path: Path, rank: int) -> RankTimeline:
    """The GPU kernels of one rank's Chrome trace on the host's clock (µs)."""
    trace = json.loads(Path(path).read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    kernels = [(base_us + e["ts"], base_us + e["ts"] + e.get("dur", 0.0), e.get("name", ""), e.get("tid"))
               for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return RankTimeline(rank, sorted(kernels, key=lambda k: k[0]))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def compare(timelines: list[RankTimeline], group_size: int | None = None) -> tuple[list[dict], list[str]]:
    """One row per rank (milliseconds; module docstring) and notes (collective counts that differ
    within a group: the shorter count is matched)."""
    timelines = sorted(timelines, key=lambda t: t.rank)
    group_size = group_size or len(timelines)
    starts = [t.kernels[0][0] for t in timelines if t.kernels]
    ends = [max(k[1] for k in t.kernels) for t in timelines if t.kernels]
    span = (max(ends) - min(starts)) if starts else 0.0
    def ms(kernels):
        return _union([(a, b) for a, b, _, _ in kernels]) / 1e3

    rows = {t.rank: {"rank": t.rank, "busy_ms": ms(t.kernels), "nccl_ms": ms(t.nccl), "barrier_ms": ms(t.barriers),
                     "copy_ms": ms(t.copies), "wait_ms": 0.0, "last": 0, "collectives": len(t.nccl) + len(t.barriers)}
            for t in timelines}
    notes = []
    for g in range(0, len(timelines), group_size):
        group = timelines[g:g + group_size]
        for kind, what in (("nccl", "NCCL kernels"), ("barriers", "symmetric-memory barriers")):
            counts = [len(getattr(t, kind)) for t in group]
            if len(set(counts)) > 1:
                notes.append(f"ranks {group[0].rank}-{group[-1].rank}: {counts} {what}; the first "
                             f"{min(counts)} of each are matched")
            for i in range(min(counts)):
                arrivals = [getattr(t, kind)[i][0] for t in group]
                last = max(arrivals)
                for t, s in zip(group, arrivals):
                    rows[t.rank]["wait_ms"] += (last - s) / 1e3
                rows[group[arrivals.index(last)].rank]["last"] += 1
    for r in rows.values():
        r["idle_ms"] = span / 1e3 - r["busy_ms"]
    return [rows[t.rank] for t in timelines], notes


def merged_trace(timelines: list[RankTimeline]) -> dict:
    """One Chrome trace: a process per rank, its streams as threads, time from the first kernel."""
    t0 = min((t.kernels[0][0] for t in timelines if t.kernels), default=0.0)
    events = []
    for t in timelines:
        events.append({"ph": "M", "name": "process_name", "pid": t.rank, "tid": 0, "args": {"name": f"rank {t.rank}"}})
        events += [{"ph": "X", "cat": "kernel", "name": name, "pid": t.rank, "tid": stream,
                    "ts": a - t0, "dur": b - a} for a, b, name, stream in t.kernels]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _traces(run_dir: Path, step: int) -> list[tuple[int, Path]]:
    found = []
    for p in sorted(Path(run_dir).glob(f"profile_step{step}_rank*.json")):
        m = re.fullmatch(rf"profile_step{step}_rank(\d+)\.json", p.name)
        if m:
            found.append((int(m.group(1)), p))
    return found


def _step_a2a_gb(run_dir: Path, step: int) -> float | None:
    """The step's ``a2a_gb`` from the run's metrics.jsonl (rank 0's rows), if logged."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step") == step and row.get("a2a_gb"):
            return float(row["a2a_gb"])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megatron-moe-rank-timelines", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="the run directory holding profile_step{N}_rank{R}.json")
    ap.add_argument("--step", type=int, required=True, help="the profiled step (MEGATRON_MOE_PROFILE_STEP)")
    ap.add_argument("--group-size", type=int, default=None,
                    help="ranks per collective group (contiguous; default: all ranks)")
    ap.add_argument("--merged", type=Path, default=None, help="write one Chrome trace of all ranks here")
    args = ap.parse_args(argv)
    traces = _traces(args.run_dir, args.step)
    if not traces:
        ap.exit(2, f"megatron-moe-rank-timelines: error: no profile_step{args.step}_rank*.json in "
                   f"{args.run_dir}: run the trainer with MEGATRON_MOE_PROFILE_STEP={args.step}\n")
    if args.group_size is not None and (args.group_size < 1 or len(traces) % args.group_size):
        ap.exit(2, f"megatron-moe-rank-timelines: error: --group-size {args.group_size} does not divide the "
                   f"{len(traces)} ranks found\n")
    timelines = [read_timeline(p, r) for r, p in traces]
    rows, notes = compare(timelines, args.group_size)
    gb = _step_a2a_gb(args.run_dir, args.step)
    print(f"{'rank':>4} {'busy ms':>9} {'idle ms':>9} {'nccl ms':>9} {'barrier ms':>10} {'copy ms':>9} {'wait ms':>9} "
          f"{'last':>5} {'collectives':>12}" + (f" {'copy GB/s':>10}" if gb else ""))
    for r in rows:
        rate = f" {gb / (r['copy_ms'] / 1e3):>10.0f}" if gb and r["copy_ms"] else (f" {'-':>10}" if gb else "")
        print(f"{r['rank']:>4} {r['busy_ms']:>9.2f} {r['idle_ms']:>9.2f} {r['nccl_ms']:>9.2f} {r['barrier_ms']:>10.2f} "
              f"{r['copy_ms']:>9.2f} {r['wait_ms']:>9.2f} {r['last']:>5} {r['collectives']:>12}{rate}")
    if gb:
        print(f"a2a_gb (metrics.jsonl, step {args.step}): {gb:.3f} GB a rank")
    for n in notes:
        print(f"note: {n}")
    if args.merged is not None:
        args.merged.write_text(json.dumps(merged_trace(timelines)))
        print(f"merged trace: {args.merged}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
