"""Find the largest micro-batch that fits on the GPU for a config (the paper's Table 3 search).

    megatron-moe-find-micro-batch dmoe-xs                                    # one GPU
    megatron-moe-find-micro-batch moe-xs model.moe.capacity_factor=2 \\
        --json results/micro_batch/moe-xs-cf2.json
    megatron-moe-find-micro-batch gpt-small --nproc 8                        # torchrun, 8 GPUs
    megatron-moe-find-micro-batch dmoe-small --start 1                       # pure doubling
    megatron-moe-find-micro-batch my-configs/dmoe-xs-long.yaml               # a config file

A config is a shipped config's name (gpt-xs, dmoe-xs, moe-xs, gpt-small, dmoe-small, ...) or a
YAML file's path. From a source checkout ``python tools/find_micro_batch.py ...`` does the same.

Candidates are the powers of two that divide ``global_batch_size / data-parallel size`` (the
training program requires that division). The search starts at ``--start`` (default: the
config's ``train.micro_batch_size``, rounded down to a candidate) and gallops:

* the start fits  -> double until a size does not fit (or the largest candidate fits);
* the start OOMs  -> halve until a size fits (or even 1 does not: an error).

It assumes memory grows with the micro-batch (a size that fits means every smaller one fits),
so it needs |log2(answer / start)| + 2 trials at most. Each trial runs, in a subprocess::

    python -m megatron_moe.training --config CFG [overrides] train.micro_batch_size=M \\
        train.exit_interval=2 train.eval_interval=0 train.save_interval=0 train.log_interval=1 \\
        logging.wandb=false logging.runs_dir=SCRATCH name=mbs-probe-M

(``torchrun --standalone --nproc-per-node N -m megatron_moe.training ...`` with ``--nproc N``),
in the working directory it was started from, so relative paths in the overrides
(``data.paths=[...]``, ``data.cache_dir=...``) mean what they mean to the caller; the config
is passed as an absolute path. Two optimizer steps cover the steady-state peak: the AdamW
state exists from the first step on. The trial is stopped as soon as step 2 is in the scratch
run's metrics.jsonl, so the checkpoint that ``exit_interval`` would write (about 44 GB for
dmoe-small) is not waited for; the scratch directory is removed afterwards. Outcomes:

* ``fits``: step 2 was reached (its peak memory is recorded: ``peak_reserved_gb``, what the
  process held, CUDA graphs' pools included);
* ``oom``: the output holds "CUDA out of memory", "OutOfMemoryError" or another
  allocation failure (see ``OOM_PATTERNS``);
* anything else (config error, data error, a crash, a timeout) stops the search with that
  run's last output lines: it is not a memory limit, and going on would hide it.

The extra ``key=value`` overrides go to every trial: pass the same ones as the real run
(data, train_iters, capacity_factor ...) so the data cache they build is the one it uses.
Prints the trials and the answer; ``--json`` writes them. Exit status 0 when a size was
found, 1 when none fits or a trial failed otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

FITS, OOM, FAILED = "fits", "oom", "failed"

# Allocation failures: PyTorch's caching allocator ("torch.OutOfMemoryError: CUDA out of
# memory. Tried to allocate ..."), raw CUDA calls ("CUDA error: out of memory"), cuBLAS
# workspaces and NCCL buffers. Triton's "OutOfResources: out of resource: shared memory" is a
# kernel configuration problem, not a batch-size one: it is not matched.
OOM_PATTERNS = [
    re.compile(r"CUDA out of memory", re.I),
    re.compile(r"OutOfMemoryError"),
    re.compile(r"CUDA error: out of memory", re.I),
    re.compile(r"CUBLAS_STATUS_ALLOC_FAILED"),
    re.compile(r"Cuda failure '?out of memory'?", re.I),
    re.compile(r"cudaErrorMemoryAllocation"),
]


class SearchError(RuntimeError):
    """No micro-batch could be chosen; the message says why and what to do."""


@dataclass
class Trial:
    micro_batch_size: int
    outcome: str                 # fits | oom | failed
    seconds: float = 0.0
    peak_mem_gb: float | None = None
    detail: str = ""             # failed: the last output lines; oom: the matching line


@dataclass
class SearchResult:
    micro_batch_size: int
    candidates: list[int]
    trials: list[Trial] = field(default_factory=list)


# ----------------------------------------------------------------------------- search


def candidate_sizes(global_batch_size: int, data_parallel_size: int = 1) -> list[int]:
    """Powers of two dividing global_batch_size / data_parallel_size, ascending."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} is invalid: expected an int >= 1")
    if data_parallel_size < 1 or global_batch_size % data_parallel_size:
        raise ValueError(f"data-parallel size {data_parallel_size} is invalid: expected an int >= 1 "
                         f"that divides train.global_batch_size ({global_batch_size})")
    per_rank = global_batch_size // data_parallel_size
    out, m = [], 1
    while m <= per_rank and per_rank % m == 0:
        out.append(m)
        m *= 2
    return out


