"""Pretrain a megatron-core GPT (dense or with our MoE) from a YAML config.

    megatron-moe-train                                   # configs/tiny-cpu.yaml, CPU, a few minutes
    megatron-moe-train --config configs/dmoe-xs.yaml train.lr=3e-4 name=dmoe-xs-lr3e-4
    megatron-moe-train --config configs/dmoe-xs.yaml --resume        # continue runs/dmoe-xs
    megatron-moe-train --config configs/dmoe-xs.yaml --print-config  # the resolved YAML
    torchrun --standalone --nproc-per-node 8 -m megatron_moe.train --config configs/dmoe-xs.yaml
    scripts/pretrain.sh configs/dmoe-xs.yaml             # the same, all GPUs of this node

One process on the CPU (gloo, fp32) or one per GPU under torchrun (NCCL, device LOCAL_RANK,
bf16 compute copies of fp32 master parameters: megatron_moe/precision.py; or autocast with
``train.bf16_params=false``). Data parallelism is done here, not by DDP: after the
micro-batches of a step are accumulated, megatron_moe/parallel.py's GradReducer all-reduces the
gradients in flattened buckets, dense parameters over all ranks and expert parameters
(``expert_parallel = True``) over the ranks holding the same experts
(``model.moe.expert_parallel_size``; see parallel.py for the scaling).

Each step: ``global_batch_size / (micro_batch_size * data_parallel_size)`` micro-batches
(LM loss scaled by 1/num_micro, aux loss too via ``set_aux_loss_scale``), bucketed
all-reduce, gradient clipping (global norm, each parameter counted once), AdamW (no decay
on biases and norm weights; with ``train.fused_optimizer`` the clipping scale, the update and the
bf16 copies' refresh are one kernel pass, optim.py), linear warm-up then cosine decay to min_lr, and
``update_expert_biases``. The data order is a function of the consumed-sample count, so
``--resume`` continues exactly: N steps + resume N steps give the same losses as 2N straight.
Evaluation: every ``train.eval_interval`` steps and at the last step, the mean LM loss over
the same ``eval_iters * global_batch_size`` validation sequences each time (val_loss, val_ppl).
``train.exit_interval`` stops early with a checkpoint (e.g. inside a Slurm time limit).
The run directory ``logging.runs_dir/name`` holds config.yaml, metrics.jsonl, wandb/ and
checkpoints/ (see megatron_moe/checkpoint.py and megatron_moe/metrics.py). A fresh start in a
run directory that has checkpoints is refused (pass --resume or another name=...); --resume
with no checkpoint starts from scratch. MEGATRON_MOE_DEBUG=1 shows tracebacks of input errors.

Non-finite steps: the step's LM loss (summed over ranks) and global gradient norm are read
on the host before the optimizer step (the one host synchronisation of a step; the loss is
logged anyway). If either is NaN/Inf the update is skipped: no optimizer step and no
expert-bias update, so weights and optimizer state stay as they were; the step still counts
(its data is consumed and the learning-rate schedule, a function of the step, moves on, as
Megatron-LM counts a skipped iteration; unlike Megatron-LM's scheduler, ours does not hold
back). ``skipped_steps`` (cumulative) goes to metrics.jsonl and the run stops with a
TrainError after ``train.max_consecutive_nonfinite`` such steps in a row. Both counters are
saved in checkpoints, so a resumed run counts on exactly.

``train.deterministic: true`` turns on torch.use_deterministic_algorithms (plus
CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring unless set; cuDNN deterministic, no
benchmarking): identical losses for identical seeds on the same hardware.

Fault injection (tests only, tests/test_faults.py): ``MEGATRON_MOE_FAULT_NONFINITE=3,4:inf``
multiplies the LM loss of the first micro-batch of steps 3 and 4 (1-based) by NaN (default)
or Inf before the backward, so loss and gradients are poisoned as by a real divergence;
see also MEGATRON_MOE_FAULT_SAVE_SLEEP in megatron_moe/checkpoint.py.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint,
                         verify_checkpoint)
from .dispatch import exchange_time_ms
from .metrics import MetricsLogger, ep_rank_imbalance, expert_load_stats, format_line
from .optim import AdamW
from .parallel import GradReducer, clip_coefficient, clip_grad_norm, init_parallel_groups
from .precision import BF16Params
from .run_config import ConfigError, RunConfig, load_config

__all__ = ["main", "train", "lr_at", "build_optimizer"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = "configs/tiny-cpu.yaml"


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says what to change."""


