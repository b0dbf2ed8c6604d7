"""Atomic training checkpoints: model, optimizer, scheduler, data position, RNG states, config.

Layout (``run_dir/checkpoints``)::

    iter_0000100/            one complete checkpoint
        model.pt             model.state_dict()                       (rank 0)
        optimizer.pt         optimizer.state_dict()                   (rank 0)
        rng_rank00000.pt     python / numpy / torch / CUDA RNG states (every rank its own)
        meta.json            step, consumed samples, scheduler, resolved config, and the size
                             of every file above; written last
    latest                   text: the directory name of the newest complete checkpoint

A save writes everything into ``.tmp-iter_XXXXXXX``, fsyncs each file and the folder, renames
the folder to ``iter_XXXXXXX`` and only then replaces ``latest`` atomically (write
``latest.tmp``, fsync, ``os.replace``). A crash at any point leaves ``latest`` naming the
previous complete checkpoint. ``load_checkpoint`` checks that every file named in meta.json is
there with its size before reading any of it, and the names and shapes of the weights before
loading them: a checkpoint that does not fit is refused with every missing, unexpected and
reshaped entry listed, numbered names merged (``decoder.layers.{0..5}.mlp.moe.experts.w1:
[64, 512, 2048] -> [64, 768, 3072]``).

Resuming with another config: ``config_changes(meta["config"], cfg.to_dict())`` lists the keys
whose values differ; ``shape_changes`` picks those a checkpoint cannot load across (the model's
shape: ``SHAPE_KEYS``), so the trainer can refuse them before it builds anything.

Data parallelism: parameters are replicated, so rank 0 writes the model and optimizer; each
rank writes its RNG states; barriers order the steps when torch.distributed is initialised.

Expert parallelism (``groups.ep_size`` = P > 1): model.pt / optimizer.pt hold the dense
parameters and their optimizer state only, and the P ranks of the first expert-parallel group
each write ``experts_ep{j:03d}.pt`` (their experts' weights and optimizer state, keyed by
parameter name). Every expert is stored exactly once. Loading maps the files and takes each
rank's experts from the shards that hold them (in expert order), so a run can resume with
another expert-parallel size (or none); a checkpoint without EP loads onto EP ranks the same way.

Fault injection (tests only): ``fault_hooks.hooks.pause_save = (STEP, SECONDS)`` makes the save
of checkpoint STEP sleep after its first file is written into the temporary folder, so a test can
kill the process in the middle of a checkpoint write.

    from megatron_moe.training.checkpoint import save_checkpoint, latest_checkpoint, load_checkpoint
    save_checkpoint(run_dir, step=100, model=model, optimizer=opt, meta={...})
    path = latest_checkpoint(run_dir)            # None when there is none
    meta = load_checkpoint(path, model, opt)     # restores RNG states too
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .distributed import barrier
from .fault_hooks import hooks

FORMAT_VERSION = 1
CKPT_DIRNAME = "checkpoints"
LATEST = "latest"

__all__ = ["CheckpointError", "save_checkpoint", "latest_checkpoint", "load_checkpoint",
           "verify_checkpoint", "checkpoint_dir", "get_rng_state", "set_rng_state",
           "state_dict_mismatch", "group_numbered", "ConfigChange", "ABSENT", "config_changes",
           "shape_changes", "SHAPE_KEYS", "FFN_KEYS"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CKPT_DIRNAME


def _iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _rng_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fault_pause(step: int) -> None:
    """Test hook (fault_hooks.hooks.pause_save): hold the save of one step open mid-write."""
    if hooks.pause_save is not None and hooks.pause_save[0] == step:
        time.sleep(hooks.pause_save[1])


# ----------------------------------------------------------------------------- RNG


def get_rng_state() -> dict:
    """Every RNG the training step may draw from, in a form torch.load(weights_only=True) reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        try:
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker()
            state["cuda_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
        except Exception:  # no megatron / no tracker: nothing else to save
            pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        if state.get("cuda_tracker"):
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["cuda_tracker"]))


def _as_tuple(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_as_tuple(v) for v in x)
    if isinstance(x, tuple):
        return tuple(_as_tuple(v) for v in x)
    return x


