"""Training metrics: metrics.jsonl in the run directory, Weights & Biases, console lines.

Only rank 0 logs. Every step writes one JSON object per line to ``run_dir/metrics.jsonl``
(flushed at once) and the same keys to W&B::

    step, consumed_samples, tokens, lm_loss, aux_loss, z_loss, lr, grad_norm, tokens_per_s,
    tflops_per_gpu, mfu, step_time_s, peak_mem_gb, peak_reserved_gb, skipped_steps,
    expert_load/layerN/min_share, expert_load/layerN/max_share, expert_load/layerN/cv,
    expert_load/ep_rank_imbalance, expert_load/layerN/ep_rank_imbalance   (expert parallelism only)
    a2a_ms, a2a_fraction                           (expert parallelism only: GPU time in the token
                                                    all-to-alls, all layers, and its share of the step)
    a2a_gb, a2a_gb_per_s                           (expert parallelism only: GB each rank received
                                                    from the other ranks of its group in the step's
                                                    token exchanges; over a2a_ms, where measured)
    dropped_fraction, dropped_fraction/layerN      (capacity models only)
    val_loss, val_ppl                              (evaluation steps only)
    world_size, data_train_tokens, data_epochs     (the first step of each start, resumes included)
    config_changes                                 (the first step after a resume with a changed config:
                                                    {key: [old, new]})

Meanings: lm_loss is the mean token loss of the global batch; aux_loss (load balancing) and
z_loss are summed over the MoE layers, already times their coefficients, averaged over the
micro-batches and ranks; lr is the step's learning rate; grad_norm the global norm before
clipping; tokens_per_s counts the global batch over the step's wall time; tflops_per_gpu =
flops_per_token (megatron_moe/training/flops.py: forward + backward, as in the paper) x tokens_per_s /
GPUs; mfu = tflops_per_gpu / the GPU's dense bf16 peak (flops.peak_tflops); peak_mem_gb =
torch.cuda.max_memory_allocated in GB (1e9 bytes), peak_reserved_gb = torch.cuda.max_memory_reserved:
what the process has held on the GPU, CUDA graphs' memory pools included (a graph keeps its
pool when its tensors are freed, so under ``train.cuda_graphs`` this, not peak_mem_gb, is what
must fit). Expert load: share of the step's
token->expert assignments (all ranks) per expert; cv = population std / mean of the counts;
ep_rank_imbalance = the busiest expert-parallel rank's assignments over the mean rank's (its
experts' counts summed; 1 = balanced, P = all on one of P ranks; the top-level key averages the
layers): under expert parallelism the other ranks wait for the busiest at every exchange.
a2a_gb counts the four exchanges of every MoE layer and micro-batch (dispatch and combine, forward
and backward), averaged over the ranks: the valid rows for ``a2a_splits`` host and symmetric, the
whole blocks for padded (which sends those); a2a_gb_per_s divides it by a2a_ms, which holds the
waits for other ranks too (eager runs only: a CUDA graph's exchanges are not timed; the profile's
exchange kernels are, ``megatron-moe-rank-timelines``).
``mfu``, ``peak_mem_gb`` and ``peak_reserved_gb`` are null on the CPU; non-finite numbers are written as null.
W&B (``WandbRun``): ``logging.wandb_mode: auto`` runs online when W&B has credentials
(WANDB_API_KEY or a ``wandb login``), else offline, and says which and why in one console line;
its files go under ``run_dir/wandb``; a resumed run continues the same W&B run without logging a
step twice; the console names the run's URL, or the offline folders and the ``wandb sync``
command that uploads them, at the start and at the end. Nothing here waits long on the network:
an online init that fails or takes over 15 s falls back to offline with a one-line warning.

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
import shlex
import string
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsLogger", "StepProfiler", "WandbRun", "a2a_gb", "a2a_rows_sent", "ep_rank_imbalance",
           "expert_load_stats", "format_line", "wandb_credentials", "wandb_mode"]

PROG = "megatron-moe-train"


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


def a2a_rows_sent(tokens_per_expert_LE: torch.Tensor, ep_size: int, ep_rank: int) -> torch.Tensor:
    """This rank's assignments to experts on the other ranks of its expert-parallel group, summed over
    the layers, from its own (not yet reduced) [L, E] counts: a 0-dim tensor on their device (no
    host read). Summed over the ranks it is every rank's rows received as well."""
    El = tokens_per_expert_LE.shape[1] // ep_size
    return tokens_per_expert_LE.sum() - tokens_per_expert_LE[:, ep_rank * El:(ep_rank + 1) * El].sum()


