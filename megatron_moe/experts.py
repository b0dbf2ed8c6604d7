"""Experts: stacked weights and the compute paths (``MoEConfig.mlp_impl``) over them.

All paths share one weight layout, so one checkpoint runs any of them:
  w1 [E, H, F] (swiglu: [E, H, 2F], gate half first), w2 [E, F, H].

Legend: T tokens, K top_k, H hidden, F ffn, E experts.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import AUTO_GROUPED_MM_MIN_WIDTH, MoEConfig
from .kernels.activation import activate, pre_width_factor
from .kernels.metadata import routing_metadata
from .ops.blocksparse_mlp import blocksparse_mlp
from .ops.torch_grouped_mm_mlp import torch_grouped_mm_mlp
from .ops.triton_grouped_mlp import triton_grouped_mlp


def resolve_mlp_impl(cfg: MoEConfig, dtype, device_type: str) -> str:
    """The expert compute path that runs: ``cfg.mlp_impl`` itself unless it is 'auto'.

    'auto' follows the layer benchmark (docs/results.md): 'torch_grouped_mm' when both hidden
    and ffn are at least AUTO_GROUPED_MM_MIN_WIDTH (a few wide experts, where the vendor's
    grouped GEMM is ahead), our 'triton_grouped' kernels below it (small and fine-grained
    experts, where the two are close and ours also fuses training's gradient accumulation into
    the fp32 master gradient). 'torch_grouped_mm' only where it runs and fits the options:
    bfloat16 on CUDA, sizes multiples of 8, exact all-to-all splits, no recompute_activation.
    """
    if cfg.mlp_impl != "auto":
        return cfg.mlp_impl
    H, F_ = cfg.hidden_size, cfg.ffn_hidden_size
    wide = min(H, F_) >= AUTO_GROUPED_MM_MIN_WIDTH and H % 8 == 0 and F_ % 8 == 0
    runs = device_type != "cuda" or dtype == torch.bfloat16
    if wide and runs and cfg.a2a_splits == "host" and not cfg.recompute_activation:
        return "torch_grouped_mm"
    return "triton_grouped"


def reference_experts(x_TH, w1_EHF, w2_EFH, expert_ids_TK, weights_TK, activation):
    """Plain-PyTorch dropless MoE: a loop over experts with index_select / index_add."""
    T, K = expert_ids_TK.shape
    y_TH = torch.zeros_like(x_TH)
    token_N = torch.arange(T, device=x_TH.device).repeat_interleave(K)
    ids_N, w_N = expert_ids_TK.reshape(-1), weights_TK.reshape(-1)
    for e in range(w1_EHF.shape[0]):
        sel = (ids_N == e).nonzero(as_tuple=True)[0]
        tok = token_N[sel]
        out = activate(x_TH[tok] @ w1_EHF[e], activation) @ w2_EFH[e]
        y_TH = y_TH.index_add(0, tok, (out.float() * w_N[sel, None]).to(x_TH.dtype))
    return y_TH


def capacity_experts(x_TH, w1_EHF, w2_EFH, expert_ids_TK, weights_TK, activation, capacity):
    """Tutel/GShard capacity-factor MoE: every expert gets a [capacity, H] batch (zero padded).

    Assignments are served k-major (all tokens' first choices before any second choice), in
    token order within each k; those past an expert's capacity are dropped (output zero).
    Returns (y_TH, dropped_fraction).
    """
    T, K = expert_ids_TK.shape
    E, H = w1_EHF.shape[0], x_TH.shape[1]
    ids_KT = expert_ids_TK.t().reshape(-1)
    onehot = F.one_hot(ids_KT, E)
    pos_KT = ((torch.cumsum(onehot, 0) - 1) * onehot).sum(-1)
    keep_KT = pos_KT < capacity
    kept = keep_KT.nonzero(as_tuple=True)[0]
    tok, e, pos = kept % T, ids_KT[kept], pos_KT[kept]
    w = weights_TK.t().reshape(-1)[kept]
    x_ECH = x_TH.new_zeros(E, capacity, H).index_put((e, pos), x_TH[tok])
    out_ECH = torch.bmm(activate(torch.bmm(x_ECH, w1_EHF), activation), w2_EFH)
    y_TH = torch.zeros_like(x_TH).index_add(0, tok, (out_ECH[e, pos].float() * w[:, None]).to(x_TH.dtype))
    dropped = 1.0 - keep_KT.float().mean()
    return y_TH, dropped


class Experts(nn.Module):
    """Stacked expert weights; ``first_expert`` is the global index of local expert 0 (EP)."""

    def __init__(self, cfg: MoEConfig, num_local_experts: int | None = None, first_expert: int = 0):
        super().__init__()
        self.cfg = cfg
        self.first_expert = first_expert
        E = cfg.num_experts if num_local_experts is None else num_local_experts
        self.w1 = nn.Parameter(torch.empty(E, cfg.hidden_size, cfg.w1_columns))
        self.w2 = nn.Parameter(torch.empty(E, cfg.ffn_hidden_size, cfg.hidden_size))
        for p in (self.w1, self.w2):
            p.expert_parallel = True  # reduced over the expert-data-parallel group only
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert from its own generator seeded by (torch.initial_seed(), global index), so an
        expert's initial weights do not depend on how experts are split over ranks."""
        if self.w1.device.type == "meta":
            return
        gen = torch.Generator(device=self.w1.device)
        base = torch.initial_seed() % (2**62)
        std2 = self.cfg.output_init_std or self.cfg.init_method_std
        for i in range(self.w1.shape[0]):
            gen.manual_seed(base + 1_000_003 * (self.first_expert + i + 1))
            self.w1[i].normal_(0.0, self.cfg.init_method_std, generator=gen)
            self.w2[i].normal_(0.0, std2, generator=gen)

    def forward(self, x_TH, expert_ids_TK, weights_TK, w1=None, w2=None, capacity=None, skip_padding=False,
                expert_dx=None):
        """Σ_k weights_TK[t, k] * expert_{ids[t, k]}(x_TH[t]). Returns (y_TH, dropped_fraction or None).

        ``capacity`` (capacity impl only) overrides ``cfg.capacity(len(x_TH))``: under expert
        parallelism the rows here come from the whole group, and the group's token count sets it.
        ``skip_padding``: ids equal to the number of local experts mark padding rows (triton_grouped
        and reference only); nothing is computed for them and their output rows are undefined.
        ``expert_dx`` (triton_grouped only; ops/router_logits.py's ExpertDx): the backward hands
        dL/dx_TH to it and returns none for x_TH (the router's backward adds its own and returns
        the sum).
        """
        cfg = self.cfg
        w1 = self.w1 if w1 is None else w1
        w2 = self.w2 if w2 is None else w2
        impl = resolve_mlp_impl(cfg, x_TH.dtype, x_TH.device.type)
        if impl == "reference":
            return reference_experts(x_TH, w1, w2, expert_ids_TK, weights_TK, cfg.activation), None
        if impl == "capacity":
            if capacity is None:
                capacity = cfg.capacity(x_TH.shape[0])
            return capacity_experts(x_TH, w1, w2, expert_ids_TK, weights_TK, cfg.activation, capacity)
        E = w1.shape[0]
        if skip_padding and impl != "triton_grouped":
            raise ValueError(f"padding rows (a2a_splits='padded' or 'symmetric') need mlp_impl triton_grouped or "
                             f"reference, not {impl!r}")
        if skip_padding:  # padding sorts last, into an extra bin that no expert reads
            routing = routing_metadata(expert_ids_TK, E + 1, cfg.block_size)
            routing = dataclasses.replace(routing, num_experts=E,
                                          tokens_per_expert_E=routing.tokens_per_expert_E[:E],
                                          expert_offsets_E1=routing.expert_offsets_E1[:E + 1])
        else:
            routing = routing_metadata(expert_ids_TK, E, cfg.block_size)
        if expert_dx is not None and impl != "triton_grouped":
            raise ValueError(f"expert_dx needs mlp_impl triton_grouped, not {impl!r}")
        if impl == "triton_grouped":
            return triton_grouped_mlp(x_TH, w1, w2, weights_TK, routing, cfg.activation,
                                      recompute_activation=cfg.recompute_activation, expert_dx=expert_dx), None
        if impl == "torch_grouped_mm":
            return torch_grouped_mm_mlp(x_TH, w1, w2, weights_TK, routing, cfg.activation), None
        return blocksparse_mlp(x_TH, w1, w2, weights_TK, routing, cfg.activation), None


class SharedExpert(nn.Module):
    """A dense MLP every token goes through (w1 [H, Fs] or [H, 2Fs] for swiglu, w2 [Fs, H])."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        fs = cfg.shared_expert_ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(cfg.hidden_size, pre_width_factor(cfg.activation) * fs))
        self.w2 = nn.Parameter(torch.empty(fs, cfg.hidden_size))
        nn.init.normal_(self.w1, std=cfg.init_method_std)
        nn.init.normal_(self.w2, std=cfg.output_init_std or cfg.init_method_std)

    def forward(self, x_TH, w1=None, w2=None):
        w1 = self.w1 if w1 is None else w1
        w2 = self.w2 if w2 is None else w2
        return activate(x_TH @ w1, self.cfg.activation) @ w2
