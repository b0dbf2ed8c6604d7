"""The trainer run as a subprocess on a tiny config: helpers of the tests that run it as a user does.

    sys.path.insert(0, str(Path(__file__).parent))        # in a test module of this folder
    from _trainer import read_metrics, run_trainer, tiny_args

Shared by test_train.py, test_faults.py, test_run_lock.py and test_resume_changes.py: the command
(``python -m megatron_moe.training``, or _hooked_train.py with fault hook flags; either under
torchrun), an environment without the caller's TRITON_INTERPRET, W&B, distributed and debug
variables, the run's metrics.jsonl rows, the work directory's corpus, and the overrides that
shrink configs/tiny-cpu.yaml (seq 64, global batch 8, a 512-piece tokenizer on that corpus).
Each test file adds its own schedule and intervals, timeout and thread count.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.yaml"
HOOKED = Path(__file__).with_name("_hooked_train.py")

# inherited from the test's own environment, these would change the run (TRITON_INTERPRET: the
# kernels' slow interpreter; the distributed ones: a torchrun the test did not start; the debug
# switches: tracebacks and finiteness checks; SLURM_JOB_ID: the run lock's requeue rule)
_DROPPED = ("TRITON_INTERPRET", "WANDB_API_KEY", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT", "WANDB_MODE", "MEGATRON_MOE_DEBUG", "MEGATRON_MOE_CHECK_FINITE", "SLURM_JOB_ID")


def trainer_env(**extra: str) -> dict:
    """This process's environment without the variables above, unbuffered, W&B silent, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    env.update(PYTHONUNBUFFERED="1", WANDB_SILENT="true", **extra)
    return env


def trainer_cmd(args: list[str], hooks: list[str] | None = None, nproc: int | None = None) -> list[str]:
    """``python -m megatron_moe.training ARGS``; with ``hooks`` (e.g. ["--bf16-on-cpu"], or [] for
    none) ``python _hooked_train.py HOOKS -- ARGS``; with ``nproc``, either under
    ``torch.distributed.run --standalone``."""
    prog = ["-m", "megatron_moe.training"] if hooks is None else [str(HOOKED), *hooks, "--"]
    head = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*head, *prog, *args]


def run_trainer(args: list[str], *, nproc: int | None = None, check: bool = True, timeout: int = 300,
                hooks: list[str] | None = None, **env: str) -> subprocess.CompletedProcess:
    """trainer_cmd(args, hooks, nproc) run to the end in the repository with trainer_env(**env),
    its output captured; with ``check``, a failed run raises AssertionError with its output's tails."""
    cmd = trainer_cmd(args, hooks, nproc)
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir: Path, *, tolerant: bool = False) -> list[dict]:
    """The rows of ``run_dir``/metrics.jsonl. For a run that is being watched or was killed,
    ``tolerant``: no file yet is no rows and a line cut short by a kill is skipped; otherwise
    either is an error (a finished run has the file, every line whole)."""
    path = run_dir / "metrics.jsonl"
    if tolerant and not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            if not tolerant:
                raise
    return rows


def tiny_workdir(root: Path, small_corpus, *, total_chars: int, max_file_chars: int) -> Path:
    """``root`` with a corpus of stdlib sources in root/corpus, where tiny_args reads it
    (``small_corpus``: the fixture of tests/conftest.py); returns ``root``."""
    small_corpus(root / "corpus", total_chars=total_chars, max_file_chars=max_file_chars)
    return root


def tiny_args(workdir: Path, name: str, *extra: str) -> list[str]:
    """The CLI arguments of run ``name``: configs/tiny-cpu.yaml at seq 64, micro-batch 4, global
    batch 8, a 512-piece tokenizer on ``workdir``/corpus (split 90/10/0; prepared data cached in
    ``workdir``/cache), runs under ``workdir``/runs; then ``extra``."""
    return ["--config", str(TINY), f"name={name}", f"data.paths=[{workdir / 'corpus'}]",
            "data.tokenizer_vocab_size=512", f"data.cache_dir={workdir / 'cache'}", "data.split='90,10,0'",
            "model.vocab_size=512", "model.seq_length=64", "train.micro_batch_size=4",
            "train.global_batch_size=8", f"logging.runs_dir={workdir / 'runs'}", *extra]
