"""Resuming with a changed config, and checkpoints that do not fit the model.

    python -m pytest -q tests/training/test_resume_changes.py     # about a minute on 2 CPU cores

* ``config_changes`` / ``shape_changes`` (checkpoint.py): which keys differ, and which of them a
  checkpoint cannot load across. The expectation is independent of the list in checkpoint.py:
  both models are built and their state dicts' names and shapes compared, for every model key
  of the config (a new key fails the test until it is given an alternative value here).
* The trainer (a subprocess, as a user runs it): allowed changes are printed, applied and
  logged with the first step after the resume (``config_changes``); shape changes stop the
  run before anything is built or written, one line per key; a checkpoint that still does not
  fit (no saved config) is refused with every mismatched weight listed, not cut off.
* ``load_checkpoint``'s listing: missing, unexpected and reshaped entries, numbered names
  merged exactly; expert weights re-sliced only across expert-parallel sizes.
* The warm-up error names the key that sets the decay length.
"""
from __future__ import annotations

import json
import shutil
import sys
from functools import lru_cache, partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_moe.training.checkpoint import (CheckpointError, ConfigChange, config_changes, group_numbered,
                                              load_checkpoint, save_checkpoint, shape_changes)
from megatron_moe.training.optimizer import lr_at
from megatron_moe.training.run_config import ConfigError, load_config

sys.path.insert(0, str(Path(__file__).parent))
from _trainer import TINY, read_metrics, run_trainer, tiny_args, tiny_workdir  # noqa: E402

SHAPE_NOTE = "(the checkpoint's weights have the old shape; start a new run with another name=)"


# ----------------------------------------------------------------------------- which keys changed


def test_config_changes_lists_every_differing_key():
    saved = {"name": "a", "model": {"hidden_size": 8, "moe": {"top_k": 1, "num_experts": 4}},
             "train": {"lr": 1e-3, "lr_decay_iters": None, "gone": 1}, "data": {"paths": ["x"]}}
    new = {"name": "a", "model": {"hidden_size": 8, "moe": None},
           "train": {"lr": 3e-4, "lr_decay_iters": 50, "added": True}, "data": {"paths": ["x", "y"]}}
    assert config_changes(saved, new) == [
        ConfigChange("model.moe", {"top_k": 1, "num_experts": 4}, None),
        ConfigChange("train.lr", 1e-3, 3e-4), ConfigChange("train.lr_decay_iters", None, 50),
        ConfigChange("train.added", "(absent)", True), ConfigChange("train.gone", 1, "(absent)"),
        ConfigChange("data.paths", ["x"], ["x", "y"])]
    assert [str(c) for c in config_changes(saved, new)] == [
        "model.moe: {...} -> null", "train.lr: 0.001 -> 0.0003", "train.lr_decay_iters: null -> 50",
        "train.added: (absent) -> true", "train.gone: 1 -> (absent)", 'data.paths: ["x"] -> ["x", "y"]']
    assert config_changes(saved, saved) == []


SMALL = ["model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
         "model.seq_length=16", "model.vocab_size=128", "model.moe.num_experts=4"]

# Another valid value for every model key of the config; the test below fails for a key missing here.
ALTERNATIVES = {
    "model.num_layers": "3", "model.hidden_size": "64", "model.num_attention_heads": "8",
    "model.ffn_hidden_size": "96", "model.seq_length": "32", "model.vocab_size": "256",
    "model.position_embedding_type": "rope", "model.activation": "swiglu", "model.init_method_std": "0.01",
    "model.share_embeddings_and_output_weights": "false", "model.moe": "null",
    "model.moe.num_experts": "8", "model.moe.top_k": "1", "model.moe.mlp_impl": "reference",
    "model.moe.block_size": "64", "model.moe.recompute_activation": "true", "model.moe.a2a_splits": "padded",
    "model.moe.capacity_factor": "2.0", "model.moe.normalize_top_k": "true",
    "model.moe.score_function": "sigmoid", "model.moe.jitter_eps": "0.1", "model.moe.aux_loss_coeff": "0.0",
    "model.moe.z_loss_coeff": "0.0", "model.moe.expert_bias": "true",
    "model.moe.expert_bias_update_rate": "0.01", "model.moe.shared_expert_ffn_hidden_size": "32",
    "model.moe.ffn_hidden_size": "32", "model.moe.moe_layer_freq": "2", "model.moe.expert_parallel_size": "2",
}
# Refused although the shapes stay: the attention heads split the same [3h, h] weight another way.
SAME_SHAPE_OTHER_LAYOUT = {"model.num_attention_heads"}


