"""Run configuration: YAML files -> validated dataclasses (RunConfig = name, model, train, data, logging).

    from megatron_moe.run_config import load_config
    cfg = load_config("configs/dmoe-xs.yaml", ["train.lr=3e-4", "model.moe.top_k=2"])
    print(cfg.to_yaml())

The same from the shell (prints the resolved YAML and exits):

    megatron-moe-train --config configs/dmoe-xs.yaml train.lr=3e-4 --print-config

Rules:
  * ``base: other.yaml`` inherits another config (path relative to the file that names it);
    the child is deep-merged over it (mappings merge key by key, anything else replaces),
    chains of bases work, cycles are an error. ``name`` is never inherited: it is the file's
    own ``name:`` or, failing that, the file's stem.
  * Overrides ``a.b=value`` are applied last; the value is parsed as a YAML scalar/flow value
    (``3e-4`` is a float, ``null`` is None, ``[a.txt, b.txt]`` is a list).
  * Unknown keys are rejected with a "did you mean" suggestion; values of the wrong type are
    rejected naming the key; each section's ``__post_init__`` then checks its own ranges and
    raises ``ValueError`` naming ``section.field``.
  * Relative paths inside a config (``data.paths``, ``logging.runs_dir``, ...) are relative to
    the working directory the program runs in, as with Megatron-LM's flags.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .data import DataConfig
from .model_config import ModelConfig

__all__ = ["TrainConfig", "LoggingConfig", "RunConfig", "load_config", "config_from_dict", "ConfigError"]

SECTIONS = ("name", "model", "train", "data", "logging")
WANDB_MODES = ("auto", "online", "offline")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ConfigError(ValueError):
    """A config that cannot be loaded: the message names the key and what would be valid."""


def _fail(key: str, value: Any, valid: str) -> None:
    raise ConfigError(f"{key}={value!r} is invalid: {valid}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    optimizer step, activations bf16 throughout (Megatron-LM's --bf16; megatron_moe/precision.py).
    false: torch.autocast over the fp32 parameters (LayerNorm, bias adds and the residual
    stream in fp32; slower)."""
    grad_accumulation_fusion: bool = True
    """With bf16_params: the grouped experts' weight-gradient kernels add into the fp32 master
    gradients in their epilogues (Megatron-LM's --gradient-accumulation-fusion) instead of
    writing bf16 gradients that a separate pass adds; the sums are then fp32 throughout."""
    fused_optimizer: bool = True
    """One pass per step over each parameter for the clipping scale, the AdamW update and the
    bf16 copies' refresh (a Triton kernel, megatron_moe/optim.py) instead of three (a multiply,
    torch's fused AdamW, a copy). Same math; false runs the three."""
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
    --overlap-grad-reduce); the same update. On 4 H200s (steps 51-200, one call): dmoe-small
    EP=4 0.70 -> 0.75 of one GPU, gpt-small DP=4 0.92 -> 0.96 (benchmarks/NOTES.md)."""
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms; on GPUs also
    CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO=Ring): identical losses for identical seeds on the
    same hardware and software, possibly slower. An op without a deterministic implementation
    stops the run with an error naming it."""

    def __post_init__(self) -> None:
        for f in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                  "max_consecutive_nonfinite"):
            v = getattr(self, f)
            if not _is_int(v) or v < 1:
                _fail(f"train.{f}", v, "expected an int >= 1")
        for f in ("lr_warmup_iters", "eval_interval", "eval_iters", "save_interval", "seed"):
            v = getattr(self, f)
            if not _is_int(v) or v < 0:
                _fail(f"train.{f}", v, "expected an int >= 0")
        for f in ("lr_decay_iters", "exit_interval"):
            v = getattr(self, f)
            if v is not None and (not _is_int(v) or v < 1):
                _fail(f"train.{f}", v, "expected an int >= 1 or null")
        if self.global_batch_size % self.micro_batch_size != 0:
            _fail("train.global_batch_size", self.global_batch_size,
                  f"expected a multiple of train.micro_batch_size ({self.micro_batch_size})")
        if self.eval_interval > 0 and self.eval_iters < 1:
            _fail("train.eval_iters", self.eval_iters, "expected >= 1 when train.eval_interval > 0")
        for f in ("lr", "min_lr", "weight_decay", "clip_grad"):
            v = getattr(self, f)
            if not _is_num(v) or v < 0:
                _fail(f"train.{f}", v, "expected a finite number >= 0")
        if self.lr <= 0:
            _fail("train.lr", self.lr, "expected a number > 0")
        if self.min_lr > self.lr:
            _fail("train.min_lr", self.min_lr, f"expected <= train.lr ({self.lr})")
        for f in ("adam_beta1", "adam_beta2"):
            v = getattr(self, f)
            if not _is_num(v) or not 0 <= v < 1:
                _fail(f"train.{f}", v, "expected a number in [0, 1)")
        if not _is_num(self.adam_eps) or self.adam_eps <= 0:
            _fail("train.adam_eps", self.adam_eps, "expected a number > 0")
        for f in ("bf16", "bf16_params", "grad_accumulation_fusion", "fused_optimizer", "deterministic", "save_final",
                  "overlap_grad_reduce"):
            if not isinstance(getattr(self, f), bool):
                _fail(f"train.{f}", getattr(self, f), "expected true or false")
        if self.lr_warmup_iters > self.decay_iters:
            _fail("train.lr_warmup_iters", self.lr_warmup_iters,
                  f"expected <= the decay length ({self.decay_iters}: train.lr_decay_iters, "
                  "or train.train_iters when it is null)")

    @property
    def decay_iters(self) -> int:
        return self.train_iters if self.lr_decay_iters is None else self.lr_decay_iters


