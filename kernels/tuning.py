"""Tuned configs that outlive the process: the autotuner's choice per launch, kept on disk.

    cfg = stored_config(kernel, launch_key, device)    # one of kernel.configs, or None
    remember(kernel, launch_key, device, cfg, tuned_s)  # after the autotuner chose

Triton's autotuner compiles and times every candidate config of a kernel the first time a process
launches it at a new shape, and keeps the choice in memory only (its own disk cache,
``cache_results``, skips configs with pre-hooks, which our grouped GEMMs have). A run thus starts
with minutes of tuning on a fresh machine, and again in every new process. Here the choice is
kept per GPU: a later process takes the stored config, compiles that one alone (from Triton's
compilation cache when it is there) and times nothing.

A tuning that does run (no stored choice) first compiles the candidates in parallel
(:func:`precompile`): on a fresh machine most of its seconds are compiles, one CPU core each, and
the autotuner then loads each candidate from Triton's file cache before timing it.

Where (one JSON file per GPU name and Triton version, ``NVIDIA-H100-80GB-HBM3-triton3.6.0.json``):
  * ``$MEGATRON_MOE_TUNING_CACHE`` (a folder; ``0`` turns storing and reading off), else
    ``$XDG_CACHE_HOME/megatron-moe/tuning``, else ``~/.cache/megatron-moe/tuning``;
  * then the tables shipped with the package, ``kernels/tuned/`` (same file names), for a first
    run on a fresh machine (``MEGATRON_MOE_TUNING_SHIPPED=0``: not read).
An entry is keyed by the kernel's name, a hash of its source, its candidate configs and the A/B
switches (kernels/switches.py; a changed kernel, config list or switch tunes again), and the
launch key (shapes, dtypes, meta-parameters).
An entry that names no current candidate is ignored. Writing re-reads the file, adds the entry
and replaces the file through a temporary one: concurrent ranks never leave a torn file (one
rank's entry may be lost, and is tuned again by a later run). Rank 0 (``$RANK`` unset or 0)
prints one line per tuned launch: the kernel, the key, the seconds it took and the choice.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import triton
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner

from . import switches

__all__ = ["stored_config", "remember", "cache_file", "shipped_file", "entry_key", "precompile"]

ENV = "MEGATRON_MOE_TUNING_CACHE"
SHIPPED_DIR = Path(__file__).with_name("tuned")

_tables: dict[Path, dict] = {}  # file -> its entries, read once per process
_JSON_TYPES = (bool, int, float, str, type(None))


def _folder() -> Path | None:
    value = switches.tuning_cache()
    if value == "0":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-moe" / "tuning"


def _file_name(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{gpu}-triton{triton.__version__}").strip("-") + ".json"


def cache_file(device: torch.device) -> Path | None:
    """The user's file for this device's GPU, None when storing is off."""
    folder = _folder()
    return None if folder is None else folder / _file_name(device)


def shipped_file(device: torch.device) -> Path:
    """The package's table for this device's GPU (it may not exist)."""
    return SHIPPED_DIR / _file_name(device)


def _config_dict(cfg: triton.Config) -> dict:
    """A config's launch settings (block sizes, warps, stages, ...) as JSON values."""
    return {k: v for k, v in sorted(cfg.all_kwargs().items()) if isinstance(v, _JSON_TYPES)}


def entry_key(kernel, launch_key) -> str:
    """The kernel's name, a hash of its source, its candidate configs and the A/B switches, and
    the launch key."""
    fn = kernel.fn
    digest = hashlib.sha1(fn.src.encode() + switches.fingerprint().encode())
    for cfg in kernel.configs:
        digest.update(json.dumps(_config_dict(cfg)).encode())
    return f"{fn.__name__}|{digest.hexdigest()[:16]}|{launch_key!r}"


