"""compare_runs' outputs: files in folders that do not exist yet, bad output paths, the plots
(titles, the target-loss line, the training-loss curve, their size) and gzipped metrics."""
import gzip
import json
import os
import subprocess
import sys

import pytest
import yaml

from megatron_moe.tools import compare_runs

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
CLI = [sys.executable, os.path.join(TOOLS, "compare_runs.py")]
PLOTS = ("val_loss_vs_time.png", "val_loss_vs_tokens.png", "train_loss.png", "throughput.png",
         "expert_load.png")


def write_run(root, name, step_time, val, steps=10, moe=True):
    d = root / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"name": name, "model": {"seq_length": 100},
                                                   "train": {"micro_batch_size": 4}}))
    rows = []
    for step in range(1, steps + 1):
        m = {"step": step, "consumed_samples": 8 * step, "lm_loss": 5.0 - step * 0.1 + 0.05 * (step % 2),
             "tokens_per_s": 800 / step_time, "step_time_s": step_time, "peak_mem_gb": 1.5}
        if moe:
            m["expert_load/layer1/cv"] = 0.5 / step
        if step % (steps // 2) == 0:
            m["val_loss"] = val[step // (steps // 2) - 1]
        rows.append(m)
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    return d


@pytest.fixture
def two_runs(tmp_path):
    return (write_run(tmp_path, "dense", 2.0, [4.0, 3.0], moe=False),
            write_run(tmp_path, "moe", 1.0, [3.5, 2.5]))


def test_outputs_go_into_folders_that_do_not_exist_yet(tmp_path, two_runs):
    out = tmp_path / "new" / "deeper"
    proc = subprocess.run(CLI + [str(r) for r in two_runs] + [
        "--markdown", str(out / "md" / "table.md"), "--json", str(out / "js" / "table.json"),
        "--plots", str(out / "plots")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (out / "md" / "table.md").read_text().startswith("| run |")
    assert json.loads((out / "js" / "table.json").read_text())["target_loss"] == 3.0
    for f in PLOTS:
        assert (out / "plots" / f).is_file(), f


@pytest.mark.parametrize("flag", ["--markdown", "--json", "--plots"])
def test_a_bad_output_path_is_one_line_and_exit_2(tmp_path, two_runs, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for bad in (blocker / "x" / "out", tmp_path) if flag != "--plots" else (blocker / "plots", blocker):
        proc = subprocess.run(CLI + [str(r) for r in two_runs] + [flag, str(bad)], capture_output=True, text=True)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert proc.stderr.startswith(f"compare_runs: error: {flag} {bad}: "), proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def _plot_calls(monkeypatch, runs, rows, target, baseline, out_dir):
    """make_plots with the matplotlib Axes calls that matter recorded: {file: {title, hlines, lines}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    real_save = plt.Figure.savefig

    def savefig(fig, path, *a, **k):
        ax = fig.axes[0]
        figures[os.path.basename(path)] = dict(
            titles=[a.get_title() for a in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""],
            labels=[line.get_label() for a in fig.axes for line in a.get_lines()],
            hlines=[line.get_ydata()[0] for line in ax.get_lines()
                    if len(set(line.get_ydata())) == 1 and len(line.get_ydata()) == 2],
            dpi=k.get("dpi"))
        return real_save(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    written = compare_runs.make_plots(runs, rows, str(out_dir), target=target, baseline=baseline)
    return figures, written


def test_plots_have_titles_the_target_line_and_a_training_loss_curve(tmp_path, monkeypatch, two_runs):
    runs = [compare_runs.load_run(str(r)) for r in two_runs]
    rows, target = compare_runs.summarize(runs, "dense", "baseline")
    figs, written = _plot_calls(monkeypatch, runs, rows, target, "dense", tmp_path / "plots")
    assert sorted(os.path.basename(p) for p in written) == sorted(PLOTS)
    for name, f in figs.items():
        title = " ".join(f["titles"])
        assert "moe" in title and ("dense" in title) == (name != "expert_load.png"), (name, title)  # which runs
        assert 80 <= f["dpi"] <= 100
    for name in ("val_loss_vs_time.png", "val_loss_vs_tokens.png"):
        assert figs[name]["hlines"] == [3.0], name  # the baseline's final validation loss
        assert any(lbl.startswith("target 3.000") and "dense" in lbl for lbl in figs[name]["labels"])
        assert "validation loss" in " ".join(figs[name]["titles"])
    assert "training loss" in " ".join(figs["train_loss.png"]["titles"])
    assert {"dense", "moe"} <= set(figs["train_loss.png"]["labels"])
    for p in written:
        assert 2_000 < os.path.getsize(p) < 60_000, p


def test_the_default_target_line_and_the_baselines_final_beside_it(tmp_path, monkeypatch, two_runs):
    runs = [compare_runs.load_run(str(r)) for r in two_runs]
    rows, target = compare_runs.summarize(runs, "moe", 3.25)  # a number: the line, and moe's final
    figs, _ = _plot_calls(monkeypatch, runs, rows, target, "moe", tmp_path / "p1")
    assert figs["val_loss_vs_tokens.png"]["hlines"] == [3.25, 2.5]
    labels = figs["val_loss_vs_tokens.png"]["labels"]
    assert "target 3.250" in labels and "moe's final 2.500" in labels


def test_training_loss_is_smoothed_only_when_long(tmp_path):
    short = compare_runs.smooth([1.0, 3.0, 2.0])
    assert short == ([1.0, 3.0, 2.0], 1)
    values = [float(i % 2) for i in range(1000)]
    out, window = compare_runs.smooth(values)
    assert window > 1 and len(out) == 1000
    assert all(abs(v - 0.5) < 0.1 for v in out[window:-window])


def test_gzipped_metrics_read_as_plain_ones(tmp_path, two_runs):
    plain = compare_runs.load_run(str(two_runs[1]))
    text = (two_runs[1] / "metrics.jsonl").read_bytes()
    (two_runs[1] / "metrics.jsonl").unlink()
    (two_runs[1] / "metrics.jsonl.gz").write_bytes(gzip.compress(text))
    packed = compare_runs.load_run(str(two_runs[1]))
    assert packed.steps == plain.steps and packed.name == "moe"
    (two_runs[1] / "metrics.jsonl").write_bytes(text[: len(text) // 2])  # both: the plain file wins
    assert len(compare_runs.load_run(str(two_runs[1])).steps) < len(plain.steps)


def test_help_names_the_console_script():
    assert "megatron-moe-compare-runs runs/gpt-xs runs/dmoe-xs" in compare_runs.__doc__
