"""Fused AdamW step: the gradient-clipping scale, the AdamW update of the fp32 master weights and
the refresh of their 16-bit compute copies, in one pass over every parameter and one launch.

Per element, for a parameter p with gradient g, moments m and v, and its group's lr, wd, β1, β2,
eps at step t (after the increment), s the clipping coefficient (1 when none is given):

    g' = s·g
    p  = p·(1 - lr·wd)                                   (decoupled weight decay)
    m  = β1·m + (1-β1)·g'
    v  = β2·v + (1-β2)·g'²
    p  = p - (lr / (1-β1^t)) · m / (sqrt(v) / sqrt(1-β2^t) + eps)
    copy = round(p)                                      (bf16 or fp16, when given)

torch.optim.AdamW's update, in the same order. Unfused, a training step passes over the
gradients three times beside it: the clipping multiply (read and write g), the fused AdamW
(reads p, g, m, v; writes p, m, v) and the copy refresh (read p, write the copy). Here each
element moves 16 bytes in and 14 out (12 without copies) once: for dmoe-small's 3.7B parameters
~111 GB per step against ~156 GB unfused.

Moments in bf16 (``exp_avgs``/``exp_avg_sqs`` bfloat16, as Megatron's precision-aware optimizer
with ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``): read and widened to fp32, updated in
fp32 (the step uses the unrounded values), stored rounded to nearest even: 12 bytes in and 10
out per element, and 8 bytes less of state per parameter.

One launch covers all parameters: a table holds each parameter's addresses (p, g, m, v, copy)
and numel, another its per-step scalars (decay, step size, sqrt(1-β2^t), β1, β2, eps); a
block map (static while the parameter set is) gives each program its parameter and offset.

Legend: P parameters, B blocks of BLOCK elements over all of them.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import cdiv, round_bf16, use_triton
from .launcher import launch

BLOCK = 1024  # elements per program: one 16-byte access per array per thread at 8 warps
NUM_WARPS = 8
# columns of the tables
_ADDRS = 6   # p, g, m, v, copy (0 when none), numel
_HYPER = 6   # decay = 1 - lr·wd, step_size = lr / (1-β1^t), bc2_sqrt = sqrt(1-β2^t), β1, β2, eps


def hyperparameters(lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                    step: int) -> tuple[float, ...]:
    """The per-parameter scalars of one update at step ``step`` (1-based, after the increment)."""
    return (1.0 - lr * weight_decay, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step),
            beta1, beta2, eps)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _adamw_kernel(addrs_ptr, hyper_ptr, block_param_ptr, block_start_ptr, scale_ptr,
                  HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr, COPY_DTYPE: tl.constexpr,
                  STATE_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(block_param_ptr + pid).to(tl.int64)
    start = tl.load(block_start_ptr + pid)
    row = addrs_ptr + i * 6
    p_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    if STATE_BF16:
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
    else:
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 5)
    h = hyper_ptr + i * 6
    decay = tl.load(h + 0)
    step_size = tl.load(h + 1)
    bc2_sqrt = tl.load(h + 2)
    beta1 = tl.load(h + 3)
    beta2 = tl.load(h + 4)
    eps = tl.load(h + 5)

    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    if STATE_BF16:
        tl.store(m_ptr + offs, round_bf16(m), mask=mask)
        tl.store(v_ptr + offs, round_bf16(v), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        c_ptr = tl.load(row + 4).to(tl.pointer_type(COPY_DTYPE))
        if COPY_DTYPE == tl.bfloat16:
            c = round_bf16(p)
        else:
            c = p.to(COPY_DTYPE)
        tl.store(c_ptr + offs, c, mask=mask)


# ----------------------------------------------------------------------------- launcher

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class BlockMap:
    """Which parameter and offset each program of the launch takes: ``param_B`` (int32) and
    ``start_B`` (int64), built once for a list of sizes on ``device``; it also keeps the last
    address table it was given on the device (:meth:`addresses`), so steps whose tensors have not
    moved upload nothing."""

    def __init__(self, numels: list[int], device: torch.device, block: int = BLOCK):
        self.numels, self.block = tuple(numels), block
        counts = [cdiv(n, block) for n in numels]
        self.num_blocks = sum(counts)
        idx = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                      torch.tensor(counts, dtype=torch.int64))
        first = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
        start = (torch.arange(self.num_blocks, dtype=torch.int64) - first[idx.long()]) * block
        self.param_B = idx.to(device)
        self.start_B = start.to(device)
        self._rows: list | None = None
        self._addrs: torch.Tensor | None = None

    def addresses(self, rows: list[list[int]]) -> torch.Tensor:
        """``rows`` as an int64 [P, 6] table on the map's device (cached while they repeat)."""
        if rows != self._rows:
            self._addrs = _to_device(torch.tensor(rows, dtype=torch.int64), self.param_B.device)
            self._rows = rows
        return self._addrs


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host table on ``device`` without a host sync (pinned; the caching host allocator
    keeps the staging buffer alive until the copy is done)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _check(params, grads, exp_avgs, exp_avg_sqs, copies, hyper):
    P = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(hyper) == P) or (
            copies is not None and len(copies) != P):
        raise ValueError(f"adamw_step_: {P} params but {len(grads)} grads, {len(exp_avgs)} exp_avgs, "
                         f"{len(exp_avg_sqs)} exp_avg_sqs, {len(hyper)} hyperparameter rows"
                         + (f", {len(copies)} copies" if copies is not None else ""))
    state_dtype = exp_avgs[0].dtype if P else torch.float32
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adamw_step_: the moments must be float32 or bfloat16, got {state_dtype}")
    for k in range(P):
        group = [params[k], grads[k], exp_avgs[k], exp_avg_sqs[k]]
        dtypes = [torch.float32, torch.float32, state_dtype, state_dtype]
        if any(t.dtype != d or t.shape != params[k].shape or not t.is_contiguous()
               or t.device != params[k].device for t, d in zip(group, dtypes)):
            raise ValueError(f"adamw_step_: parameter {k}: p and grad must be contiguous float32 "
                             f"tensors, exp_avg and exp_avg_sq contiguous {state_dtype} (one dtype for "
                             f"all parameters), all of one shape on one device, got "
                             f"{[(t.dtype, tuple(t.shape), t.is_contiguous()) for t in group]}")
        if copies is not None:
            c = copies[k]
            if c.dtype not in _TL_DTYPE or c.shape != params[k].shape or not c.is_contiguous():
                raise ValueError(f"adamw_step_: copy {k} must be a contiguous bfloat16 or float16 "
                                 f"tensor of shape {tuple(params[k].shape)}, got {c.dtype} "
                                 f"{tuple(c.shape)}")
    if copies is not None and len({c.dtype for c in copies}) > 1:
        raise ValueError("adamw_step_: the copies must share one dtype, got "
                         f"{sorted(str(d) for d in {c.dtype for c in copies})}")


