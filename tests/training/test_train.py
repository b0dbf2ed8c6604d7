"""The training program on the CPU: loss falls, metrics, W&B offline, checkpoints, resume.

    pytest tests/training/test_train.py -q            # about 1-2 minutes on 2 cores

Training runs as ``python -m megatron_moe.training`` subprocesses (as a user runs it) with
TRITON_INTERPRET unset, so the grouped MoE path takes its fast PyTorch fallback; the data is
a small slice of the Python standard library's sources with a 512-piece tokenizer, prepared
once per session. Unit tests below cover the pieces (schedule, clipping, sampler, reducer,
optimizer groups, checkpoint atomicity) against independent references.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

from megatron_moe.training.checkpoint import (CheckpointError, get_rng_state, latest_checkpoint,
                                     load_checkpoint, save_checkpoint, set_rng_state,
                                     verify_checkpoint)
from megatron_moe.training.data import build_datasets, prepare_data, split_tokens
from megatron_moe.training.metrics import MetricsLogger, ep_rank_imbalance, expert_load_stats
from megatron_moe.training.run_config import load_config
from megatron_moe.training.grad_reduce import GradReducer, clip_grad_norm
from megatron_moe.training.data import MicroBatchSampler
from megatron_moe.training.optimizer import build_optimizer, lr_at
from megatron_moe.training.train import TrainError, pretrain

sys.path.insert(0, str(Path(__file__).parent))
from _trainer import REPO, TINY, read_metrics, run_trainer, tiny_args, tiny_workdir, trainer_env  # noqa: E402

STEPS = 16  # straight run; the resume test runs 8 + 8
EVAL_EVERY = 8


# ----------------------------------------------------------------------------- helpers


_run = partial(run_trainer, timeout=400)  # the torchrun runs pass OMP_NUM_THREADS="1" themselves


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, small_corpus) -> Path:
    """A small corpus (stdlib sources, ~300 KB) and the directories the runs share."""
    return tiny_workdir(tmp_path_factory.mktemp("train"), small_corpus, total_chars=300_000, max_file_chars=60_000)


def _overrides(workdir: Path, name: str, *extra: str) -> list[str]:
    return tiny_args(workdir, name, f"train.train_iters={STEPS}", "train.lr_warmup_iters=4", "train.lr=3e-3",
                     "train.min_lr=3e-4", f"train.eval_interval={EVAL_EVERY}", "train.eval_iters=2",
                     "train.save_interval=8", "train.log_interval=4", *extra)


@pytest.fixture(scope="module")
def straight(workdir) -> Path:
    """16 steps straight through, W&B on (offline)."""
    _run(_overrides(workdir, "straight", "logging.wandb=true", "logging.wandb_mode=auto"))
    return workdir / "runs" / "straight"


# ----------------------------------------------------------------------------- end to end


def test_loss_falls(straight):
    losses = [r["lm_loss"] for r in read_metrics(straight)]
    assert len(losses) == STEPS
    assert losses[0] > math.log(512) - 0.5  # starts near uniform over the vocabulary
    assert sum(losses[-4:]) / 4 < losses[0] - 0.7, losses  # measured: 6.24 -> 5.1
    vals = [r["val_loss"] for r in read_metrics(straight) if "val_loss" in r]
    assert len(vals) == STEPS // EVAL_EVERY and vals[-1] < vals[0]


def test_metrics_jsonl_has_every_key(straight):
    rows = read_metrics(straight)
    cfg = load_config(straight / "config.yaml")
    every = {"step", "consumed_samples", "tokens", "lm_loss", "aux_loss", "z_loss", "lr",
             "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "step_time_s", "peak_mem_gb",
             "peak_reserved_gb"}
    for layer in (1, 2):
        every |= {f"expert_load/layer{layer}/{k}" for k in ("min_share", "max_share", "cv")}
    for i, r in enumerate(rows, start=1):
        assert every <= set(r), every - set(r)
        assert r["step"] == i and r["consumed_samples"] == 8 * i and r["tokens"] == 8 * 64 * i
        assert r["lr"] == pytest.approx(lr_at(i - 1, cfg.train))
        assert r["mfu"] is None and r["peak_mem_gb"] is None and r["peak_reserved_gb"] is None  # CPU: no CUDA memory
        assert r["tflops_per_gpu"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["aux_loss"] > 0 and r["z_loss"] > 0  # tiny-cpu has both coefficients
        for layer in (1, 2):
            lo, hi = r[f"expert_load/layer{layer}/min_share"], r[f"expert_load/layer{layer}/max_share"]
            assert 0 <= lo <= 1 / 8 <= hi <= 1
        assert "dropped_fraction" not in r  # dropless
        # the data's size and the epochs the run reads, once, with the first step
        assert ("data_train_tokens" in r) == ("data_epochs" in r) == (i == 1)
        assert r.get("world_size", 1) == 1 and ("world_size" in r) == (i == 1)  # the processes, once
        assert ("val_loss" in r) == (i % EVAL_EVERY == 0)
        if "val_loss" in r:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-6)


def test_first_row_reports_the_training_data(straight):
    cfg = load_config(straight / "config.yaml")
    first = read_metrics(straight)[0]
    # the train split's tokens (split_tokens is checked against the tokenizer in test_data.py)
    train_ds = build_datasets(cfg.data, prepare_data(cfg.data), seq_length=cfg.model.seq_length,
                              seed=cfg.train.seed, num_samples=(8, 1, 1),
                              model_vocab_size=cfg.model.vocab_size)[0]
    assert first["data_train_tokens"] == split_tokens(train_ds) > 0
    read = cfg.train.train_iters * cfg.train.global_batch_size * cfg.model.seq_length
    assert first["data_epochs"] == pytest.approx(read / first["data_train_tokens"])


def test_wandb_offline_run_exists(straight):
    runs = list((straight / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((straight / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), "the offline run has no .wandb log"
    run_id = (straight / "wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(run_id)


def test_checkpoint_exists_and_loads(straight):
    ckpt = latest_checkpoint(straight)
    assert ckpt is not None and ckpt.name == f"iter_{STEPS:07d}"
    assert (straight / "checkpoints" / "iter_0000008").is_dir()  # save_interval 8
    meta = verify_checkpoint(ckpt)
    assert meta["step"] == STEPS and meta["consumed_samples"] == STEPS * 8
    assert meta["config"] == load_config(straight / "config.yaml").to_dict()
    state = torch.load(ckpt / "model.pt", weights_only=True)
    expert_keys = [k for k in state if k.endswith("experts.w1")]
    assert len(expert_keys) == 2 and state[expert_keys[0]].shape == (8, 128, 512)
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert opt["state"] and {g["weight_decay"] for g in opt["param_groups"]} == {0.1, 0.0}
    assert (ckpt / "rng_rank00000.pt").exists()
    assert not list((straight / "checkpoints").glob(".tmp-*"))


def test_resume_matches_straight(workdir, straight):
    """8 steps, stop (train.exit_interval), --resume 8 more == 16 straight, bit for bit."""
    args = _overrides(workdir, "resumed", "logging.wandb=false")
    first = _run(args + ["train.exit_interval=8"])
    run_dir = workdir / "runs" / "resumed"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))
    assert "continue with --resume" in first.stdout
    second = _run(args + ["--resume"])
    assert "resumed from" in second.stdout
    got = [r["lm_loss"] for r in read_metrics(run_dir)]
    want = [r["lm_loss"] for r in read_metrics(straight)]
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)
    got_val = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    want_val = [r["val_loss"] for r in read_metrics(straight) if "val_loss" in r]
    assert got_val == pytest.approx(want_val, abs=1e-6)
    # the final weights agree too
    a = torch.load(latest_checkpoint(run_dir) / "model.pt", weights_only=True)
    b = torch.load(latest_checkpoint(straight) / "model.pt", weights_only=True)
    tensors = [k for k in b if isinstance(b[k], torch.Tensor)]
    assert len(tensors) > 10
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in tensors)


def test_data_parallel_two_ranks_matches_one(workdir, straight):
    """torchrun 2 CPU ranks (gloo): same global batch, same losses as one process."""
    _run(_overrides(workdir, "dp2", "logging.wandb=false", "train.exit_interval=4"),
         nproc=2, OMP_NUM_THREADS="1")
    got = [r["lm_loss"] for r in read_metrics(workdir / "runs" / "dp2")]
    want = [r["lm_loss"] for r in read_metrics(straight)][:4]
    assert got == pytest.approx(want, abs=2e-5)


def test_the_micro_batch_size_leaves_the_training_unchanged(workdir):
    """Global batch 8 as 4, 2 or 1 micro-batches: the same losses and gradient norms to fp32 rounding.
    The load-balancing and z losses are off: they are computed per micro-batch, so their value
    depends on how the global batch is split (GPU runs at micro-batch 64 and 128 part after ~20
    steps: docs/performance.md, "The step once the router has spread out")."""
    rows = {}
    for mb in (2, 4, 8):
        name = f"mb{mb}"
        _run(_overrides(workdir, name, "logging.wandb=false", "train.exit_interval=4", f"train.micro_batch_size={mb}",
                        "model.moe.aux_loss_coeff=0", "model.moe.z_loss_coeff=0"))
        rows[mb] = read_metrics(workdir / "runs" / name)
    assert [len(r) for r in rows.values()] == [4, 4, 4]
    for mb in (2, 8):
        for key in ("lm_loss", "grad_norm"):
            assert [r[key] for r in rows[mb]] == pytest.approx([r[key] for r in rows[4]], rel=1e-5), (mb, key)


@pytest.mark.parametrize("ep,bf16", [(1, False), (2, False), (2, True)])
def test_overlap_grad_reduce_matches_plain(workdir, ep, bf16):
    """train.overlap_grad_reduce (bucket all-reduces started during the last backward) gives the
    plain reduction's losses: 2 gloo ranks, 2 micro-batches each, data and expert parallelism;
    with bf16 parameters the buckets start from precision.BF16Params' readiness calls."""
    losses = {}
    hooks = ["--bf16-on-cpu"] if bf16 else []
    for overlap in ("false", "true"):
        name = f"ovl-ep{ep}-{'bf16' if bf16 else 'fp32'}-{overlap}"
        out = _run(_overrides(workdir, name, "logging.wandb=false", "train.exit_interval=4", "train.micro_batch_size=2",
                              f"model.moe.expert_parallel_size={ep}", f"train.overlap_grad_reduce={overlap}"),
                   nproc=2, OMP_NUM_THREADS="1", hooks=hooks)
        assert ("bf16 params (fp32 masters)" in out.stdout) == bf16
        losses[overlap] = [r["lm_loss"] for r in read_metrics(workdir / "runs" / name)]
    assert len(losses["true"]) == 4 and losses["true"] == pytest.approx(losses["false"], abs=1e-6)


