"""Training metrics: metrics.jsonl in the run directory, Weights & Biases, console lines.

Only rank 0 logs. Every step writes one JSON object per line to ``run_dir/metrics.jsonl``
(flushed at once) and the same keys to W&B::

    step, consumed_samples, tokens, lm_loss, aux_loss, z_loss, lr, grad_norm, tokens_per_s,
    tflops_per_gpu, mfu, step_time_s, peak_mem_gb, skipped_steps,
    expert_load/layerN/min_share, expert_load/layerN/max_share, expert_load/layerN/cv,
    expert_load/ep_rank_imbalance, expert_load/layerN/ep_rank_imbalance   (expert parallelism only)
    a2a_ms, a2a_fraction                           (expert parallelism only: GPU time in the token
                                                    all-to-alls, all layers, and its share of the step)
    dropped_fraction, dropped_fraction/layerN      (capacity models only)
    val_loss, val_ppl                              (evaluation steps only)
    world_size, data_train_tokens, data_epochs     (the first step of each start, resumes included)

Meanings: lm_loss is the mean token loss of the global batch; aux_loss (load balancing) and
z_loss are summed over the MoE layers, already times their coefficients, averaged over the
micro-batches and ranks; lr is the step's learning rate; grad_norm the global norm before
clipping; tokens_per_s counts the global batch over the step's wall time; tflops_per_gpu =
flops_per_token (megatron_moe/training/flops.py: forward + backward, as in the paper) x tokens_per_s /
GPUs; mfu = tflops_per_gpu / the GPU's dense bf16 peak (flops.peak_tflops); peak_mem_gb =
torch.cuda.max_memory_allocated in GB (1e9 bytes). Expert load: share of the step's
token->expert assignments (all ranks) per expert; cv = population std / mean of the counts;
ep_rank_imbalance = the busiest expert-parallel rank's assignments over the mean rank's (its
experts' counts summed; 1 = balanced, P = all on one of P ranks; the top-level key averages the
layers): under expert parallelism the other ranks wait for the busiest at every exchange.
``mfu`` and ``peak_mem_gb`` are null on the CPU; non-finite numbers are written as null.
W&B runs offline unless WANDB_API_KEY is set (or ``logging.wandb_mode: online``); its files go
under ``run_dir/wandb``; the run id is kept in ``run_dir/wandb_run_id`` so a resumed run
continues the same W&B run. Nothing here waits on the network: an online init that fails
falls back to no W&B with a warning.

    from megatron_moe.training.metrics import MetricsLogger
    log = MetricsLogger(cfg, run_dir, enabled=(rank == 0), resume_step=0)
    log.log({"lm_loss": 3.2, ...}, step=1)
    log.close()
"""
from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsLogger", "StepProfiler", "ep_rank_imbalance", "expert_load_stats", "format_line",
           "wandb_mode"]


def wandb_mode(setting: str) -> str:
    """'auto' -> 'online' when WANDB_API_KEY is set, else 'offline'; others unchanged."""
    if setting == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return setting


def expert_load_stats(tokens_per_expert_LE: torch.Tensor, names: list[str]) -> dict[str, float]:
    """Per MoE layer: min and max share of the assignments and the coefficient of variation
    (std / mean, population std) of the per-expert counts. 0 everywhere = perfectly balanced."""
    out: dict[str, float] = {}
    counts = tokens_per_expert_LE.detach().double().cpu()
    for name, c in zip(names, counts):
        total = float(c.sum())
        if total <= 0:
            continue
        share = c / total
        out[f"expert_load/{name}/min_share"] = float(share.min())
        out[f"expert_load/{name}/max_share"] = float(share.max())
        mean = c.mean()
        out[f"expert_load/{name}/cv"] = float(c.std(unbiased=False) / mean)
    return out


