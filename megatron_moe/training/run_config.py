"""Run configuration: YAML files -> validated dataclasses (RunConfig = name, model, train, data, logging).

    from megatron_moe.training.run_config import load_config
    cfg = load_config("dmoe-xs", ["train.lr=3e-4", "model.moe.top_k=2"])   # a name or a path
    print(cfg.to_yaml())

The same from the shell (prints the resolved YAML and exits):

    megatron-moe-train --config dmoe-xs train.lr=3e-4 --print-config

Files, ``base:`` inheritance, overrides and type checks: megatron_moe/megatron/yaml_config.py.
The ``model:`` section is megatron_moe/megatron/model_config.py, ``data:`` is
megatron_moe/training/data/config.py. Relative paths inside a config (``data.paths``,
``logging.runs_dir``, ...) are relative to the working directory the program runs in, as with
Megatron-LM's flags.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_moe._validation import invalid, is_int, is_number
from megatron_moe.megatron.model_config import ModelConfig
from megatron_moe.megatron.yaml_config import (ConfigError, apply_overrides, build_dataclass,
                                               find_config, read_config_file)

from .data import DataConfig

__all__ = ["TrainConfig", "LoggingConfig", "RunConfig", "load_config", "config_from_dict", "ConfigError"]

SECTIONS = ("name", "model", "train", "data", "logging")
WANDB_MODES = ("auto", "online", "offline")
CUDA_GRAPH_MODES = ("auto", "micro_batch", "none")  # train.cuda_graphs (cuda_graphs.py)
ADAM_MOMENTS_DTYPES = ("fp32", "bf16")
BF16_MOMENTS_MAX_BETA2 = 0.99  # docs/training.md: the second moment's drift in bf16, measured
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    global_batch_size: int = 512
    """Sequences per optimizer step over all ranks: micro_batch_size * data-parallel size *
    number of accumulated micro-batches."""
    train_iters: int = 1000
    """Optimizer steps of the whole run."""
    lr: float = 6.0e-4
    """Peak learning rate (reached at the end of the warm-up)."""
    min_lr: float = 6.0e-5
    """Learning rate at the end of the cosine decay (and after it)."""
    lr_warmup_iters: int = 100
    """Steps of linear warm-up from 0 to lr."""
    lr_decay_iters: int | None = None
    """Step at which the cosine decay reaches min_lr; null = train_iters."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to biases and norm weights, as in Megatron)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    bf16: bool = True
    """bf16 compute on GPUs (the optimizer state, gradients and master weights stay fp32);
    the CPU runs fp32."""
    bf16_params: bool = True
    """With bf16: the model computes with bf16 copies of its fp32 parameters, rounded once per
    optimizer step, activations bf16 throughout (Megatron-LM's --bf16; megatron_moe/training/precision.py).
    false: torch.autocast over the fp32 parameters (LayerNorm, bias adds and the residual
    stream in fp32; slower)."""
    grad_accumulation_fusion: bool = True
    """With bf16_params: the grouped experts' weight-gradient kernels add into the fp32 master
    gradients in their epilogues (Megatron-LM's --gradient-accumulation-fusion) instead of
    writing bf16 gradients that a separate pass adds; the sums are then fp32 throughout."""
    fused_optimizer: bool = True
    """One pass per step over each parameter for the clipping scale, the AdamW update and the
    bf16 copies' refresh (a Triton kernel, megatron_moe/training/optimizer.py) instead of three (a multiply,
    torch's fused AdamW, a copy). Same math; false runs the three."""
    adam_moments_dtype: str = "fp32"
    """'bf16': AdamW's two moments stored in bf16 (4 bytes per parameter instead of 8, 8 bytes
    less of memory traffic per parameter and step; as Megatron-LM's --use-precision-aware-optimizer
    --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16), updated in fp32 and rounded to nearest when
    stored. Needs fused_optimizer and adam_beta2 <= 0.99 (docs/training.md says why)."""
    seed: int = 1234
    """Seed of the model init, the data shuffling and every RNG."""
    eval_interval: int = 100
    """Evaluate on the validation split every this many steps; 0 = never."""
    eval_iters: int = 10
    """Global batches of one evaluation (as in Megatron-LM): eval_iters * global_batch_size
    validation sequences, the same ones at every evaluation, split over the ranks."""
    save_interval: int = 500
    """Save a checkpoint every this many steps (and always at the end); 0 = only at the end."""
    log_interval: int = 1
    """Print a log line every this many steps (metrics.jsonl and W&B get every step)."""
    exit_interval: int | None = None
    """Stop (after saving a checkpoint) at the first step divisible by this; null = run to
    train_iters. ``--resume`` continues from there, e.g. within a Slurm time limit."""
    max_consecutive_nonfinite: int = 5
    """A step whose LM loss or gradient norm is NaN/Inf is skipped: no optimizer update (the
    weights and optimizer state stay as they were), while its data, the step count and the
    learning-rate schedule advance; ``skipped_steps`` counts them. The run stops with an
    error after this many such steps in a row (1 = at the first one)."""
    save_final: bool = True
    """Save a checkpoint at the last step (false for throwaway runs such as the reproduction's,
    whose final checkpoints would only cost time and disk; exit_interval stops still save)."""
    overlap_grad_reduce: bool = True
    """Data/expert-data parallelism: start each gradient bucket's all-reduce during the step's
    last backward, as soon as its gradients are complete, instead of after it (as Megatron's
    --overlap-grad-reduce); the same update, with the exchange hidden behind the backward
    (measured: docs/expert-parallelism.md)."""
    cuda_graphs: str | bool = "auto"  # false (YAML's reading of `off`) = "none"
    """'micro_batch': capture each micro-batch's forward, loss and backward in a CUDA graph at the
    first step and replay it (one launch instead of thousands; megatron_moe/training/cuda_graphs.py
    says what it needs and what the capture costs at start-up); 'none': eager; 'auto':
    'micro_batch' for a one-process run on a GPU whose model a graph can hold, else 'none'."""
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms; on GPUs also
    CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO=Ring): identical losses for identical seeds on the
    same hardware and software, possibly slower. An op without a deterministic implementation
    stops the run with an error naming it."""

    def __post_init__(self) -> None:
        for f in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                  "max_consecutive_nonfinite"):
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                invalid(f"train.{f}", v, "expected an int >= 1")
        for f in ("lr_warmup_iters", "eval_interval", "eval_iters", "save_interval", "seed"):
            v = getattr(self, f)
            if not is_int(v) or v < 0:
                invalid(f"train.{f}", v, "expected an int >= 0")
        for f in ("lr_decay_iters", "exit_interval"):
            v = getattr(self, f)
            if v is not None and (not is_int(v) or v < 1):
                invalid(f"train.{f}", v, "expected an int >= 1 or null")
        if self.global_batch_size % self.micro_batch_size != 0:
            invalid("train.global_batch_size", self.global_batch_size,
                  f"expected a multiple of train.micro_batch_size ({self.micro_batch_size})")
        if self.eval_interval > 0 and self.eval_iters < 1:
            invalid("train.eval_iters", self.eval_iters, "expected >= 1 when train.eval_interval > 0")
        for f in ("lr", "min_lr", "weight_decay", "clip_grad"):
            v = getattr(self, f)
            if not is_number(v) or v < 0:
                invalid(f"train.{f}", v, "expected a finite number >= 0")
        if self.lr <= 0:
            invalid("train.lr", self.lr, "expected a number > 0")
        if self.min_lr > self.lr:
            invalid("train.min_lr", self.min_lr, f"expected <= train.lr ({self.lr})")
        for f in ("adam_beta1", "adam_beta2"):
            v = getattr(self, f)
            if not is_number(v) or not 0 <= v < 1:
                invalid(f"train.{f}", v, "expected a number in [0, 1)")
        if not is_number(self.adam_eps) or self.adam_eps <= 0:
            invalid("train.adam_eps", self.adam_eps, "expected a number > 0")
        for f in ("bf16", "bf16_params", "grad_accumulation_fusion", "fused_optimizer", "deterministic", "save_final",
                  "overlap_grad_reduce"):
            if not isinstance(getattr(self, f), bool):
                invalid(f"train.{f}", getattr(self, f), "expected true or false")
        if self.adam_moments_dtype not in ADAM_MOMENTS_DTYPES:
            invalid("train.adam_moments_dtype", self.adam_moments_dtype, f"expected one of {ADAM_MOMENTS_DTYPES}")
        if self.adam_moments_dtype == "bf16" and not self.fused_optimizer:
            invalid("train.adam_moments_dtype", self.adam_moments_dtype,
                    "expected fp32 with train.fused_optimizer=false (torch's AdamW keeps fp32 moments): "
                    "set train.fused_optimizer=true or train.adam_moments_dtype=fp32")
        if self.adam_moments_dtype == "bf16" and self.adam_beta2 > BF16_MOMENTS_MAX_BETA2:
            invalid("train.adam_beta2", self.adam_beta2,
                    f"expected <= {BF16_MOMENTS_MAX_BETA2} with train.adam_moments_dtype=bf16 (a second "
                    "moment that moves by less than bf16's rounding step per update drifts: measured "
                    "8% off at 0.995, 44% at 0.999): lower train.adam_beta2 or set "
                    "train.adam_moments_dtype=fp32")
        if self.cuda_graphs is False:  # YAML reads `off` / `false` as a boolean
            self.cuda_graphs = "none"
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            invalid("train.cuda_graphs", self.cuda_graphs, f"expected one of {CUDA_GRAPH_MODES}")
        if self.lr_warmup_iters > self.decay_iters:  # either key may be the one that changed
            key = "train.train_iters" if self.lr_decay_iters is None else "train.lr_decay_iters"
            why = ", as train.lr_decay_iters is null" if self.lr_decay_iters is None else ""
            invalid("train.lr_warmup_iters", self.lr_warmup_iters,
                    f"expected <= the decay length ({key}={self.decay_iters}{why}): lower "
                    f"train.lr_warmup_iters or raise {key}")

    @property
    def decay_iters(self) -> int:
        return self.train_iters if self.lr_decay_iters is None else self.lr_decay_iters


@dataclass
class LoggingConfig:
    runs_dir: str = "runs"
    """Parent of the run directories: a run writes to runs_dir/name."""
    wandb: bool = True
    """Log to Weights & Biases (offline unless W&B has credentials, see wandb_mode)."""
    wandb_project: str = "megatron-moe"
    wandb_group: str | None = None
    """Runs of one comparison share a group (W&B shows them side by side)."""
    wandb_mode: str = "auto"
    """'auto' (online when W&B has credentials: WANDB_API_KEY or a `wandb login`; else offline),
    'online' or 'offline'."""

    def __post_init__(self) -> None:
        if not isinstance(self.runs_dir, str) or not self.runs_dir:
            invalid("logging.runs_dir", self.runs_dir, "expected a non-empty path")
        if not isinstance(self.wandb, bool):
            invalid("logging.wandb", self.wandb, "expected true or false")
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            invalid("logging.wandb_project", self.wandb_project, "expected a non-empty string")
        if self.wandb_group is not None and (not isinstance(self.wandb_group, str) or not self.wandb_group):
            invalid("logging.wandb_group", self.wandb_group, "expected a non-empty string or null")
        if self.wandb_mode not in WANDB_MODES:
            invalid("logging.wandb_mode", self.wandb_mode, f"expected one of {WANDB_MODES}")


@dataclass
class RunConfig:
    name: str
    """Run name: the run directory is logging.runs_dir/name and the W&B run is called so."""
    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            invalid("name", self.name, "expected letters, digits, '.', '_' or '-' (it names the run "
                  "directory), starting with a letter or digit")

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.runs_dir) / self.name

    def to_dict(self) -> dict:
        """Plain nested dict (lists, no tuples) that load_config/config_from_dict read back."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def config_from_dict(data: dict, overrides: list[str] | None = None) -> RunConfig:
    """Build a RunConfig from a (resolved, base-free) nested dict plus ``key=value`` overrides."""
    data = apply_overrides(data, overrides)
    if "base" in data:
        raise ConfigError("base is only allowed in config files (use load_config)")
    return build_dataclass(RunConfig, data, "")


def load_config(name_or_path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (a path, or the name of a shipped config), following ``base:``;
    apply ``a.b=value`` overrides; validate."""
    return config_from_dict(read_config_file(find_config(name_or_path)), overrides)