@dataclass
class LoggingConfig:
    runs_dir: str = "runs"
    """Parent of the run directories: a run writes to runs_dir/name."""
    wandb: bool = True
    """Log to Weights & Biases (offline unless there is an API key, see wandb_mode)."""
    wandb_project: str = "megatron-moe"
    wandb_group: str | None = None
    """Runs of one comparison share a group (W&B shows them side by side)."""
    wandb_mode: str = "auto"
    """'auto' (online when WANDB_API_KEY is set, else offline), 'online' or 'offline'."""

    def __post_init__(self) -> None:
        if not isinstance(self.runs_dir, str) or not self.runs_dir:
            _fail("logging.runs_dir", self.runs_dir, "expected a non-empty path")
        if not isinstance(self.wandb, bool):
            _fail("logging.wandb", self.wandb, "expected true or false")
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            _fail("logging.wandb_project", self.wandb_project, "expected a non-empty string")
        if self.wandb_group is not None and (not isinstance(self.wandb_group, str) or not self.wandb_group):
            _fail("logging.wandb_group", self.wandb_group, "expected a non-empty string or null")
        if self.wandb_mode not in WANDB_MODES:
            _fail("logging.wandb_mode", self.wandb_mode, f"expected one of {WANDB_MODES}")


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
            _fail("name", self.name, "expected letters, digits, '.', '_' or '-' (it names the run "
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


# ----------------------------------------------------------------------------- YAML reading


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float (YAML 1.2) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"duplicate key {key!r} {key_node.start_mark}".strip())
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (name, model, train, data, "
                          f"logging) at the top, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _resolve_file(path: Path, chain: tuple[Path, ...]) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"config inheritance cycle: {cycle}")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r} is invalid: expected the path of a config file "
                          "(relative to this file)")
    base_path = path.parent / base
    if not base_path.exists():
        raise ConfigError(f"{path}: base config {base_path} does not exist (base is relative to "
                          "the file that names it)")
    parent = _resolve_file(base_path, (*chain, path))
    parent.pop("name", None)  # a run's name is never inherited
    return _deep_merge(parent, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value parsed as YAML)."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"override {text!r} is invalid: expected key=value, e.g. train.lr=3e-4")
    key, _, raw = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} is invalid: expected a dotted key such as "
                          "train.lr or model.moe.top_k before '='")
    if parts[0] == "base":
        raise ConfigError(f"override {text!r} is invalid: base can only be set inside a config file")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {e}") from None
    return parts, value


def _apply_override(data: dict, parts: list[str], value: Any, text: str) -> None:
    node = data
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {text!r} is invalid: {'.'.join(parts[:i + 1])} is a value "
                              f"({nxt!r}), not a section")
        node = nxt
    node[parts[-1]] = value


# ----------------------------------------------------------------------------- typed building


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return {bool: "true or false", int: "an int", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


class _Mismatch(Exception):
    pass


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``hint`` (converting int -> float and nested
    mappings -> dataclasses); raise ConfigError naming ``key`` when it does not fit."""
    try:
        return _convert_inner(value, hint, key)
    except _Mismatch:
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(hint)}, "
                          f"got {type(value).__name__}") from None


def _convert_inner(value: Any, hint: Any, key: str) -> Any:
    if hint is Any or hint is object:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert_inner(value, a, key)
            except _Mismatch:
                continue
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(hint, value, key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if _is_int(value):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise _Mismatch
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        args = typing.get_args(hint)
        if origin is tuple and args and Ellipsis not in args:
            if len(value) != len(args):
                raise _Mismatch
            items = [_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            elem = args[0] if args else Any
            items = [_convert(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    return value


def _unknown_key(section: str, key: str, valid: list[str]) -> ConfigError:
    full = f"{section}.{key}" if section else str(key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    if close:
        hint = f"{section}.{close[0]}" if section else close[0]
        return ConfigError(f"unknown key '{full}': did you mean '{hint}'?")
    where = f"'{section}'" if section else "the top level"
    return ConfigError(f"unknown key '{full}': valid keys in {where} are {', '.join(valid)}")


def _build(cls: type, data: dict, section: str) -> Any:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for k in data:
        if k not in names:
            raise _unknown_key(section, k, names)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotation: fall back to no type checking
        hints = {}
    kwargs = {}
    for f in fields:
        key = f"{section}.{f.name}" if section else f.name
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints.get(f.name, Any), key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key '{key}' (required)")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e)
        if section and not msg.startswith(section):
            # MoEConfig-style messages ("MoEConfig.top_k=...") or bare field names: say where.
            msg = f"{section}: {msg}"
        raise ConfigError(msg) from None


def config_from_dict(data: dict, overrides: list[str] | None = None) -> RunConfig:
    """Build a RunConfig from a (resolved, base-free) nested dict plus ``key=value`` overrides."""
    data = copy.deepcopy(data) if data else {}
    for text in overrides or []:
        parts, value = parse_override(text)
        _apply_override(data, parts, value, text)
    if "base" in data:
        raise ConfigError("base is only allowed in config files (use load_config)")
    return _build(RunConfig, data, "")


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (following ``base:``), apply ``a.b=value`` overrides, validate."""
    path = Path(path)
    data = _resolve_file(path, ())
    if "name" not in data:
        data["name"] = path.stem
    return config_from_dict(data, overrides)