def classify(returncode: int | None, output: str, reached_step2: bool) -> tuple[str, str]:
    """(outcome, detail) of one trial from its exit status, output and progress.

    An allocation failure anywhere in the output means ``oom`` even if a later line says
    something else (torchrun wraps the child's traceback in its own error). Reaching step 2
    without one means ``fits`` (the trial may have been stopped by us: any exit status).
    """
    for line in output.splitlines():
        if any(p.search(line) for p in OOM_PATTERNS):
            return OOM, line.strip()[:300]
    if reached_step2:
        return FITS, ""
    tail = "\n".join(output.strip().splitlines()[-15:])
    return FAILED, f"exit status {returncode}: {tail}" if tail else f"exit status {returncode}, no output"


def search(candidates: list[int], run_one: Callable[[int], Trial], start: int | None = None,
           log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """Largest candidate for which ``run_one`` says ``fits``, by galloping from ``start``.

    ``candidates`` ascending; ``start`` defaults to the largest candidate and is rounded down
    to a candidate. Raises SearchError when even the smallest candidate runs out of memory or
    a trial fails for another reason.
    """
    if not candidates:
        raise SearchError("no candidate micro-batch sizes")
    cands = sorted(set(candidates))
    if start is None:
        i = len(cands) - 1
    else:
        below = [j for j, c in enumerate(cands) if c <= start]
        i = below[-1] if below else 0
    trials: list[Trial] = []

    def attempt(j: int) -> bool:
        t = run_one(cands[j])
        trials.append(t)
        mem = f", peak {t.peak_mem_gb:.1f} GB" if t.peak_mem_gb is not None else ""
        log(f"micro_batch_size={cands[j]}: {t.outcome} ({t.seconds:.0f} s{mem})"
            + (f": {t.detail.splitlines()[0]}" if t.outcome == OOM and t.detail else ""))
        if t.outcome == FAILED:
            raise SearchError(f"micro_batch_size={cands[j]} failed for a reason other than memory "
                              f"(fix that first; its output ends with):\n{t.detail}")
        if t.outcome not in (FITS, OOM):
            raise SearchError(f"run_one returned outcome {t.outcome!r}: expected {FITS!r}, {OOM!r} "
                              f"or {FAILED!r}")
        return t.outcome == FITS

    if attempt(i):
        best = i
        while best + 1 < len(cands) and attempt(best + 1):
            best += 1
    else:
        best = i - 1
        while best >= 0 and not attempt(best):
            best -= 1
        if best < 0:
            raise SearchError(f"no micro-batch fits: even micro_batch_size={cands[0]} runs out of "
                              "memory; use more GPUs (expert parallelism: "
                              "model.moe.expert_parallel_size) or a smaller model")
    return SearchResult(cands[best], cands, trials)


# ----------------------------------------------------------------------------- one trial


def _steps_logged(metrics: Path) -> tuple[int, float | None]:
    """(last complete step in metrics.jsonl, highest peak_reserved_gb, else peak_mem_gb) of a scratch run."""
    last, peak = 0, None
    try:
        text = metrics.read_text()
    except OSError:
        return 0, None
    for line in text.splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        last = max(last, int(m.get("step", 0)))
        # what the process held (CUDA graphs' pools included); allocated where a run has no such key
        held = m.get("peak_reserved_gb", m.get("peak_mem_gb"))
        if isinstance(held, (int, float)):
            peak = held if peak is None else max(peak, held)
    return last, peak


def trial_command(config: str, overrides: list[str], micro: int, runs_dir: str, nproc: int) -> list[str]:
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                f"--nproc-per-node={nproc}"]
    else:
        head = [sys.executable]
    return head + ["-m", "megatron_moe.training", "--config", config, *overrides,
                   f"train.micro_batch_size={micro}", "train.exit_interval=2", "train.eval_interval=0",
                   "train.save_interval=0", "train.log_interval=1", "logging.wandb=false",
                   f"logging.runs_dir={runs_dir}", f"name=mbs-probe-{micro}"]


