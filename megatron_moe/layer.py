"""DroplessMoE: router -> dispatch -> experts -> combine, usable without Megatron.

    from megatron_moe import MoEConfig, DroplessMoE
    layer = DroplessMoE(MoEConfig(hidden_size=1024, ffn_hidden_size=4096, num_experts=64,
                                  top_k=1, activation="gelu", mlp_impl="blocksparse"))
    y = layer(x)          # x: [tokens, hidden] or [seq, batch, hidden]; y has x's shape
    layer.aux_loss        # load-balancing (+ z-) loss of the last forward, differentiable

Expert parallelism: ``DroplessMoE(cfg, ep_group=group)`` holds experts
[rank*E/P, (rank+1)*E/P) of the group in ``experts.w1``/``experts.w2`` (same per-expert layout,
so a single-GPU checkpoint's experts slice onto ranks and back) and exchanges tokens with
all-to-all (megatron_moe/dispatch.py). The router is replicated on every rank.

The expert compute runs in x's dtype, or the autocast dtype under torch.autocast (bf16 on GPUs);
the router's logits are fp32-accurate either way (router.router_logits).

Input check (opt-in, it costs a host synchronisation per forward): ``MEGATRON_MOE_CHECK_FINITE=1``
in the environment (read once, at import) or ``DroplessMoE.check_finite = True`` makes forward
raise ``ValueError`` when x holds NaN/Inf, before routing spreads them to other tokens' experts.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from .config import MoEConfig
from .dispatch import (AllToAllDispatcher, Dispatcher, LocalDispatcher, PaddedAllToAllDispatcher,
                       SymmetricAllToAllDispatcher)
from .experts import Experts, SharedExpert, resolve_mlp_impl
from .kernels.switches import router_dx_add
from .ops.router_logits import ExpertDx
from .router import TopKRouter


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DroplessMoE(nn.Module):
    check_finite: bool = os.environ.get("MEGATRON_MOE_CHECK_FINITE", "0") not in ("", "0")
    """Raise on NaN/Inf in the input (one host sync per forward); off unless the environment
    variable MEGATRON_MOE_CHECK_FINITE=1 was set at import. Settable per class or instance."""

    def __init__(self, cfg: MoEConfig, ep_group=None, dispatcher: Dispatcher | None = None):
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"DroplessMoE(cfg): expected a MoEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.router = TopKRouter(cfg)
        if dispatcher is None:
            use_a2a = ep_group is not None and torch.distributed.get_world_size(ep_group) > 1
            a2a = {"padded": PaddedAllToAllDispatcher, "symmetric": SymmetricAllToAllDispatcher}.get(
                cfg.a2a_splits, AllToAllDispatcher)
            dispatcher = a2a(ep_group, cfg.num_experts) if use_a2a else LocalDispatcher()
        self.dispatcher = dispatcher
        self.ep_size = dispatcher.num_ranks
        self.ep_rank = getattr(dispatcher, "rank", 0)
        self.num_local_experts = cfg.num_experts // self.ep_size
        self.experts = Experts(cfg, self.num_local_experts, first_expert=self.ep_rank * self.num_local_experts)
        self.shared_expert = SharedExpert(cfg) if cfg.shared_expert_ffn_hidden_size > 0 else None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.load_balancing_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped_fraction: torch.Tensor | None = None
        self.exchange_row_bytes: int | None = None  # set by each forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H = self.cfg.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"DroplessMoE input: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != H:
            raise ValueError(f"DroplessMoE input x has shape {tuple(x.shape)}: expected [tokens, {H}] "
                             f"or [seq, batch, {H}] (hidden_size={H})")
        if not x.is_floating_point():
            raise ValueError(f"DroplessMoE input x has dtype {x.dtype}: expected a floating-point tensor")
        if self.check_finite:
            bad = int((~torch.isfinite(x)).sum())
            if bad:
                raise ValueError(
                    f"DroplessMoE input x has {bad} non-finite values (NaN/Inf) of {x.numel()} "
                    f"(shape {tuple(x.shape)}): they come from the input or an earlier layer; "
                    "check the learning rate, the data and the layers before this one "
                    "(MEGATRON_MOE_CHECK_FINITE=1 turned this check on)")
        # Drop the last forward's losses before routing: they hold its autograd graph, and with it
        # the gradient accumulators of the leaves (router weight, x), which autograd would reuse
        # here together with the stream they were made on. A CUDA graph captured on its own stream
        # after eager steps on the default stream then fails (the legacy stream cannot be captured).
        # (the per-forward attributes are plain ones: set in __dict__, without nn.Module.__setattr__'s
        # ~4 µs of checks for parameters, buffers and submodules each)
        state = self.__dict__
        state["aux_loss"] = state["z_loss"] = state["load_balancing_loss"] = None
        x_TH = x.reshape(-1, H)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
        else:
            dtype = x.dtype
        impl = resolve_mlp_impl(self.cfg, dtype, dev)
        if impl in ("triton_grouped", "blocksparse") and dtype not in KERNEL_DTYPES:
            raise ValueError(f"DroplessMoE input x has dtype {dtype}: mlp_impl={impl!r} "
                             "runs float32, bfloat16 or float16; cast the input, or use "
                             "mlp_impl='reference' for other dtypes")
        # local experts of triton_grouped hand their dL/dx to the router's backward, which adds its
        # own into it (one pass fewer over [T, H]; ops/router_logits.py's ExpertDx says why the order
        # is safe)
        expert_dx = None
        if (impl == "triton_grouped" and dtype == x_TH.dtype and type(self.dispatcher) is LocalDispatcher
                and x_TH.requires_grad and torch.is_grad_enabled() and self.router.takes_expert_dx(x_TH)
                and router_dx_add()):
            expert_dx = ExpertDx()
        with torch.autocast(dev, enabled=False):
            r = self.router(x_TH, expert_dx)
            state["load_balancing_loss"], state["z_loss"] = r.aux_loss, r.z_loss
            state["aux_loss"] = r.aux_loss + r.z_loss
            state["tokens_per_expert"] = r.tokens_per_expert_E.detach()
            xc_TH = x_TH.to(dtype)
            w1, w2 = self.experts.w1.to(dtype), self.experts.w2.to(dtype)
            state["exchange_row_bytes"] = H * dtype.itemsize  # (a row's bytes in the token exchanges)
            xd, ids, w, ctx = self.dispatcher.dispatch(xc_TH, r.expert_ids_TK, r.weights_TK)
            if expert_dx is not None and not (xd is x_TH and w is r.weights_TK and w.requires_grad):
                expert_dx = None  # the router's holder stays empty: autograd adds the two
            y, dropped = self.experts(xd, ids, w, w1=w1, w2=w2,
                                      capacity=self.cfg.capacity(x_TH.shape[0] * self.ep_size),
                                      skip_padding=self.dispatcher.pads_rows, expert_dx=expert_dx)
            y_TH = self.dispatcher.combine(y, ctx)
            state["dropped_fraction"] = None if dropped is None else dropped.detach()
            if self.shared_expert is not None:
                y_TH = y_TH + self.shared_expert(
                    xc_TH, self.shared_expert.w1.to(dtype), self.shared_expert.w2.to(dtype))
        return y_TH.reshape(x.shape)

    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step (call after each optimizer step; no-op unless expert_bias)."""
        self.router.update_expert_bias()


def update_expert_biases(model: nn.Module) -> None:
    """Run ``update_expert_bias`` on every DroplessMoE inside ``model``."""
    for m in model.modules():
        if isinstance(m, DroplessMoE):
            m.update_expert_bias()