# ----------------------------------------------------------------------------- save


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, meta: dict, groups=None) -> Path:
    """Write checkpoint ``step`` atomically and point ``latest`` at it. Every rank must call it.

    ``meta`` is JSON-serialisable (consumed samples, scheduler state, resolved config, ...);
    ``step`` and the file manifest are added to it. Returns the checkpoint's directory.
    """
    rank, world = _dist()
    root = checkpoint_dir(run_dir)
    final = root / _iter_name(step)
    tmp = root / f".tmp-{_iter_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an earlier crash
        tmp.mkdir()
    barrier()

    _save_file(get_rng_state(), tmp / _rng_name(rank))
    _fault_pause(step)
    ep = groups.ep_size if groups is not None else 1
    experts = _expert_names(model)
    if ep > 1 and rank < ep:  # the first EP group: EP rank j == global rank j
        _save_file(_expert_shard(model, optimizer, experts), tmp / _shard_name(rank))
    barrier()

    if rank == 0:
        model_state = model.state_dict()
        opt_state = optimizer.state_dict() if optimizer is not None else None
        if ep > 1:  # experts live in the shards
            model_state = {k: v for k, v in model_state.items() if k not in experts}
            if opt_state is not None:
                idx2name = _optimizer_param_names(model, optimizer)
                opt_state["state"] = {i: st for i, st in opt_state["state"].items()
                                      if idx2name.get(i) not in experts}
        _save_file(model_state, tmp / "model.pt")
        if opt_state is not None:
            _save_file(opt_state, tmp / "optimizer.pt")
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        full_meta = {"format_version": FORMAT_VERSION, "step": int(step), "world_size": world,
                     "expert_parallel_size": ep, **meta, "files": files}
        _write_text(tmp / "meta.json", json.dumps(full_meta, indent=1, sort_keys=False))
        _fsync_dir(tmp)
        old = None
        if final.exists():  # re-saving a step (after resuming from an older one)
            old = root / f".old-{_iter_name(step)}"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        latest_tmp = root / f"{LATEST}.tmp"
        _write_text(latest_tmp, final.name + "\n")
        os.replace(latest_tmp, root / LATEST)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


# ----------------------------------------------------------------------------- load


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when the run has no checkpoint yet."""
    root = checkpoint_dir(run_dir)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{pointer} is corrupt (it holds {name!r}); write the name of a "
                              f"complete checkpoint directory in {root} into it")
    return root / name


def verify_checkpoint(path: str | Path) -> dict:
    """Check the checkpoint is complete (every file of its manifest, with its size); return meta."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not meta_path.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: meta.json is missing (the save "
                              "did not finish); resume from an older checkpoint by writing its "
                              f"name into {path.parent / LATEST}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is unreadable: {e}") from None
    files = meta.get("files")
    if not isinstance(files, dict) or "model.pt" not in files:
        raise CheckpointError(f"checkpoint {path}: meta.json has no file manifest")
    for name, size in files.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} has "
                                  f"{f.stat().st_size} bytes, the manifest says {size}")
    return meta


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True,
                    groups=None) -> dict:
    """Verify, then load model (strict), optimizer and this rank's RNG states; return meta.

    Expert weights and their optimizer state are re-sliced for this rank's expert-parallel
    position (``groups``), whatever expert-parallel size the checkpoint was written with; the
    files are memory-mapped, so a rank reads the experts it takes (at EP = 8 an eighth of them)
    instead of holding every shard in host memory. Tensors go where the model's parameters are.
    """
    path = Path(path)
    meta = verify_checkpoint(path)
    rank, world = _dist()
    # memory-mapped: each rank reads the expert rows it takes, not every expert of every shard
    load = functools.partial(torch.load, map_location="cpu", weights_only=True, mmap=True)
    state = load(path / "model.pt")
    experts = _expert_names(model)
    saved_ep = int(meta.get("expert_parallel_size", 1))
    shards = [load(path / _shard_name(j)) for j in range(saved_ep)] if saved_ep > 1 else []
    ep_rank, ep_size = (groups.ep_rank, groups.ep_size) if groups is not None else (0, 1)
    local = {n: p.shape[0] for n, p in model.named_parameters() if n in experts}

    def this_ranks(parts: list) -> list:  # tensors along the expert axis -> this rank's rows of each
        return [_rank_rows([p[i] for p in parts], local_n, ep_rank, ep_size) if torch.is_tensor(parts[0][i])
                and parts[0][i].dim() > 0 else parts[0][i] for i in range(len(parts[0]))] if parts else []

    for name, local_n in local.items():  # all experts in the files, this rank's share in the model
        parts = [[sh["params"][name]] for sh in shards if name in sh["params"]] or (
            [[state[name]]] if name in state else [])
        if parts:
            state[name] = this_ranks(parts)[0]
    _load_model_state(path, model, state)
    if optimizer is not None:
        if "optimizer.pt" not in meta["files"]:
            raise CheckpointError(f"checkpoint {path} has no optimizer state")
        opt_state = load(path / "optimizer.pt")
        idx2name = _optimizer_param_names(model, optimizer)
        name2idx = {n: i for i, n in idx2name.items()}
        for name, local_n in local.items():
            if shards:  # the expert's state is in the shards, else in optimizer.pt with the rest
                sts = [sh["optim"][name] for sh in shards if name in sh["optim"]]
            else:
                st = opt_state["state"].get(name2idx.get(name))
                sts = [st] if st is not None else []
            if not sts or name2idx.get(name) is None:
                continue
            keys = list(sts[0])
            rows = this_ranks([[st[k] for k in keys] for st in sts])
            opt_state["state"][name2idx[name]] = dict(zip(keys, rows))
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path}: the optimizer state does not fit: {e}") from None
    if restore_rng:
        rng_file = path / _rng_name(rank)
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
        else:
            meta["rng_restored"] = False  # saved with fewer ranks: RNG streams start anew
    return meta


