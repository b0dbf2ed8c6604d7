"""Top-k router: logits = x @ router.weight.T, scores in fp32, top-k selection, aux and z losses.

Legend: T tokens, H hidden, E experts, K top_k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import MoEConfig


@dataclass
class RouterOutput:
    expert_ids_TK: torch.Tensor  # int64 [T, K]
    weights_TK: torch.Tensor  # fp32 [T, K]: combine weights (differentiable)
    tokens_per_expert_E: torch.Tensor  # int64 [E]
    aux_loss: torch.Tensor  # fp32 scalar: load-balancing loss (already times its coefficient)
    z_loss: torch.Tensor  # fp32 scalar: z-loss (already times its coefficient)


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many times each of 0..n-1 occurs in ``ids`` (int64 [n]). A scatter-add rather than
    torch.bincount, which reads the maximum back to the host on CUDA."""
    flat = ids.reshape(-1).long()
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard loss E * sum_e f_e * P_e: f_e = share of the T*K assignments routed to e
    (no gradient), P_e = mean router probability of e. Equals 1 when perfectly balanced."""
    T, E = probs_TE.shape
    f_E = tokens_per_expert_E.to(torch.float32) / max(T * top_k, 1)
    return E * torch.sum(f_E * probs_TE.mean(dim=0))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class TopKRouter(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Aux-loss-free balancing: selection bias and the loads counted since the last update.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.register_buffer("_load_since_update", torch.zeros(cfg.num_experts), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.init_method_std)

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        cfg = self.cfg
        if self.training and cfg.jitter_eps > 0:
            noise = torch.empty_like(x_TH).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
            x_TH = x_TH * noise
        logits_TE = (x_TH.float() @ self.weight.float().t())
        if cfg.score_function == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        select_TE = scores_TE.detach() + self.expert_bias if cfg.expert_bias else scores_TE
        expert_ids_TK = torch.topk(select_TE, cfg.top_k, dim=-1).indices
        weights_TK = torch.gather(scores_TE, 1, expert_ids_TK)
        if cfg.normalize_top_k:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        tokens_per_expert_E = count_ids(expert_ids_TK, cfg.num_experts)
        zero = logits_TE.new_zeros(())
        aux = cfg.aux_loss_coeff * load_balancing_loss(probs_TE, tokens_per_expert_E, cfg.top_k) \
            if cfg.aux_loss_coeff > 0 else zero
        zl = cfg.z_loss_coeff * z_loss(logits_TE) if cfg.z_loss_coeff > 0 else zero
        if self.training and cfg.expert_bias:
            self._load_since_update += tokens_per_expert_E.to(self._load_since_update.dtype)
        return RouterOutput(expert_ids_TK, weights_TK, tokens_per_expert_E, aux, zl)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """bias_e += rate * sign(mean load - load_e) over the loads since the last call, summed
        over all ranks (call it on every rank)."""
        if not self.cfg.expert_bias:
            return
        load_E = self._load_since_update
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(load_E)  # every rank applies the same update
        if load_E.sum() > 0:
            self.expert_bias += self.cfg.expert_bias_update_rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()