def test_bf16_params_resume_is_exact_and_tracks_fp32(workdir, straight):
    """bf16 compute copies over fp32 masters (forced on the CPU): 8 steps + --resume 8 equal 16
    straight bit for bit (the checkpoint holds the fp32 masters; the copies are re-rounded on
    load), and the losses stay within bf16 noise of the fp32 run; without the gradient-accumulation
    fusion and with autocast (bf16_params=false) as well."""
    env = {"hooks": ["--bf16-on-cpu"]}
    out = _run(_overrides(workdir, "bf16-straight", "logging.wandb=false"), **env)
    assert "bf16 params (fp32 masters)" in out.stdout
    args = _overrides(workdir, "bf16-resumed", "logging.wandb=false")
    _run(args + ["train.exit_interval=8"], **env)
    _run(args + ["--resume"], **env)
    want = [r["lm_loss"] for r in read_metrics(workdir / "runs" / "bf16-straight")]
    got = [r["lm_loss"] for r in read_metrics(workdir / "runs" / "bf16-resumed")]
    assert len(got) == STEPS and got == want
    state = torch.load(latest_checkpoint(workdir / "runs" / "bf16-straight") / "model.pt", weights_only=True)
    floats = [v for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert all(v.dtype == torch.float32 for v in floats)
    fp32 = [r["lm_loss"] for r in read_metrics(straight)]
    assert max(abs(a - b) for a, b in zip(want, fp32)) < 0.05, (want, fp32)
    assert want != fp32  # it really ran in bf16
    # the experts' gradients through a bf16 tensor and a separate add (no fusion): same model
    _run(_overrides(workdir, "bf16-unfused", "logging.wandb=false", "train.grad_accumulation_fusion=false",
                    "train.exit_interval=4"), **env)
    unfused = [r["lm_loss"] for r in read_metrics(workdir / "runs" / "bf16-unfused")]
    assert len(unfused) == 4 and max(abs(a - b) for a, b in zip(unfused, want)) < 0.02, (unfused, want)
    out = _run(_overrides(workdir, "bf16-autocast", "logging.wandb=false", "train.bf16_params=false",
                          "train.exit_interval=4"), **env)
    assert "bf16 autocast" in out.stdout
    auto = [r["lm_loss"] for r in read_metrics(workdir / "runs" / "bf16-autocast")]
    assert max(abs(a - b) for a, b in zip(auto, fp32)) < 0.05 and auto != fp32[:4]


def test_capacity_model_logs_dropped_fraction(workdir, straight):
    _run(_overrides(workdir, "capacity", "logging.wandb=false", "train.exit_interval=2",
                    "model.moe.mlp_impl=capacity", "model.moe.capacity_factor=1.0"))
    rows = read_metrics(workdir / "runs" / "capacity")
    assert len(rows) == 2
    for r in rows:
        per_layer = [r["dropped_fraction/layer1"], r["dropped_fraction/layer2"]]
        assert all(0 <= v < 1 for v in per_layer)
        assert r["dropped_fraction"] == pytest.approx(sum(per_layer) / 2)


@pytest.mark.parametrize("impl,bf16", [("triton_grouped", False), ("torch_grouped_mm", False), ("blocksparse", False),
                                       ("triton_grouped", True)])
def test_one_expert_trains_as_the_dense_mlp(workdir, impl, bf16):
    """An MoE of one expert (top-1: its softmax weight is exactly 1) from the dense model's
    initial weights trains as megatron-core's dense MLP does (its biases removed: the experts
    have none): same losses and gradient norms step for step, over gradient
    accumulation (2 micro-batches), clipping (active at first: the norms start above 1), weight
    decay and the learning-rate schedule. The reference is megatron-core's own MLP in the same
    training loop, so this checks the experts' path through training (parameter groups, the
    gradients' accumulation, the norm) against one that does not use any of our MoE code.
    Checked to fail when the experts skip weight decay (fp32) and when the fused accumulation
    overwrites the first micro-batch's gradient (bf16)."""
    init = workdir / f"one-expert-init-{impl}-{bf16}.pt"
    logs = {}
    for mode, extra in (("dense", ["model.moe=null"]),
                        ("moe", ["model.moe.num_experts=1", "model.moe.top_k=1", f"model.moe.mlp_impl={impl}",
                                 "model.moe.aux_loss_coeff=0", "model.moe.z_loss_coeff=0"])):
        name = f"one-expert-{impl}-{'bf16' if bf16 else 'fp32'}-{mode}"
        args = _overrides(workdir, name, "logging.wandb=false", "train.exit_interval=6",
                          "train.eval_interval=0", *extra)
        hooks = ["--bf16-on-cpu"] if bf16 else []
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_one_expert_worker.py")), mode,
                               str(init), *hooks, "--", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=400, env=trainer_env())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        logs[mode] = read_metrics(workdir / "runs" / name)
    dense, moe = logs["dense"], logs["moe"]
    assert len(dense) == len(moe) == 6
    assert dense[0]["grad_norm"] > 1.0  # clipping is exercised
    # measured: fp32 <= 1.2e-7 relative; bf16 parameters (grouped: gradient-accumulation fusion
    # into the fp32 masters) <= 1.5e-5 in the loss and <= 2.7e-4 in the norm
    tol = {"lm_loss": 1e-4, "grad_norm": 2e-3} if bf16 else {"lm_loss": 5e-6, "grad_norm": 5e-6}
    for key, rel in tol.items():
        assert [r[key] for r in moe] == pytest.approx([r[key] for r in dense], rel=rel, abs=0), key
    assert all(r["aux_loss"] == 0 for r in moe)


