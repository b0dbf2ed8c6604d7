"""tools/rank_timelines.py on hand-made traces of the trainer's form (torch.profiler's Chrome
trace: baseTimeNanoseconds, kernel events with ts/dur in µs), where every expected number is
worked out by hand below.

    pytest tests/tools/test_rank_timelines.py -q
"""
from __future__ import annotations

import json

import pytest

from megatron_moe.tools.rank_timelines import compare, main, read_timeline


def _trace(path, base_ns, kernels):
    """kernels: (ts µs relative to base, dur µs, name, stream)."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0, "pid": 1, "tid": 1}]
    events += [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d, "pid": 0, "tid": s}
               for ts, d, n, s in kernels]
    path.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": events}))
    return path


def _two_ranks(tmp_path):
    # rank 0: base 1,000,000 ns = 1000 µs. Kernels at absolute µs: gemm 1000-1100 and an overlapping
    # one on another stream 1050-1150 (busy 150), a2a #1 1200-1500, a2a #2 1600-1650.
    r0 = _trace(tmp_path / "profile_step7_rank0.json", 1_000_000, [
        (0, 100, "gemm", 7), (50, 100, "gemm2", 9), (200, 300, "ncclDevKernel_SendRecv", 13),
        (600, 50, "ncclDevKernel_SendRecv", 13)])
    # rank 1: base 500,000 ns = 500 µs. Absolute: gemm 1000-1400 (its host was late), a2a #1 1450-1500,
    # a2a #2 1550-1700.
    r1 = _trace(tmp_path / "profile_step7_rank1.json", 500_000, [
        (500, 400, "gemm", 7), (950, 50, "ncclDevKernel_SendRecv", 13), (1050, 150, "ncclDevKernel_SendRecv", 13)])
    return r0, r1


def test_ranks_on_one_clock_waits_and_the_last_to_arrive(tmp_path):
    r0, r1 = _two_ranks(tmp_path)
    rows, notes = compare([read_timeline(r1, 1), read_timeline(r0, 0)])
    assert notes == []
    by = {r["rank"]: r for r in rows}
    # span: 1000 (first start) .. 1700 (last end) = 700 µs
    assert by[0]["busy_ms"] == pytest.approx(0.150 + 0.300 + 0.050)  # overlap counted once
    assert by[1]["busy_ms"] == pytest.approx(0.400 + 0.050 + 0.150)
    assert by[0]["idle_ms"] == pytest.approx(0.700 - 0.500) and by[1]["idle_ms"] == pytest.approx(0.700 - 0.600)
    # a2a #1: rank 0 at 1200, rank 1 at 1450 -> rank 0 waits 250; #2: 1600 vs 1550 -> rank 1 waits 50
    assert by[0]["wait_ms"] == pytest.approx(0.250) and by[1]["wait_ms"] == pytest.approx(0.050)
    assert (by[0]["last"], by[1]["last"]) == (1, 1)
    assert by[0]["nccl_ms"] == pytest.approx(0.350) and by[0]["collectives"] == by[1]["collectives"] == 2


def test_groups_are_matched_within_themselves_and_uneven_counts_noted(tmp_path):
    # four ranks in two groups of 2: group {2, 3} has one collective on rank 2 and two on rank 3
    paths = []
    for r, kernels in enumerate([[(0, 10, "ncclDevKernel_SendRecv", 1)], [(30, 10, "ncclDevKernel_SendRecv", 1)],
                                 [(5, 10, "ncclDevKernel_SendRecv", 1)],
                                 [(0, 10, "ncclDevKernel_SendRecv", 1), (50, 10, "ncclKernel_AllReduce", 1)]]):
        paths.append(_trace(tmp_path / f"profile_step1_rank{r}.json", 0, kernels))
    rows, notes = compare([read_timeline(p, r) for r, p in enumerate(paths)], group_size=2)
    by = {r["rank"]: r for r in rows}
    assert by[0]["wait_ms"] == pytest.approx(0.030) and by[1]["last"] == 1  # group {0, 1}
    assert by[3]["wait_ms"] == pytest.approx(0.005) and by[2]["last"] == 1  # group {2, 3}: rank 2 at 5 µs
    assert notes == ["ranks 2-3: [1, 2] NCCL kernels; the first 1 of each are matched"]


def test_cli_table_merged_trace_and_errors(tmp_path, capsys):
    _two_ranks(tmp_path)
    merged = tmp_path / "merged.json"
    assert main([str(tmp_path), "--step", "7", "--merged", str(merged)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["rank", "busy", "ms", "idle", "ms", "nccl", "ms", "barrier", "ms", "copy",
                                           "ms", "wait", "ms", "last", "collectives"]
    assert out.splitlines()[1].split()[:8] == ["0", "0.50", "0.20", "0.35", "0.00", "0.00", "0.25", "1"]
    events = json.loads(merged.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"rank 0", "rank 1"}
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0.0 and len([e for e in events if e["ph"] == "X"]) == 7
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--step", "8"])
    assert e.value.code == 2 and "no profile_step8_rank*.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--step", "7", "--group-size", "3"])
    assert e.value.code == 2 and "--group-size 3 does not divide the 2 ranks" in capsys.readouterr().err


def test_symmetric_exchange_barriers_are_collectives_and_copies_give_a_rate(tmp_path, capsys):
    """The symmetric exchange's kernels: barriers matched by order as collectives (beside NCCL's,
    each kind on its own), row copies summed, and with the step's a2a_gb in metrics.jsonl a rate."""
    barrier = "void c10d::symmetric_memory::barrier_kernel<(c10d::symmetric_memory::MemOpSem)0>(unsigned int**, ...)"
    copy = "_copy_row_blocks_kernel"
    # rank 0 (absolute µs): copy 0-100, barrier 100-400 (waits for rank 1), copy 400-500, nccl 600-610,
    # barrier 700-710; rank 1: copy 0-380, barrier 380-400, copy 400-600, nccl 605-610, barrier 650-710
    r0 = _trace(tmp_path / "profile_step7_rank0.json", 0, [
        (0, 100, copy, 7), (100, 300, barrier, 7), (400, 100, copy, 7), (600, 10, "ncclDevKernel_SendRecv", 9),
        (700, 10, barrier, 7)])
    r1 = _trace(tmp_path / "profile_step7_rank1.json", 0, [
        (0, 380, copy, 7), (380, 20, barrier, 7), (400, 200, copy, 7), (605, 5, "ncclDevKernel_SendRecv", 9),
        (650, 60, barrier, 7)])
    rows, notes = compare([read_timeline(r0, 0), read_timeline(r1, 1)])
    by = {r["rank"]: r for r in rows}
    assert notes == []
    assert by[0]["copy_ms"] == pytest.approx(0.200) and by[1]["copy_ms"] == pytest.approx(0.580)
    assert by[0]["barrier_ms"] == pytest.approx(0.310) and by[1]["barrier_ms"] == pytest.approx(0.080)
    # barrier #1: 100 vs 380 -> rank 0 waits 280, rank 1 last; #2: 700 vs 650 -> rank 1 waits 50;
    # the NCCL kernel: 600 vs 605 -> rank 0 waits 5, rank 1 last
    assert by[0]["wait_ms"] == pytest.approx(0.285) and by[1]["wait_ms"] == pytest.approx(0.050)
    assert (by[0]["last"], by[1]["last"]) == (1, 2) and by[0]["collectives"] == 3
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 6, "a2a_gb": 9.0}) + "\n"
                                            + json.dumps({"step": 7, "a2a_gb": 0.058}) + "\n")
    assert main([str(tmp_path), "--step", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("copy GB/s")
    assert lines[1].split()[-1] == "290" and lines[2].split()[-1] == "100"  # 0.058 GB / 0.2 ms, / 0.58 ms
    assert lines[3] == "a2a_gb (metrics.jsonl, step 7): 0.058 GB a rank"
