"""benchmarks/step_gaps.py: the GPU's busy time and idle gaps of a profiled step, from a Chrome
trace, checked on a hand-made trace whose answer is worked out below."""
import json
from pathlib import Path

import pytest
from _util import load_script

PATH = Path(__file__).parents[2] / "benchmarks" / "step_gaps.py"


@pytest.fixture(scope="module")
def step_gaps():
    return load_script(PATH)


def trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def kernel(name, ts, dur, corr, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_busy_and_gaps(tmp_path, step_gaps):
    """Kernels a [0, 10), b [12, 20), a copy overlapping b [15, 25), c [200, 250), d [253, 260), plus
    CPU events that must be ignored: busy = 10 + 13 + 50 + 7 = 80 µs over a 260 µs span; gaps of 2,
    175 and 3 µs; the long one ends at c, launched by a graph launch 165 µs after the gap began."""
    events = [kernel("a", 0, 10, 1), kernel("b", 12, 8, 2), kernel("m", 15, 10, 3, cat="gpu_memcpy"),
              kernel("c", 200, 50, 4), kernel("d", 253, 7, 5),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 190, "dur": 5,
               "args": {"correlation": 4}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 30, "dur": 100, "args": {}}]
    gpu, launches = step_gaps.load(trace(tmp_path, events))
    span, busy, gaps = step_gaps.gaps(gpu)
    assert (span, busy) == (260, 80)
    assert [(at, length) for at, length, _ in gaps] == [(10, 2), (25, 175), (250, 3)]
    assert gpu[gaps[1][2]]["name"] == "c" and launches[4]["name"] == "cudaGraphLaunch"
    text = step_gaps.report(trace(tmp_path, events), min_us=50)
    assert "span 0.26 ms, busy 0.08 ms (30.8%), idle 0.18 ms in 3 gaps" in text
    assert "m -> c  [cudaGraphLaunch at +165 µs from the gap's start]" in text
    assert sum(line.endswith("]") for line in text.splitlines()) == 1  # only the gap of >= 50 µs is listed


def test_no_gpu_events_and_unreadable_trace(tmp_path, step_gaps, capsys):
    path = trace(tmp_path, [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 1}])
    assert "no GPU events" in step_gaps.report(path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    step_gaps.main([str(bad)])
    assert "cannot read the trace" in capsys.readouterr().err