def test_pretrain_script_launches_torchrun(workdir):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "pretrain.sh"), str(TINY),
                           "--print-config", "train.seed=5"], cwd=REPO, env=trainer_env(NPROC="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seed: 5" in proc.stdout


def test_launch_scripts_parse():
    for script in ("scripts/pretrain.sh", "scripts/slurm/pretrain.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    sbatch = (REPO / "scripts" / "slurm" / "pretrain.sbatch").read_text()
    assert "NCCL_NVLS_ENABLE" in sbatch and "--rdzv-backend=c10d" in sbatch


# ----------------------------------------------------------------------------- refusals


def test_fresh_run_refuses_a_run_dir_with_checkpoints(straight, workdir):
    cfg = load_config(TINY, [f"logging.runs_dir={workdir / 'runs'}", "name=straight",
                             "train.train_iters=16", "train.lr_warmup_iters=4"])
    with pytest.raises(TrainError, match=r"already holds checkpoints .*--resume"):
        pretrain(cfg, resume=False)


def test_global_batch_must_divide(monkeypatch, tmp_path):
    # the data-parallel size comes from WORLD_SIZE before torch.distributed is initialised (an
    # earlier test may have initialised a world of one in this process: hide it); one step at
    # most should the check ever be missed
    import megatron_moe.training.train as train_mod

    monkeypatch.setattr(train_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config(TINY, [f"logging.runs_dir={tmp_path}", "train.exit_interval=1", "logging.wandb=false"])
    with pytest.raises(TrainError, match=r"train\.global_batch_size=16 is not divisible by "
                                         r"train\.micro_batch_size \(8\) x data-parallel size \(3\)"):
        pretrain(cfg)


def test_cli_reports_bad_data_in_one_line(workdir):
    proc = _run(_overrides(workdir, "nodata", "data.paths=[/no/such/file.txt]",
                           "logging.wandb=false"), check=False)
    assert proc.returncode in (1, 2)
    assert "/no/such/file.txt" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- units


class _TC:
    lr, min_lr, lr_warmup_iters, train_iters = 1.0, 0.1, 10, 110
    decay_iters = 110


def test_lr_schedule():
    tc = _TC()
    assert [lr_at(s, tc) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(10, tc) == pytest.approx(1.0)
    assert lr_at(60, tc) == pytest.approx(0.55)  # cosine midpoint: (lr + min_lr) / 2
    assert lr_at(35, tc) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, tc) == pytest.approx(0.1) and lr_at(500, tc) == pytest.approx(0.1)
    values = [lr_at(s, tc) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # tied: one parameter
        self.w = nn.Parameter(torch.randn(2, 4, 4))
        self.w.expert_parallel = True

    def forward(self, x):
        h = self.norm(self.emb(x))
        h = self.fc(h) + torch.einsum("bh,ehk->bk", h, self.w)
        return self.out(h)


def test_clip_grad_norm_counts_each_parameter_once():
    torch.manual_seed(0)
    m = _Tied()
    m(torch.tensor([1, 2, 3])).square().sum().backward()
    params = list(m.parameters())  # deduplicated by nn.Module
    assert sum(p is m.emb.weight for p in params) == 1
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    ref = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, max_norm=0.5)
    assert float(norm) == pytest.approx(float(want), rel=1e-5)
    for p, g in zip(params, ref):
        torch.testing.assert_close(p.grad, g * (0.5 / (float(want) + 1e-6)), rtol=1e-5, atol=0)
    before = [p.grad.clone() for p in params]
    clip_grad_norm(params, max_norm=0.0)  # 0 = measure only
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))


def test_optimizer_no_decay_on_biases_and_norms():
    m = _Tied()

    class TC:
        lr, weight_decay, adam_beta1, adam_beta2, adam_eps, fused_optimizer = 1e-3, 0.1, 0.9, 0.95, 1e-8, True
        adam_moments_dtype = "fp32"

    opt = build_optimizer(m, TC)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decay == {id(m.emb.weight), id(m.fc.weight), id(m.w)}
    assert no_decay == {id(m.norm.weight), id(m.norm.bias), id(m.fc.bias)}
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_micro_batch_sampler_partitions_each_global_batch():
    B, micro, dp = 16, 2, 4  # 2 micro-batches per rank per step
    ranks = [list(MicroBatchSampler(32, 96, micro, r, dp)) for r in range(dp)]
    assert all(len(x) == 8 for x in ranks)  # 4 steps x 2 micro-batches
    for step in range(4):
        seen = sorted(i for r in ranks for mb in r[2 * step:2 * step + 2] for i in mb)
        assert seen == list(range(32 + step * B, 32 + (step + 1) * B))
    # one rank, resumed at any step boundary, reads what it would have read straight
    full = list(MicroBatchSampler(0, 96, micro, 1, dp))
    assert list(MicroBatchSampler(32, 96, micro, 1, dp)) == full[4:]


def test_grad_reducer_single_process_keeps_grads_and_fills_missing():
    m = _Tied()
    m(torch.tensor([1])).sum().backward()
    m.w.grad = None  # e.g. a parameter unused this step
    params = list(m.parameters())
    before = {id(p): p.grad.clone() for p in params if p.grad is not None}
    red = GradReducer(params, bucket_numel=16)
    assert [id(p) for p in red.expert] == [id(m.w)] and all(p is not m.w for p in red.dense)
    assert len(list(red._buckets(red.dense))) > 1
    red.reduce()
    assert torch.equal(m.w.grad, torch.zeros_like(m.w))
    assert all(torch.equal(p.grad, before[id(p)]) for p in params if id(p) in before)


def test_expert_load_stats():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 4.0, 2.0, 2.0]])
    s = expert_load_stats(counts, ["layer1", "layer3"])
    assert s["expert_load/layer1/cv"] == 0 and s["expert_load/layer1/min_share"] == 0.25
    assert s["expert_load/layer3/max_share"] == 0.5 and s["expert_load/layer3/min_share"] == 0.125
    c = counts[1].double()
    assert s["expert_load/layer3/cv"] == pytest.approx(float(c.std(unbiased=False) / c.mean()))


