"""Compare training runs: a table of throughput, memory and loss, and PNG plots.

    megatron-moe-compare-runs runs/gpt-xs runs/dmoe-xs runs/moe-xs --baseline gpt-xs
    megatron-moe-compare-runs runs/* --target-loss 3.5 --plots plots/ --markdown results/table.md
    megatron-moe-compare-runs runs/gpt-xs runs/dmoe-xs --baseline gpt-xs --target-loss baseline

    megatron-moe-compare-runs wandb:ENTITY/PROJECT/groups/repro-xs --baseline gpt-xs
    megatron-moe-compare-runs runs/dmoe-xs https://wandb.ai/ENTITY/PROJECT/runs/RUN_ID

(``python tools/compare_runs.py ...`` from a source checkout does the same.)

Each run is a run directory of ``megatron-moe-train`` (metrics.jsonl, or a gzipped
metrics.jsonl.gz as the committed results keep them, and config.yaml) or a W&B
run read through W&B's API (needs the network and access: ``wandb login`` or WANDB_API_KEY):
``wandb:ENTITY/PROJECT/RUN_ID``, ``wandb:ENTITY/PROJECT/groups/GROUP`` (every run of a group,
e.g. the reproduction's ``repro-xs``), or the run's or group's https URL. W&B runs of
``megatron-moe-train`` carry the same keys as metrics.jsonl; runs of Megatron-LM's own
``pretrain_gpt.py`` are read from its keys (``lm loss``, ``lm loss validation``, ``samples vs
steps``, ``batch-size``, and, with ``--log-timers-to-tensorboard --log-throughput``,
``iteration-time`` and ``throughput``; it writes W&B where it writes TensorBoard, so it needs
``--tensorboard-dir`` beside ``--wandb-project``) and its arguments (seq_length,
global_batch_size, micro_batch_size, world_size).

Printed per run: tokens/s per GPU and TFLOP/s per GPU (medians over the steps after the first 10%,
which hold compilation and autotuning), MFU, micro-batch, peak memory, the final validation
loss, the mean dropped-token fraction (capacity models), the wall time to reach the target
validation loss (linear interpolation between evaluations; default: the worst final validation
loss among the runs, so every run reaches it; ``--target-loss baseline``: the baseline's final
one, the paper's time to reach the dense model's loss) and the speed-ups against the baseline run
(throughput ratio, and time-to-target ratio). Wall time is the sum of the step times with the
first step counted as a median step: its compilation and Triton autotuning are a one-off
start-up (printed as "start-up (s)") that a few-minute run would otherwise count in full and a
real pretraining run would not notice.

Plots (``--plots DIR``, small PNGs, each titled with what it shows and the runs): validation loss
against wall time and against tokens, with the target loss as a horizontal line (and the
baseline's final loss when the target is another); training loss (lm_loss, a centred moving
average on long runs) against tokens and wall time; throughput bars; expert load (coefficient
of variation, mean over layers) over training, when a run logged it. Output folders are created
as needed; an output path that cannot be written is a one-line error (exit status 2).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field

import yaml


@dataclass
class Run:
    name: str
    path: str
    steps: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    def series(self, key: str) -> list[tuple[dict, float]]:
        return [(m, m[key]) for m in self.steps if isinstance(m.get(key), (int, float))]


def metrics_file(path: str) -> str:
    """A run directory's metrics.jsonl, else its gzipped copy metrics.jsonl.gz (committed results)."""
    for name in ("metrics.jsonl", "metrics.jsonl.gz"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise FileNotFoundError(f"{path}: no metrics.jsonl (is it a megatron-moe-train run directory?)")


def load_run(path: str) -> Run:
    metrics = metrics_file(path)
    steps = []
    try:
        with (gzip.open(metrics, "rt") if metrics.endswith(".gz") else open(metrics)) as f:
            for i, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    steps.append(json.loads(line))
                except json.JSONDecodeError:  # a run killed mid-line: keep what is complete
                    print(f"warning: {metrics}:{i}: skipping an incomplete line", file=sys.stderr)
    except EOFError:
        raise ValueError(f"{metrics}: the gzip file is truncated") from None
    cfg = {}
    cfg_path = os.path.join(path, "config.yaml")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = yaml.safe_load(f) or {}
    # a resumed run repeats the steps after its last checkpoint: keep the last record of each step
    by_step = {m["step"]: m for m in steps if "step" in m}
    ordered = [by_step[k] for k in sorted(by_step)]
    return Run(name=cfg.get("name") or os.path.basename(os.path.normpath(path)), path=path,
               steps=ordered, config=cfg)


# ---------------------------------------------------------------------------------------------
# W&B runs
# ---------------------------------------------------------------------------------------------

# Megatron-LM's W&B keys (training_log, evaluate_and_print_results) -> metrics.jsonl's
MEGATRON_LM_KEYS = {"lm loss": "lm_loss", "lm loss validation": "val_loss", "iteration-time": "step_time_s",
                    "throughput": "tflops_per_gpu", "grad-norm": "grad_norm", "learning-rate": "lr",
                    "samples vs steps": "consumed_samples"}


def is_wandb_spec(spec: str) -> bool:
    return spec.startswith("wandb:") or re.match(r"https?://", spec) is not None


def parse_wandb_spec(spec: str) -> tuple[str, str, str | None, str | None]:
    """(entity, project, run id, group) of ``wandb:ENTITY/PROJECT/RUN_ID``,
    ``wandb:ENTITY/PROJECT/runs/RUN_ID``, ``wandb:ENTITY/PROJECT/groups/GROUP`` or a W&B URL of a
    run or a group (https://HOST/ENTITY/PROJECT/runs/RUN_ID[/...], .../groups/GROUP[/...])."""
    if spec.startswith("wandb:"):
        path = spec[len("wandb:"):]
    else:
        path = re.sub(r"^https?://[^/]+/", "", spec)
    parts = [p for p in re.split(r"[?#]", path, maxsplit=1)[0].split("/") if p]
    if len(parts) == 3 and parts[2] not in ("runs", "groups"):
        return parts[0], parts[1], parts[2], None
    if len(parts) >= 4 and parts[2] in ("runs", "groups"):
        return (parts[0], parts[1], parts[3], None) if parts[2] == "runs" else (parts[0], parts[1], None, parts[3])
    raise ValueError(f"{spec}: not a W&B run or group; expected wandb:ENTITY/PROJECT/RUN_ID, "
                     f"wandb:ENTITY/PROJECT/groups/GROUP or the run's URL (https://wandb.ai/ENTITY/PROJECT/runs/RUN_ID)")


def load_wandb_runs(spec: str, api=None) -> list[Run]:
    """The W&B run, or every run of the W&B group, that ``spec`` names (parse_wandb_spec);
    ``api``: a ``wandb.Api()`` (made here when None)."""
    entity, project, run_id, group = parse_wandb_spec(spec)
    if api is None:
        try:
            import wandb
        except ImportError:
            raise ValueError(f"{spec}: reading W&B runs needs the wandb package: pip install wandb") from None
    try:
        if api is None:
            api = wandb.Api(timeout=60)
        found = ([api.run(f"{entity}/{project}/{run_id}")] if run_id else
                 list(api.runs(f"{entity}/{project}", filters={"group": group})))
        runs = [run_from_wandb(r, spec) for r in found]
    except Exception as e:
        raise ValueError(f"{spec}: could not read it from W&B ({type(e).__name__}: {e}); check the "
                         f"entity, project and run id or group, and that `wandb login` or WANDB_API_KEY "
                         f"gives access (reading W&B needs the network)") from e
    if not runs:
        raise ValueError(f"{spec}: the W&B project {entity}/{project} has no runs in group {group!r}")
    names = [r.name for r in runs]
    for r, wr in zip(runs, found):  # one group may hold reruns of one config: tell them apart
        if names.count(r.name) > 1:
            r.name = f"{r.name} ({wr.id})"
    return runs


def run_from_wandb(wrun, spec: str) -> Run:
    """A Run from a W&B public-API run: its history by step (later records of a step win, as
    in load_run), finite numbers only; Megatron-LM's keys translated (_megatron_lm_rows)."""
    config = dict(wrun.config or {})
    by_step: dict[int, dict] = {}
    for h in wrun.scan_history(page_size=10_000):
        step = h.get("_step")
        if not isinstance(step, int):
            continue
        row = by_step.setdefault(step, {"step": step})
        for k, v in h.items():
            if k.startswith("_") or v is None or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)) and not math.isfinite(v):
                continue
            row[k] = v
    steps = [by_step[k] for k in sorted(by_step)]
    name = config.get("name") if isinstance(config.get("name"), str) else None
    if any("lm loss" in m for m in steps) and not any("lm_loss" in m for m in steps):
        steps, config = _megatron_lm_rows(steps, config)
    return Run(name=name or wrun.name or wrun.id, path=spec, steps=steps, config=config)