def _rank_rows(parts: list[torch.Tensor], n_local: int, ep_rank: int, ep_size: int) -> torch.Tensor:
    """Rows [ep_rank * n_local, (ep_rank + 1) * n_local) of the concatenation of ``parts`` (an
    expert tensor split along its first axis, as saved), reading only those rows; all rows when
    the total is not n_local * ep_size (another number of experts: the load then says so)."""
    total = sum(p.shape[0] for p in parts)
    lo, hi = (ep_rank * n_local, (ep_rank + 1) * n_local) if total == n_local * ep_size else (0, total)
    pieces, start = [], 0
    for p in parts:
        a, b = max(lo - start, 0), min(hi - start, p.shape[0])
        if a < b:
            pieces.append(p[a:b])
        start += p.shape[0]
    return torch.cat(pieces)  # a copy: nothing stays mapped from the file


def _load_model_state(path: Path, model: torch.nn.Module, state: dict) -> None:
    """model.load_state_dict(state, strict=True), after checking the names and shapes first:
    a checkpoint that does not fit raises one CheckpointError listing every missing,
    unexpected and reshaped entry (torch's own message is long and cut off by the CLI)."""
    lines = state_dict_mismatch(state, model.state_dict())
    if lines:
        raise CheckpointError(f"checkpoint {path} does not fit this model (was the model config changed?); "
                              "its weights against the model's, one kind and pattern per line below\n  "
                              + "\n  ".join(lines))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not fit this model (was the model config "
                              f"changed?): {' '.join(str(e).split())}") from None


def _shape(v: Any) -> str:
    return str(list(v.shape)) if torch.is_tensor(v) else "(no tensor)"


def state_dict_mismatch(saved: dict, expected: dict) -> list[str]:
    """What keeps ``saved`` from loading where ``expected`` (a model's state_dict) is: lines
    ``missing: NAME [shape]`` (the model's, absent from saved), ``unexpected: NAME [shape]``
    and ``shape: NAME: [saved] -> [model]``; names alike but for their layer (or other) numbers
    with the same shapes share a line (``decoder.layers.{0..5}.mlp.moe.experts.w1``). Empty when
    it fits."""
    rows = [(n, "missing", f" {_shape(v)}") for n, v in expected.items() if n not in saved]
    rows += [(n, "unexpected", f" {_shape(v)}") for n, v in saved.items() if n not in expected]
    rows += [(n, "shape", f": {_shape(saved[n])} -> {_shape(v)}") for n, v in expected.items()
             if n in saved and torch.is_tensor(v) and _shape(saved[n]) != _shape(v)]
    return [f"{kind}: {name}{detail}" for name, kind, detail in group_numbered(rows)]


def group_numbered(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Rows (dotted name, kind, detail) with names that differ in one integer part only, and
    the same kind and detail, merged into one: layers.0.w, layers.1.w, layers.3.w ->
    layers.{0..1,3}.w. Each integer position is merged in turn, so a name keeps every number it
    stands for, and only those."""
    parts = [(tuple(name.split(".")), kind, detail) for name, kind, detail in rows]
    for i in range(max((len(p) for p, _, _ in parts), default=0)):
        merged: dict[tuple, list[int | None]] = {}  # (name with part i blanked, kind, detail) -> numbers
        for p, kind, detail in parts:
            numbered = i < len(p) and p[i].isdigit()
            key = (p[:i] + ("",) + p[i + 1:] if numbered else p, kind, detail)
            merged.setdefault(key, []).append(int(p[i]) if numbered else None)
        parts = [(p if numbers == [None] else p[:i] + (_spans(numbers),) + p[i + 1:], kind, detail)
                 for (p, kind, detail), numbers in merged.items()]
    return [(".".join(p), kind, detail) for p, kind, detail in parts]


def _spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '{0..2,5}'; one number stays itself."""
    if len(numbers) == 1:
        return str(numbers[0])
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return "{" + ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs) + "}"