def test_ep_rank_imbalance():
    # 8 experts over 2 ranks (experts 0-3, 4-7) and over 4 ranks (pairs); a plain loop as reference
    counts = torch.tensor([[1.0, 1, 1, 1, 1, 1, 1, 1], [6.0, 0, 0, 0, 1, 0, 0, 1], [0.0] * 8])
    names = ["layer1", "layer2", "layer3"]
    assert ep_rank_imbalance(counts, names, 1) == {}
    for ep in (2, 4):
        s = ep_rank_imbalance(counts, names, ep)
        want = {}
        for name, row in zip(names[:2], counts[:2].tolist()):
            per = [sum(row[r * 8 // ep:(r + 1) * 8 // ep]) for r in range(ep)]
            want[name] = max(per) / (sum(per) / ep)
        assert s["expert_load/layer1/ep_rank_imbalance"] == pytest.approx(1.0)
        assert s["expert_load/layer2/ep_rank_imbalance"] == pytest.approx(want["layer2"])
        assert "expert_load/layer3/ep_rank_imbalance" not in s  # no tokens: no ratio
        assert s["expert_load/ep_rank_imbalance"] == pytest.approx((1.0 + want["layer2"]) / 2)
    assert ep_rank_imbalance(torch.tensor([[0.0, 0, 9, 0]]), ["l"], 4)["expert_load/l/ep_rank_imbalance"] == 4.0
    with pytest.raises(ValueError, match="8 experts do not split over ep_size=3"):
        ep_rank_imbalance(counts, names, 3)


def test_a2a_rows_sent_and_gb():
    """The rows a rank's tokens send to the group's other ranks (a loop over layers and experts as
    reference), and the GB per rank a step's four exchanges of them carry."""
    from megatron_moe.training.metrics import a2a_gb, a2a_rows_sent

    counts = torch.tensor([[3.0, 0, 5, 1, 2, 2, 0, 7], [0.0, 0, 0, 0, 4, 0, 0, 0]])
    for ep in (2, 4, 8):
        El = 8 // ep
        for rank in range(ep):
            want = sum(v for row in counts.tolist() for e, v in enumerate(row) if e // El != rank)
            got = a2a_rows_sent(counts, ep, rank)
            assert got.dim() == 0 and float(got) == want, (ep, rank)
    # 1000 rows sent over 4 ranks, 1536-byte rows: each goes there and back, forward and backward
    assert a2a_gb(1000.0, 4, 1536) == pytest.approx(4 * 250 * 1536 / 1e9)
    assert a2a_gb(1000.0, 4, 1536, padded_rows=3000) == pytest.approx(4 * 3000 * 1536 / 1e9)


def test_metrics_logger_truncates_on_resume_and_writes_null(tmp_path):
    class Cfg:
        class logging:
            wandb = False

    log = MetricsLogger(Cfg, tmp_path, enabled=True)
    for step in (1, 2, 3):
        log.log({"lm_loss": float(step), "mfu": None}, step)
    log.log({"lm_loss": float("nan")}, 4)
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[3]["lm_loss"] is None and rows[0]["mfu"] is None
    MetricsLogger(Cfg, tmp_path, enabled=True, resume_step=2).close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not MetricsLogger(Cfg, tmp_path / "other", enabled=False).enabled
    assert not (tmp_path / "other").exists()  # only rank 0 writes


# ----------------------------------------------------------------------------- checkpoints


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_checkpoint_round_trip_restores_everything(tmp_path):
    m, opt = _model_and_opt(0)
    torch.manual_seed(123)
    save_checkpoint(tmp_path, 5, m, opt, {"consumed_samples": 40})
    expect_next = torch.rand(3)
    m2, opt2 = _model_and_opt(1)
    torch.manual_seed(999)
    meta = load_checkpoint(latest_checkpoint(tmp_path), m2, opt2)
    assert meta["step"] == 5 and meta["consumed_samples"] == 40
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expect_next)  # the RNG continues where it was saved


def test_rng_state_round_trip():
    import random

    import numpy as np

    state = get_rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


_CRASH = r"""
import os, sys, torch, torch.nn as nn
import megatron_moe.training.checkpoint as ck
torch.manual_seed(7)
m = nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
where = sys.argv[2]
real_rename, real_replace = os.rename, os.replace
def die(*a, **k):
    os._exit(9)  # the process is killed: no cleanup, no exception handlers
if where == "before_rename":
    ck.os.rename = die
else:
    ck.os.replace = die
ck.save_checkpoint(sys.argv[1], 2, m, opt, {"consumed_samples": 16})
"""


@pytest.mark.parametrize("where", ["before_rename", "before_latest"])
def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path, where):
    m, opt = _model_and_opt(0)
    save_checkpoint(tmp_path, 1, m, opt, {"consumed_samples": 8})
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path), where], env=trainer_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "iter_0000001"
    if where == "before_rename":
        assert (root / ".tmp-iter_0000002").is_dir() and not (root / "iter_0000002").exists()
    else:
        assert (root / "iter_0000002").is_dir()  # complete, but latest was not moved yet
    m2, opt2 = _model_and_opt(3)
    meta = load_checkpoint(latest_checkpoint(tmp_path), m2, opt2)
    assert meta["step"] == 1
    assert all(torch.equal(saved[k], v) for k, v in m2.state_dict().items())
    # the next save of step 2 goes through (stale temp dir / existing dir replaced)
    save_checkpoint(tmp_path, 2, m2, opt2, {"consumed_samples": 16})
    assert latest_checkpoint(tmp_path).name == "iter_0000002"
    assert not list(root.glob(".tmp-*")) and not list(root.glob(".old-*"))
    verify_checkpoint(root / "iter_0000002")


