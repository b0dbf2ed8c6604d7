"""Fused LM cross-entropy (autograd op over kernels/cross_entropy.py).

    loss_T = lm_cross_entropy(logits_TV, labels_T)      # fp32 [T]; logits in any float dtype

Forward saves the logits as they are (bf16 under autocast) and two fp32 numbers per row (max and
log Σ exp); the backward recomputes the softmax from them and, with ``inplace_backward`` (the
default), writes dL/dlogits over the saved logits, their last use: the caller must not read the
logits after the backward. A second backward through the same forward is then a clear error.

Legend: T rows (tokens), V vocabulary.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd


class LMCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, labels_T, inplace_backward):
        loss_T, stats_T2 = cross_entropy_fwd(logits_TV, labels_T)
        ctx.save_for_backward(logits_TV, labels_T, stats_T2)
        ctx.inplace, ctx.consumed = inplace_backward, False
        return loss_T

    @staticmethod
    def backward(ctx, dloss_T):
        if ctx.consumed:
            raise RuntimeError("lm_cross_entropy: a second backward through the same forward is not supported "
                               "(the first one wrote the gradient over the saved logits); run the forward again")
        logits_TV, labels_T, stats_T2 = ctx.saved_tensors
        ctx.consumed = ctx.inplace
        return cross_entropy_bwd(logits_TV, labels_T, stats_T2, dloss_T, inplace=ctx.inplace), None, None


def lm_cross_entropy(logits_TV: torch.Tensor, labels_T: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """Per-row cross-entropy -log softmax(logits)[label] in fp32 [T] (no reduction, no masking)."""
    return LMCrossEntropy.apply(logits_TV, labels_T, inplace_backward)
