"""The first training step's time (tuning, compilation) of a config in fresh processes, with and
without the tuned configs kept on disk (kernels/tuning.py) and Triton's compilation cache.

    python3 benchmarks/first_step.py --out $OUT [--config dmoe-xs] [--runs fresh,shipped,warm] [overrides ...]

Four runs of two steps each (global batch 64, the built-in corpus; micro-batch 32, or the
config's where it is smaller: dmoe-small's 16, the size that fits an 80 GB GPU):

  fresh         empty Triton cache, empty tuning folder, kernels/tuned/ not read: a fresh machine
                without shipped tables
  shipped       empty Triton cache, the tuning folder of 'fresh': a fresh machine with tables
                shipped in kernels/tuned/
  warm          the Triton cache and tuning folder of 'fresh': a later run on the same machine
  warm-untuned  the Triton cache of 'fresh', tuning not kept (MEGATRON_MOE_TUNING_CACHE=0):
                a later run before kernels/tuning.py

Prints the first and second step's seconds per run (a failed run's last log lines after the
table); copies the tuning file to --out (to ship it: kernels/tuned/<its name>).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def command(config: str, overrides: list[str], runs: Path) -> list[str]:
    """The trainer's command line for one run: two steps of global batch 64 at micro-batch 32, or
    the config's (after the overrides) where that is smaller; the overrides last, so they win."""
    from megatron_moe.training.run_config import load_config

    micro = min(32, load_config(config, overrides).train.micro_batch_size)
    return [sys.executable, "-m", "megatron_moe.training", "--config", config, "logging.wandb=false",
            f"logging.runs_dir={runs}", "train.global_batch_size=64", f"train.micro_batch_size={micro}",
            "train.train_iters=2", "train.lr_warmup_iters=1", "train.eval_interval=0", "train.save_final=false",
            "train.log_interval=1", "data.default_corpus_mb=4", "data.cache_dir=/tmp/first-step-data", *overrides]


def run(name: str, config: str, overrides: list[str], env: dict, out: Path) -> dict:
    runs = Path(f"/tmp/first-step-runs/{name}")
    shutil.rmtree(runs, ignore_errors=True)
    cmd = command(config, overrides, runs)
    t0 = time.time()
    with open(out / f"first_step_{name}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=900).returncode
    rows = [json.loads(line) for p in runs.glob("*/metrics.jsonl") for line in p.read_text().splitlines()]
    steps = {r["step"]: r.get("step_time_s") for r in rows if "step" in r}
    log_lines = (out / f"first_step_{name}.log").read_text().splitlines()
    tuned = sum(line.startswith("megatron-moe: tuned") for line in log_lines)
    # a failed run's last lines (the trainer's one-line error, or a traceback's end) in the result
    # and the printed table: the per-run logs may not come back from a GPU machine
    tail = [line.strip() for line in log_lines if line.strip()][-3:] if rc else []
    return {"name": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "step1_s": steps.get(1),
            "step2_s": steps.get(2), "tuned_lines": tuned, "error": " | ".join(tail)[-600:] or None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device_out")))
    ap.add_argument("--config", default="dmoe-xs")
    ap.add_argument("--runs", default="fresh,shipped,warm,warm-untuned", help="which of the four runs, in order")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path("/tmp/first-step")
    shutil.rmtree(root, ignore_errors=True)
    caches = {n: root / f"triton-{n}" for n in ("fresh", "shipped")}
    tuning = root / "tuning"
    plan = [("fresh", {"TRITON_CACHE_DIR": str(caches["fresh"]), "MEGATRON_MOE_TUNING_CACHE": str(tuning),
                       "MEGATRON_MOE_TUNING_SHIPPED": "0"}),
            ("shipped", {"TRITON_CACHE_DIR": str(caches["shipped"]), "MEGATRON_MOE_TUNING_CACHE": str(tuning)}),
            ("warm", {"TRITON_CACHE_DIR": str(caches["fresh"]), "MEGATRON_MOE_TUNING_CACHE": str(tuning)}),
            ("warm-untuned", {"TRITON_CACHE_DIR": str(caches["fresh"]), "MEGATRON_MOE_TUNING_CACHE": "0"})]
    results = []
    for name, env in plan:
        if name not in args.runs.split(","):
            continue
        results.append(run(name, args.config, args.overrides, env, args.out))
        print(results[-1], flush=True)
    for f in tuning.glob("*.json"):
        shutil.copy(f, args.out / f.name)
    (args.out / "first_step.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.config}: first step in fresh processes\n"
          "| run | step 1 s | step 2 s | tuned launches |\n|---|---|---|---|")
    for r in results:
        s1 = "-" if r["step1_s"] is None else f"{r['step1_s']:.1f}"
        s2 = "-" if r["step2_s"] is None else f"{r['step2_s']:.2f}"
        print(f"| {r['name']}{' (failed)' if r['rc'] else ''} | {s1} | {s2} | {r['tuned_lines']} |")
    for r in results:
        if r["rc"]:
            print(f"{r['name']} failed (rc {r['rc']}): {r['error']}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