def test_each_rank_takes_its_expert_rows_from_the_shards():
    """_rank_rows against concatenate-then-slice: every saved/loading expert-parallel size pair of
    1, 2, 4 and 8 over 8 experts (a rank's rows inside one shard, or spanning several), and all
    rows when the saved number of experts is not the model's (the load then reports it)."""
    from megatron_moe.training.checkpoint import _rank_rows

    full = torch.arange(8 * 3.0).reshape(8, 3)
    for saved in (1, 2, 4, 8):
        parts = list(full.chunk(saved))
        for ep in (1, 2, 4, 8):
            n = 8 // ep
            for r in range(ep):
                assert torch.equal(_rank_rows(parts, n, r, ep), full[r * n:(r + 1) * n]), (saved, ep, r)
    assert torch.equal(_rank_rows(list(full.chunk(2)), 3, 1, 2), full)  # 8 saved, 6 in the model


def test_incomplete_or_mismatched_checkpoint_is_refused(tmp_path):
    m, opt = _model_and_opt(0)
    path = save_checkpoint(tmp_path, 3, m, opt, {"consumed_samples": 24})
    with open(path / "model.pt", "r+b") as f:  # a torn write
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"incomplete: model\.pt has 10 bytes"):
        load_checkpoint(path, m, opt)
    path = save_checkpoint(tmp_path, 4, m, opt, {"consumed_samples": 32})
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: optimizer\.pt is missing"):
        verify_checkpoint(path)
    path = save_checkpoint(tmp_path, 5, m, opt, {"consumed_samples": 40})
    with pytest.raises(CheckpointError, match=r"does not fit this model"):
        load_checkpoint(path, nn.Linear(4, 2))
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        verify_checkpoint(path)
    (tmp_path / "checkpoints" / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"latest is corrupt"):
        latest_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- expert parallelism


