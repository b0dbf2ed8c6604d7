"""The activations: their list, their element-wise math for every kernel, and a one-pass backward.

* :data:`ACTIVATIONS`: the activations every path supports (MoEConfig and the model config use it).
* Element-wise math in Triton (fp32 in, fp32 out), the one definition that the grouped GEMMs'
  epilogues and prologue, the block-sparse SDD's epilogues and the pass below inline:
  :func:`tanh`, :func:`sigmoid`, :func:`gelu_and_grad`, :func:`activation_fwd`, and the
  backward epilogues :func:`gelu_bwd`, :func:`swiglu_bwd` (they store dL/dh and return the
  activation, which the callers reduce or store). ``FAST`` picks the hardware's tanh.approx.f32
  (the callers ask for it for 16-bit outputs on a GPU only); otherwise tanh and sigmoid are exact.
* The same math in PyTorch for the references: :func:`activate`, :func:`gelu_and_grad_reference`,
  :func:`activation_bwd_reference`.
* :func:`activation_backward_`: the activation's backward and its recompute in one pass (the
  torch._grouped_mm path's backward)::

    act_NF = activation_backward_(h_NX, dact_NF, "gelu")   # h_NX <- dL/dh, dact_NF <- act(h)

  The grouped_mm op needs, after its forward, both act(h) (for dW2 = act(h)ᵀ do) and
  dL/dh = dL/dact * act'(h) (for dW1 and dx). Separately that is two passes over h and three
  [N, F] writes; here one pass reads h and dL/dact once and writes both results over its inputs
  (dL/dh over h, act(h) over dL/dact), so no [N, F] tensor is allocated. Math in fp32 on the
  rounded inputs, results rounded once to the tensors' dtype; exact tanh / sigmoid (the pass is
  memory-bound, the hardware tanh would buy nothing).

GELU is the tanh approximation, 0.5·h·(1 + tanh(u)) with u = sqrt(2/π)·(h + 0.044715·h³);
SwiGLU is silu(gate)·up with gate the first half of the pre-activation's columns.

Legend: N rows, F ffn; X = F (gelu) or 2F (swiglu: gate columns [0, F), up columns [F, 2F)).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import cdiv, interpret_mode, use_triton
from .launcher import launch

ACTIVATIONS = ("gelu", "swiglu")
"""The activations every path supports; the one list (MoEConfig and the model config use it)."""


def pre_width_factor(activation: str | None) -> int:
    """Pre-activation columns per activation output: 2 for swiglu (the gate and up projections
    side by side, [gate | up]), else 1 (gelu, or no activation). The first expert weight is
    [H, pre_width_factor(activation) * F]."""
    return 2 if activation == "swiglu" else 1


# ----------------------------------------------------------------------------------------------
# Element-wise math in Triton (fp32)
# ----------------------------------------------------------------------------------------------


@triton.jit
def tanh(x, FAST: tl.constexpr):
    """tanh of fp32 x; FAST: the hardware's tanh.approx.f32 (one instruction, relative error about
    2^-11: used when the outputs are 16-bit, never under the interpreter)."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    if FAST:
        return 0.5 + 0.5 * tanh(0.5 * x, FAST)
    else:
        return tl.sigmoid(x)


@triton.jit
def gelu_and_grad(h, FAST: tl.constexpr = False):
    """GELU (tanh approximation) of h and its derivative."""
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    t = tanh(u, FAST)
    act = 0.5 * h * (1.0 + t)
    grad = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
    return act, grad