def _leaves(d: dict, prefix: str) -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def test_every_model_key_has_an_alternative():
    model = load_config(TINY, SMALL).to_dict()["model"]
    assert _leaves(model, "model.") | {"model.moe"} == set(ALTERNATIVES)


@lru_cache(maxsize=None)
def _shapes(overrides: tuple[str, ...]) -> dict:
    """Names and shapes of the state dict of the model the config builds (an independent
    account of what a checkpoint of it holds)."""
    from megatron_moe.megatron import build_gpt_model, init_megatron

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_megatron(1234)
    model = build_gpt_model(load_config(TINY, list(overrides)).model)
    return {n: tuple(v.shape) if torch.is_tensor(v) else None for n, v in model.state_dict().items()}


@pytest.mark.parametrize("base, key, value", [
    *((SMALL, key, value) for key, value in ALTERNATIVES.items()),
    (SMALL + ["model.position_embedding_type=rope"], "model.seq_length", "32"),  # no position table
    (SMALL + ["model.moe.ffn_hidden_size=64"], "model.ffn_hidden_size", "96"),  # experts keep theirs
    (SMALL + ["model.moe.ffn_hidden_size=64", "model.moe.moe_layer_freq=2"], "model.ffn_hidden_size", "96"),
    (SMALL, "model.moe.ffn_hidden_size", "64"),  # = model.ffn_hidden_size, which it stood for
    (SMALL + ["model.moe=null"], "model.num_attention_heads", "8"),
])
def test_shape_changes_are_the_changes_of_the_weights(base, key, value):
    """Changing one key: config_changes names that key alone; shape_changes refuses it exactly
    when the two models' state dicts differ in names or shapes (expert parallelism: never, the
    shards are re-sliced on load; the head count: always)."""
    old, new = load_config(TINY, base).to_dict(), load_config(TINY, [*base, f"{key}={value}"]).to_dict()
    changes = config_changes(old, new)
    assert [c.key for c in changes] == [key]
    if key == "model.moe.expert_parallel_size":  # needs 2 ranks to build: tests/training/test_train.py
        refuse = False                           # resumes an EP=2 checkpoint at EP=1
    else:
        refuse = key in SAME_SHAPE_OTHER_LAYOUT or _shapes(tuple(base)) != _shapes((*base, f"{key}={value}"))
    assert shape_changes(changes, old, new) == (changes if refuse else [])


# ----------------------------------------------------------------------------- the trainer


_run = partial(run_trainer, check=False, timeout=300, OMP_NUM_THREADS="1")  # the tests check the exit status