def _megatron_lm_rows(rows: list[dict], args: dict) -> tuple[list[dict], dict]:
    """Megatron-LM's W&B history and arguments in metrics.jsonl's keys and config shape.
    ``iteration-time`` is logged every --log-interval steps as that interval's mean: every step of
    the interval gets it (rows are added for steps that logged nothing), so wall time and
    tokens/s (global batch x sequence / iteration time) count every step."""
    seq, gbs = args.get("seq_length"), args.get("global_batch_size")
    config = {"model": {"seq_length": seq},
              "train": {"micro_batch_size": args.get("micro_batch_size"), "global_batch_size": gbs}}
    by_step = {m["step"]: {MEGATRON_LM_KEYS.get(k, k): v for k, v in m.items()} for m in rows}
    prev = 0
    for step in sorted(by_step):
        t = by_step[step].get("step_time_s")
        if not isinstance(t, (int, float)):
            continue
        for s in range(prev + 1, step + 1):
            m = by_step.setdefault(s, {"step": s})
            m["step_time_s"] = t
            batch = m.get("batch-size", gbs)
            if seq and isinstance(batch, (int, float)) and t > 0:
                m["tokens_per_s"] = batch * seq / t
        prev = step
    out = [by_step[k] for k in sorted(by_step)]
    for m in out:  # "samples vs steps" where logged, else a constant global batch
        if gbs and not isinstance(m.get("consumed_samples"), (int, float)):
            m["consumed_samples"] = m["step"] * gbs
    if out and isinstance(args.get("world_size"), int):
        out[0]["world_size"] = args["world_size"]
    return out, config