class AdamWLaunch:
    """One update made ready by :func:`adamw_prepare`: the checks done, the address table and the
    hyperparameters on the device; :meth:`run` launches it (once per preparation)."""

    def __init__(self, run, block_map: BlockMap | None):
        self._run, self.block_map = run, block_map

    def run(self, grad_scale: torch.Tensor | None = None) -> None:
        """The update of every parameter, gradients times ``grad_scale`` (a float32 scalar tensor
        on the parameters' device, read there) when given."""
        self._run(grad_scale)


def adamw_prepare(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], hyper: list[tuple[float, ...]], *,
                  copies: list[torch.Tensor] | None = None, block_map: BlockMap | None = None,
                  block: int = BLOCK, num_warps: int = NUM_WARPS) -> AdamWLaunch:
    """:func:`adamw_step_`'s host work without its launch: the checks, the block map (rebuilt when
    the sizes or ``block`` change; ``.block_map`` to pass back next time), the address table and
    the hyperparameters uploaded. Nothing changes until ``.run(grad_scale)``."""
    _check(params, grads, exp_avgs, exp_avg_sqs, copies, hyper)
    if not params:
        return AdamWLaunch(lambda grad_scale: None, block_map)
    if not use_triton(*params):
        return AdamWLaunch(lambda grad_scale: adamw_step_reference(params, grads, exp_avgs, exp_avg_sqs, hyper,
                                                                   copies=copies, grad_scale=grad_scale), block_map)
    device = params[0].device
    numels = [p.numel() for p in params]
    if (block_map is None or block_map.numels != tuple(numels) or block_map.block != block
            or block_map.param_B.device != device):
        block_map = BlockMap(numels, device, block)
    if block_map.num_blocks == 0:
        return AdamWLaunch(lambda grad_scale: None, block_map)
    rows = [[t.data_ptr() for t in (params[k], grads[k], exp_avgs[k], exp_avg_sqs[k])]
            + [copies[k].data_ptr() if copies is not None else 0, numels[k]] for k in range(len(params))]
    addrs = block_map.addresses(rows)
    hyp = _to_device(torch.tensor(hyper, dtype=torch.float32), device)
    meta = dict(HAS_COPY=copies is not None,
                COPY_DTYPE=_TL_DTYPE[copies[0].dtype] if copies is not None else tl.bfloat16,
                STATE_BF16=exp_avgs[0].dtype == torch.bfloat16, BLOCK=block, num_warps=num_warps)

    def run(grad_scale):
        if grad_scale is not None:
            if grad_scale.numel() != 1 or grad_scale.device != device:
                raise ValueError(f"adamw_step_: grad_scale must be a scalar tensor on {device}, got "
                                 f"shape {tuple(grad_scale.shape)} on {grad_scale.device}")
            grad_scale = grad_scale.reshape(1).to(torch.float32)
        launch(_adamw_kernel, (block_map.num_blocks,),
               (addrs, hyp, block_map.param_B, block_map.start_B, grad_scale if grad_scale is not None else hyp),
               dict(HAS_SCALE=grad_scale is not None, **meta))

    return AdamWLaunch(run, block_map)


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], hyper: list[tuple[float, ...]], *,
                copies: list[torch.Tensor] | None = None, grad_scale: torch.Tensor | None = None,
                block_map: BlockMap | None = None, block: int = BLOCK,
                num_warps: int = NUM_WARPS) -> BlockMap | None:
    """One AdamW update of every parameter in place (module docstring), copies written too.

    ``hyper[k]`` is :func:`hyperparameters` for parameter k; ``grad_scale`` a float32 scalar
    tensor on the parameters' device (the clipping coefficient; read there, no host sync).
    Triton on the GPU and under the interpreter, :func:`adamw_step_reference` otherwise. Returns
    the block map to pass back next step (rebuilt when the sizes or ``block`` change).
    ``block`` (elements per program) and ``num_warps``: launch shape (benchmarks/bench_adamw.py).
    :func:`adamw_prepare` then ``.run(grad_scale)`` is the same in two halves.
    """
    prepared = adamw_prepare(params, grads, exp_avgs, exp_avg_sqs, hyper, copies=copies, block_map=block_map,
                             block=block, num_warps=num_warps)
    prepared.run(grad_scale)
    return prepared.block_map


# ----------------------------------------------------------------------------- reference


@torch.no_grad()
def adamw_step_reference(params, grads, exp_avgs, exp_avg_sqs, hyper, *, copies=None, grad_scale=None):
    """The same update with plain PyTorch ops, one parameter at a time (the CPU path); bf16
    moments are updated in fp32 and rounded when stored, as the kernel does."""
    for k, p in enumerate(params):
        decay, step_size, bc2_sqrt, beta1, beta2, eps = hyper[k]
        g = grads[k] if grad_scale is None else grads[k] * grad_scale.to(grads[k].dtype)
        p.mul_(decay)
        m, v = exp_avgs[k], exp_avg_sqs[k]
        if m.dtype != torch.float32:
            m, v = m.float(), v.float()
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if m is not exp_avgs[k]:
            exp_avgs[k].copy_(m)
            exp_avg_sqs[k].copy_(v)
        if copies is not None:
            copies[k].copy_(p)