def a2a_gb(rows_sent_all_ranks: float, world_size: int, row_bytes: int, *, padded_rows: int | None = None) -> float:
    """GB each rank receives from the others in a step's token exchanges (module docstring): four
    exchanges carry each assignment that leaves its rank (there and back, forward and backward), so
    4 x the rows sent, averaged over the ranks; ``padded_rows``: the rows a padded exchange carries
    from other ranks per exchange, summed over the step's exchanges of one kind (they travel whole)."""
    rows = 4 * (padded_rows if padded_rows is not None else rows_sent_all_ranks / world_size)
    return rows * row_bytes / 1e9


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
    add("peak_reserved_gb", ".1f", "reserved GB")
    add("dropped_fraction", ".3f", "dropped")
    return " | ".join(parts)


class MetricsLogger:
    """metrics.jsonl + W&B for rank 0; every method is a no-op on other ranks."""

    def __init__(self, cfg, run_dir: str | Path, *, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = None
        self.wandb: WandbRun | None = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step > 0:
            self._truncate_after(resume_step)
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if cfg.logging.wandb:
            self.wandb = WandbRun.start(cfg, self.run_dir, resume_step)

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

    @property
    def wandb_dir(self) -> str | None:
        """This start's W&B folder (run_dir/wandb/run-* or offline-run-*), None without W&B."""
        return None if self.wandb is None else self.wandb.sync_dir

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, int(step))

    def summary(self, values: dict) -> None:
        if self.wandb is not None:
            self.wandb.summary({k: _clean(v) for k, v in values.items()})

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb is not None:
            self.wandb.finish(exit_code)
            self.wandb = None


# ----------------------------------------------------------------------------- Weights & Biases