def _read(path: Path) -> dict:
    """The entries of a tuning file; {} when it is missing or unreadable (then tuning runs)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"megatron-moe: ignoring the tuning file {path} ({e}); kernels tune again", file=sys.stderr)
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def _table(path: Path) -> dict:
    if path not in _tables:
        _tables[path] = _read(path)
    return _tables[path]


def stored_config(kernel, launch_key, device: torch.device):
    """The stored choice for this launch (the user's file, then the shipped table) if it is one of
    the kernel's current candidates, else None."""
    if len(kernel.configs) < 2:
        return None
    user = cache_file(device)
    if user is None:
        return None
    key = entry_key(kernel, launch_key)
    for path in (user, shipped_file(device)) if switches.shipped_tuning() else (user,):
        entry = _table(path).get(key)
        if isinstance(entry, dict):
            for cfg in kernel.configs:
                if _config_dict(cfg) == entry.get("config"):
                    return cfg
    return None


def _write(path: Path, key: str, entry: dict) -> None:
    """Add ``entry`` to the file: re-read, merge, replace through a temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read(path)
    entries[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"triton": triton.__version__, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _tables[path] = entries


def remember(kernel, launch_key, device: torch.device, cfg: triton.Config, tuned_s: float | None,
             label: str = "") -> None:
    """Store the autotuner's choice for this launch; ``tuned_s``: the seconds the autotuner spent
    choosing it (None: it had chosen before, for a launch that shares its key), printed once with
    ``label`` (e.g. the shape)."""
    if len(kernel.configs) < 2:
        return
    if tuned_s is not None and os.environ.get("RANK", "0") == "0":
        chosen = " ".join(f"{k}={v}" for k, v in _config_dict(cfg).items() if v is not None)
        timed = getattr(kernel, "configs_timings", None)  # the autotuner's last timings: what its prune left
        # without its timings (an autotuner that keeps none) how many the prune left is not known
        count = f"{len(timed)} of {len(kernel.configs)} candidates timed" if timed else \
            f"of {len(kernel.configs)} candidates"
        print(f"megatron-moe: tuned {kernel.fn.__name__}{f' {label}' if label else ''} in {tuned_s:.1f} s "
              f"({count}): {chosen}", file=sys.stderr, flush=True)
    path = cache_file(device)
    if path is None:
        return
    key, entry = entry_key(kernel, launch_key), {"config": _config_dict(cfg)}
    if _table(path).get(key) == entry:
        return
    try:
        _write(path, key, entry)
    except OSError as e:  # a read-only home, a full disk: tuning still works, only not kept
        print(f"megatron-moe: cannot store tuned configs in {path} ({e}); set {ENV} to a writable "
              "folder, or 0", file=sys.stderr)
        _table(path)[key] = entry


# ----------------------------------------------------------------------------- parallel compiles


class _CompileOnly:
    """The driver calls a compile (``JITFunction.run(..., warmup=True)``) makes, answered without
    CUDA: a forked process must not touch the parent's CUDA context."""

    def __init__(self, device: int, target):
        self.device, self.target = device, target

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_benchmarker(self):
        """Triton 3.6's autotuner "times" even a pruned list of one config: the call is made (a
        compile where launches are compiles, as in tests/kernels/_compile_sm90.py), nothing timed."""
        def call_once(kernel_call, quantiles=None, **kwargs):
            kernel_call()
            return [0.0] * len(quantiles) if quantiles else 0.0
        return call_once


def _compile_share(kernel, args, meta, configs, device: int, target) -> None:
    """A forked process's part: compile ``configs`` for this launch into Triton's file cache."""
    try:
        driver.set_active(_CompileOnly(device, target))
        nargs = dict(zip(kernel.arg_names, args))
        for cfg in configs:
            kw = {**meta, **cfg.all_kwargs()}
            if cfg.pre_hook is not None:  # e.g. a tensor descriptor's box, part of the signature
                cfg.pre_hook({**nargs, **kw})
            kernel.fn.run(*args, grid=(1,), warmup=True, **kw)
    except BaseException:  # its configs are compiled again by the autotuner; nothing to report
        os._exit(1)
    os._exit(0)


def _tuned_already(kernel, args, meta) -> bool:
    """Whether the autotuner has a choice for this launch's key (its key arguments and dtypes)."""
    named = {**dict(zip(kernel.arg_names, args)), **meta}
    key = [named[k] for k in kernel.keys if k in named]
    key += [str(v.dtype) for k, v in named.items() if k in kernel.arg_names and hasattr(v, "dtype")]
    return tuple(key) in kernel.cache


_precompile_stuck = False  # a worker outlived its timeout once: this process compiles one by one


def precompile(kernel, args, meta, *, workers: int | None = None, timeout: float = 60.0) -> int:
    """Compile the candidate configs the autotuner ``kernel`` is about to time for this launch
    (``kernel[grid](*args, **meta)``) into Triton's file cache, in ``workers`` forked processes at
    once (default ``switches.compile_workers()``); the autotuner then loads each instead of
    compiling it. Returns how many configs the processes compiled: 0 when skipped (fewer than 2
    workers or candidates, a key already tuned, no ``fork``, not Triton's autotuner). A process
    that fails, or outlives ``timeout`` seconds (then killed, and this process stops forking:
    a fork of a multi-threaded process can deadlock), only leaves its configs to the autotuner;
    so does an autotuner this cannot read (one line on stderr, then no more forking)."""
    global _precompile_stuck
    workers = switches.compile_workers() if workers is None else workers
    if (workers < 2 or _precompile_stuck or not isinstance(kernel, Autotuner) or len(kernel.configs) < 2
            or not hasattr(os, "fork")):
        return 0
    try:  # Triton's autotuner internals (other versions may differ): a failure costs the speed-up only
        if _tuned_already(kernel, args, meta):
            return 0
        kernel.nargs = dict(zip(kernel.arg_names, args))  # what the prune function reads
        configs = kernel.prune_configs(meta)
        device = driver.active.get_current_device()
        target = driver.active.get_current_target()
    except Exception as e:
        _precompile_stuck = True
        print(f"megatron-moe: candidates compiled one by one ({type(e).__name__}: {e})", file=sys.stderr)
        return 0
    if len(configs) < 2:
        return 0
    shares = [configs[i::workers] for i in range(min(workers, len(configs)))]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_compile_share, args=(kernel, args, meta, share, device, target), daemon=True)
             for share in shares]
    with warnings.catch_warnings():  # Python 3.12 warns at every fork of a multi-threaded process
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        for p in procs:
            p.start()
    deadline, compiled = time.monotonic() + timeout, 0
    for p, share in zip(procs, shares):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            _precompile_stuck = True
        elif p.exitcode == 0:
            compiled += len(share)
    return compiled