# ----------------------------------------------------------------------------- distributed


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    created_group: bool


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> DistInfo:
    """Initialise torch.distributed: env:// under torchrun, else a world of one process.

    NCCL with device LOCAL_RANK when CUDA is available, gloo on the CPU. Idempotent.
    """
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    created = False
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
        created = True
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, created)


def _unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """named_parameters without duplicates (tied embeddings count once), trainable only."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def build_optimizer(model: torch.nn.Module, tc, device: torch.device) -> AdamW:
    """AdamW with Megatron's decay rule: no weight decay on biases and 1-D (norm) weights;
    ``tc.fused_optimizer``: clipping scale, update and bf16 copies in one kernel (optim.py)."""
    decay, no_decay = [], []
    for name, p in _unique_params(model):
        (no_decay if (name.endswith(".bias") or p.ndim == 1) else decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return AdamW(groups, lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                 fused_kernel=tc.fused_optimizer)


def lr_at(step: int, tc) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up from lr/warmup to lr over
    lr_warmup_iters steps, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    warm, decay = tc.lr_warmup_iters, tc.decay_iters
    if step < warm:
        return tc.lr * (step + 1) / warm
    if step >= decay:
        return tc.min_lr
    progress = (step - warm) / max(decay - warm, 1)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- data


class MicroBatchSampler:
    """Index lists of this rank's micro-batches, in order, from ``start`` consumed samples.

    Global step g covers samples [g*B, (g+1)*B) (B = global batch), cut into chunks of
    micro*dp samples; in each chunk rank r takes [r*micro, (r+1)*micro). A function of the
    consumed-sample count alone, so a resumed run reads exactly what a straight run reads.
    """

    def __init__(self, start: int, end: int, micro: int, rank: int, dp: int):
        self.start, self.end, self.micro, self.rank, self.dp = start, end, micro, rank, dp

    def __iter__(self):
        chunk = self.micro * self.dp
        s = self.start
        while s + chunk <= self.end:
            lo = s + self.rank * self.micro
            yield list(range(lo, lo + self.micro))
            s += chunk

    def __len__(self) -> int:
        return max(0, (self.end - self.start) // (self.micro * self.dp))


def _loader(dataset, sampler, device: torch.device, seed: int):
    """Worker processes on GPUs; its own generator, so the global torch RNG is not drawn from."""
    cuda = device.type == "cuda"
    gen = torch.Generator()
    gen.manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2 if cuda else 0,
                                       pin_memory=cuda, generator=gen)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ----------------------------------------------------------------------------- helpers


def _moe_layer_names(model: torch.nn.Module, layers: list) -> list[str]:
    """'layerN' (1-based transformer layer) for each MoE layer, found from module names."""
    ids = {id(m): i for i, m in enumerate(layers)}
    names = [f"moe{i}" for i in range(len(layers))]
    for name, m in model.named_modules():
        if id(m) in ids:
            found = re.findall(r"layers\.(\d+)\.", name + ".")
            if found:
                names[ids[id(m)]] = f"layer{int(found[-1]) + 1}"
    return names


def _print0(rank: int, *args, bar=None) -> None:
    if rank != 0:
        return
    msg = " ".join(str(a) for a in args)
    if bar is not None and not bar.disable:
        bar.write(msg)
    else:
        print(msg, flush=True)


def _forward_loss(model, batch: dict, amp) -> torch.Tensor:
    """Mean LM loss over the micro-batch's unmasked tokens (fp32 scalar)."""
    with amp():
        loss_BS = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return (loss_BS.float() * mask).sum() / mask.sum().clamp_min(1.0)