def wandb_credentials() -> str | None:
    """Where W&B would take credentials from, or None: WANDB_API_KEY (or
    WANDB_IDENTITY_TOKEN_FILE), else a login stored by ``wandb login`` (the netrc entry for the
    W&B host, or an ``api_key`` in wandb's settings files).

    The stored login is found by wandb's own lookup (``wbauth.authenticate_session``, what
    wandb.init and wandb.login run before they send anything), with prompting and session
    updates off: it reads the environment and files only, no network call and no writes. A key
    is not verified here; a wrong one fails the online init, which then falls back to offline."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(var):
            return var
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        host = wandb_setup.singleton().settings.base_url
        found = wbauth.authenticate_session(host=host, source=PROG, prompt=False, update_session=False)
    except Exception:  # a malformed netrc or key, another wandb version: no usable login
        return None
    return "the login stored by `wandb login`" if found is not None else None


def wandb_mode(setting: str) -> tuple[str, str]:
    """(mode, why) for ``logging.wandb_mode``: 'auto' is 'online' when W&B has credentials
    (``wandb_credentials``), else 'offline'; 'online' and 'offline' are taken as they are."""
    if setting != "auto":
        return setting, f"logging.wandb_mode={setting}"
    source = wandb_credentials()
    if source:
        return "online", f"logging.wandb_mode=auto and W&B credentials from {source}"
    return "offline", ("logging.wandb_mode=auto and no W&B credentials; set WANDB_API_KEY or run "
                       "`wandb login` to log online")


def _say(message: str) -> None:
    print(f"W&B: {message}", flush=True)


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _shown(path: str | Path) -> str:
    """``path`` relative to the working directory where it lies below it, shell-quoted."""
    path = Path(path).resolve()
    try:
        path = path.relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return shlex.quote(str(path))


class WandbRun:
    """The W&B run of a run directory (rank 0), continued by every resume, one row per step.

    The run id is kept in ``run_dir/wandb_run_id``; the last step given to W&B in
    ``run_dir/wandb_last_step`` ("ID STEP", rewritten atomically after each logged step). A run
    resumes from its last checkpoint, so the steps after it that were logged before a crash are
    run again: they are not logged to W&B again (only to metrics.jsonl, which was cut back to the
    checkpoint). W&B history cannot be rewritten, and the alternatives duplicate or fail:

    * offline, each wandb.init makes a new ``offline-run-*`` folder (wandb 0.31 refuses to reuse
      one), and ``wandb sync`` uploads the folders of one run id one after another in order of
      start time, appending their rows: redone steps would be uploaded twice;
    * online, wandb ignores a step below the run's current one, with a warning for each;
    * rewinding (``resume_from="ID?_step=N"``) replaces rows, but the server does it at an online
      init: an offline init only notes the branch point, and the init fails where the server
      does not have the run yet (a first attempt that ran offline and was not synced).

    Skipping behaves the same online, offline and in ``wandb sync``, so the folders of a run
    never overlap. W&B keeps the values logged before the crash for the redone steps (identical
    when the resume is exact; the console says which steps); steps wandb had not yet written
    when the process was killed outright (it writes its log every few seconds, and a SIGTERM or
    SIGKILL skips the final write) stay missing in W&B: a gap, never a duplicate.

    The console gets, at the start and at the end, the run's URL or its offline folder with the
    ``wandb sync`` command that uploads all the run's offline folders.
    """

    def __init__(self, run, mode: str, run_dir: Path, run_id: str, last_step: int):
        self.run, self.mode, self.run_dir, self.id = run, mode, run_dir, run_id
        self.last_step = last_step
        self._last_file = run_dir / "wandb_last_step"

    @classmethod
    def start(cls, cfg, run_dir: Path, resume_step: int) -> WandbRun | None:
        """Init W&B for a run that starts after ``resume_step`` (0: a fresh run, a new id); None
        without wandb installed (a one-line note) or when no init worked."""
        try:
            import wandb
        except ImportError:
            print(f"{PROG}: note: logging.wandb is true but wandb is not installed: pip "
                  "install wandb (or \"megatron-moe[wandb]\"), or set logging.wandb=false; logging to "
                  f"{run_dir / 'metrics.jsonl'} only", file=sys.stderr, flush=True)
            return None
        run_id, last_step = cls._previous(run_dir) if resume_step > 0 else (None, 0)
        run_id = run_id or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        mode, why = wandb_mode(cfg.logging.wandb_mode)
        _say(f"{mode} ({why})")
        run, mode = cls._init(wandb, mode, cls._init_kwargs(wandb, cfg, run_dir, run_id))
        if run is None:
            return None
        (run_dir / "wandb_run_id").write_text(run_id + "\n")
        wb = cls(run, mode, run_dir, run_id, last_step)
        if last_step > resume_step:
            _say(f"steps {resume_step + 1}-{last_step} went to W&B before this resume and are not "
                 f"logged again (metrics.jsonl has the redone values); W&B goes on at step {last_step + 1}")
        _say(wb.where())
        return wb

    @staticmethod
    def _previous(run_dir: Path) -> tuple[str | None, int]:
        """(run id, last step W&B got) of the run directory's W&B run; the step counts only
        when it was written for that id."""
        id_file, last_file = run_dir / "wandb_run_id", run_dir / "wandb_last_step"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        if not run_id or not last_file.exists():
            return run_id, 0
        parts = last_file.read_text().split()
        ok = len(parts) == 2 and parts[0] == run_id and parts[1].isdigit()
        return run_id, int(parts[1]) if ok else 0

    @staticmethod
    def _init_kwargs(wandb, cfg, run_dir: Path, run_id: str) -> dict:
        """wandb.init's arguments but the mode. ``dir`` is absolute because wandb-core, a
        process of its own, writes the transaction log relative to its own working directory.
        An online init waits at most 15 s, the upload at the end at most 60 s (what is left
        then stays in the local folder): W&B never holds up a job."""
        return dict(project=cfg.logging.wandb_project, group=cfg.logging.wandb_group, name=cfg.name,
                    config=cfg.to_dict(), dir=str(run_dir.resolve()), id=run_id, resume="allow",
                    settings=wandb.Settings(silent=True, init_timeout=15, finish_timeout=60))

    @staticmethod
    def _init(wandb, mode: str, kwargs: dict):
        """(run, mode): wandb.init in ``mode``; an online init that fails tries offline once."""
        try:
            return wandb.init(mode=mode, **kwargs), mode
        except Exception as e:  # never let logging stop a training run
            if mode == "offline":
                _warn(f"W&B init failed ({_one_line(e)}); continuing without W&B")
                return None, mode
            _warn(f"W&B online init failed ({_one_line(e)}); logging offline instead")
        try:
            return wandb.init(mode="offline", **kwargs), "offline"
        except Exception as e:
            _warn(f"W&B offline init failed too ({_one_line(e)}); continuing without W&B")
            return None, "offline"

    @property
    def sync_dir(self) -> str | None:
        return getattr(self.run.settings, "sync_dir", None)

    def offline_folders(self) -> list[Path]:
        """This run's offline folders under run_dir/wandb, one per start, oldest first."""
        files = (self.run_dir / "wandb").glob(f"offline-run-*/run-{self.id}.wandb")
        return sorted(f.parent for f in files)

    def where(self) -> str:
        """Where W&B writes: the run's URL, or its offline folder and the upload command."""
        if self.mode == "online":
            return f"online run {getattr(self.run, 'url', None) or self.sync_dir}"
        folders = " ".join(_shown(f) for f in self.offline_folders() or [self.sync_dir])
        return f"offline run in {_shown(self.sync_dir)}; upload with: wandb sync {folders}"

    def log(self, values: dict, step: int) -> None:
        """Log ``values`` at ``step`` unless W&B already has that step (see the class)."""
        if step <= self.last_step:
            return
        try:
            self.run.log(values, step=step)
            self._remember(step)
        except Exception as e:  # a W&B hiccup must not stop training
            _warn(f"wandb.log failed at step {step} ({_one_line(e)})")

    def _remember(self, step: int) -> None:
        self.last_step = step
        tmp = self._last_file.with_name(self._last_file.name + ".tmp")
        tmp.write_text(f"{self.id} {step}\n")
        os.replace(tmp, self._last_file)

    def summary(self, values: dict) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def finish(self, exit_code: int) -> None:
        """Finish the run (at most 60 s of upload at the end) and say again where it is."""
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:  # pragma: no cover
            _warn(f"wandb.finish failed ({_one_line(e)})")
        _say(self.where())


class StepProfiler:
    """torch.profiler over one training step (``MEGATRON_MOE_PROFILE_STEP=N``, a diagnosis aid:
    kernel times, host gaps, NCCL waits). Writes ``profile_step{N}_rank{R}.txt`` (ops by GPU
    time, then by host time, then the torch ops by GPU time per input shape: which op launched a
    kernel, in an eager step) and the Chrome trace ``profile_step{N}_rank{R}.json`` into the run
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
        self._prof = torch.profiler.profile(activities=acts, record_shapes=True)
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
            by_shape = self._prof.key_averages(group_by_input_shape=True)
            f.write(by_shape.table(sort_by=sort_gpu, row_limit=30, max_name_column_width=40,
                                   max_shapes_column_width=80) + "\n")
        self._prof.export_chrome_trace(f"{stem}.json")
        self._prof = None
