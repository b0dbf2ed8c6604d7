"""Fused cross-entropy over the vocabulary: one read of the logits forward, one read and one write
backward, never an fp32 copy of the [T, V] logits.

* :func:`cross_entropy_fwd`: loss[t] = logsumexp(logits[t]) - logits[t, label[t]] and the row
  statistics stats[t] = (max_v logits[t, v], log Σ_v exp(logits[t, v] - max)) in fp32, from
  logits in any float dtype (online max / sum of exponentials in fp32, one pass over each row;
  the max is taken out before anything is rounded, so large logits lose no precision).
* :func:`cross_entropy_bwd`: dlogits[t] = dloss[t] · (softmax(logits[t]) - onehot(label[t])),
  recomputed from the logits and stats, in the logits' dtype; optionally written over the logits
  (their last use), so the backward needs no second [T, V] buffer.

The unfused path (megatron-core's vocab_parallel_cross_entropy under bf16 autocast) makes an
fp32 copy of the logits and passes over it five times (max, subtract, exp, divide, and the
gradient's multiply), and saves the fp32 softmax for the backward.

Legend: T rows (tokens), V vocabulary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_power_of_2, use_triton
from .launcher import launch


def _block_v(V: int) -> int:
    return min(4096, next_power_of_2(max(V, 16)))


@triton.jit
def _cross_entropy_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, stats_ptr, V, stride_t,
                              BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_t
    offs = tl.arange(0, BLOCK_V)
    # the row's max and Σ exp(x - max), a block at a time: the block's max first, then one
    # exponential per element (the sum rescaled once per block; a running max per lane costs two,
    # and the exponentials, not the memory, then set the pace). The max starts finite (-3e38), so
    # exp(m - m_new) never meets -inf - (-inf); masked lanes (x = -inf) add exp(-inf) = 0
    m = tl.full((), -3.0e38, tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    log_s = tl.log(s)
    label = tl.load(labels_ptr + row).to(tl.int64)
    x_label = tl.load(base + label).to(tl.float32)
    tl.store(loss_ptr + row, log_s - (x_label - m))
    tl.store(stats_ptr + 2 * row, m)
    tl.store(stats_ptr + 2 * row + 1, log_s)


@triton.jit
def _cross_entropy_bwd_kernel(logits_ptr, dlogits_ptr, labels_ptr, stats_ptr, dloss_ptr, V, stride_t, stride_dt,
                              BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_t
    dbase = dlogits_ptr + row * stride_dt
    offs = tl.arange(0, BLOCK_V)
    m = tl.load(stats_ptr + 2 * row)
    log_s = tl.load(stats_ptr + 2 * row + 1)
    dl = tl.load(dloss_ptr + row).to(tl.float32)
    label = tl.load(labels_ptr + row).to(tl.int64)
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        x = tl.load(base + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp((x - m) - log_s)
        g = dl * (p - tl.where(v0 + offs == label, 1.0, 0.0))
        tl.store(dbase + v0 + offs, g.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _check(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> None:
    if logits_TV.dim() != 2 or not logits_TV.is_floating_point():
        raise ValueError(f"cross_entropy: logits must be a float [T, V] tensor, got {logits_TV.dtype} "
                         f"{tuple(logits_TV.shape)}")
    if labels_T.shape != logits_TV.shape[:1] or labels_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cross_entropy: labels must be int32/int64 [T={logits_TV.shape[0]}], got "
                         f"{labels_T.dtype} {tuple(labels_T.shape)}")


def cross_entropy_fwd_triton(logits_TV, labels_T):
    _check(logits_TV, labels_T)
    T, V = logits_TV.shape
    if logits_TV.stride(1) != 1:
        logits_TV = logits_TV.contiguous()
    loss_T = torch.empty(T, device=logits_TV.device, dtype=torch.float32)
    stats_T2 = torch.empty(T, 2, device=logits_TV.device, dtype=torch.float32)
    if T:
        launch(_cross_entropy_fwd_kernel, (T,),
               (logits_TV, labels_T.contiguous(), loss_T, stats_T2, V, logits_TV.stride(0)),
               dict(BLOCK_V=_block_v(V), num_warps=8))
    return loss_T, stats_T2


def cross_entropy_bwd_triton(logits_TV, labels_T, stats_T2, dloss_T, inplace=False):
    T, V = logits_TV.shape
    if logits_TV.stride(1) != 1:
        logits_TV, inplace = logits_TV.contiguous(), True  # a private copy may be overwritten
    dlogits_TV = logits_TV if inplace else torch.empty_like(logits_TV)
    if T:
        launch(_cross_entropy_bwd_kernel, (T,),
               (logits_TV, dlogits_TV, labels_T.contiguous(), stats_T2.contiguous(), dloss_T.contiguous(), V,
                logits_TV.stride(0), dlogits_TV.stride(0)),
               dict(BLOCK_V=_block_v(V), num_warps=8))
    return dlogits_TV


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch references (and the CPU path without the Triton interpreter)
# ----------------------------------------------------------------------------------------------


def cross_entropy_fwd_reference(logits_TV, labels_T):
    _check(logits_TV, labels_T)
    x = logits_TV.float()
    m_T = x.amax(dim=-1) if x.shape[1] else x.new_zeros(x.shape[0])
    log_s_T = torch.log(torch.exp(x - m_T[:, None]).sum(-1))
    loss_T = log_s_T - (x.gather(1, labels_T.long()[:, None])[:, 0] - m_T)
    return loss_T, torch.stack([m_T, log_s_T], 1)


def cross_entropy_bwd_reference(logits_TV, labels_T, stats_T2, dloss_T, inplace=False):
    g = torch.exp((logits_TV.float() - stats_T2[:, :1]) - stats_T2[:, 1:])
    g[torch.arange(g.shape[0], device=g.device), labels_T.long()] -= 1.0
    g = (g * dloss_T.float()[:, None]).to(logits_TV.dtype)
    return logits_TV.copy_(g) if inplace else g


def cross_entropy_fwd(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_T fp32 [T], stats_T2 fp32 [T, 2]): loss = logsumexp(logits) - logits[label] per row,
    stats = (row max, log Σ exp(logits - max)); logsumexp = their sum. Labels must lie in [0, V)
    (not checked on the GPU: that would be a host synchronisation)."""
    fn = cross_entropy_fwd_triton if use_triton(logits_TV, labels_T) else cross_entropy_fwd_reference
    return fn(logits_TV, labels_T)


def cross_entropy_bwd(logits_TV: torch.Tensor, labels_T: torch.Tensor, stats_T2: torch.Tensor, dloss_T: torch.Tensor,
                      inplace: bool = False) -> torch.Tensor:
    """dL/dlogits [T, V] in the logits' dtype: dloss · (softmax(logits) - onehot(label)), the
    softmax from the forward's stats; with ``inplace`` written over logits_TV (then gone)."""
    fn = cross_entropy_bwd_triton if use_triton(logits_TV, labels_T, stats_T2, dloss_T) else cross_entropy_bwd_reference
    return fn(logits_TV, labels_T, stats_T2, dloss_T, inplace=inplace)