def load_runs(specs: list[str]) -> list[Run]:
    """Run directories and W&B runs or groups, in the order given."""
    runs = []
    for spec in specs:
        if is_wandb_spec(spec):
            runs.extend(load_wandb_runs(spec))
        else:
            runs.append(load_run(spec))
    return runs


def _tokens_per_sample(run: Run) -> int | None:
    return (run.config.get("model") or {}).get("seq_length")


def _step_times(run: Run) -> list[float]:
    return [m["step_time_s"] for m in run.steps if isinstance(m.get("step_time_s"), (int, float))]


def startup_seconds(run: Run) -> float | None:
    """The first step's time beyond a median step's (compilation, autotuning): left out of the wall clock."""
    times = _step_times(run)
    if len(times) < 2:
        return None
    return max(times[0] - statistics.median(times[1:]), 0.0)


def wall_clock(run: Run) -> list[tuple[float, dict]]:
    """(seconds since the start, record): step_time_s summed, the start-up left out."""
    skip = startup_seconds(run) or 0.0
    t, out, first = 0.0, [], True
    for m in run.steps:
        if isinstance(m.get("step_time_s"), (int, float)):
            t += m["step_time_s"] - (skip if first else 0.0)
            first = False
        out.append((t, m))
    return out


def tokens_seen(run: Run, m: dict) -> float | None:
    seq = _tokens_per_sample(run)
    if seq and isinstance(m.get("consumed_samples"), (int, float)):
        return m["consumed_samples"] * seq
    return None


