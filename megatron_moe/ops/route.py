"""The router after its logits as one autograd op (kernels/router.py): 2 launches forward, 1 backward.

    ids_TK, weights_TK, counts_E, aux, z = route(logits_TE, bias_E, top_k, softmax=True,
                                                 aux_coeff=0.01, z_coeff=0.0)

On a GPU (or under the Triton interpreter) the fused kernels; elsewhere, with ``fused=False`` and
with ``MEGATRON_MOE_FUSED_ROUTER=0`` (A/B runs) the plain-PyTorch reference through autograd.
The forward saves the logits (fp32 [T, E]), the chosen experts and the counts; the backward
recomputes the scores.

Legend: T tokens, E experts, K top_k.
"""
from __future__ import annotations

import torch

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.switches import fused_router
from megatron_moe.kernels.router import route_bwd_triton, route_fwd_triton, route_reference


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, top_k, softmax, normalize, aux_coeff, z_coeff):
        ids_TK, weights_TK, counts_E, aux, z = route_fwd_triton(
            logits_TE, bias_E, top_k, softmax=softmax, normalize=normalize, aux_coeff=aux_coeff, z_coeff=z_coeff)
        ctx.save_for_backward(logits_TE, ids_TK, counts_E)
        ctx.mark_non_differentiable(ids_TK, counts_E)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros made
        ctx.args = dict(softmax=softmax, normalize=normalize, aux_coeff=aux_coeff, z_coeff=z_coeff)
        return ids_TK, weights_TK, counts_E, aux, z

    @staticmethod
    def backward(ctx, _dids, dweights_TK, _dcounts, daux, dz):
        logits_TE, ids_TK, counts_E = ctx.saved_tensors
        if dweights_TK is None and daux is None and dz is None:
            return (None,) * 7
        dlogits_TE = route_bwd_triton(logits_TE, ids_TK, counts_E, dweights_TK, daux, dz, **ctx.args)
        return dlogits_TE, None, None, None, None, None, None


def route(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, *, softmax: bool = True,
          normalize: bool = False, aux_coeff: float = 0.0, z_coeff: float = 0.0, fused: bool = True):
    """(ids_TK int64, weights_TK fp32, counts_E int64, aux fp32 [], z fp32 []) from fp32 logits;
    weights, aux and z are differentiable with respect to the logits (kernels/router.py defines
    them). ``bias_E`` (or None) shifts the selection only."""
    kw = dict(softmax=softmax, normalize=normalize, aux_coeff=float(aux_coeff), z_coeff=float(z_coeff))
    if (fused and fused_router() and logits_TE.shape[0] > 0 and logits_TE.dtype == torch.float32
            and use_triton(logits_TE)):
        return _Route.apply(logits_TE, None if bias_E is None else bias_E.float().contiguous(), top_k,
                            kw["softmax"], kw["normalize"], kw["aux_coeff"], kw["z_coeff"])
    return route_reference(logits_TE, bias_E, top_k, **kw)