def test_expert_parallel_training_matches_and_reshards(workdir, straight):
    """EP=2 over 2 gloo ranks: 8 steps, stop, resume 8 more == 16 straight on one process (fp32
    tolerance); the EP checkpoint stores each expert once (dense in model.pt, experts in
    per-rank shards) and also resumes on one process without EP (re-sliced experts)."""
    import shutil

    args = _overrides(workdir, "ep2", "logging.wandb=false", "model.moe.expert_parallel_size=2")
    _run(args + ["train.exit_interval=8"], nproc=2, OMP_NUM_THREADS="1")
    run_dir = workdir / "runs" / "ep2"
    ckpt = latest_checkpoint(run_dir)
    dense = torch.load(ckpt / "model.pt", weights_only=True)
    shards = [torch.load(ckpt / f"experts_ep{j:03d}.pt", weights_only=True) for j in range(2)]
    assert not [k for k in dense if ".experts." in k]
    full = torch.load(latest_checkpoint(straight).parent / "iter_0000008" / "model.pt", weights_only=True)
    for name, t in shards[0]["params"].items():
        assert t.shape[0] == 4 and torch.allclose(torch.cat([t, shards[1]["params"][name]]), full[name], atol=2e-5)
    shutil.copytree(run_dir, workdir / "runs" / "ep2to1")

    _run(args + ["--resume"], nproc=2, OMP_NUM_THREADS="1")
    want = [r["lm_loss"] for r in read_metrics(straight)]
    got = [r["lm_loss"] for r in read_metrics(run_dir)]
    assert len(got) == STEPS and got == pytest.approx(want, abs=5e-5)
    imb = [r["expert_load/ep_rank_imbalance"] for r in read_metrics(run_dir)]  # 1 (balanced) to 2 (one rank)
    assert len(imb) == STEPS and all(1.0 <= v <= 2.0 for v in imb)
    assert not any("ep_rank_imbalance" in k for r in read_metrics(straight) for k in r)

    to1 = _overrides(workdir, "ep2to1", "logging.wandb=false", "model.moe.expert_parallel_size=1")
    out = _run(to1 + ["--resume"])
    assert "resumed from" in out.stdout
    got1 = [r["lm_loss"] for r in read_metrics(workdir / "runs" / "ep2to1")]
    assert len(got1) == STEPS and got1 == pytest.approx(want, abs=5e-5)


def test_a_checkpoint_without_expert_parallelism_resumes_with_it(workdir, straight):
    """The reverse of the re-slicing above: the one-process run's step-8 checkpoint resumes over 2
    gloo ranks at EP=2 (each rank takes its half of every expert) and continues with the straight
    run's losses (fp32 tolerance); the change is reported."""
    import shutil

    run_dir = workdir / "runs" / "ep1to2"
    shutil.copytree(straight, run_dir, ignore=shutil.ignore_patterns("iter_0000016", "wandb*", ".lock"))
    (run_dir / "checkpoints" / "latest").write_text("iter_0000008\n")
    args = _overrides(workdir, "ep1to2", "logging.wandb=false", "model.moe.expert_parallel_size=2")
    out = _run(args + ["--resume"], nproc=2, OMP_NUM_THREADS="1")
    assert "model.moe.expert_parallel_size: 1 -> 2" in out.stdout, out.stdout[-2000:]
    want = {r["step"]: r["lm_loss"] for r in read_metrics(straight)}
    got = {r["step"]: r["lm_loss"] for r in read_metrics(run_dir)}
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(9, STEPS + 1)] == pytest.approx([want[s] for s in range(9, STEPS + 1)], abs=5e-5)


@pytest.fixture(scope="module")
def mb1(workdir) -> Path:
    """16 steps on one process at micro-batch 1: the reference of the runs below, which split the
    global batch of 8 over 1, 2, 4 or 8 ranks into the same 8 one-sequence micro-batches (the aux
    loss is per micro-batch, so the reference must have the same micro-batches)."""
    _run(_overrides(workdir, "mb1", "logging.wandb=false", "train.micro_batch_size=1"))
    return workdir / "runs" / "mb1"


@pytest.mark.parametrize("first, then", [(8, (4, 1)), (4, (8, 2)), (1, (8,))])
def test_checkpoints_move_between_expert_parallel_sizes(workdir, mb1, first, then):
    """A run at EP=``first`` (``first`` gloo ranks, 8 experts split over them; EP=1 is the
    reference's own step-8 checkpoint) stops after 8 steps; its checkpoint resumes at each size of
    ``then`` (over that many ranks; each rank's experts come from one or several shards, or one
    shard feeds several ranks): every run's 16 losses are the one-process run's (fp32 tolerance),
    and the change of size is reported."""
    import shutil

    want = [r["lm_loss"] for r in read_metrics(mb1)]
    base = ["logging.wandb=false", "train.micro_batch_size=1"]
    name = f"ep{first}of8"
    if first == 1:
        shutil.copytree(mb1, workdir / "runs" / name, ignore=shutil.ignore_patterns("iter_0000016", ".lock"))
        (workdir / "runs" / name / "checkpoints" / "latest").write_text("iter_0000008\n")
    else:
        _run(_overrides(workdir, name, *base, f"model.moe.expert_parallel_size={first}", "train.exit_interval=8"),
             nproc=first, OMP_NUM_THREADS="1")
        ckpt = latest_checkpoint(workdir / "runs" / name)
        assert ckpt.name == "iter_0000008"
        assert sorted(p.name for p in ckpt.glob("experts_ep*.pt")) == [f"experts_ep{j:03d}.pt" for j in range(first)]
    for size in then:
        run_dir = workdir / "runs" / f"{name}to{size}"
        shutil.copytree(workdir / "runs" / name, run_dir)
        out = _run(_overrides(workdir, run_dir.name, *base, f"model.moe.expert_parallel_size={size}") + ["--resume"],
                   nproc=None if size == 1 else size, OMP_NUM_THREADS="1")
        assert f"model.moe.expert_parallel_size: {first} -> {size}" in out.stdout, out.stdout[-2000:]
        got = {r["step"]: r["lm_loss"] for r in read_metrics(run_dir)}
        assert sorted(got) == list(range(1, STEPS + 1)), (size, sorted(got))
        assert [got[s] for s in sorted(got)] == pytest.approx(want, abs=5e-5), (first, size)