def tokens_per_s_per_gpu(run: Run) -> list[float]:
    """tokens_per_s (the whole job's) over the processes, step by step: ``world_size`` is logged
    with the first step of each start (a resume may change it); runs without it count as one."""
    world, out = 1, []
    for m in run.steps:
        if isinstance(m.get("world_size"), int) and m["world_size"] > 0:
            world = m["world_size"]
        if isinstance(m.get("tokens_per_s"), (int, float)):
            out.append(m["tokens_per_s"] / world)
    return out


def steady(values: list[float]) -> float | None:
    """Median after dropping the first 10% (at least one value when there are several)."""
    if not values:
        return None
    skip = max(1, len(values) // 10) if len(values) > 1 else 0
    return statistics.median(values[skip:])


def val_curve(run: Run) -> list[tuple[float, float | None, float]]:
    """(wall seconds, tokens, val_loss) at each evaluation."""
    return [(t, tokens_seen(run, m), m["val_loss"]) for t, m in wall_clock(run)
            if isinstance(m.get("val_loss"), (int, float))]


def time_to_loss(run: Run, target: float) -> float | None:
    """Wall seconds at which the validation loss first reaches ``target`` (interpolated)."""
    prev = None
    for t, _, v in val_curve(run):
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            (t0, v0) = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def summarize(runs: list[Run], baseline: str | None,
              target: float | str | None) -> tuple[list[dict], float | None]:
    """Rows of the table; ``target`` is a validation loss, None (the worst final one) or
    ``"baseline"`` (the baseline run's final one: the paper's "time to dense's loss")."""
    base_run = next((r for r in runs if r.name == baseline), None)
    if baseline and base_run is None:
        raise ValueError(f"--baseline {baseline!r} is not one of the runs: {[r.name for r in runs]}")
    finals = [val_curve(r)[-1][2] for r in runs if val_curve(r)]
    if target == "baseline":
        if base_run is None or not val_curve(base_run):
            raise ValueError(f"--target-loss baseline needs the baseline run's final validation loss: "
                             f"{baseline!r} has none")
        target = val_curve(base_run)[-1][2]
    elif target is None and finals:
        target = max(finals)
    rows = []
    for r in runs:
        vc = val_curve(r)
        row = dict(
            run=r.name,
            tokens_per_s_per_gpu=steady(tokens_per_s_per_gpu(r)),
            tflops_per_gpu=steady([v for _, v in r.series("tflops_per_gpu")]),
            mfu=steady([v for _, v in r.series("mfu")]),
            micro_batch=(r.config.get("train") or {}).get("micro_batch_size"),
            peak_mem_gb=max([v for _, v in r.series("peak_mem_gb")], default=None),
            final_val_loss=vc[-1][2] if vc else None,
            dropped_fraction=(statistics.mean([v for _, v in r.series("dropped_fraction")])
                              if r.series("dropped_fraction") else None),
            time_to_target_s=time_to_loss(r, target) if target is not None else None,
            startup_s=startup_seconds(r),
            steps=max([m.get("step", 0) for m in r.steps], default=0),
            data_epochs=max([v for _, v in r.series("data_epochs")], default=None),
        )
        rows.append(row)
    base = next((row for row in rows if row["run"] == baseline), None)
    for row in rows:
        row["throughput_speedup"] = (row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
                                     if base and row["tokens_per_s_per_gpu"] and base["tokens_per_s_per_gpu"] else None)
        row["time_to_target_speedup"] = (base["time_to_target_s"] / row["time_to_target_s"]
                                         if base and row["time_to_target_s"] and base["time_to_target_s"] else None)
    return rows, target


COLUMNS = [("run", "run", "{}"), ("tokens_per_s_per_gpu", "tokens/s/GPU", "{:,.0f}"),
           ("tflops_per_gpu", "TFLOP/s/GPU", "{:.1f}"), ("mfu", "MFU", "{:.1%}"),
           ("micro_batch", "micro-batch", "{}"), ("peak_mem_gb", "peak GB", "{:.1f}"),
           ("final_val_loss", "val loss", "{:.3f}"), ("dropped_fraction", "dropped", "{:.1%}"),
           ("time_to_target_s", "time to target (s)", "{:.0f}"), ("startup_s", "start-up (s)", "{:.0f}"),
           ("throughput_speedup", "throughput x", "{:.2f}"), ("time_to_target_speedup", "time-to-target x", "{:.2f}")]


def _fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return spec.format(v)


# shown when some run logged it (runs from before 2026-11-23 did not)
DATA_EPOCHS = ("data_epochs", "data epochs", "{:.2f}")


def markdown_table(rows: list[dict]) -> str:
    cols = COLUMNS + ([DATA_EPOCHS] if any(r.get("data_epochs") is not None for r in rows) else [])
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k), spec) for k, _, spec in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


