"""tools/compare_runs.py on synthetic run directories with known answers."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from megatron_moe.tools import compare_runs

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


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


def test_target_loss_baseline_is_the_baselines_final_loss(tmp_path):
    a = write_run(tmp_path, "dense", step_time=2.0, tokens_per_s=1000.0, val=[4.0, 3.2])
    b = write_run(tmp_path, "moe", step_time=1.0, tokens_per_s=2000.0, val=[3.5, 2.5])
    runs = [compare_runs.load_run(str(b)), compare_runs.load_run(str(a))]
    rows, target = compare_runs.summarize(runs, "dense", "baseline")
    assert target == 3.2  # dense's final, not the first run's (2.5)
    moe, dense = rows
    assert dense["time_to_target_s"] == pytest.approx(20.0)  # its whole run
    assert moe["time_to_target_s"] == pytest.approx(5.0 + 5.0 * 0.3)  # 3.5 at 5 s, 2.5 at 10 s
    assert moe["time_to_target_speedup"] == pytest.approx(20.0 / 6.5)
    rows, target = compare_runs.summarize(runs, "moe", "baseline")
    assert target == 2.5 and rows[1]["time_to_target_s"] is None  # moe's final, not the worst (3.2)
    with pytest.raises(ValueError, match="baseline"):
        compare_runs.summarize(runs, "gpt", "baseline")
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "compare_runs.py"), str(a), "--target-loss", "dense"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "'dense' is invalid: expected a validation loss" in out.stderr


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


RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
COMMITTED = sorted(d for d in os.listdir(RESULTS)
                   if os.path.isdir(os.path.join(RESULTS, d, "runs"))
                   and os.path.isfile(os.path.join(RESULTS, d, "table.md")))


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
        line = next(line for line in f if "baseline: " in line)
    baseline = line.split("baseline: ")[1].strip()
    target = ["--target-loss", "baseline"] if "(the baseline's final)" in line else []
    out = tmp_path / "table.md"
    assert compare_runs.main([os.path.join(d, "runs", r) for r in rows]
                             + ["--baseline", baseline, "--markdown", str(out)] + target) == 0
    with open(os.path.join(d, "table.md")) as f:
        assert out.read_text() == f.read()


def test_tokens_per_gpu_follows_the_world_size_of_each_start(tmp_path):
    """world_size comes with the first step of each start: a run resumed on twice the GPUs
    doubles its tokens_per_s with the same tokens/s per GPU."""
    d = write_run(tmp_path, "moe", step_time=1.0, tokens_per_s=2000.0, val=[3.5, 2.5])
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()[:10]]
    for m in rows:
        del m["world_size"]
        if m["step"] > 5:
            m["tokens_per_s"] = 4000.0
    rows[0]["world_size"], rows[5]["world_size"] = 2, 4
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    run = compare_runs.load_run(str(d))
    assert compare_runs.tokens_per_s_per_gpu(run) == [1000.0] * 10
    rows[0].pop("world_size"), rows[5].pop("world_size")  # older runs: counted as one process
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    assert compare_runs.tokens_per_s_per_gpu(compare_runs.load_run(str(d)))[-1] == 4000.0


# ----------------------------------------------------------------------------- W&B runs


class FakeWandbRun:
    """What compare_runs reads of a wandb.apis.public.Run: id, name, config, scan_history()."""

    def __init__(self, run_id, name, config, history):
        self.id, self.name, self.config, self._history = run_id, name, config, history

    def scan_history(self, page_size=1000):
        return iter(self._history)


class FakeWandbApi:
    def __init__(self, runs, groups=None):
        self._runs, self._groups = runs, groups or {}

    def run(self, path):
        if path not in self._runs:
            raise LookupError(f"Could not find run {path}")
        return self._runs[path]

    def runs(self, path, filters=None):
        return [r for p, r in self._runs.items() if p.startswith(path + "/")
                and self._groups.get(p) == (filters or {}).get("group")]


def wandb_history(run_dir):
    """The W&B history megatron-moe-train's MetricsLogger writes beside metrics.jsonl: the same
    keys without "step" (W&B's _step), plus W&B's own _runtime/_timestamp, nulls dropped; a
    NaN where a key was not logged at that step (as W&B's history tables may show)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        h = {"_step": m.pop("step"), "_runtime": 1.0, "_timestamp": 1.7e9}
        h.update({k: v for k, v in m.items() if v is not None})
        h.setdefault("val_loss", float("nan"))
        out.append(h)
    return out


def test_wandb_specs_parse():
    p = compare_runs.parse_wandb_spec
    assert p("wandb:ent/proj/ab12cd34") == ("ent", "proj", "ab12cd34", None)
    assert p("wandb:ent/proj/runs/ab12cd34") == ("ent", "proj", "ab12cd34", None)
    assert p("wandb:ent/proj/groups/repro-xs") == ("ent", "proj", None, "repro-xs")
    assert p("https://wandb.ai/ent/proj/runs/ab12cd34/overview?nw=1") == ("ent", "proj", "ab12cd34", None)
    assert p("https://wandb.example.org/ent/proj/groups/repro-xs/workspace") == ("ent", "proj", None, "repro-xs")
    assert compare_runs.is_wandb_spec("https://wandb.ai/x") and not compare_runs.is_wandb_spec("runs/wandb:x")
    for bad in ("wandb:ent/proj", "wandb:ent/proj/runs", "https://wandb.ai/ent/proj/reports/r1/x"):
        with pytest.raises(ValueError, match="not a W&B run or group; expected wandb:ENTITY/PROJECT/RUN_ID"):
            p(bad)


def test_wandb_run_gives_the_table_of_its_run_directory(tmp_path):
    a = write_run(tmp_path, "dense", 2.0, 1000.0, [4.0, 3.0], repeat_step=3)
    b = write_run(tmp_path, "moe", 1.0, 2000.0, [3.5, 2.5], dropped=0.1)
    api = FakeWandbApi({f"ent/proj/id{d.name}": FakeWandbRun(f"id{d.name}", f"w-{d.name}",
                                                             yaml.safe_load((d / "config.yaml").read_text()),
                                                             wandb_history(d)) for d in (a, b)})
    from_dirs, t1 = compare_runs.summarize([compare_runs.load_run(str(a)), compare_runs.load_run(str(b))],
                                           "dense", None)
    runs = compare_runs.load_wandb_runs("wandb:ent/proj/iddense", api) + \
        compare_runs.load_wandb_runs("https://wandb.ai/ent/proj/runs/idmoe", api)
    assert [r.name for r in runs] == ["dense", "moe"]  # the config's name, not W&B's display name
    from_wandb, t2 = compare_runs.summarize(runs, "dense", None)
    assert t1 == t2 == 3.0 and from_wandb == from_dirs
    assert from_wandb[1]["time_to_target_speedup"] == pytest.approx(20.0 / 7.5)


def test_megatron_lm_run_from_wandb():
    """pretrain_gpt.py's keys: losses every step, iteration-time and throughput every 5 steps
    (--log-interval 5: the interval's mean), validation at steps 5 and 10; flat arguments."""
    history = []
    for step in range(1, 11):
        h = {"_step": step, "lm loss": 5.0 - 0.1 * step, "learning-rate": 1e-4, "batch-size": 8,
             "samples vs steps": 8 * step}
        if step % 5 == 0:
            h.update({"iteration-time": 2.0, "throughput": 123.0, "lm loss validation": 4.0 - step / 10})
        history.append(h)
    history.append({"_step": 10, "lm loss validation ppl": 20.0})  # a second record of step 10
    args = {"seq_length": 100, "global_batch_size": 8, "micro_batch_size": 4, "world_size": 2, "num_layers": 2}
    api = FakeWandbApi({"ent/proj/mlm1": FakeWandbRun("mlm1", "megatron-dense", args, history)})
    (run,) = compare_runs.load_wandb_runs("wandb:ent/proj/mlm1", api)
    assert run.name == "megatron-dense" and [m["step"] for m in run.steps] == list(range(1, 11))
    assert run.steps[9]["lm loss validation ppl"] == 20.0 and run.steps[9]["val_loss"] == 3.0
    assert [t for t, _ in compare_runs.wall_clock(run)] == pytest.approx([2.0 * s for s in range(1, 11)])
    (row,), target = compare_runs.summarize([run], None, 3.25)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(8 * 100 / 2.0 / 2)  # global batch x seq / time / GPUs
    assert row["tflops_per_gpu"] == 123.0 and row["micro_batch"] == 4 and row["final_val_loss"] == 3.0
    assert row["time_to_target_s"] == pytest.approx(15.0)  # 3.5 at 10 s, 3.0 at 20 s
    assert compare_runs.tokens_seen(run, run.steps[4]) == 5 * 8 * 100
    # a batch-size ramp-up: the logged samples and batch size win over the argument's global batch
    for h in history[:5]:
        h["batch-size"], h["samples vs steps"] = 4, 4 * h["_step"]
    for h in history[5:10]:
        h["samples vs steps"] = 20 + 8 * (h["_step"] - 5)
    (ramp,) = compare_runs.load_wandb_runs("wandb:ent/proj/mlm1", api)
    assert [m["tokens_per_s"] for m in ramp.steps] == [200.0] * 5 + [400.0] * 5
    assert compare_runs.tokens_seen(ramp, ramp.steps[4]) == 20 * 100 and ramp.steps[9]["consumed_samples"] == 60


def test_wandb_groups_and_errors(tmp_path):
    d = write_run(tmp_path, "moe", 1.0, 2000.0, [3.5, 2.5])
    cfg, hist = yaml.safe_load((d / "config.yaml").read_text()), wandb_history(d)
    api = FakeWandbApi({"ent/proj/r1": FakeWandbRun("r1", "x", cfg, hist),
                        "ent/proj/r2": FakeWandbRun("r2", "y", cfg, hist),
                        "ent/proj/r3": FakeWandbRun("r3", "z", {**cfg, "name": "dense"}, hist)},
                       groups={"ent/proj/r1": "g", "ent/proj/r2": "g", "ent/proj/r3": "h"})
    runs = compare_runs.load_wandb_runs("wandb:ent/proj/groups/g", api)
    assert [r.name for r in runs] == ["moe (r1)", "moe (r2)"]  # reruns of one config told apart
    with pytest.raises(ValueError, match="has no runs in group 'nope'"):
        compare_runs.load_wandb_runs("wandb:ent/proj/groups/nope", api)
    with pytest.raises(ValueError, match=r"wandb:ent/proj/r9: could not read it from W&B \(LookupError"):
        compare_runs.load_wandb_runs("wandb:ent/proj/r9", api)


def test_cli_reads_wandb_and_reports_errors_in_one_line(tmp_path):
    d = write_run(tmp_path, "moe", 1.0, 2000.0, [3.5, 2.5])
    e = write_run(tmp_path, "dense", 2.0, 1000.0, [4.0, 3.0])
    data = {"ent/proj/r1": {"name": "w", "config": yaml.safe_load((d / "config.yaml").read_text()),
                            "history": wandb_history(d), "group": "g"}}
    (tmp_path / "fake.json").write_text(json.dumps(data).replace("NaN", "null"))
    pkg = tmp_path / "fake" / "wandb"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import json, os\n"
        "class _Run:\n"
        "    def __init__(self, rid, d):\n"
        "        self.id, self.name, self.config, self._h = rid, d['name'], d['config'], d['history']\n"
        "    def scan_history(self, page_size=1000):\n"
        "        return iter(self._h)\n"
        "class Api:\n"
        "    def __init__(self, timeout=None):\n"
        "        self.data = json.load(open(os.environ['FAKE_WANDB']))\n"
        "    def run(self, path):\n"
        "        return _Run(path.split('/')[-1], self.data[path])\n"
        "    def runs(self, path, filters=None):\n"
        "        return [_Run(p.split('/')[-1], d) for p, d in self.data.items() if d['group'] == filters['group']]\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), FAKE_WANDB=str(tmp_path / "fake.json"))
    cli = [sys.executable, os.path.join(TOOLS, "compare_runs.py")]
    out = subprocess.run(cli + [str(e), "wandb:ent/proj/groups/g", "--baseline", "dense"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "| moe | 1,000 |" in out.stdout and "| dense | 500 |" in out.stdout
    for args, msg in (([str(tmp_path / "none")], "none: no metrics.jsonl"),
                      (["wandb:ent/proj/r7"], "wandb:ent/proj/r7: could not read it from W&B (KeyError"),
                      (["wandb:ent/proj"], "wandb:ent/proj: not a W&B run or group")):
        out = subprocess.run(cli + args, capture_output=True, text=True, env=env)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.startswith("compare_runs: error: ") and msg in out.stderr
        assert out.stderr.count("\n") == 1, out.stderr  # one line, no traceback