def test_expert_parallel_size_must_divide_world(workdir):
    proc = _run(_overrides(workdir, "ep3", "logging.wandb=false", "model.moe.expert_parallel_size=4",
                           "train.exit_interval=1"), nproc=2, check=False, OMP_NUM_THREADS="1")
    assert proc.returncode != 0
    assert "expert_parallel_size=4 does not divide the world size 2" in proc.stdout + proc.stderr


def test_save_final_false_writes_no_checkpoint(workdir):
    run = _run(_overrides(workdir, "nosave", "logging.wandb=false", "train.train_iters=2",
                          "train.lr_warmup_iters=1", "train.save_interval=0", "train.save_final=false",
                          "train.eval_interval=0"))
    run_dir = workdir / "runs" / "nosave"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert latest_checkpoint(run_dir) is None and "saved checkpoint" not in run.stdout


def test_profile_one_step_writes_tables_and_trace(workdir):
    """MEGATRON_MOE_PROFILE_STEP=N: torch.profiler over step N only, files in the run directory."""
    _run(_overrides(workdir, "profiled", "train.train_iters=3", "train.lr_warmup_iters=1",
                    "train.eval_interval=0", "train.save_interval=0", "train.save_final=false",
                    "logging.wandb=false"), MEGATRON_MOE_PROFILE_STEP="2")
    run = workdir / "runs" / "profiled"
    assert sorted(p.name for p in run.glob("profile_*")) == ["profile_step2_rank0.json", "profile_step2_rank0.txt"]
    table = (run / "profile_step2_rank0.txt").read_text()
    assert "Name" in table and "TritonGroupedMLP" in table  # the MoE layer's op is in the step
    assert "Input Shapes" in table  # the third table: the ops per input shape
    assert json.loads((run / "profile_step2_rank0.json").read_text())["traceEvents"]


