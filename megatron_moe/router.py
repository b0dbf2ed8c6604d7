"""Top-k router: logits = x @ router.weight.T, scores in fp32, top-k selection, aux and z losses.

The logits are fp32-accurate. For bf16 input (autocast training) they run on the tensor cores:
the fp32 weight is split into bf16 parts (hi + mid + lo, 24 bits together), each product of a bf16
x and a part is exact, and the accumulation is fp32 (``router_logits``); the gradients split
dL/dlogits the same way. Logits and the weight gradient are as accurate as an fp32 GEMM's, at a
bf16 GEMM's speed, without the fp32 copy of x that an fp32 GEMM reads and saves. With bf16
parameters (training's default, megatron_moe/training/precision.py) the weight is already bf16: one part,
exact products, fp32 accumulation; its gradient is rounded to bf16 and summed into the fp32
master's.

Legend: T tokens, H hidden, E experts, K top_k, P parts of the split weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import MoEConfig
from .kernels.router import count_ids, load_balancing_loss, z_loss  # noqa: F401  (the reference's parts)
from .ops.route import route


@dataclass
class RouterOutput:
    expert_ids_TK: torch.Tensor  # int64 [T, K]
    weights_TK: torch.Tensor  # fp32 [T, K]: combine weights (differentiable)
    tokens_per_expert_E: torch.Tensor  # int64 [E]
    aux_loss: torch.Tensor  # fp32 scalar: load-balancing loss (already times its coefficient)
    z_loss: torch.Tensor  # fp32 scalar: z-loss (already times its coefficient)


def mm_f32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b of bf16 a and b, returned in ``out_dtype``: fp32 output from fp32 accumulation on the
    tensor cores on CUDA (a bf16 output: torch's bf16 GEMM, which accumulates in fp32 unless
    cuBLAS splits the reduction); elsewhere exact products and fp32 sums through an fp32 matmul."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype) if out_dtype == torch.float32 else torch.mm(a, b).to(out_dtype)
    return (a.float() @ b.float()).to(out_dtype)


def split_bf16(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """bf16 tensors whose fp32 sum is t to ~8 * parts bits (3 parts: t exactly, for fp32 t)."""
    out, rest = [t.to(torch.bfloat16)], t
    for _ in range(parts - 1):
        rest = rest - out[-1]
        out.append(rest.to(torch.bfloat16))
    return out


class _RouterLogits(torch.autograd.Function):
    """logits_TE = x_TH @ w_EH.T for bf16 x, fp32 or bf16 w, in fp32.

    Forward: one GEMM against the weight's bf16 parts stacked along E, the parts summed (a bf16
    weight is its own single part). Backward: g = dL/dlogits in bf16 parts (hi, lo for a bf16
    weight; hi, mid, lo for an fp32 one), stacked along E into one [T, Q·E] operand A:
    dw = Σ_q A_qᵀ @ x, and dx = A @ [w; w] (bf16 w) or [A, g_hi] @ [w_hi; w_hi; w_hi; w_mid]
    (fp32 w; the dropped products are below 2^-16 of Σ|g||w|, and dx is rounded to bf16 anyway)."""

    @staticmethod
    def forward(ctx, x_TH, w_EH):
        T, E = x_TH.shape[0], w_EH.shape[0]
        P = 1 if w_EH.dtype == torch.bfloat16 else 3
        w_PEH = w_EH if P == 1 else torch.cat(split_bf16(w_EH, P), 0)
        out = mm_f32(x_TH, w_PEH.t())
        ctx.save_for_backward(x_TH, w_PEH)
        ctx.parts, ctx.w_dtype = P, w_EH.dtype
        return out if P == 1 else out.view(T, P, E).sum(1)

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_PEH = ctx.saved_tensors
        E = g_TE.shape[1]
        g_parts = split_bf16(g_TE, 2 if ctx.parts == 1 else 3)
        Q = len(g_parts)
        w_hi = w_PEH[:E]
        if ctx.parts == 1:  # [g_hi, g_lo] @ [w; w]
            a_TJ, b_JH = torch.cat(g_parts, 1), torch.cat([w_hi, w_hi], 0)
        else:  # [g_hi, g_mid, g_lo, g_hi] @ [w_hi; w_hi; w_hi; w_mid]
            a_TJ, b_JH = torch.cat(g_parts + g_parts[:1], 1), torch.cat([w_hi, w_hi, w_hi, w_PEH[E:2 * E]], 0)
        dx = mm_f32(a_TJ, b_JH, x_TH.dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = mm_f32(a_TJ[:, :Q * E].t(), x_TH).view(Q, E, -1).sum(0).to(ctx.w_dtype)
        return dx, dw


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """fp32 logits x_TH @ w_EH.T: on the tensor cores for bf16 x (fp32 or bf16 w), else in fp32."""
    if x_TH.dtype == torch.bfloat16 and w_EH.dtype in (torch.float32, torch.bfloat16):
        return _RouterLogits.apply(x_TH, w_EH)
    return x_TH.float() @ w_EH.float().t()


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

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        cfg = self.cfg
        if self.training and cfg.jitter_eps > 0:
            noise = torch.empty_like(x_TH).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
            x_TH = x_TH * noise
        logits_TE = router_logits(x_TH, self.weight)
        # scores, top-k, weights, counts and losses: fused kernels on GPUs (kernels/router.py),
        # the plain-PyTorch reference with mlp_impl='reference' and on the CPU
        expert_ids_TK, weights_TK, tokens_per_expert_E, aux, zl = route(
            logits_TE, self.expert_bias if cfg.expert_bias else None, cfg.top_k,
            softmax=cfg.score_function == "softmax", normalize=cfg.normalize_top_k,
            aux_coeff=cfg.aux_loss_coeff, z_coeff=cfg.z_loss_coeff, fused=cfg.mlp_impl != "reference")
        if self.training and cfg.expert_bias:
            self.local_tokens_per_expert += tokens_per_expert_E.to(self.local_tokens_per_expert.dtype)
        return RouterOutput(expert_ids_TK, weights_TK, tokens_per_expert_E, aux, zl)

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