def _args(workdir: Path, name: str, *extra: str) -> list[str]:
    return tiny_args(workdir, name, "train.train_iters=8", "train.lr_warmup_iters=2", "train.lr=3e-3",
                     "train.min_lr=3e-4", "train.eval_interval=0", "train.save_interval=4", "train.log_interval=1",
                     "logging.wandb=false", *extra)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, small_corpus) -> tuple[Path, Path]:
    """(workdir, run directory) of a run stopped after 4 of 8 steps (a checkpoint at step 4)."""
    workdir = tiny_workdir(tmp_path_factory.mktemp("resume"), small_corpus, total_chars=150_000,
                           max_file_chars=40_000)
    proc = _run(_args(workdir, "base", "train.exit_interval=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, workdir / "runs" / "base"


def _copy(stopped, name: str) -> Path:
    workdir, run_dir = stopped
    shutil.copytree(run_dir, workdir / "runs" / name)
    return workdir / "runs" / name


def test_shape_changes_stop_before_anything_is_built(stopped):
    """hidden size and expert count changed (and the learning rate, which alone could apply): one
    line per refused key after the error line; nothing built, nothing in the run written."""
    workdir, _ = stopped
    run_dir = _copy(stopped, "refused")
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = _run(_args(workdir, "refused", "--resume", "model.hidden_size=256", "model.moe.num_experts=4",
                      "train.lr=1e-3"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == (f"megatron-moe-train: error: cannot resume from {run_dir}/checkpoints/iter_0000004: "
                        "2 config change(s) alter the model's parameters, one per line below; resume with "
                        "the checkpoint's values (MEGATRON_MOE_DEBUG=1 shows the traceback)")
    assert lines[1:] == [f"  model.hidden_size: 128 -> 256 {SHAPE_NOTE}",
                         f"  model.moe.num_experts: 8 -> 4 {SHAPE_NOTE}"]
    assert "data:" not in proc.stdout and "run refused" not in proc.stdout  # nothing was built
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files


def test_other_changes_apply_and_are_logged_with_the_first_step(stopped):
    workdir, _ = stopped
    run_dir = _copy(stopped, "changed")
    proc = _run(_args(workdir, "changed", "--resume", "train.lr=1e-3", "train.train_iters=6",
                      "model.moe.mlp_impl=reference", "train.log_interval=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {"name": ["base", "changed"], "model.moe.mlp_impl": ["triton_grouped", "reference"],
            "train.train_iters": [8, 6], "train.lr": [0.003, 0.001], "train.log_interval": [1, 2],
            "train.exit_interval": [4, None]}
    out = proc.stdout.splitlines()
    at = out.index("config changes since iter_0000004 (they apply from step 5):")
    shown = {"name: base -> changed", "model.moe.mlp_impl: triton_grouped -> reference",
             "train.train_iters: 8 -> 6", "train.lr: 0.003 -> 0.001", "train.log_interval: 1 -> 2",
             "train.exit_interval: 4 -> null"}
    assert {ln.strip() for ln in out[at + 1:at + 1 + len(shown)]} == shown
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["config_changes"] == want
    assert all("config_changes" not in r for i, r in enumerate(rows) if i != 4)
    new = load_config(run_dir / "config.yaml").train  # rewritten with the new config
    assert new.lr == 1e-3 and new.train_iters == 6
    assert rows[4]["lr"] == pytest.approx(lr_at(4, new)) != pytest.approx(rows[3]["lr"])


def test_a_checkpoint_without_its_config_lists_every_mismatch(stopped):
    """Without meta.json's config nothing is refused beforehand: the model is built with the new
    hidden size and the load names every reshaped weight, layer numbers merged, in full."""
    workdir, _ = stopped
    run_dir = _copy(stopped, "noconfig")
    meta_path = run_dir / "checkpoints" / "iter_0000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]
    meta_path.write_text(json.dumps(meta))
    proc = _run(_args(workdir, "noconfig", "--resume", "model.hidden_size=256"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(f"megatron-moe-train: error: checkpoint {run_dir}/checkpoints/iter_0000004 does "
                               "not fit this model (was the model config changed?)")
    L = "  shape: decoder.layers.{0..1}"
    assert lines[1:] == [
        "  shape: embedding.word_embeddings.weight: [512, 128] -> [512, 256]",
        "  shape: embedding.position_embeddings.weight: [64, 128] -> [64, 256]",
        f"{L}.input_layernorm.weight: [128] -> [256]", f"{L}.input_layernorm.bias: [128] -> [256]",
        f"{L}.self_attention.linear_proj.weight: [128, 128] -> [256, 256]",
        f"{L}.self_attention.linear_proj.bias: [128] -> [256]",
        f"{L}.self_attention.linear_qkv.weight: [384, 128] -> [768, 256]",
        f"{L}.self_attention.linear_qkv.bias: [384] -> [768]",
        f"{L}.pre_mlp_layernorm.weight: [128] -> [256]", f"{L}.pre_mlp_layernorm.bias: [128] -> [256]",
        f"{L}.mlp.moe.router.weight: [8, 128] -> [8, 256]",
        f"{L}.mlp.moe.experts.w1: [8, 128, 512] -> [8, 256, 512]",
        f"{L}.mlp.moe.experts.w2: [8, 512, 128] -> [8, 512, 256]",
        "  shape: decoder.final_layernorm.weight: [128] -> [256]",
        "  shape: decoder.final_layernorm.bias: [128] -> [256]"]


# ----------------------------------------------------------------------------- load_checkpoint's listing


class _Layer(nn.Module):
    def __init__(self, hidden: int, experts: int, expert_bias: bool):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.moe = nn.Module()
        self.mlp.moe.router = nn.Linear(hidden, experts, bias=False)
        if expert_bias:
            self.mlp.moe.router.register_buffer("expert_bias", torch.zeros(experts))
        self.mlp.moe.experts = nn.Module()
        self.mlp.moe.experts.w1 = nn.Parameter(torch.randn(experts, hidden, 2 * hidden))


class _Net(nn.Module):
    def __init__(self, hidden: int, expert_bias: bool = False, head: bool = False):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(_Layer(hidden, 4, expert_bias) for _ in range(6))
        if head:
            self.head = nn.Linear(hidden, 3, bias=False)


def test_load_lists_missing_unexpected_and_reshaped_weights(tmp_path):
    path = save_checkpoint(tmp_path, 1, _Net(8, head=True), None, {})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, _Net(12, expert_bias=True), restore_rng=False)
    assert str(e.value).splitlines() == [
        f"checkpoint {path} does not fit this model (was the model config changed?); its weights against "
        "the model's, one kind and pattern per line below",
        "  missing: decoder.layers.{0..5}.mlp.moe.router.expert_bias [4]",
        "  unexpected: head.weight [3, 8]",
        "  shape: decoder.layers.{0..5}.mlp.moe.router.weight: [4, 8] -> [4, 12]",
        "  shape: decoder.layers.{0..5}.mlp.moe.experts.w1: [4, 8, 16] -> [4, 12, 24]"]


def test_numbered_names_merge_into_exactly_the_numbers_they_stand_for():
    rows = [(f"layers.{i}.w", "shape", ": [2] -> [3]") for i in (0, 1, 2, 5, 9, 10)]
    rows += [("layers.3.w", "shape", ": [2] -> [4]"), ("layers.4.w", "missing", " [2]")]
    rows += [(f"layers.{i}.experts.{j}.b", "missing", " [1]") for i in (0, 1) for j in (0, 1, 2)]
    rows += [("layers.2.experts.0.b", "missing", " [1]"), ("final.w", "unexpected", " [2]")]
    assert group_numbered(rows) == [
        ("layers.{0..2,5,9..10}.w", "shape", ": [2] -> [3]"), ("layers.3.w", "shape", ": [2] -> [4]"),
        ("layers.4.w", "missing", " [2]"), ("layers.{0..2}.experts.0.b", "missing", " [1]"),
        ("layers.{0..1}.experts.{1..2}.b", "missing", " [1]"), ("final.w", "unexpected", " [2]")]


class _Experts(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.arange(2.0 * n).reshape(n, 2))
        self.w.expert_parallel = True


def test_expert_weights_are_resliced_only_across_expert_parallel_sizes(tmp_path):
    """8 saved experts load as experts 4..7 on expert-parallel rank 1 of 2; into a model of 4
    experts without expert parallelism they do not fit (they used to load their first half)."""
    path = save_checkpoint(tmp_path, 1, _Experts(8), None, {})
    rank1 = _Experts(4)
    load_checkpoint(path, rank1, restore_rng=False, groups=SimpleNamespace(ep_rank=1, ep_size=2))
    assert torch.equal(rank1.w.detach(), torch.arange(8.0, 16.0).reshape(4, 2))
    with pytest.raises(CheckpointError, match=r"\n  shape: w: \[8, 2\] -> \[4, 2\]$"):
        load_checkpoint(path, _Experts(4), restore_rng=False)


# ----------------------------------------------------------------------------- the warm-up


@pytest.mark.parametrize("overrides, message", [
    (["train.train_iters=20", "train.lr_warmup_iters=100"],
     "train.lr_warmup_iters=100 is invalid: expected <= the decay length (train.train_iters=20, as "
     "train.lr_decay_iters is null): lower train.lr_warmup_iters or raise train.train_iters"),
    (["train.lr_decay_iters=50", "train.lr_warmup_iters=100"],
     "train.lr_warmup_iters=100 is invalid: expected <= the decay length (train.lr_decay_iters=50): lower "
     "train.lr_warmup_iters or raise train.lr_decay_iters"),
])
def test_warmup_longer_than_the_decay_names_both_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert str(e.value) == message
