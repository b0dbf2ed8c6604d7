"""tools/compare_runs.py on synthetic run directories with known answers."""
import json
import os
import subprocess
import sys

import pytest
import yaml

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
sys.path.insert(0, TOOLS)
import compare_runs  # noqa: E402


def write_run(root, name, step_time, tokens_per_s, val, dropped=None, repeat_step=None):
    d = root / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"name": name, "model": {"seq_length": 100},
                                                   "train": {"micro_batch_size": 4}}))
    lines = []
    for step in range(1, 11):
        m = {"step": step, "consumed_samples": 8 * step, "lm_loss": 5.0 - step * 0.1,
             "tokens_per_s": tokens_per_s, "step_time_s": step_time, "peak_mem_gb": 1.5,
             "expert_load/layer1/cv": 0.5 / step, "world_size": 2}
        if step % 5 == 0:
            m["val_loss"] = val[step // 5 - 1]
        if dropped is not None:
            m["dropped_fraction"] = dropped
        lines.append(json.dumps(m))
    if repeat_step:  # a resumed run writes the step again; the later record wins
        lines.append(json.dumps({"step": repeat_step, "tokens_per_s": tokens_per_s, "step_time_s": step_time,
                                 "world_size": 2, "consumed_samples": 8 * repeat_step}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 11, \"trunc")
    return d


def test_table_numbers(tmp_path):
    a = write_run(tmp_path, "dense", step_time=2.0, tokens_per_s=1000.0, val=[4.0, 3.0])
    b = write_run(tmp_path, "moe", step_time=1.0, tokens_per_s=2000.0, val=[3.5, 2.5], dropped=0.1)
    runs = [compare_runs.load_run(str(a)), compare_runs.load_run(str(b))]
    rows, target = compare_runs.summarize(runs, "dense", None)
    assert target == 3.0  # the worst final validation loss
    dense, moe = rows
    assert dense["tokens_per_s_per_gpu"] == 500.0 and moe["tokens_per_s_per_gpu"] == 1000.0
    assert dense["time_to_target_s"] == pytest.approx(20.0)  # reaches 3.0 at step 10
    # moe: 3.5 at 5 s, 2.5 at 10 s -> 3.0 at 7.5 s
    assert moe["time_to_target_s"] == pytest.approx(7.5)
    assert moe["time_to_target_speedup"] == pytest.approx(20.0 / 7.5)
    assert moe["throughput_speedup"] == pytest.approx(2.0)
    assert moe["dropped_fraction"] == pytest.approx(0.1) and dense["dropped_fraction"] is None
    assert moe["micro_batch"] == 4 and moe["final_val_loss"] == 2.5


def test_cli_writes_table_and_plots(tmp_path):
    a = write_run(tmp_path, "dense", 2.0, 1000.0, [4.0, 3.0], repeat_step=3)
    b = write_run(tmp_path, "moe", 1.0, 2000.0, [3.5, 2.5])
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "compare_runs.py"), str(a), str(b),
                          "--baseline", "dense", "--plots", str(tmp_path / "plots"),
                          "--markdown", str(tmp_path / "t.md")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| moe |" in out.stdout and "2.67" in out.stdout
    for f in ("val_loss_vs_time.png", "val_loss_vs_tokens.png", "throughput.png", "expert_load.png"):
        assert (tmp_path / "plots" / f).stat().st_size > 1000
    assert (tmp_path / "t.md").read_text().startswith("| run |")


def test_data_epochs_column_only_when_logged(tmp_path):
    a = write_run(tmp_path, "dense", 2.0, 1000.0, [4.0, 3.0])
    b = write_run(tmp_path, "moe", 1.0, 2000.0, [3.5, 2.5])
    rows, _ = compare_runs.summarize([compare_runs.load_run(str(a)), compare_runs.load_run(str(b))], None, None)
    assert "data epochs" not in compare_runs.markdown_table(rows)  # older runs: table unchanged
    lines = (b / "metrics.jsonl").read_text().split("\n")
    first = json.loads(lines[0])
    first.update(data_train_tokens=400, data_epochs=2.5)  # what train.py logs with step 1
    (b / "metrics.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]))
    rows, _ = compare_runs.summarize([compare_runs.load_run(str(a)), compare_runs.load_run(str(b))], None, None)
    table = compare_runs.markdown_table(rows).splitlines()
    assert table[0].endswith("| data epochs |")
    assert table[2].endswith("| - |") and table[3].endswith("| 2.50 |")


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        compare_runs.load_run(str(tmp_path))
    a = write_run(tmp_path, "dense", 2.0, 1000.0, [4.0, 3.0])
    with pytest.raises(ValueError, match="--baseline 'nope' is not one of the runs"):
        compare_runs.summarize([compare_runs.load_run(str(a))], "nope", None)


def test_first_step_startup_left_out_of_wall_time(tmp_path):
    d = write_run(tmp_path, "moe", step_time=1.0, tokens_per_s=2000.0, val=[3.5, 2.5])
    lines = (d / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["step_time_s"] = 31.0  # 30 s of compilation and autotuning on top of a 1 s step
    (d / "metrics.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    run = compare_runs.load_run(str(d))
    assert compare_runs.startup_seconds(run) == pytest.approx(30.0)
    assert [t for t, _ in compare_runs.wall_clock(run)][:3] == pytest.approx([1.0, 2.0, 3.0])
    rows, _ = compare_runs.summarize([run], None, 3.0)
    assert rows[0]["time_to_target_s"] == pytest.approx(7.5) and rows[0]["startup_s"] == pytest.approx(30.0)


RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
COMMITTED = sorted(d for d in os.listdir(RESULTS)
                   if os.path.isdir(os.path.join(RESULTS, d, "runs")) and os.path.isfile(os.path.join(RESULTS, d, "table.md")))


def test_committed_results_keep_their_runs():
    """The reproduction's newest results ship their runs (metrics.jsonl + config.yaml), so their
    tables rebuild without a GPU; a .gitignore rule once dropped every runs/ folder."""
    assert "repro-small-gb64-500mb-4x" in COMMITTED and "repro-xs-gb64-200mb-fusedopt" in COMMITTED


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_table_rebuilds(tmp_path, name):
    d = os.path.join(RESULTS, name)
    with open(os.path.join(d, "table.md")) as f:
        rows = [line.split("|")[1].strip() for line in f.read().splitlines()[2:] if line.startswith("|")]
    with open(os.path.join(d, "compare.txt")) as f:
        baseline = next(line.split("baseline: ")[1].strip() for line in f if "baseline: " in line)
    out = tmp_path / "table.md"
    assert compare_runs.main([os.path.join(d, "runs", r) for r in rows]
                             + ["--baseline", baseline, "--markdown", str(out)]) == 0
    with open(os.path.join(d, "table.md")) as f:
        assert out.read_text() == f.read()