# ----------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_bookkeeping_keeps_every_loss(workdir, straight):
    """train.cuda_graphs=micro_batch with the CPU stand-in for the graph (cuda_graphs.EagerReplay:
    two warm-up passes, a capture, replays through static inputs and outputs, gradients zeroed
    in place and added into): the same LM losses, gradient norms and validation losses as the
    eager straight run, every digit; the capture is reported once, in the first row. Without bf16
    compute copies MEGATRON_MOE_GRAPH_OVERWRITE=1 cannot apply (autograd adds into the fp32
    gradients): the run says so and zeroes them."""
    out = _run(_overrides(workdir, "graphed", "logging.wandb=false", "train.cuda_graphs=micro_batch"),
               hooks=["--cuda-graphs-on-cpu"], MEGATRON_MOE_GRAPH_OVERWRITE="1")
    assert "MEGATRON_MOE_GRAPH_OVERWRITE=1 needs bf16 compute copies" in out.stdout, out.stdout[-2000:]
    got, want = read_metrics(workdir / "runs" / "graphed"), read_metrics(straight)
    for key in ("lm_loss", "grad_norm", "aux_loss", "z_loss", "val_loss"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert [("cuda_graph_capture_s" in r) for r in got] == [True] + [False] * (STEPS - 1)


@pytest.mark.parametrize("name,extra", [
    ("bf16-fused", ["model.moe.score_function=sigmoid", "model.moe.expert_bias=true"]),
    ("bf16-plain", ["train.grad_accumulation_fusion=false", "train.eval_interval=0"])])
def test_cuda_graph_bookkeeping_with_bf16_params(workdir, name, extra):
    """The same with bf16 compute copies (their gradients added into the fp32 masters by a hook,
    or by the experts' kernels with grad_accumulation_fusion) and, in the first case, expert
    biases (the routers' token counts, which the warm-up also adds to, are put back): 6 steps,
    each equal to the eager run's, every digit, by default (a step's first micro-batch overwrites
    the gradients: no zeroing; the trainer says so) and with MEGATRON_MOE_GRAPH_OVERWRITE=0 (the
    gradients zeroed and added into)."""
    rows = {}
    for mode in ("none", "micro_batch", "overwrite"):
        args = _overrides(workdir, f"{name}-{mode}", "logging.wandb=false", "train.train_iters=6",
                          "train.lr_warmup_iters=2", "train.save_final=false",
                          f"train.cuda_graphs={'none' if mode == 'none' else 'micro_batch'}", *extra)
        env = {"MEGATRON_MOE_GRAPH_OVERWRITE": "0"} if mode == "micro_batch" else {}
        out = _run(args, hooks=["--bf16-on-cpu", "--cuda-graphs-on-cpu"], **env)
        assert ("the first micro-batch overwrites the gradients" in out.stdout) == (mode == "overwrite"), mode
        rows[mode] = read_metrics(workdir / "runs" / f"{name}-{mode}")
    for key in ("lm_loss", "grad_norm", "aux_loss", "expert_load/layer1/max_share"):
        assert [r[key] for r in rows["micro_batch"]] == [r[key] for r in rows["none"]], key
        assert [r[key] for r in rows["overwrite"]] == [r[key] for r in rows["none"]], key


@pytest.mark.parametrize("name,splits,graphs,extra,hooks", [
    ("fp32", "padded", "auto", [], []),
    ("bf16-bias", "padded", "micro_batch", ["model.moe.score_function=sigmoid", "model.moe.expert_bias=true"],
     ["--bf16-on-cpu"]),
    ("fp32", "symmetric", "auto", [], []),
    ("bf16", "symmetric", "micro_batch", [], ["--bf16-on-cpu"])])
def test_cuda_graph_bookkeeping_under_expert_parallelism(workdir, name, splits, graphs, extra, hooks):
    """EP=2 over 2 gloo ranks with an exchange that needs no host read (a2a_splits padded, or
    symmetric: on the CPU its shared-memory stand-in) and the CPU stand-in for the graph: 6
    steps, each equal to the eager EP run's (every digit; both reduce the gradients after the
    backward, as a graph does), also with bf16 compute copies (there each step's first
    micro-batch overwrites the gradients from a second capture, with both exchanges) and expert
    biases (whose token counts the warm-up also adds to). ``auto`` graphs such a run, and says so."""
    rows = {}
    for mode in ("none", graphs):
        args = _overrides(workdir, f"ep2-{splits}-{name}-{mode}", "logging.wandb=false", "train.train_iters=6",
                          "train.lr_warmup_iters=2", "train.save_final=false", "train.eval_interval=0",
                          "model.moe.expert_parallel_size=2", f"model.moe.a2a_splits={splits}",
                          "train.overlap_grad_reduce=false", f"train.cuda_graphs={mode}", *extra)
        out = _run(args, hooks=["--cuda-graphs-on-cpu", *hooks], nproc=2, OMP_NUM_THREADS="1")
        rows[mode] = read_metrics(workdir / "runs" / f"ep2-{splits}-{name}-{mode}")
    assert len(rows[graphs]) == 6 and "cuda_graph_capture_s" in rows[graphs][0]
    if graphs == "auto":
        assert "capture" in out.stdout and "(train.cuda_graphs=auto -> micro_batch)" in out.stdout, out.stdout[-2000:]
    overwrites = "the first micro-batch overwrites the gradients" in out.stdout
    assert overwrites == ("--bf16-on-cpu" in hooks), out.stdout[-2000:]
    for key in ("lm_loss", "grad_norm", "aux_loss", "expert_load/ep_rank_imbalance", "expert_load/layer1/max_share",
                "a2a_gb"):
        assert [r[key] for r in rows[graphs]] == [r[key] for r in rows["none"]], key
    # the exchanged volume: padded blocks whole (tokens x top_k rows from the other rank, four
    # exchanges a layer and micro-batch), the symmetric exchange's valid rows at most that
    cfg = yaml.safe_load((workdir / "runs" / f"ep2-{splits}-{name}-none" / "config.yaml").read_text())
    tc, mc = cfg["train"], cfg["model"]
    n_micro = tc["global_batch_size"] // (tc["micro_batch_size"] * 2)
    moe_layers = len([k for k in rows["none"][0] if k.startswith("expert_load/layer") and k.endswith("/max_share")])
    row_bytes = mc["hidden_size"] * (2 if "--bf16-on-cpu" in hooks else 4)
    rows_whole = tc["micro_batch_size"] * mc["seq_length"] * mc["moe"]["top_k"] * moe_layers * n_micro
    for r in rows["none"]:
        if splits == "padded":
            assert r["a2a_gb"] == pytest.approx(4 * rows_whole * row_bytes / 1e9)
        else:
            assert 0 < r["a2a_gb"] <= 4 * rows_whole * row_bytes / 1e9
        assert "a2a_gb_per_s" not in r  # (no exchange time on the CPU)


def test_graphs_with_the_host_read_exchange_are_refused_before_the_data(workdir):
    """EP=2 with a2a_splits=host and train.cuda_graphs=micro_batch: one line naming the fix,
    before the data is prepared."""
    args = _overrides(workdir, "ep2-host-graphs", "logging.wandb=false", "model.moe.expert_parallel_size=2",
                      f"data.cache_dir={workdir / 'cache-refused'}", "train.cuda_graphs=micro_batch")
    proc = _run(args, hooks=["--cuda-graphs-on-cpu"], nproc=2, OMP_NUM_THREADS="1", check=False)
    assert proc.returncode != 0
    assert ("model.moe.expert_parallel_size=2 with model.moe.a2a_splits=host: the token exchange's sizes are "
            "read by the host in every forward") in proc.stderr, proc.stderr[-2000:]
    assert not (workdir / "cache-refused").exists()


# ----------------------------------------------------------------------------- bf16 moments


def test_bf16_moments_train_and_resume_with_fp32_moments(workdir, straight):
    """train.adam_moments_dtype=bf16 (the fused update's reference here, a CPU without Triton):
    8 steps whose losses stay close to the fp32-moment straight run's, a checkpoint holding bf16
    moments (half their bytes), then --resume with fp32 moments (cast on load, the change
    reported) for the other 8 steps, still close to the straight run."""
    args = _overrides(workdir, "bf16m", "logging.wandb=false")
    _run(args + ["train.adam_moments_dtype=bf16", "train.exit_interval=8"])
    run_dir = workdir / "runs" / "bf16m"
    opt = torch.load(latest_checkpoint(run_dir) / "optimizer.pt", weights_only=True)
    moments = [t for st in opt["state"].values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)
    out = _run(args + ["train.adam_moments_dtype=fp32", "--resume"])
    assert "train.adam_moments_dtype: bf16 -> fp32" in out.stdout, out.stdout[-2000:]
    got = [r["lm_loss"] for r in read_metrics(run_dir)]
    want = [r["lm_loss"] for r in read_metrics(straight)]
    assert len(got) == STEPS and got[0] == want[0]  # the first step's loss precedes any update
    assert got == pytest.approx(want, rel=2e-3), (got, want)  # measured: at most 1.1e-4 apart
    assert got != want  # the moments were rounded: not the fp32 run by accident