def ep_rank_imbalance(tokens_per_expert_LE: torch.Tensor, names: list[str], ep_size: int) -> dict[str, float]:
    """Per MoE layer: max over expert-parallel ranks of the assignments to that rank's experts
    (rank r holds the r-th contiguous block of E / ep_size experts) over their mean; and the
    mean over layers as ``expert_load/ep_rank_imbalance``. Empty when ep_size is 1."""
    if ep_size <= 1:
        return {}
    counts = tokens_per_expert_LE.detach().double().cpu()
    L, E = counts.shape
    if E % ep_size:
        raise ValueError(f"ep_rank_imbalance: {E} experts do not split over ep_size={ep_size} ranks")
    per_rank = counts.reshape(L, ep_size, E // ep_size).sum(-1)
    out: dict[str, float] = {}
    for name, r in zip(names, per_rank):
        if float(r.sum()) > 0:
            out[f"expert_load/{name}/ep_rank_imbalance"] = float(r.max() / r.mean())
    if out:
        out["expert_load/ep_rank_imbalance"] = sum(out.values()) / len(out)
    return out


def _clean(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def format_line(step: int, total: int, m: dict) -> str:
    """One console line: the numbers a person watches."""
    parts = [f"step {step}/{total}"]

    def add(key, fmt, label=None):
        v = m.get(key)
        if v is not None:
            parts.append(f"{label or key} {format(v, fmt)}")

    add("lm_loss", ".4f")
    add("aux_loss", ".4f", "aux")
    if m.get("z_loss"):
        add("z_loss", ".4f", "z")
    add("val_loss", ".4f")
    add("lr", ".2e")
    add("grad_norm", ".3f")
    add("tokens_per_s", ",.0f", "tok/s")
    add("tflops_per_gpu", ".3g", "TFLOP/s/gpu")
    add("mfu", ".1%", "MFU")
    add("step_time_s", ".3f", "s/step")
    add("a2a_ms", ".1f", "a2a ms")
    add("peak_mem_gb", ".1f", "mem GB")
    add("dropped_fraction", ".3f", "dropped")
    return " | ".join(parts)


class MetricsLogger:
    """metrics.jsonl + W&B for rank 0; every method is a no-op on other ranks."""

    def __init__(self, cfg, run_dir: str | Path, *, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = None
        self.wandb_run = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step > 0:
            self._truncate_after(resume_step)
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if cfg.logging.wandb:
            self.wandb_run = self._init_wandb(cfg, resume=resume_step > 0)

    def _truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (logged before a crash, redone after resume)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:
                continue  # a line cut short by the crash
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def _init_wandb(self, cfg, resume: bool):
        try:
            import wandb
        except ImportError:
            print("megatron-moe-train: note: logging.wandb is true but wandb is not installed: pip "
                  "install wandb (or \"megatron-moe[wandb]\"), or set logging.wandb=false; logging to "
                  f"{self.path} only", file=sys.stderr, flush=True)
            return None
        mode = wandb_mode(cfg.logging.wandb_mode)
        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if (resume and id_file.exists()) else None
        if run_id is None:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        kwargs = dict(project=cfg.logging.wandb_project, group=cfg.logging.wandb_group,
                      name=cfg.name, config=cfg.to_dict(), dir=str(self.run_dir), mode=mode,
                      id=run_id, resume="allow",
                      settings=wandb.Settings(silent=True, init_timeout=30))
        try:
            run = wandb.init(**kwargs)
        except Exception as e:  # never let logging stop a training run
            if mode == "offline":
                warnings.warn(f"wandb.init failed ({e}); continuing without W&B")
                return None
            warnings.warn(f"wandb.init online failed ({e}); logging offline instead")
            try:
                run = wandb.init(**{**kwargs, "mode": "offline"})
            except Exception as e2:
                warnings.warn(f"wandb.init offline failed too ({e2}); continuing without W&B")
                return None
        id_file.write_text(run_id + "\n")
        return run

    @property
    def wandb_dir(self) -> str | None:
        return None if self.wandb_run is None else getattr(self.wandb_run.settings, "sync_dir", None)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({k: v for k, v in row.items() if k != "step" and v is not None},
                                   step=int(step))
            except Exception as e:  # pragma: no cover - a W&B hiccup must not stop training
                print(f"warning: wandb.log failed at step {step}: {e}", file=sys.stderr)

    def summary(self, values: dict) -> None:
        if self.wandb_run is not None:
            for k, v in values.items():
                self.wandb_run.summary[k] = _clean(v)

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish(exit_code=exit_code)
            except Exception as e:  # pragma: no cover
                print(f"warning: wandb.finish failed: {e}", file=sys.stderr)
            self.wandb_run = None


class StepProfiler:
    """torch.profiler over one training step (``MEGATRON_MOE_PROFILE_STEP=N``, a diagnosis aid:
    kernel times, host gaps, NCCL waits). Writes ``profile_step{N}_rank{R}.txt`` (ops by GPU
    time, then by host time) and the Chrome trace ``profile_step{N}_rank{R}.json`` into the run
    directory."""

    def __init__(self, run_dir: str | Path, rank: int, device: torch.device):
        want = os.environ.get("MEGATRON_MOE_PROFILE_STEP", "")
        self.step = int(want) if want.isdigit() else None
        self.run_dir, self.rank, self.device = Path(run_dir), rank, device
        self._prof = None

    def start(self, step: int) -> None:
        if step != self.step:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()

    def finish(self, step: int) -> None:
        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        stem = self.run_dir / f"profile_step{step}_rank{self.rank}"
        ka = self._prof.key_averages()
        sort_gpu = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(f"{stem}.txt", "w") as f:
            f.write(ka.table(sort_by=sort_gpu, row_limit=40) + "\n")
            f.write(ka.table(sort_by="cpu_time_total", row_limit=25) + "\n")
        self._prof.export_chrome_trace(f"{stem}.json")
        self._prof = None
