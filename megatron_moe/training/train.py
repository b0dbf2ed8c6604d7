"""Pretrain a megatron-core GPT (dense or with our MoE) from a YAML config.

    megatron-moe-train                                   # the tiny-cpu config, CPU, a few minutes
    megatron-moe-train --config dmoe-xs train.lr=3e-4 name=dmoe-xs-lr3e-4
    megatron-moe-train --config dmoe-xs --resume         # continue runs/dmoe-xs
    megatron-moe-train --config dmoe-xs --print-config   # the resolved YAML
    megatron-moe-train --config my-run.yaml              # any config file by path
    torchrun --standalone --nproc-per-node 8 -m megatron_moe.training --config dmoe-xs
    scripts/pretrain.sh dmoe-xs                          # the same, all GPUs of this node

One process on the CPU (gloo, fp32) or one per GPU under torchrun (NCCL, device LOCAL_RANK,
bf16 compute copies of fp32 master parameters: precision.py; or autocast with
``train.bf16_params=false``). Data parallelism is done here, not by DDP: after the
micro-batches of a step are accumulated, grad_reduce.py's GradReducer all-reduces the
gradients in flattened buckets, dense parameters over all ranks and expert parameters over the
ranks holding the same experts (``model.moe.expert_parallel_size``).

A run, in the order this file reads:
  * ``pretrain(cfg, resume)``: the checks that need no process group, the process group, the
    run directory's lock (run_lock.py: rank 0 takes it before anything reads or writes the
    directory, the other ranks learn the outcome; released at the end, whatever the end);
    then ``_train``: the checkpoint to resume and the config's changes since it (a change of
    the model's shape stops the run before anything is built; the others are printed and
    logged as ``config_changes`` with the first step), the metrics logger, ``build`` (seeds,
    data, model, optimizer, precision), ``restore`` (the latest checkpoint, last, so its RNG
    states are what the next step sees) and ``_loop``. Running out of memory anywhere there
    ends the run with one line naming train.micro_batch_size and the ways out. SIGTERM or
    SIGUSR1 (stop_signals.py) end it after the step in progress, with a checkpoint.
  * each step (``train_step``): ``global_batch_size / (micro_batch_size * data-parallel size)``
    micro-batches (LM loss scaled by 1/num_micro, the aux losses too via
    ``set_aux_loss_scale``), the bucketed all-reduce, the global gradient norm, then one host
    read of the step's statistics; if loss and norm are finite, AdamW (clipping scale, update
    and bf16 copies in one pass) and ``update_expert_biases``. With ``train.cuda_graphs`` each
    micro-batch's forward and backward replays from a CUDA graph captured at the first step
    (cuda_graphs.py).
  * ``step_metrics``: tokens/s, TFLOP/s per GPU, MFU, expert load; ``evaluate`` every
    ``train.eval_interval`` steps and at the last (the same validation sequences each time);
    ``save`` every ``train.save_interval`` steps, at ``train.exit_interval`` and at the end.

The data order is a function of the consumed-sample count, so ``--resume`` continues exactly:
N steps + resume N steps give the same losses as 2N straight. The run directory
``logging.runs_dir/name`` holds .lock, config.yaml, metrics.jsonl, wandb/ and checkpoints/
(run_lock.py, checkpoint.py, metrics.py). A fresh start in a run directory that has checkpoints
is refused (pass --resume or another name=...); --resume with no checkpoint starts from scratch.

Non-finite steps: if the step's LM loss or global gradient norm is NaN/Inf the update is
skipped (weights and optimizer state stay as they were); the step still counts (its data is
consumed and the learning-rate schedule, a function of the step, moves on, as Megatron-LM
counts a skipped iteration). ``skipped_steps`` (cumulative) goes to metrics.jsonl and the run
stops after ``train.max_consecutive_nonfinite`` such steps in a row. Both counters are saved in
checkpoints, so a resumed run counts on exactly.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_moe import update_expert_biases
from megatron_moe.dispatch import exchange_time_ms
from megatron_moe.megatron import build_gpt_model, init_megatron, moe_layers, set_aux_loss_scale
from megatron_moe.ops.master_grad import overwriting
from megatron_moe.parallel import ParallelGroups, check_symmetric_exchange, init_parallel_groups

from .cuda_graphs import ENV_GRAPH_OVERWRITE, EagerReplay, MicroBatchGraph, check_supported, resolve_mode
from .checkpoint import (ABSENT, CheckpointError, config_changes, latest_checkpoint, load_checkpoint,
                         save_checkpoint, shape_changes, verify_checkpoint)
from .data import MicroBatchSampler, build_datasets, micro_batch_loader, prepare_data, split_tokens
from .distributed import DistInfo, set_deterministic, setup_distributed, teardown, world_size
from .fault_hooks import hooks
from .flops import count_parameters, flops_per_token, peak_tflops
from .grad_reduce import GradReducer, clip_coefficient, clip_grad_norm
from .metrics import (MetricsLogger, StepProfiler, a2a_gb, a2a_rows_sent, ep_rank_imbalance, expert_load_stats,
                      format_line)
from .optimizer import AdamW, build_optimizer, lr_at, trainable_params
from .precision import BF16Params
from .run_config import ConfigError, RunConfig, load_config
from .run_lock import RunLock, RunLockError
from .stop_signals import StopSignals

__all__ = ["main", "pretrain", "TrainError", "evaluate"]

DEFAULT_CONFIG = "tiny-cpu"


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says what to change."""


