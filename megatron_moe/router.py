"""Top-k router: logits = x @ router.weight.T, scores in fp32, top-k selection, aux and z losses.

The logits are fp32-accurate. For bf16 input (autocast training) they run on the tensor cores
(ops/router_logits.py): the fp32 weight is split into bf16 parts (hi + mid + lo, 24 bits
together), each product of a bf16 x and a part is exact, and the accumulation is fp32; the
gradients split dL/dlogits the same way. Logits and the weight gradient are as accurate as an fp32
GEMM's, at a bf16 GEMM's speed, without the fp32 copy of x that an fp32 GEMM reads and saves. With
bf16 parameters (training's default, megatron_moe/training/precision.py) the weight is already
bf16: one part, exact products, fp32 accumulation; its gradient is rounded to bf16 and summed into
the fp32 master's.

Legend: T tokens, H hidden, E experts, K top_k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import MoEConfig
from .kernels.router import count_ids, load_balancing_loss, z_loss  # noqa: F401  (the reference's parts)
from .ops.route import route
from .ops.router_logits import ExpertDx, router_logits


@dataclass
class RouterOutput:
    expert_ids_TK: torch.Tensor  # int64 [T, K]
    weights_TK: torch.Tensor  # fp32 [T, K]: combine weights (differentiable)
    tokens_per_expert_E: torch.Tensor  # int64 [E]
    aux_loss: torch.Tensor  # fp32 scalar: load-balancing loss (already times its coefficient)
    z_loss: torch.Tensor  # fp32 scalar: z-loss (already times its coefficient)


class TopKRouter(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Aux-loss-free balancing: selection bias and the loads counted since the last update
        # (the names megatron-core's TopKRouter uses: its finalize_model_grads updates both).
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.register_buffer("local_tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.init_method_std)

    def forward(self, x_TH: torch.Tensor, expert_dx: ExpertDx | None = None) -> RouterOutput:
        """``expert_dx``: see ops/router_logits.py's :class:`ExpertDx` (the layer passes one only
        where :meth:`takes_expert_dx`)."""
        cfg = self.cfg
        if self.jitters():
            if expert_dx is not None:
                raise ValueError("TopKRouter: expert_dx with jitter_eps > 0 (the logits' input is not x)")
            noise = torch.empty_like(x_TH).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
            x_TH = x_TH * noise
        logits_TE = router_logits(x_TH, self.weight, expert_dx)
        # scores, top-k, weights, counts and losses: fused kernels on GPUs (kernels/router.py),
        # the plain-PyTorch reference with mlp_impl='reference' and on the CPU
        expert_ids_TK, weights_TK, tokens_per_expert_E, aux, zl = route(
            logits_TE, self.expert_bias if cfg.expert_bias else None, cfg.top_k,
            softmax=cfg.score_function == "softmax", normalize=cfg.normalize_top_k,
            aux_coeff=cfg.aux_loss_coeff, z_coeff=cfg.z_loss_coeff, fused=cfg.mlp_impl != "reference")
        if self.training and cfg.expert_bias:
            self.local_tokens_per_expert += tokens_per_expert_E.to(self.local_tokens_per_expert.dtype)
        return RouterOutput(expert_ids_TK, weights_TK, tokens_per_expert_E, aux, zl)

    def jitters(self) -> bool:
        return self.training and self.cfg.jitter_eps > 0

    def takes_expert_dx(self, x_TH: torch.Tensor) -> bool:
        """Whether the logits' backward can add the experts' dL/dx of x_TH into its own: bf16 x
        (ops/router_logits.py's tensor-core path) that the logits read as it is (no jitter)."""
        return x_TH.dtype == torch.bfloat16 and not self.jitters()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """bias_e += rate * sign(mean load - load_e) over the loads since the last call, summed
        over all ranks (call it on every rank)."""
        if not self.cfg.expert_bias:
            return
        load_E = self.local_tokens_per_expert
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(load_E)  # every rank applies the same update
        # no load (no forward since the last call): the signs are all 0, no change; no host check
        self.expert_bias += self.cfg.expert_bias_update_rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()
