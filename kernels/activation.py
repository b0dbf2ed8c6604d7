"""The activation's backward and its recompute in one pass (the torch._grouped_mm path's backward).

    act_NF = activation_backward_(h_NX, dact_NF, "gelu")   # h_NX <- dL/dh, dact_NF <- act(h)

The grouped_mm op needs, after its forward, both act(h) (for dW2 = act(h)ᵀ do) and
dL/dh = dL/dact * act'(h) (for dW1 and dx). Separately that is two passes over h and three
[N, F] writes; here one pass reads h and dL/dact once and writes both results over its inputs
(dL/dh over h, act(h) over dL/dact), so no [N, F] tensor is allocated.

Legend: N rows, F ffn; X = F (gelu) or 2F (swiglu: gate columns [0, F), up columns [F, 2F)).
Math in fp32 on the rounded inputs, results rounded once to the tensors' dtype; exact tanh /
sigmoid (this pass is memory-bound, the hardware tanh would buy nothing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import cdiv, interpret_mode, use_triton
from .grouped import _gelu_and_grad, _sigmoid

ACTIVATIONS = ("gelu", "swiglu")
"""The activations every path supports; the one list (MoEConfig and the model config use it)."""


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """GELU (tanh approximation) or SwiGLU (silu(gate) * up, gate = first half of the columns),
    in plain PyTorch: the references and the CPU paths use it."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _activation_backward_kernel(
    # pointers
    h_ptr, dact_ptr,
    # sizes
    N, F,
    # strides
    stride_hn, stride_hf, stride_dn, stride_df,
    # meta-parameters
    ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_f = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (offs_n < N)[:, None] & (offs_f < F)[None, :]
    h_ptrs = h_ptr + offs_n[:, None] * stride_hn + offs_f[None, :] * stride_hf
    d_ptrs = dact_ptr + offs_n[:, None] * stride_dn + offs_f[None, :] * stride_df
    dact = tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "gelu":
        act, grad = _gelu_and_grad(h, False)
        tl.store(h_ptrs, (dact * grad).to(h_ptr.dtype.element_ty), mask=mask)
    else:  # swiglu: h is the gate, up lives F columns to the right
        up_ptrs = h_ptrs + F * stride_hf
        up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
        sig = _sigmoid(h, False)
        silu = h * sig
        act = silu * up
        tl.store(h_ptrs, (dact * up * sig * (1.0 + h * (1.0 - sig))).to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(up_ptrs, (dact * silu).to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(d_ptrs, act.to(dact_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def activation_backward_triton_(h_NX, dact_NF, activation):
    N, F_ = dact_NF.shape
    if N and F_:
        BLOCK_N, BLOCK_F = (4, 16) if interpret_mode() else (8, 256)
        _activation_backward_kernel[(cdiv(N, BLOCK_N), cdiv(F_, BLOCK_F))](
            h_NX, dact_NF, N, F_,
            h_NX.stride(0), h_NX.stride(1), dact_NF.stride(0), dact_NF.stride(1),
            ACTIVATION=activation, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F,
        )
    return dact_NF


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference
# ----------------------------------------------------------------------------------------------


def activation_backward_reference_(h_NX, dact_NF, activation):
    h = h_NX.float()
    dact = dact_NF.float()
    if activation == "gelu":
        hh = h.detach().requires_grad_()
        with torch.enable_grad():
            act = F.gelu(hh, approximate="tanh")
            (dh,) = torch.autograd.grad(act, hh, dact)
    else:
        gate, up = h.chunk(2, dim=1)
        gg, uu = gate.detach().requires_grad_(), up.detach().requires_grad_()
        with torch.enable_grad():
            act = F.silu(gg) * uu
            dgate, dup = torch.autograd.grad(act, (gg, uu), dact)
        dh = torch.cat([dgate, dup], dim=1)
    h_NX.copy_(dh)
    return dact_NF.copy_(act.detach())


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------


def activation_backward_(h_NX: torch.Tensor, dact_NF: torch.Tensor, activation: str) -> torch.Tensor:
    """In place: h_NX <- dL/dh (from dL/dact = dact_NF), dact_NF <- act(h). Returns dact_NF.

    gelu: act = gelu_tanh(h), X = F. swiglu: act = silu(gate) * up with h = [gate | up], X = 2F.
    Both tensors 2-D, of one dtype and device (any strides).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if h_NX.dim() != 2 or dact_NF.dim() != 2:
        raise ValueError(f"h_NX {tuple(h_NX.shape)} and dact_NF {tuple(dact_NF.shape)} must be 2-D")
    X = dact_NF.shape[1] * (2 if activation == "swiglu" else 1)
    if tuple(h_NX.shape) != (dact_NF.shape[0], X):
        raise ValueError(f"h_NX has shape {tuple(h_NX.shape)}, expected {(dact_NF.shape[0], X)} for "
                         f"dact_NF {tuple(dact_NF.shape)} and activation {activation!r}")
    if h_NX.dtype != dact_NF.dtype or h_NX.device != dact_NF.device:
        raise ValueError(f"h_NX ({h_NX.dtype}, {h_NX.device}) and dact_NF ({dact_NF.dtype}, {dact_NF.device}) "
                         "must share dtype and device")
    if use_triton(h_NX, dact_NF):
        return activation_backward_triton_(h_NX, dact_NF, activation)
    return activation_backward_reference_(h_NX, dact_NF, activation)