def make_subprocess_runner(config: str, overrides: list[str], nproc: int = 1, timeout_s: float = 1200,
                           scratch_parent: str | None = None, keep_log: Callable[[int, str], None] | None = None
                           ) -> Callable[[int], Trial]:
    """A ``run_one`` that trains 2 steps in a subprocess in a scratch run directory (the
    subprocess runs in the current working directory)."""

    def run_one(micro: int) -> Trial:
        scratch = tempfile.mkdtemp(prefix=f"find-mb-{micro}-", dir=scratch_parent)
        cmd = trial_command(config, overrides, micro, scratch, nproc)
        metrics = Path(scratch) / f"mbs-probe-{micro}" / "metrics.jsonl"
        log_path = Path(scratch) / "output.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true")
        t0 = time.time()
        reached, peak, rc = False, None, None
        try:
            with open(log_path, "w") as out:
                proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # its own group: torchrun's children too
                try:
                    while True:
                        rc = proc.poll()
                        step, peak = _steps_logged(metrics)
                        if step >= 2:
                            reached = True
                            break
                        if rc is not None:
                            break
                        if time.time() - t0 > timeout_s:
                            break
                        time.sleep(0.5)
                finally:
                    if proc.poll() is None:  # step 2 reached (skip the checkpoint) or timed out
                        os.killpg(proc.pid, signal.SIGTERM)
                        try:
                            proc.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            os.killpg(proc.pid, signal.SIGKILL)
                            proc.wait()
                    rc = proc.returncode if rc is None else rc
            output = log_path.read_text(errors="replace")
            if keep_log is not None:
                keep_log(micro, output)
            outcome, detail = classify(rc, output, reached)
            if outcome == FAILED and not reached and time.time() - t0 > timeout_s:
                detail = f"timed out after {timeout_s:.0f} s (--timeout)\n{detail}"
            return Trial(micro, outcome, time.time() - t0, peak, detail)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return run_one


# ----------------------------------------------------------------------------- CLI


def _load(config: str, overrides: list[str], prog: str = "find_micro_batch.py"):
    from megatron_moe.megatron.yaml_config import find_config
    from megatron_moe.training.run_config import ConfigError, load_config

    try:
        path = find_config(config).resolve()
        return str(path), load_config(path, overrides)
    except ConfigError as e:
        raise SystemExit(f"{prog}: config error: {str(e).replace('--config ', 'config ', 1)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Largest power-of-two micro-batch that trains 2 steps without running out of "
                    "GPU memory (each candidate in a subprocess, in this working directory).",
        epilog="Overrides (key=value) go to every trial, e.g. model.moe.capacity_factor=1.5.\n\n"
               "examples:\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="config name (e.g. dmoe-xs, one of the shipped configs) or a YAML file")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ap.add_argument("--nproc", type=int, default=int(os.environ.get("NPROC", "1") or 1),
                    help="GPUs = data-parallel size; >1 runs under torchrun (default $NPROC or 1)")
    ap.add_argument("--start", type=int, help="first size tried (default: the config's micro_batch_size)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per trial (default 1200)")
    ap.add_argument("--scratch", help="parent folder of the scratch run directories (default: the "
                                      "system temp folder)")
    ap.add_argument("--json", help="write the result and the trials into this file")
    args = ap.parse_intermixed_args(argv)
    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc} is invalid: expected an int >= 1 (the number of GPUs)")
    if args.start is not None and args.start < 1:
        ap.error(f"--start {args.start} is invalid: expected an int >= 1")
    if args.timeout <= 0:
        ap.error(f"--timeout {args.timeout} is invalid: expected seconds > 0")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"override {bad[0]!r} is invalid: expected key=value, e.g. train.train_iters=60")

    config, cfg = _load(args.config, args.overrides, ap.prog)
    gbs = cfg.train.global_batch_size
    try:
        cands = candidate_sizes(gbs, args.nproc)
    except ValueError as e:
        ap.error(f"--nproc: {e}")
    start = args.start if args.start is not None else cfg.train.micro_batch_size
    print(f"{cfg.name}: global batch {gbs}, {args.nproc} GPU(s), candidates {cands}, start {start}",
          file=sys.stderr, flush=True)
    runner = make_subprocess_runner(config, args.overrides, args.nproc, args.timeout, args.scratch)
    try:
        res = search(cands, runner, start, log=lambda s: print("  " + s, file=sys.stderr, flush=True))
    except SearchError as e:
        print(f"{ap.prog}: {cfg.name}: {e}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        device = None
        try:
            import torch

            device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 - informative only
            pass
        Path(args.json).write_text(json.dumps({
            "config": config, "name": cfg.name, "overrides": args.overrides,
            "global_batch_size": gbs, "data_parallel_size": args.nproc,
            "micro_batch_size": res.micro_batch_size, "candidates": res.candidates,
            "device": device, "date": time.strftime("%Y-%m-%d"),
            "trials": [asdict(t) for t in res.trials]}, indent=1) + "\n")
    print(f"{cfg.name}: largest micro-batch that fits: {res.micro_batch_size} "
          f"({len(res.trials)} trials)", file=sys.stderr)
    print(res.micro_batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