# ----------------------------------------------------------------------------- the run's state


@dataclass
class Run:
    """Everything a training run holds between steps."""

    cfg: RunConfig
    di: DistInfo
    logger: MetricsLogger
    num_micro: int
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: AdamW
    reducer: GradReducer
    groups: ParallelGroups
    amp: object  # a context manager factory: the forward's precision
    bf16: BF16Params | None
    layers: list  # the DroplessMoE layers
    layer_names: list[str]
    data_iter: object
    valid_loader: object | None
    flops_per_token: float
    peak_tflops: float | None
    step: int = 0
    consumed: int = 0
    skipped: int = 0  # non-finite steps in the whole run
    consecutive: int = 0  # ... and in a row up to now
    first_info: dict = field(default_factory=dict)  # logged with this process's first step
    stop: StopSignals | None = None  # SIGTERM / SIGUSR1 noted by pretrain: save and stop
    graph: MicroBatchGraph | None = None  # train.cuda_graphs=micro_batch (cuda_graphs.py)

    def micro_batch(self, batch: dict, first: bool = False) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (replayed from the graph if there is
        one; ``first``: the step's first): its statistics, [lm, aux, z, dropped(L),
        tokens_per_expert(L*E)] fp32."""
        if self.graph is not None:
            return self.graph(batch, first=first)
        return _micro_batch(self.model, self.layers, self.amp, self.num_micro, batch)

    def zero_grad(self) -> None:
        """Before a step's first micro-batch: free the gradients (eager: it writes new ones),
        zero them in place (a graph adds into them), or nothing (a graph whose first
        micro-batch overwrites them)."""
        if self.graph is None:
            self.optimizer.zero_grad(set_to_none=True)
        elif not self.graph.overwrites:
            self.optimizer.zero_grad(set_to_none=False)

    def print(self, *args, bar=None) -> None:
        if self.di.rank != 0:
            return
        msg = " ".join(str(a) for a in args)
        if bar is not None and not bar.disable:
            bar.write(msg)
        else:
            print(msg, flush=True)


@dataclass
class StepResult:
    lm_loss: float
    grad_norm: float
    lr: float
    finite: bool
    packed_C: torch.Tensor  # [lm, aux, z, dropped(L), tokens_per_expert(L*E), grad_norm] on the CPU
    stop_signal: str | None = None  # a stop signal any rank received (stop_signals.py)
    a2a_rows_sent: float | None = None  # expert parallelism: rows sent to other ranks, all ranks' summed


# ----------------------------------------------------------------------------- build


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


def _precision(tc, model, params, reducer, optimizer, device) -> tuple[object, BF16Params | None, str]:
    """(the forward's context, the bf16 copies or None, a description). ``train.bf16`` applies
    on GPUs; the CPU runs fp32."""
    if not (tc.bf16 and (device.type == "cuda" or hooks.bf16_on_cpu)):
        return contextlib.nullcontext, None, "fp32"
    if tc.bf16_params:
        bf16 = BF16Params(model, params, grad_ready=reducer.grad_ready,
                          fuse_grad_accumulation=tc.grad_accumulation_fusion)
        optimizer.set_copies(bf16.masters, bf16.copies)  # each step rounds the masters into them
        return bf16.compute, bf16, "bf16 params (fp32 masters)"
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None, "bf16 autocast"


def _data(cfg: RunConfig, run_print, logger: MetricsLogger, rank: int):
    """(train dataset, validation dataset or None, validation samples, info for the first step)."""
    tc, mc = cfg.train, cfg.model
    prepared = prepare_data(cfg.data, rank=rank)
    n_train = tc.train_iters * tc.global_batch_size
    # As in Megatron-LM: one evaluation = eval_iters global batches, the same samples every
    # time (so val_loss is comparable across steps and data-parallel sizes).
    n_valid = tc.eval_iters * tc.global_batch_size if tc.eval_interval > 0 else 0
    train_ds, valid_ds, _ = build_datasets(
        cfg.data, prepared, seq_length=mc.seq_length, seed=tc.seed,
        num_samples=(n_train, max(n_valid, 1), max(n_valid, 1)), model_vocab_size=mc.vocab_size)
    if n_valid and valid_ds is None:
        run_print("warning: the validation split is empty (data.split): evaluation is off")
        n_valid = 0
    info = {}
    train_tokens = split_tokens(train_ds)
    if train_tokens:  # how often the run goes over its training data
        epochs = n_train * mc.seq_length / train_tokens
        info = {"data_train_tokens": train_tokens, "data_epochs": epochs}
        run_print(f"data: {train_tokens:,} tokens in the train split ({prepared.num_tokens:,} in "
                  f"all); {tc.train_iters} steps read {n_train * mc.seq_length:,} = {epochs:.2f} epochs"
                  + (" (data repeats: validation loss then also measures memorisation; more data "
                     "(data.paths, data.default_corpus_mb) or fewer train.train_iters avoid it)"
                     if epochs > 1 else ""))
        logger.summary(info)
    return train_ds, (valid_ds if n_valid else None), n_valid, info


def build(cfg: RunConfig, di: DistInfo, logger: MetricsLogger, num_micro: int, step: int,
          consumed: int) -> Run:
    """Seeds, data, model, optimizer and precision of a run that starts at ``step``."""
    tc, mc = cfg.train, cfg.model
    rank, world, device = di.rank, di.world_size, di.device

    def run_print(*a):
        if rank == 0:
            print(*a, flush=True)

    init_megatron(tc.seed)  # seeds random, numpy, torch (and megatron's CUDA RNG tracker)
    train_ds, valid_ds, n_valid, data_info = _data(cfg, run_print, logger, rank)

    ep = mc.moe.expert_parallel_size if mc.moe is not None else 1
    a2a = mc.moe.a2a_splits if mc.moe is not None else "host"
    try:
        groups = init_parallel_groups(ep, num_experts=mc.moe.num_experts if mc.moe is not None else None)
    except ValueError as e:
        raise TrainError(str(e)) from None
    model = build_gpt_model(mc)
    hooks.out_of_memory(0)  # tests: a model too large for the memory
    model.train()
    params = [p for _, p in trainable_params(model)]
    if device.type == "cuda":
        _check_state_fits(params, tc, torch.cuda.get_device_properties(device).total_memory,
                          torch.cuda.get_device_name(device), experts=mc.moe is not None)
    reducer = GradReducer.for_groups(params, groups, overlap=tc.overlap_grad_reduce)
    reducer.broadcast_params(model)
    optimizer = build_optimizer(model, tc)
    layers = moe_layers(model)
    set_aux_loss_scale(1.0 / num_micro)
    amp, bf16, precision = _precision(tc, model, params, reducer, optimizer, device)
    peak = None
    if device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(device), torch.bfloat16 if tc.bf16 else torch.float32)

    counts = count_parameters(mc)
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    run_print(f"run {cfg.name}: {cfg.run_dir} | {world} x {device.type}{gpu} | {precision}"
              f"{' | deterministic' if tc.deterministic else ''} | micro {tc.micro_batch_size} x dp "
              f"{world} x {num_micro} accumulation = global {tc.global_batch_size} | {len(layers)} MoE "
              f"layers | params total {counts['total'] / 1e6:.1f}M, active/token {counts['active'] / 1e6:.1f}M")

    valid_loader = None
    if valid_ds is not None:  # re-iterated at each evaluation: the same samples every time
        valid_loader = micro_batch_loader(
            valid_ds, MicroBatchSampler(0, n_valid, tc.micro_batch_size, rank, world), device, tc.seed)
    n_train = tc.train_iters * tc.global_batch_size
    sampler = MicroBatchSampler(consumed, n_train, tc.micro_batch_size, rank, world)
    data_iter = iter(micro_batch_loader(train_ds, sampler, device, tc.seed))
    run = Run(cfg=cfg, di=di, logger=logger, num_micro=num_micro, model=model, params=params,
              optimizer=optimizer, reducer=reducer, groups=groups, amp=amp, bf16=bf16, layers=layers,
              layer_names=_moe_layer_names(model, layers), data_iter=data_iter,
              valid_loader=valid_loader, flops_per_token=float(flops_per_token(mc)), peak_tflops=peak,
              step=step, consumed=consumed, first_info={"world_size": world, **data_info})
    mode, why = resolve_mode(tc.cuda_graphs, device=device, layers=layers, ep_size=ep, world_size=world,
                             a2a_splits=a2a, simulated=hooks.cuda_graphs_on_cpu)
    if why and device.type == "cuda":
        run.print(f"cuda graphs: off, eager steps (train.cuda_graphs=auto: {why})")
    if mode != "none":
        run.graph = _micro_batch_graph(run, ep, a2a, mode)
    return run


def _micro_batch_graph(run: Run, ep: int, a2a_splits: str, mode: str) -> MicroBatchGraph:
    """train.cuda_graphs=micro_batch: the graph of ``_micro_batch``, captured at the first step."""
    tc = run.cfg.train
    check_supported(mode, device=run.di.device, layers=run.layers, ep_size=ep, a2a_splits=a2a_splits,
                    simulated=hooks.cuda_graphs_on_cpu)
    if run.di.world_size > 1 and tc.overlap_grad_reduce:
        run.print("note: with train.cuda_graphs the gradient reduction runs after the backward "
                  "(train.overlap_grad_reduce applies to eager steps)")

    asked = os.environ.get(ENV_GRAPH_OVERWRITE, "")
    overwrite = asked != "0"  # the default; "0" keeps the zeroing
    if asked == "1" and run.bf16 is None:
        run.print(f"note: {ENV_GRAPH_OVERWRITE}=1 needs bf16 compute copies (train.bf16_params): "
                  "the graph adds into zeroed gradients")

    def captured(g: MicroBatchGraph) -> None:
        how = ("; the first micro-batch overwrites the gradients" if g.overwrites else
               f"; gradients zeroed each step ({g.no_overwrite})" if g.no_overwrite else "")
        run.print(f"cuda graphs: {g.warmup_iters} warm-up micro-batches {g.warmup_s:.1f} s, "
                  f"capture {g.capture_s:.1f} s (train.cuda_graphs={tc.cuda_graphs}"
                  f"{' -> ' + mode if mode != tc.cuda_graphs else ''}){how}")
        times = {"cuda_graph_warmup_s": g.warmup_s, "cuda_graph_capture_s": g.capture_s}
        run.first_info.update(times)  # the capture runs in the first step: its row has them
        run.logger.summary(times)

    step = lambda batch: _micro_batch(run.model, run.layers, run.amp, run.num_micro, batch)  # noqa: E731
    return MicroBatchGraph(step, grads=run.params, state=list(run.model.buffers()),
                           backend=EagerReplay() if run.di.device.type != "cuda" else None,
                           on_capture=captured,
                           overwriting=overwriting if overwrite and run.bf16 is not None else None)


def restore(run: Run, ckpt: Path) -> None:
    """Load ``ckpt`` into the run: weights, optimizer, RNG states, the non-finite counters."""
    try:
        meta = load_checkpoint(ckpt, run.model, run.optimizer, groups=run.groups)
    except CheckpointError as e:
        raise TrainError(str(e)) from None
    if run.bf16 is not None:
        run.bf16.refresh()
    run.skipped = int(meta.get("skipped_steps", 0))
    run.consecutive = int(meta.get("consecutive_nonfinite", 0))
    if meta.get("world_size") != run.di.world_size:
        run.print(f"note: checkpoint written by {meta.get('world_size')} ranks, resuming on "
                  f"{run.di.world_size}: same data order, new RNG streams where ranks were added")
    run.print(f"resumed from {ckpt} at step {run.step} ({run.consumed} samples consumed)")


# ----------------------------------------------------------------------------- one step


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _forward_loss(model, batch: dict, amp) -> torch.Tensor:
    """Mean LM loss over the micro-batch's unmasked tokens (fp32 scalar)."""
    with amp():
        loss_BS = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return (loss_BS.float() * mask).sum() / mask.sum().clamp_min(1.0)


def _micro_batch(model, layers: list, amp, num_micro: int, batch: dict) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch (the LM loss scaled by 1/num_micro, the aux
    losses by set_aux_loss_scale); returns its statistics as one fp32 vector,
    [lm, aux, z, dropped(L), tokens_per_expert(L*E)] (what train.cuda_graphs captures)."""
    lm = _forward_loss(model, batch, amp)
    if "loss_factor" in batch:  # tests: a diverged step (fault_hooks.loss_factor_at_step)
        lm = lm * batch["loss_factor"]
    (lm / num_micro).backward()
    zero = lm.new_zeros(())

    def total(values) -> torch.Tensor:
        values = [v.detach().float() for v in values if v is not None]
        return torch.stack(values).sum() if values else zero

    parts = [lm.detach().float(), total(m.load_balancing_loss for m in layers), total(m.z_loss for m in layers)]
    if layers:
        parts += [torch.stack([zero if m.dropped_fraction is None else m.dropped_fraction.float()
                               for m in layers])]
        parts += [torch.stack([m.tokens_per_expert.float() for m in layers]).reshape(-1)]
    return torch.cat([p.reshape(-1) for p in parts])


def train_step(run: Run) -> StepResult:
    """One optimizer step over ``num_micro`` micro-batches; the one host synchronisation is the
    read of the step's statistics (they decide whether the update is applied)."""
    tc, device = run.cfg.train, run.di.device
    lr = lr_at(run.step, tc)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    run.zero_grad()
    hooks.out_of_memory(run.step + 1)  # tests: a micro-batch too large for the memory
    stats_C = None
    for micro in range(run.num_micro):
        batch = _to(next(run.data_iter), device)
        if hooks.loss_factor_at_step:  # tests: a diverged step (the first micro-batch's loss x factor)
            factor = hooks.loss_factor_at_step.get(run.step + 1, 1.0) if micro == 0 else 1.0
            batch["loss_factor"] = torch.tensor(factor, device=device)
        if micro == run.num_micro - 1 and run.graph is None:
            run.reducer.arm()  # overlap_grad_reduce: buckets reduce during this backward
        micro_C = run.micro_batch(batch, first=micro == 0)
        stats_C = micro_C.clone() if stats_C is None else stats_C.add_(micro_C)
    run.reducer.reduce()
    grad_norm = clip_grad_norm(run.params, tc.clip_grad, run.groups, scale=False)  # the step scales
    grad_scale = clip_coefficient(grad_norm, tc.clip_grad)
    run.optimizer.prepare()  # the update's host work now, while the GPU runs the micro-batches
    # the stop-signal flags ride along: every rank learns whether any rank received one
    stop_S = run.stop.flags(device) if run.stop is not None else None
    sent_1 = None  # expert parallelism: the rows this rank's tokens sent to the group's other ranks
    if run.groups.ep_size > 1 and run.layers:
        tpe_LE = stats_C[3 + len(run.layers):].view(len(run.layers), -1)
        sent_1 = a2a_rows_sent(tpe_LE, run.groups.ep_size, run.groups.ep_rank).reshape(1)
    packed = torch.cat([stats_C] + ([sent_1] if sent_1 is not None else []) + ([stop_S] if stop_S is not None else []))
    if run.di.world_size > 1:
        dist.all_reduce(packed)
    # grad_norm is global already (the same on every rank): appended after the reduction
    packed_C = torch.cat([packed, grad_norm.reshape(1).to(packed)]).cpu()  # the one sync
    stop_signal = None
    if stop_S is not None:  # the flags out again: packed_C keeps the layout StepResult documents
        n = len(stop_S)
        stop_signal = run.stop.first(packed_C[-1 - n:-1])
        packed_C = torch.cat([packed_C[:-1 - n], packed_C[-1:]])
    rows_sent = None
    if sent_1 is not None:  # out again too, after the flags
        rows_sent = float(packed_C[-2])
        packed_C = torch.cat([packed_C[:-2], packed_C[-1:]])
    lm_loss = float(packed_C[0]) / (run.num_micro * run.di.world_size)
    gnorm = float(packed_C[-1])
    finite = math.isfinite(lm_loss) and math.isfinite(gnorm)  # the same on every rank
    if finite:
        run.optimizer.step(grad_scale=grad_scale)  # copies too; only the launch is left to do
        update_expert_biases(run.model)
        run.consecutive = 0
    else:  # skip the update; the step, its data and the schedule still count
        run.zero_grad()
        run.skipped += 1
        run.consecutive += 1
    run.step += 1
    run.consumed += tc.global_batch_size
    return StepResult(lm_loss, gnorm, lr, finite, packed_C, stop_signal, rows_sent)


def step_metrics(run: Run, r: StepResult, step_time: float) -> dict:
    """The row metrics.jsonl and W&B get for a step (metrics.py lists the keys)."""
    tc, mc, n_layers = run.cfg.train, run.cfg.model, len(run.layers)
    denom = run.num_micro * run.di.world_size
    tokens_per_step = tc.global_batch_size * mc.seq_length
    device = run.di.device
    m = {"consumed_samples": run.consumed, "tokens": run.consumed * mc.seq_length,
         "lm_loss": r.lm_loss,
         "aux_loss": float(r.packed_C[1]) / denom if n_layers else None,  # null: dense
         "z_loss": float(r.packed_C[2]) / denom if n_layers else None,
         "lr": r.lr, "grad_norm": r.grad_norm, "skipped_steps": run.skipped,
         "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
         "tflops_per_gpu": run.flops_per_token * tokens_per_step / step_time / run.di.world_size / 1e12,
         "mfu": None,
         "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
         "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None}
    if run.peak_tflops:
        m["mfu"] = m["tflops_per_gpu"] / run.peak_tflops
    a2a_ms = exchange_time_ms()
    if a2a_ms is not None:  # expert parallelism: GPU time in the token all-to-alls
        m["a2a_ms"] = a2a_ms
        m["a2a_fraction"] = a2a_ms / 1e3 / step_time
    if r.a2a_rows_sent is not None and run.layers[0].exchange_row_bytes:
        padded = None
        if mc.moe.a2a_splits == "padded":  # whole blocks: tokens x top_k rows from each other rank
            padded = ((run.groups.ep_size - 1) * tc.micro_batch_size * mc.seq_length * mc.moe.top_k
                      * n_layers * run.num_micro)
        m["a2a_gb"] = a2a_gb(r.a2a_rows_sent, run.di.world_size, run.layers[0].exchange_row_bytes,
                             padded_rows=padded)
        if a2a_ms:
            m["a2a_gb_per_s"] = m["a2a_gb"] / (a2a_ms / 1e3)
    if n_layers:
        tpe_LE = r.packed_C[3 + n_layers:-1].reshape(n_layers, -1)
        m.update(expert_load_stats(tpe_LE, run.layer_names))
        m.update(ep_rank_imbalance(tpe_LE, run.layer_names, run.groups.ep_size))
    if n_layers and mc.moe.mlp_impl == "capacity":
        per_layer = r.packed_C[3:3 + n_layers] / denom
        m["dropped_fraction"] = float(per_layer.mean())
        for name, v in zip(run.layer_names, per_layer.tolist()):
            m[f"dropped_fraction/{name}"] = v
    if run.first_info:  # once per process (a resumed run logs it again at its first step)
        m.update(run.first_info)
        run.first_info = {}
    return m


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


def save(run: Run, lr: float) -> Path:
    tc = run.cfg.train
    return save_checkpoint(run.cfg.run_dir, run.step, run.model, run.optimizer, {
        "consumed_samples": run.consumed,
        "skipped_steps": run.skipped, "consecutive_nonfinite": run.consecutive,
        "scheduler": {"lr": tc.lr, "min_lr": tc.min_lr, "warmup": tc.lr_warmup_iters,
                      "decay_iters": tc.decay_iters, "last_lr": lr},
        "config": run.cfg.to_dict()}, groups=run.groups)


def _check_divergence(run: Run, r: StepResult, bar) -> None:
    """Report a skipped step; stop the run after train.max_consecutive_nonfinite in a row."""
    tc = run.cfg.train
    run.print(f"step {run.step}: non-finite lm_loss {r.lm_loss} / grad_norm {r.grad_norm}: update "
              f"skipped ({run.consecutive} in a row, the run stops at train.max_consecutive_nonfinite="
              f"{tc.max_consecutive_nonfinite}; {run.skipped} skipped in all)", bar=bar)
    if run.consecutive >= tc.max_consecutive_nonfinite:
        last = latest_checkpoint(run.cfg.run_dir)
        raise TrainError(
            f"{run.consecutive} steps in a row ({run.step - run.consecutive + 1}..{run.step}) had a "
            f"non-finite LM loss or gradient norm (last: lm_loss {r.lm_loss}, grad_norm {r.grad_norm}), "
            f"train.max_consecutive_nonfinite={tc.max_consecutive_nonfinite}: the run diverged and "
            "stops. Lower train.lr, raise train.lr_warmup_iters or check the data, then --resume from "
            f"the last checkpoint ({last.name if last is not None else 'none yet: start again'})")


# ----------------------------------------------------------------------------- the loop


def _loop(run: Run) -> dict:
    """Steps until train.train_iters (or train.exit_interval, or a stop signal: stop_signals.py):
    the step, its metrics, evaluation, checkpoints. Returns the final metrics (see pretrain)."""
    from tqdm import tqdm

    tc = run.cfg.train
    bar = tqdm(total=tc.train_iters, initial=run.step, disable=run.di.rank != 0 or not sys.stdout.isatty(),
               unit="step", dynamic_ncols=True)
    profiler = StepProfiler(run.cfg.run_dir, run.di.rank, run.di.device)
    losses, steps, last_val, last_saved, ok, stopped_by = [], [], None, None, False, None
    try:
        while run.step < tc.train_iters:
            profiler.start(run.step + 1)
            t0 = time.perf_counter()
            r = train_step(run)
            m = step_metrics(run, r, time.perf_counter() - t0)
            step = run.step
            if tc.eval_interval and run.valid_loader is not None and (
                    step % tc.eval_interval == 0 or step == tc.train_iters):
                last_val = m["val_loss"] = evaluate(run.model, run.valid_loader, run.amp, run.di.device)
                m["val_ppl"] = math.exp(min(last_val, 80.0))
            profiler.finish(step)
            losses.append(r.lm_loss)
            steps.append(step)
            run.logger.log(m, step)
            bar.update(1)
            bar.set_postfix(loss=f"{r.lm_loss:.3f}", tok_s=f"{m['tokens_per_s']:,.0f}")
            if step % tc.log_interval == 0 or step == tc.train_iters or "val_loss" in m:
                run.print(format_line(step, tc.train_iters, m), bar=bar)
            if not r.finite:
                _check_divergence(run, r, bar)
            exit_now = tc.exit_interval is not None and step % tc.exit_interval == 0
            stopped_by = r.stop_signal if step < tc.train_iters else None
            if ((tc.save_interval and step % tc.save_interval == 0) or exit_now or stopped_by
                    or (step == tc.train_iters and tc.save_final)):
                last_saved = save(run, r.lr)
                run.print(f"saved checkpoint {last_saved}", bar=bar)
            if stopped_by:
                run.print(f"{stopped_by} received: stopped after step {step}, checkpoint saved; "
                          "continue with --resume", bar=bar)
                break
            if exit_now and step < tc.train_iters:
                run.print(f"train.exit_interval={tc.exit_interval}: stopping at step {step}; "
                          "continue with --resume", bar=bar)
                break
        ok = True
    finally:
        bar.close()
        if ok:
            run.logger.summary({"final_lm_loss": losses[-1] if losses else None,
                                "final_val_loss": last_val})
        run.logger.close(0 if ok else 1)
    return {"step": run.step, "consumed_samples": run.consumed, "losses": losses, "steps": steps,
            "skipped_steps": run.skipped, "lm_loss": losses[-1] if losses else None,
            "val_loss": last_val, "run_dir": str(run.cfg.run_dir),
            "checkpoint": str(last_saved) if last_saved else None, "stopped_by": stopped_by}


def _micro_batches(tc) -> int:
    """Micro-batches per step on each rank; refuses a global batch that does not divide over the
    micro-batch and the data-parallel ranks (known before the process group exists)."""
    world = world_size()
    per_step = tc.micro_batch_size * world
    if tc.global_batch_size % per_step:
        raise TrainError(
            f"train.global_batch_size={tc.global_batch_size} is not divisible by "
            f"train.micro_batch_size ({tc.micro_batch_size}) x data-parallel size ({world}) = "
            f"{per_step}: choose a global batch that is a multiple of {per_step}")
    return tc.global_batch_size // per_step


def _lock_run_dir(run_dir: Path, di: DistInfo) -> RunLock | None:
    """Rank 0 takes the run directory's lock (run_lock.py); every rank learns the outcome from a
    broadcast, so a refused job stops on all ranks before any of them reads or writes the
    directory. The lock on rank 0, None on the others."""
    lock, refusal = None, None
    if di.rank == 0:
        try:
            lock = RunLock.acquire(run_dir)
        except RunLockError as e:
            refusal = str(e)
        except OSError as e:  # e.g. no permission to create the directory
            refusal = f"cannot lock run directory {run_dir}: {e}"
    if di.world_size > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise TrainError(refusal)
    if lock is not None and lock.note():
        print(lock.note(), flush=True)
    return lock


def _resume_point(cfg: RunConfig, resume: bool, rank: int) -> tuple[Path | None, dict]:
    """The checkpoint this run continues from and its (verified) meta, or (None, {}) for a fresh
    start; a fresh start in a run directory that has checkpoints is refused."""
    run_dir = cfg.run_dir
    try:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None and not resume:
            raise TrainError(
                f"run directory {run_dir} already holds checkpoints (latest: {ckpt.name}): pass "
                "--resume to continue it, give the run another name (name=...), or delete the directory")
        if ckpt is None:
            if resume and rank == 0:
                print(f"--resume: no checkpoint in {run_dir}, starting from scratch", flush=True)
            return None, {}
        return ckpt, verify_checkpoint(ckpt)
    except CheckpointError as e:
        raise TrainError(str(e)) from None


def _config_changes(ckpt: Path, meta: dict, cfg: RunConfig, rank: int) -> dict:
    """Compare the checkpoint's config with this run's (checkpoint.config_changes). Changes of
    the model's shape stop the run here, before anything is built, one line per key; the others
    apply from the next step and are printed. Returns those as {key: [old, new]} for the first
    metrics row (W&B gets it too)."""
    if not isinstance(meta.get("config"), dict):  # a checkpoint from before configs were saved
        return {}
    saved, new = meta["config"], cfg.to_dict()
    changes = config_changes(saved, new)
    refused = shape_changes(changes, saved, new)
    if refused:
        raise TrainError(f"cannot resume from {ckpt}: {len(refused)} config change(s) alter the model's "
                         "parameters, one per line below; resume with the checkpoint's values\n" + "\n".join(
                             f"  {c} (the checkpoint's weights have the old shape; start a new run "
                             "with another name=)" for c in refused))
    if changes and rank == 0:
        print(f"config changes since {ckpt.name} (they apply from step {int(meta['step']) + 1}):\n"
              + "\n".join(f"  {c}" for c in changes), flush=True)
    return {c.key: [None if v is ABSENT else v for v in (c.old, c.new)] for c in changes}


def _out_of_memory(e: BaseException, tc, run: Run | None) -> str | None:
    """The one line for an allocation failure, None for any other error. GPUs raise
    torch.OutOfMemoryError (or a CUDA error saying "out of memory"), the CPU's allocator a
    RuntimeError saying "can't allocate memory", Python a MemoryError. The line keeps CUDA's
    words, which megatron-moe-find-micro-batch looks for in a trial's output."""
    text = str(e)
    if not (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text):
        return None
    kind = "CUDA" if isinstance(e, torch.OutOfMemoryError) or "CUDA" in text else "CPU"
    where = ("during start-up" if run is None else "in the first step" if run.step == 0
             else f"after step {run.step}")
    size = re.search(r"[Tt]ried to allocate ([\d.]+ ?\w+)", text)
    line = (f"{kind} out of memory {where}{f' (tried to allocate {size[1]})' if size else ''} with "
            f"train.micro_batch_size={tc.micro_batch_size}: lower train.micro_batch_size (the global batch "
            f"stays {tc.global_batch_size}: more micro-batches are accumulated), find the largest that fits "
            "with megatron-moe-find-micro-batch, or, for a model with many or large experts, split them "
            "over more GPUs with model.moe.expert_parallel_size")
    if kind == "CUDA" and run is not None:
        line += _state_note(run.params, tc)
    return line


def _state_bytes(params, tc) -> tuple[int, int, bool]:
    """(parameters on this GPU, bytes of state each: fp32 weights and gradients, AdamW's two
    moments, the bf16 copies; whether there are copies)."""
    n = sum(p.numel() for p in params)
    copies = bool(tc.bf16 and tc.bf16_params)
    return n, 4 + 4 + (4 if tc.adam_moments_dtype == "bf16" else 8) + (2 if copies else 0), copies


def _state_note(params, tc) -> str:
    """What the model's state takes of each GPU before any activation and what bf16 moments
    would free: the part of an out-of-memory line that says whether a micro-batch can fit at all."""
    n, per_param, copies = _state_bytes(params, tc)
    note = (f"; the model's state takes {n * per_param / 1e9:.1f} GB of this GPU before activations "
            f"({n / 1e9:.2f}B parameters x {per_param} bytes: fp32 weights and gradients, AdamW's moments"
            f"{', bf16 copies' if copies else ''})")
    if tc.adam_moments_dtype != "bf16":
        note += f", {n * 4 / 1e9:.1f} GB less with train.adam_moments_dtype=bf16"
    return note


def _check_state_fits(params, tc, total_bytes: int, gpu: str, *, experts: bool) -> None:
    """Refuse at once, in one line, a model whose state alone outgrows the GPU (it would run
    out of memory only after the warm-up and the first backward)."""
    n, per_param, _ = _state_bytes(params, tc)
    if n * per_param <= total_bytes:
        return
    fixes = ["split the experts over more GPUs with model.moe.expert_parallel_size"] if experts else []
    if tc.adam_moments_dtype != "bf16" and n * (per_param - 4) <= total_bytes:
        fixes.append(f"set train.adam_moments_dtype=bf16 ({n * (per_param - 4) / 1e9:.1f} GB)")
    fix = ", or ".join(fixes) or ("this trainer shards experts only: a dense model this size needs Megatron-LM's "
                                   "tensor or pipeline parallelism (docs/megatron.md)")
    raise TrainError(f"the model's state takes {n * per_param / 1e9:.1f} GB of each GPU before any activation "
                     f"({n / 1e9:.2f}B parameters here x {per_param} bytes), more than the "
                     f"{total_bytes / 1e9:.1f} GB of the {gpu}: {fix}")


def _known_failure(e: BaseException, tc, run: Run | None) -> str | None:
    """The one line for a failure a setting fixes (out of memory; an op with no deterministic
    version), None for any other exception (it propagates with its traceback)."""
    if isinstance(e, TrainError) or not isinstance(e, Exception):
        return None
    oom = _out_of_memory(e, tc, run)
    if oom is not None:
        return oom
    if tc.deterministic and isinstance(e, RuntimeError) and "deterministic" in str(e):
        return (f"train.deterministic=true: {str(e).splitlines()[0]} Set train.deterministic=false to "
                "run this model here")
    return None


def _train(cfg: RunConfig, resume: bool, di: DistInfo, num_micro: int, stop: StopSignals) -> dict:
    """pretrain's body, under the run directory's lock: the resume point and its config
    changes, logging, ``build``, ``restore`` and ``_loop``. A failure closes the logs (W&B
    with exit code 1); one a setting fixes becomes a TrainError naming it."""
    ckpt, meta = _resume_point(cfg, resume, di.rank)
    changes = _config_changes(ckpt, meta, cfg, di.rank) if ckpt is not None else {}
    step, consumed = int(meta.get("step", 0)), int(meta.get("consumed_samples", 0))
    # Logging first: whatever W&B does to the RNGs happens before seeding.
    if di.rank == 0:
        (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml())
    logger = MetricsLogger(cfg, cfg.run_dir, enabled=di.rank == 0, resume_step=step)
    run = None
    try:
        run = build(cfg, di, logger, num_micro, step, consumed)
        if changes:
            run.first_info["config_changes"] = changes
        if ckpt is not None:  # last, so the restored RNG states are the ones the next step sees
            restore(run, ckpt)
        run.stop = stop
        result = _loop(run)
    except BaseException as e:
        logger.close(exit_code=1)
        _release_graph(run, failed=True)
        message = _known_failure(e, cfg.train, run)
        if message is None:
            raise
        raise TrainError(message) from None
    _release_graph(run)
    return result


def _release_graph(run: Run | None, failed: bool = False) -> None:
    """The CUDA graph freed while the process group lives (MicroBatchGraph.release: NCCL cannot
    destroy a communicator that a live graph captured, and the process would hang at exit).
    After a failure: without waiting for the GPU, and the failure is what propagates."""
    if run is None or run.graph is None:
        return
    try:
        run.graph.release(wait=not failed)
    except Exception:
        if not failed:
            raise


def pretrain(cfg: RunConfig, resume: bool = False) -> dict:
    """Train per ``cfg``; with ``resume`` continue from run_dir/checkpoints/latest (if any).

    Returns the final metrics: step, consumed_samples, lm_loss, val_loss, losses (the LM loss
    of every step run by this call; NaN where a step was skipped), steps, skipped_steps (in
    the whole run), run_dir, checkpoint, stopped_by (the stop signal's name, or None),
    wall_time_s.
    """
    t_start = time.time()
    tc = cfg.train
    num_micro = _micro_batches(tc)  # bad input fails fast, before the process group
    set_deterministic(tc.deterministic)  # before CUDA / NCCL initialise
    di = setup_distributed()
    try:  # what needs no model (the device, expert parallelism), before the data is prepared
        moe = cfg.model.moe
        check_supported(tc.cuda_graphs, device=di.device, layers=[], simulated=hooks.cuda_graphs_on_cpu,
                        ep_size=moe.expert_parallel_size if moe is not None else 1,
                        a2a_splits=moe.a2a_splits if moe is not None else "host")
        if moe is not None and moe.a2a_splits == "symmetric":
            check_symmetric_exchange(moe.expert_parallel_size,
                                     int(os.environ.get("LOCAL_WORLD_SIZE", di.world_size)))
    except ValueError as e:
        raise TrainError(str(e)) from None
    lock = _lock_run_dir(cfg.run_dir, di)  # before the run reads or writes its directory
    try:
        with StopSignals() as stop:  # SIGTERM / SIGUSR1: save after the step and stop
            result = _train(cfg, resume, di, num_micro, stop)
    finally:
        if lock is not None:
            lock.release()
    result["wall_time_s"] = time.time() - t_start
    if di.rank == 0:
        lm, val = result["lm_loss"], result["val_loss"]
        print(f"done: step {result['step']}/{tc.train_iters}, lm_loss {lm if lm is None else round(lm, 4)}, "
              f"val_loss {val if val is None else round(val, 4)}, {result['wall_time_s']:.1f} s, run dir "
              f"{cfg.run_dir}", flush=True)
    return result


# ----------------------------------------------------------------------------- CLI


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    return f"megatron-moe-train: {category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-moe-train",
        description="Pretrain a megatron-core GPT with dropless MoE from a YAML config.",
        epilog="Overrides: dotted keys, e.g. train.lr=3e-4 model.moe.top_k=2 name=my-run")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"a config file, or the name of a shipped config (default {DEFAULT_CONFIG})")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run directory's latest checkpoint (fresh start if none)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    warnings.formatwarning = _one_line_warning  # e.g. a deprecated config value: one line
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        parser.exit(2, f"megatron-moe-train: config error: {e}\n")
    if args.print_config:
        sys.stdout.write(cfg.to_yaml())
        return 0
    rc = 1  # until pretrain returns
    try:
        pretrain(cfg, resume=args.resume)
        rc = 0
    except (TrainError, ConfigError, FileNotFoundError, ValueError) as e:
        # Bad input (config, data, checkpoint): one line that says what to change.
        if os.environ.get("MEGATRON_MOE_DEBUG"):
            raise
        first, _, more = str(e).partition("\n")  # a list (one line per key) follows the error
        # One write: print() writes the text and its newline apart, and under torchrun the ranks'
        # lines then run together on the shared stderr pipe.
        sys.stderr.write(f"megatron-moe-train: error: {first} (MEGATRON_MOE_DEBUG=1 shows the traceback)\n"
                         + (f"{more}\n" if more else ""))
        sys.stderr.flush()
    finally:
        teardown(rc, pending=sys.exc_info()[1])  # an exception on its way out, if any
    return rc


if __name__ == "__main__":
    sys.exit(main())