@triton.jit
def activation_fwd(h, up, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """ACTIVATION 'gelu': gelu(h) (``up`` unused); 'swiglu': silu(h) * up, h the gate."""
    if ACTIVATION == "gelu":
        act, _ = gelu_and_grad(h, FAST)
        return act
    else:
        return h * sigmoid(h, FAST) * up


@triton.jit
def gelu_bwd(h, g, dh_ptrs, mask, FAST: tl.constexpr):
    """Stores dL/dh = g * gelu'(h) (g = dL/d act) at dh_ptrs, in their dtype; returns gelu(h)."""
    act, grad = gelu_and_grad(h, FAST)
    tl.store(dh_ptrs, (g * grad).to(dh_ptrs.dtype.element_ty), mask=mask)
    return act


@triton.jit
def swiglu_bwd(gate, up, g, dh_ptrs, up_offset, mask, FAST: tl.constexpr, G_GATE_FIRST: tl.constexpr = False):
    """Stores dL/dh = [dL/d gate | dL/d up] (g = dL/d act): d gate at dh_ptrs, then d up at
    dh_ptrs + up_offset, in their dtype; returns silu(gate) * up. (d up is computed after d gate
    is stored, so the two tiles are not live in registers together.)

    d up = g * silu(gate), multiplied as g * (gate * sigmoid) or, with G_GATE_FIRST, as
    (g * gate) * sigmoid: equal but for rounding. Which of the two spills fewer registers
    depends on the caller's tile layouts (the block-sparse SDD's epilogue wants G_GATE_FIRST,
    the grouped GEMM's does not; measured: see docs/performance.md)."""
    sig = sigmoid(gate, FAST)
    silu = gate * sig
    act = silu * up
    tl.store(dh_ptrs, (g * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptrs.dtype.element_ty), mask=mask)
    dup_ptrs = dh_ptrs + up_offset
    if G_GATE_FIRST:
        dup = g * gate * sig
    else:
        dup = g * silu
    tl.store(dup_ptrs, dup.to(dh_ptrs.dtype.element_ty), mask=mask)
    return act


# ----------------------------------------------------------------------------------------------
# Element-wise math in PyTorch (the references)
# ----------------------------------------------------------------------------------------------

_GELU_C = math.sqrt(2.0 / math.pi)


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """GELU (tanh approximation) or SwiGLU (silu(gate) * up, gate = first half of the columns),
    in plain PyTorch: the references and the CPU paths use it."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_grad_reference(h: torch.Tensor):
    """GELU (tanh approximation) of fp32 h and its derivative."""
    t = torch.tanh(_GELU_C * (h + 0.044715 * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * h * h)


def activation_bwd_reference(h_NX: torch.Tensor, dact_NF: torch.Tensor, activation: str):
    """(dL/dh [N, X], act(h) [N, F]) in fp32 from the pre-activation h and g = dL/d act, with
    the formulas of the kernels' backward epilogues (:func:`gelu_bwd`, :func:`swiglu_bwd`)."""
    h, g = h_NX.float(), dact_NF.float()
    if activation == "gelu":
        act, grad = gelu_and_grad_reference(h)
        return g * grad, act
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    return torch.cat([g * up * sig * (1 + gate * (1 - sig)), g * silu], dim=-1), silu * up


# ----------------------------------------------------------------------------------------------
# Kernel: (dL/dh, act(h)) in one pass, over the inputs
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
        act = gelu_bwd(h, dact, h_ptrs, mask, False)
    else:  # swiglu: h is the gate, up lives F columns to the right
        up = tl.load(h_ptrs + F * stride_hf, mask=mask, other=0.0).to(tl.float32)
        act = swiglu_bwd(h, up, dact, h_ptrs, F * stride_hf, mask, False)
    tl.store(d_ptrs, act.to(dact_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def activation_backward_triton_(h_NX, dact_NF, activation):
    N, F_ = dact_NF.shape
    if N and F_:
        BLOCK_N, BLOCK_F = (4, 16) if interpret_mode() else (8, 256)
        launch(_activation_backward_kernel, (cdiv(N, BLOCK_N), cdiv(F_, BLOCK_F)),
               (h_NX, dact_NF, N, F_, h_NX.stride(0), h_NX.stride(1), dact_NF.stride(0), dact_NF.stride(1)),
               dict(ACTIVATION=activation, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F))
    return dact_NF


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference
# ----------------------------------------------------------------------------------------------


def activation_backward_reference_(h_NX, dact_NF, activation):
    dh, act = activation_bwd_reference(h_NX, dact_NF, activation)
    h_NX.copy_(dh)
    return dact_NF.copy_(act)


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
    X = dact_NF.shape[1] * pre_width_factor(activation)
    if tuple(h_NX.shape) != (dact_NF.shape[0], X):
        raise ValueError(f"h_NX has shape {tuple(h_NX.shape)}, expected {(dact_NF.shape[0], X)} for "
                         f"dact_NF {tuple(dact_NF.shape)} and activation {activation!r}")
    if h_NX.dtype != dact_NF.dtype or h_NX.device != dact_NF.device:
        raise ValueError(f"h_NX ({h_NX.dtype}, {h_NX.device}) and dact_NF ({dact_NF.dtype}, {dact_NF.device}) "
                         "must share dtype and device")
    if use_triton(h_NX, dact_NF):
        return activation_backward_triton_(h_NX, dact_NF, activation)
    return activation_backward_reference_(h_NX, dact_NF, activation)