PLOT_DPI = 90  # small PNGs (tens of KB): they are committed with the results


def smooth(values: list[float], points: int = 60) -> tuple[list[float], int]:
    """A centred moving average over ``window`` values (odd, about len/points; 1, i.e. none,
    for short series), the ends averaged over what exists: (smoothed, window)."""
    window = max(1, len(values) // points) | 1
    if window == 1:
        return list(values), 1
    half, out = window // 2, []
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out, window


def _to_palette(path: str, colors: int = 64) -> None:
    """Rewrite a PNG with a palette of ``colors`` (no dithering): a third of the bytes, the same
    picture for line plots. Left as it is where Pillow is missing."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def _run_names(runs: list[Run], width: int = 70) -> str:
    names = ", ".join(r.name for r in runs)
    return names if len(names) <= width else names[:width - 3] + "..."


def make_plots(runs: list[Run], rows: list[dict], out_dir: str, target: float | None = None,
               baseline: str | None = None) -> list[str]:
    """PNGs in ``out_dir`` (created): validation loss against wall time and tokens (``target``
    and the baseline run's final loss as horizontal lines), training loss, throughput, expert
    load (when logged). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name, title, shown=runs):
        fig.suptitle(f"{title}\n{_run_names(shown)}", fontsize=9)
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=PLOT_DPI)
        plt.close(fig)
        _to_palette(p)
        written.append(p)

    base_run = next((r for r in runs if r.name == baseline), None)
    base_final = val_curve(base_run)[-1][2] if base_run is not None and val_curve(base_run) else None
    finals = [val_curve(r)[-1][2] for r in runs if val_curve(r)]
    how = (f" ({baseline}'s final)" if target is not None and target == base_final else
           " (the worst final)" if finals and target == max(finals) else "")
    for xkey, xlabel, fname in ((0, "wall time (s)", "val_loss_vs_time.png"), (1, "tokens", "val_loss_vs_tokens.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            pts = [(p[xkey], p[2]) for p in val_curve(r) if p[xkey] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=r.name)
        if target is not None:
            ax.axhline(target, color="black", ls="--", lw=1, label=f"target {target:.3f}{how}")
        if base_final is not None and target != base_final:
            ax.axhline(base_final, color="gray", ls=":", lw=1, label=f"{baseline}'s final {base_final:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, fname, f"validation loss against {xlabel.split(' (')[0]}")

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), sharey=True)
    windows, tops, bottoms = set(), [], []
    for r in runs:
        clock = [(t, tokens_seen(r, m), m["lm_loss"]) for t, m in wall_clock(r)
                 if isinstance(m.get("lm_loss"), (int, float))]
        if not clock:
            continue
        losses, window = smooth([c[2] for c in clock])
        windows.add(window)
        tops.append(losses[len(losses) // 20])  # the first 5% (the initial drop) above the frame
        bottoms.append(min(losses))
        line, = axes[0].plot([c[0] for c in clock], losses, lw=1, label=r.name)
        tok = [(c[1], v) for c, v in zip(clock, losses) if c[1] is not None]
        if tok:
            axes[1].plot(*zip(*tok), lw=1, color=line.get_color(), label=r.name)
    if tops and max(tops) > min(bottoms):
        pad = 0.05 * (max(tops) - min(bottoms))
        axes[0].set_ylim(min(bottoms) - pad, max(tops) + pad)
    axes[0].set_xlabel("wall time (s)")
    axes[1].set_xlabel("tokens")
    axes[0].set_ylabel("training loss (lm_loss)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    smoothed = f", moving average of {max(windows)} steps" if windows and max(windows) > 1 else ""
    save(fig, "train_loss.png", f"training loss{smoothed}")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["run"] for r in rows], [r["tokens_per_s_per_gpu"] or 0 for r in rows], color="tab:blue")
    ax.set_ylabel("tokens/s per GPU")
    ax.tick_params(axis="x", rotation=30)
    save(fig, "throughput.png", "tokens/s per GPU (median)")

    fig, ax = plt.subplots(figsize=(6, 4))
    drew, windows = [], set()
    for r in runs:
        pts = []
        for m in r.steps:
            cvs = [v for k, v in m.items() if k.startswith("expert_load/") and k.endswith("/cv")
                   and isinstance(v, (int, float))]
            if cvs and "step" in m:
                pts.append((m["step"], statistics.mean(cvs)))
        if pts:
            cv, window = smooth([p[1] for p in pts])
            windows.add(window)
            ax.plot([p[0] for p in pts], cv, lw=1, label=r.name)
            drew.append(r)
    if drew:
        ax.set_xlabel("step")
        ax.set_ylabel("expert load CV (mean over layers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        smoothed = f", moving average of {max(windows)} steps" if max(windows) > 1 else ""
        save(fig, "expert_load.png", f"expert load: coefficient of variation of tokens per expert{smoothed}", drew)
    else:
        plt.close(fig)
    return written


def target_loss_arg(text: str) -> float | str:
    """--target-loss: a number, or 'baseline'."""
    if text == "baseline":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a validation loss (e.g. 3.5) "
                                         "or 'baseline'") from None


class OutputError(Exception):
    """An output path (--markdown, --json, --plots) that cannot be written: one line."""


def prepare_output(flag: str, path: str, is_dir: bool) -> None:
    """Create the folder ``path`` (is_dir) or the folder of the file ``path``, with its parents;
    OutputError with the reason when that is impossible or ``path`` is of the wrong kind."""
    folder = path if is_dir else (os.path.dirname(path) or ".")
    if not is_dir and os.path.isdir(path):
        raise OutputError(f"{flag} {path}: is a folder; expected a file name")
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{flag} {path}: {folder} exists and is not a folder") from None
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot create the folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{flag} {path}: the folder {folder} is not writable")


def write_output(flag: str, path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl), W&B runs or groups "
                    "(wandb:ENTITY/PROJECT/RUN_ID, wandb:ENTITY/PROJECT/groups/GROUP, or their URLs)")
    ap.add_argument("--baseline", help="run name the speed-ups are relative to (default: the first run)")
    ap.add_argument("--target-loss", type=target_loss_arg,
                    help="validation loss for time-to-target, or 'baseline' for the baseline run's final one "
                         "(default: the worst final)")
    ap.add_argument("--plots", help="write PNG plots into this directory")
    ap.add_argument("--markdown", help="write the table as Markdown into this file")
    ap.add_argument("--json", help="write the rows as JSON into this file")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.runs)
        rows, target = summarize(runs, args.baseline or runs[0].name, args.target_loss)
    except (OSError, ValueError) as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    try:
        for flag, path, is_dir in (("--markdown", args.markdown, False), ("--json", args.json, False),
                                   ("--plots", args.plots, True)):
            if path:
                prepare_output(flag, path, is_dir)
    except OutputError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(rows)
    print(table)
    if target is not None:
        how = " (the baseline's final)" if args.target_loss == "baseline" else ""
        print(f"\ntarget validation loss: {target:.3f}{how}; baseline: {args.baseline or runs[0].name}")
    try:
        if args.markdown:
            write_output("--markdown", args.markdown, table + "\n")
        if args.json:
            write_output("--json", args.json, json.dumps(dict(target_loss=target, rows=rows), indent=1))
        if args.plots:
            try:
                written = make_plots(runs, rows, args.plots, target, args.baseline or runs[0].name)
            except ImportError as e:
                raise OutputError(f"--plots {args.plots}: plotting needs matplotlib ({e}): "
                                  "pip install matplotlib") from None
            except OSError as e:
                raise OutputError(f"--plots {args.plots}: cannot write a plot there ({e.strerror or e})") from None
            for p in written:
                print("wrote", p)
    except OutputError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