# ----------------------------------------------------------------------------- resuming with another config

# Config keys that set the model's parameters (their shapes or their number): a checkpoint made
# with other values cannot load. model.seq_length joins them with learned position embeddings
# (the position table has a row per position); the MLP widths when a layer's width changes
# (``_ffn_widths``). Not among them: model.moe.expert_parallel_size (expert shards are re-sliced on
# load), the world size (parameters are replicated) and model.moe.expert_bias (its buffer is in
# every router, used or not).
SHAPE_KEYS = frozenset({
    "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.vocab_size",
    "model.position_embedding_type", "model.activation", "model.share_embeddings_and_output_weights",
    "model.moe", "model.moe.num_experts", "model.moe.moe_layer_freq",
    "model.moe.shared_expert_ffn_hidden_size"})
FFN_KEYS = frozenset({"model.ffn_hidden_size", "model.moe.ffn_hidden_size"})


@dataclass(frozen=True)
class ConfigChange:
    """A config key whose value differs between a checkpoint's run and this one; ``ABSENT``
    where one side has no such key (a key added to or removed from the program since)."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


ABSENT = "(absent)"


def _show(v: Any) -> str:
    """A config value as YAML writes it; a whole section (model.moe switched on) as {...}."""
    if isinstance(v, dict):
        return "{...}"
    return v if isinstance(v, str) else json.dumps(v)


def config_changes(saved: dict, new: dict, prefix: str = "") -> list[ConfigChange]:
    """Every key whose value differs between two resolved configs (RunConfig.to_dict(), the
    checkpoint's meta["config"] and this run's), in the new config's order; a section that is
    null on one side (model.moe: a dense model) is one change."""
    changes = []
    for k in [*new, *(k for k in saved if k not in new)]:
        old_v, new_v, key = saved.get(k, ABSENT), new.get(k, ABSENT), f"{prefix}{k}"
        if isinstance(old_v, dict) and isinstance(new_v, dict):
            changes += config_changes(old_v, new_v, f"{key}.")
        elif old_v != new_v:
            changes.append(ConfigChange(key, old_v, new_v))
    return changes


def _ffn_widths(cfg: dict) -> tuple[int | None, int | None]:
    """(the dense layers' MLP width, the experts'), None where the model has no such layer."""
    model = cfg.get("model", {})
    moe = model.get("moe")
    if not isinstance(moe, dict):
        return model.get("ffn_hidden_size"), None
    dense = model.get("num_layers", 1) > 1 and moe.get("moe_layer_freq", 1) > 1  # layer 2 is dense
    return (model.get("ffn_hidden_size") if dense else None,
            moe.get("ffn_hidden_size") or model.get("ffn_hidden_size"))


def shape_changes(changes: list[ConfigChange], saved: dict, new: dict) -> list[ConfigChange]:
    """The changes (``config_changes(saved, new)``) a checkpoint cannot load across: SHAPE_KEYS,
    model.seq_length with learned position embeddings, and the MLP widths if a layer's changes."""
    learned = new.get("model", {}).get("position_embedding_type") == "learned_absolute"
    widths_change = _ffn_widths(saved) != _ffn_widths(new)
    return [c for c in changes if c.key in SHAPE_KEYS or (learned and c.key == "model.seq_length")
            or (widths_change and c.key in FFN_KEYS)]


# ----------------------------------------------------------------------------- expert shards


def _shard_name(ep_rank: int) -> str:
    return f"experts_ep{ep_rank:03d}.pt"


def _expert_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}


def _optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Index of each parameter in optimizer.state_dict() -> its name in the model."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: names[id(p)] for i, p in enumerate(flat) if id(p) in names}


def _expert_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, experts: set[str]) -> dict:
    params = {n: p.detach().cpu() for n, p in model.named_parameters() if n in experts}
    optim = {}
    if optimizer is not None:
        by_id = {id(p): n for n, p in model.named_parameters() if n in experts}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in by_id and p in optimizer.state:
                    optim[by_id[id(p)]] = {k: (v.detach().cpu() if torch.is_tensor(v) else v)
                                           for k, v in optimizer.state[p].items()}
    return {"params": params, "optim": optim}