@torch.no_grad()
def evaluate(model, batches, amp, device) -> float:
    """Mean validation LM loss over this rank's validation micro-batches (an iterable of
    batches), averaged over ranks (every rank has the same number of them)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    n = 0
    for b in batches:
        total += _forward_loss(model, _to(b, device), amp)
        n += 1
    total /= max(n, 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    model.train(was_training)
    return float(total)


def _count_params(model_cfg) -> dict | None:
    try:
        from .flops import count_parameters

        return count_parameters(model_cfg)
    except Exception:  # noqa: BLE001 - purely informative
        return None


def _use_bf16(tc, device: torch.device) -> bool:
    """train.bf16 applies on GPUs; the CPU runs fp32 (MEGATRON_MOE_BF16_ON_CPU=1: bf16 there
    too, for tests of the bf16 code paths)."""
    return tc.bf16 and (device.type == "cuda" or os.environ.get("MEGATRON_MOE_BF16_ON_CPU") == "1")


def set_deterministic(on: bool = True) -> None:
    """Deterministic algorithms only (``train.deterministic``); call before CUDA/NCCL start.

    The environment variables are read when cuBLAS / NCCL initialise, so they are set only
    if the user has not chosen otherwise."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")  # a fixed reduction order
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _fault_steps() -> dict[int, float]:
    """MEGATRON_MOE_FAULT_NONFINITE (tests only): '3,4:inf' -> {3: nan, 4: inf}."""
    spec = os.environ.get("MEGATRON_MOE_FAULT_NONFINITE", "").strip()
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        at, _, kind = item.partition(":")
        out[int(at)] = float(kind or "nan")
    return out


# ----------------------------------------------------------------------------- training


def _start_profile(step: int, device):
    """torch.profiler over training step ``step`` when MEGATRON_MOE_PROFILE_STEP equals it (a
    diagnosis aid: kernel times, host gaps, NCCL waits of one step; see _finish_profile)."""
    want = os.environ.get("MEGATRON_MOE_PROFILE_STEP", "")
    if not want.isdigit() or int(want) != step:
        return None
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof


def _finish_profile(prof, run_dir, step: int, rank: int) -> None:
    """Writes profile_step{N}_rank{R}.txt (ops by GPU time, then by host time) and the Chrome
    trace profile_step{N}_rank{R}.json into the run directory."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    stem = Path(run_dir) / f"profile_step{step}_rank{rank}"
    ka = prof.key_averages()
    sort_gpu = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(f"{stem}.txt", "w") as f:
        f.write(ka.table(sort_by=sort_gpu, row_limit=40) + "\n")
        f.write(ka.table(sort_by="cpu_time_total", row_limit=25) + "\n")
    prof.export_chrome_trace(f"{stem}.json")


def train(cfg: RunConfig, resume: bool = False) -> dict:
    """Train per ``cfg``; with ``resume`` continue from run_dir/checkpoints/latest (if any).

    Returns the final metrics: step, consumed_samples, lm_loss, val_loss, losses (the LM loss
    of every step run by this call; NaN where a step was skipped), steps, skipped_steps (in
    the whole run), run_dir, checkpoint, wall_time_s.
    """
    t_start = time.time()
    tc = cfg.train
    run_dir = cfg.run_dir
    # Checks that need no process group come first, so bad input fails fast and cleanly.
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    per_step = tc.micro_batch_size * world
    if tc.global_batch_size % per_step:
        raise TrainError(
            f"train.global_batch_size={tc.global_batch_size} is not divisible by "
            f"train.micro_batch_size ({tc.micro_batch_size}) x data-parallel size ({world}) = "
            f"{per_step}: choose a global batch that is a multiple of {per_step}")
    num_micro = tc.global_batch_size // per_step

    try:
        ckpt = latest_checkpoint(run_dir)
    except CheckpointError as e:
        raise TrainError(str(e)) from None
    if ckpt is not None and not resume:
        raise TrainError(
            f"run directory {run_dir} already holds checkpoints (latest: {ckpt.name}): pass "
            "--resume to continue it, give the run another name (name=...), or delete the directory")
    step, consumed = 0, 0
    if resume and ckpt is not None:
        try:
            meta = verify_checkpoint(ckpt)
        except CheckpointError as e:
            raise TrainError(str(e)) from None
        step, consumed = int(meta["step"]), int(meta["consumed_samples"])

    set_deterministic(tc.deterministic)  # before CUDA / NCCL initialise
    di = setup_distributed()
    rank, device = di.rank, di.device
    if resume and ckpt is None:
        _print0(rank, f"--resume: no checkpoint in {run_dir}, starting from scratch")

    # Logging first: whatever W&B does to the RNGs happens before seeding.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    logger = MetricsLogger(cfg, run_dir, enabled=rank == 0, resume_step=step)
    try:
        return _train(cfg, di, logger, num_micro, ckpt if resume else None, step, consumed, t_start)
    except RuntimeError as e:
        logger.close(exit_code=1)
        if tc.deterministic and "deterministic" in str(e) and not isinstance(e, TrainError):
            raise TrainError(f"train.deterministic=true: {str(e).splitlines()[0]} Set "
                             "train.deterministic=false to run this model here") from None
        raise
    except BaseException:
        logger.close(exit_code=1)
        raise


def _train(cfg: RunConfig, di: DistInfo, logger: MetricsLogger, num_micro: int, ckpt: Path | None,
           step: int, consumed: int, t_start: float) -> dict:
    from . import update_expert_biases
    from .data import build_datasets, prepare_data, split_tokens
    from .megatron_adapter import build_gpt_model, init_megatron, moe_layers, set_aux_loss_scale

    tc, mc = cfg.train, cfg.model
    rank, world, device = di.rank, di.world_size, di.device
    run_dir = cfg.run_dir
    per_step = tc.micro_batch_size * world

    random.seed(tc.seed)
    np.random.seed(tc.seed)
    torch.manual_seed(tc.seed)
    init_megatron(tc.seed)

    prepared = prepare_data(cfg.data, rank=rank)
    n_train = tc.train_iters * tc.global_batch_size
    # As in Megatron-LM: one evaluation = eval_iters global batches, the same samples every
    # time (so val_loss is comparable across steps and data-parallel sizes).
    n_valid = tc.eval_iters * tc.global_batch_size if tc.eval_interval > 0 else 0
    train_ds, valid_ds, _ = build_datasets(
        cfg.data, prepared, seq_length=mc.seq_length, seed=tc.seed,
        num_samples=(n_train, max(n_valid, 1), max(n_valid, 1)), model_vocab_size=mc.vocab_size)
    if n_valid and valid_ds is None:
        _print0(rank, "warning: the validation split is empty (data.split): evaluation is off")
        n_valid = 0
    # how often the run goes over its training data: logged with the first step's metrics
    data_info = {}
    train_tokens = split_tokens(train_ds)
    if train_tokens:
        epochs = n_train * mc.seq_length / train_tokens
        data_info = {"data_train_tokens": train_tokens, "data_epochs": epochs}
        _print0(rank, f"data: {train_tokens:,} tokens in the train split ({prepared.num_tokens:,} in "
                f"all); {tc.train_iters} steps read {n_train * mc.seq_length:,} = {epochs:.2f} epochs"
                + (" (data repeats: validation loss then also measures memorisation; more data "
                   "(data.paths, data.default_corpus_mb) or fewer train.train_iters avoid it)"
                   if epochs > 1 else ""))
        logger.summary(data_info)

    # logged with the first step of this process: the processes (tools/compare_runs.py divides
    # tokens_per_s by it) and the data's size
    first_info = {"world_size": world, **data_info}

    ep = mc.moe.expert_parallel_size if mc.moe is not None else 1
    try:
        groups = init_parallel_groups(ep, num_experts=mc.moe.num_experts if mc.moe is not None else None)
    except ValueError as e:
        raise TrainError(str(e)) from None
    model = build_gpt_model(mc)
    model.train()
    params = [p for _, p in _unique_params(model)]
    reducer = GradReducer.for_groups(params, groups, overlap=tc.overlap_grad_reduce)
    reducer.broadcast_params(model)
    optimizer = build_optimizer(model, tc, device)
    layers = moe_layers(model)
    layer_names = _moe_layer_names(model, layers)
    set_aux_loss_scale(1.0 / num_micro)
    capacity = mc.moe is not None and mc.moe.mlp_impl == "capacity"

    # Throughput bookkeeping.
    tokens_per_step = tc.global_batch_size * mc.seq_length
    fpt = peak = None
    try:
        from .flops import flops_per_token, peak_tflops

        fpt = float(flops_per_token(mc))
        if device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(device),
                               torch.bfloat16 if tc.bf16 else torch.float32)
    except ImportError:
        pass
    bf16 = None  # precision.BF16Params: bf16 compute copies of the fp32 parameters
    if not _use_bf16(tc, device):
        amp, precision = contextlib.nullcontext, "fp32"
    elif tc.bf16_params:
        bf16 = BF16Params(model, params, grad_ready=reducer.grad_ready,
                          fuse_grad_accumulation=tc.grad_accumulation_fusion)
        optimizer.set_copies(bf16.masters, bf16.copies)  # each step rounds the masters into them
        amp, precision = bf16.compute, "bf16 params (fp32 masters)"
    else:
        amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
        precision = "bf16 autocast"

    counts = _count_params(mc)
    _print0(rank, f"run {cfg.name}: {run_dir} | {world} x {device.type}"
            f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}"
            f" | {precision}"
            f"{' | deterministic' if tc.deterministic else ''} | micro {tc.micro_batch_size} x dp {world}"
            f" x {num_micro} accumulation = global {tc.global_batch_size} | {len(layers)} MoE layers"
            + (f" | params total {counts['total'] / 1e6:.1f}M, active/token "
               f"{counts['active'] / 1e6:.1f}M" if counts else ""))

    valid_loader = None
    if n_valid:  # re-iterated at each evaluation: the same samples every time
        valid_loader = _loader(valid_ds, MicroBatchSampler(0, n_valid, tc.micro_batch_size, rank, world),
                               device, tc.seed)

    sampler = MicroBatchSampler(consumed, n_train, tc.micro_batch_size, rank, world)
    data_iter = iter(_loader(train_ds, sampler, device, tc.seed))

    skipped = consecutive = 0  # non-finite steps: in all, and in a row up to now
    faults = _fault_steps()
    if ckpt is not None:  # last, so the restored RNG states are the ones the next step sees
        try:
            meta = load_checkpoint(ckpt, model, optimizer, map_location=device, groups=groups)
        except CheckpointError as e:
            raise TrainError(str(e)) from None
        if bf16 is not None:
            bf16.refresh()
        skipped = int(meta.get("skipped_steps", 0))
        consecutive = int(meta.get("consecutive_nonfinite", 0))
        if meta.get("world_size") != world:
            _print0(rank, f"note: checkpoint written by {meta.get('world_size')} ranks, resuming on "
                    f"{world}: same data order, new RNG streams where ranks were added")
        _print0(rank, f"resumed from {ckpt} at step {step} ({consumed} samples consumed)")

    from tqdm import tqdm

    bar = tqdm(total=tc.train_iters, initial=step, disable=rank != 0 or not sys.stdout.isatty(),
               unit="step", dynamic_ncols=True)
    losses, steps = [], []
    last_val = None
    last_saved = None
    exit_code = 1
    n_layers = len(layers)
    try:
        while step < tc.train_iters:
            prof = _start_profile(step + 1, device)
            t0 = time.perf_counter()
            lr = lr_at(step, tc)
            for g in optimizer.param_groups:
                g["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            # Packed per-step stats: [lm, aux, z, dropped(L), tokens_per_expert(L*E)].
            lm_sum = torch.zeros((), device=device)
            aux_sum = torch.zeros((), device=device)
            z_sum = torch.zeros((), device=device)
            dropped = torch.zeros(n_layers, device=device)
            tpe = None
            for micro in range(num_micro):
                batch = _to(next(data_iter), device)
                lm = _forward_loss(model, batch, amp)
                if micro == 0 and step + 1 in faults:  # test hook: a diverged step
                    lm = lm * faults[step + 1]
                if micro == num_micro - 1:
                    reducer.arm()  # overlap_grad_reduce: buckets reduce during this backward
                (lm / num_micro).backward()
                lm_sum += lm.detach()
                for i, layer in enumerate(layers):
                    if layer.load_balancing_loss is not None:
                        aux_sum += layer.load_balancing_loss.detach().float()
                    if layer.z_loss is not None:
                        z_sum += layer.z_loss.detach().float()
                    if layer.dropped_fraction is not None:
                        dropped[i] += layer.dropped_fraction.float()
                if n_layers:
                    cur = torch.stack([l.tokens_per_expert.float() for l in layers])
                    tpe = cur if tpe is None else tpe + cur
            reducer.reduce()
            grad_norm = clip_grad_norm(params, tc.clip_grad, groups, scale=False)  # the step scales
            packed = torch.cat([torch.stack([lm_sum, aux_sum, z_sum]), dropped]
                               + ([tpe.reshape(-1)] if tpe is not None else []))
            if world > 1:
                dist.all_reduce(packed)
            # grad_norm is global already (same on every rank): appended after the reduction.
            packed = torch.cat([packed, grad_norm.reshape(1).to(packed)]).cpu()  # the one sync
            denom = num_micro * world
            lm_loss = float(packed[0]) / denom
            gnorm = float(packed[-1])
            finite = math.isfinite(lm_loss) and math.isfinite(gnorm)  # the same on every rank
            if finite:
                optimizer.step(grad_scale=clip_coefficient(grad_norm, tc.clip_grad))  # copies too
                update_expert_biases(model)
                consecutive = 0
            else:  # skip the update; the step, its data and the schedule still count
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                consecutive += 1
            step += 1
            consumed += tc.global_batch_size
            step_time = time.perf_counter() - t0
            m = {"consumed_samples": consumed, "tokens": consumed * mc.seq_length,
                 "lm_loss": lm_loss,
                 "aux_loss": float(packed[1]) / denom if n_layers else None,  # null: dense
                 "z_loss": float(packed[2]) / denom if n_layers else None,
                 "lr": lr, "grad_norm": gnorm, "skipped_steps": skipped,
                 "tokens_per_s": tokens_per_step / step_time,
                 "tflops_per_gpu": None, "mfu": None, "step_time_s": step_time,
                 "peak_mem_gb": (torch.cuda.max_memory_allocated(device) / 1e9
                                 if device.type == "cuda" else None)}
            a2a_ms = exchange_time_ms()
            if a2a_ms is not None:  # expert parallelism: GPU time in the token all-to-alls
                m["a2a_ms"] = a2a_ms
                m["a2a_fraction"] = a2a_ms / 1e3 / step_time
            if fpt is not None:
                m["tflops_per_gpu"] = fpt * tokens_per_step / step_time / world / 1e12
                if peak:
                    m["mfu"] = m["tflops_per_gpu"] / peak
            if tpe is not None:
                tpe_LE = packed[3 + n_layers:-1].reshape(n_layers, -1)
                m.update(expert_load_stats(tpe_LE, layer_names))
                m.update(ep_rank_imbalance(tpe_LE, layer_names, ep))
            if capacity and n_layers:
                per_layer = packed[3:3 + n_layers] / denom
                m["dropped_fraction"] = float(per_layer.mean())
                for name, v in zip(layer_names, per_layer.tolist()):
                    m[f"dropped_fraction/{name}"] = v

            if tc.eval_interval and n_valid and (step % tc.eval_interval == 0 or step == tc.train_iters):
                last_val = evaluate(model, valid_loader, amp, device)
                m["val_loss"] = last_val
                m["val_ppl"] = math.exp(min(last_val, 80.0))

            if prof is not None:
                _finish_profile(prof, run_dir, step, rank)
            losses.append(lm_loss)
            steps.append(step)
            if first_info:  # once per process (a resumed run logs it again at its first step)
                m.update(first_info)
                first_info = {}
            logger.log(m, step)
            bar.update(1)
            bar.set_postfix(loss=f"{lm_loss:.3f}", tok_s=f"{m['tokens_per_s']:,.0f}")
            if step % tc.log_interval == 0 or step == tc.train_iters or "val_loss" in m:
                _print0(rank, format_line(step, tc.train_iters, m), bar=bar)
            if not finite:
                _print0(rank, f"step {step}: non-finite lm_loss {lm_loss} / grad_norm {gnorm}: "
                        f"update skipped ({consecutive} in a row, the run stops at "
                        f"train.max_consecutive_nonfinite={tc.max_consecutive_nonfinite}; "
                        f"{skipped} skipped in all)", bar=bar)
                if consecutive >= tc.max_consecutive_nonfinite:
                    last = latest_checkpoint(run_dir)
                    raise TrainError(
                        f"{consecutive} steps in a row ({step - consecutive + 1}..{step}) had a "
                        f"non-finite LM loss or gradient norm (last: lm_loss {lm_loss}, grad_norm "
                        f"{gnorm}), train.max_consecutive_nonfinite={tc.max_consecutive_nonfinite}: "
                        "the run diverged and stops. Lower train.lr, raise train.lr_warmup_iters "
                        "or check the data, then --resume from the last checkpoint ("
                        f"{last.name if last is not None else 'none yet: start again'})")

            stop = tc.exit_interval is not None and step % tc.exit_interval == 0
            if ((tc.save_interval and step % tc.save_interval == 0) or stop
                    or (step == tc.train_iters and tc.save_final)):
                path = save_checkpoint(run_dir, step, model, optimizer, {
                    "consumed_samples": consumed,
                    "skipped_steps": skipped, "consecutive_nonfinite": consecutive,
                    "scheduler": {"lr": tc.lr, "min_lr": tc.min_lr, "warmup": tc.lr_warmup_iters,
                                  "decay_iters": tc.decay_iters, "last_lr": lr},
                    "config": cfg.to_dict()}, groups=groups)
                last_saved = path
                _print0(rank, f"saved checkpoint {path}", bar=bar)
            if stop and step < tc.train_iters:
                _print0(rank, f"train.exit_interval={tc.exit_interval}: stopping at step {step}; "
                        "continue with --resume", bar=bar)
                break
        exit_code = 0
    finally:
        bar.close()
        if exit_code == 0:
            logger.summary({"final_lm_loss": losses[-1] if losses else None,
                            "final_val_loss": last_val})
        logger.close(exit_code)

    result = {"step": step, "consumed_samples": consumed, "losses": losses, "steps": steps,
              "skipped_steps": skipped,
              "lm_loss": losses[-1] if losses else None, "val_loss": last_val,
              "run_dir": str(run_dir), "checkpoint": str(last_saved) if last_saved else None,
              "wall_time_s": time.time() - t_start}
    _print0(rank, f"done: step {step}/{tc.train_iters}, lm_loss "
            f"{result['lm_loss'] if result['lm_loss'] is None else round(result['lm_loss'], 4)}, "
            f"val_loss {last_val if last_val is None else round(last_val, 4)}, "
            f"{result['wall_time_s']:.1f} s, run dir {run_dir}")
    return result


# ----------------------------------------------------------------------------- CLI


def _find_config(path: str) -> Path:
    p = Path(path)
    if p.exists():
        return p
    for cand in (REPO_ROOT / path, REPO_ROOT / "configs" / path, REPO_ROOT / "configs" / f"{path}.yaml"):
        if cand.exists():
            return cand
    avail = sorted(x.stem for x in (REPO_ROOT / "configs").glob("*.yaml"))
    raise ConfigError(f"--config {path}: no such file (configs here: {', '.join(avail) or 'none'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-moe-train",
        description="Pretrain a megatron-core GPT with dropless MoE from a YAML config.",
        epilog="Overrides: dotted keys, e.g. train.lr=3e-4 model.moe.top_k=2 name=my-run")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"YAML config (default {DEFAULT_CONFIG}); a bare name looks in configs/")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run directory's latest checkpoint (fresh start if none)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    # megatron-core announces at import that TE/Apex are absent: we use neither, by design.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex|Apex is not installed"
                            r"|full scope is deprecated).*")
    try:
        cfg = load_config(_find_config(args.config), args.overrides)
    except ConfigError as e:
        parser.exit(2, f"megatron-moe-train: config error: {e}\n")
    if args.print_config:
        sys.stdout.write(cfg.to_yaml())
        return 0
    try:
        train(cfg, resume=args.resume)
    except (TrainError, ConfigError, FileNotFoundError, ValueError) as e:
        # Bad input (config, data, checkpoint): one line that says what to change.
        if os.environ.get("MEGATRON_MOE_DEBUG"):
            raise
        print(f"megatron-moe-train: error: {e} (MEGATRON_MOE_DEBUG=1 shows the traceback)",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
