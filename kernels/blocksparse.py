"""Block-sparse products over a :class:`~.metadata.Topology`: SDD, DSD, DDS and TSD (Sᵀ × D).

Legend (shape suffixes):
  E experts, B block size, R_max row blocks, P_max = R_max*B padded rows, F columns per expert
  (per group), Fb = ceil(F / B) column blocks per expert, C = E*Fb column blocks,
  Z = R_max*Fb blocks, G groups (1; 2 for SwiGLU: gate then up), K / N dense widths.

The hidden matrix S is [P_max, E*F] block sparse: row block r (expert e) holds column blocks
e*Fb .. e*Fb+Fb-1. Its data is ``[Z, B, B]`` (block z = r*Fb + j) or, with G groups,
``[G, Z, B, B]``: group g holds the columns g*F .. g*F+F-1 of each expert's weight, each group
padded to Fb blocks on its own (so SwiGLU's gate block j and up block j are data[0, z] and
data[1, z], whatever F is). Columns past F in a last partial block are zero, and so are unused
blocks (row index -1): every kernel below writes its whole output.

  sdd   A [P_max, K] x W [E, K, G*F]  -> S [G, Z, B, B]   block z = A[rows of r] @ W[e][:, cols of j]
        (optional fused epilogue: GELU (tanh), or SwiGLU over the two groups; the activation
        math is kernels/activation.py's, shared with the other kernels)
  sdd_activation_grad  the same product (dact = dY @ W restricted to S) times the activation's
        derivative at the saved pre-activation: the SDD of the backward.
  dsd   S [G, Z, B, B] x W [E, G*F, N] -> [P_max, N]      row block r sums its G*Fb blocks
  dds   Aᵀ [K, P_max] x S [G, Z, B, B] -> [E, K, G*F]     (the w1 gradient)
  tsd   Sᵀ [G, Z, B, B] x D [P_max, N] -> [E, G*F, N]     (the w2 gradient)

DDS and TSD walk each column block's blocks through the transpose indices (offsets_t_C1,
block_offsets_t_Z); an expert without tokens has none and gets exact zeros.

All kernels launch over the upper-bound sizes (Z, R_max, C) and skip unused blocks on the
device (their loops have zero trips), so nothing synchronises with the host. Weight operands
take arbitrary strides, so transposed weights (w1ᵀ, w2ᵀ) are views. Accumulation is fp32;
fp32 inputs multiply in IEEE fp32 (``input_precision="ieee"``), bf16/fp16 on the tensor cores.
Addresses are int64 wherever a row times a stride can pass 2^31. On the GPU each kernel is
autotuned per shape (first call of a shape: seconds); MEGATRON_MOE_AUTOTUNE=0 takes each
kernel's first (default) config instead (kernels/switches.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import switches
from ._common import cdiv, dot, expert_segments, input_precision, interpret_mode, use_triton
from .activation import (ACTIVATIONS, activate, activation_bwd_reference, activation_fwd, gelu_bwd, pre_width_factor,
                         swiglu_bwd)
from .metadata import Topology

# ----------------------------------------------------------------------------------------------
# Autotune configurations
# ----------------------------------------------------------------------------------------------


def _configs(names, values, interpret_values):
    """triton.Configs from (meta-parameter values..., num_warps, num_stages) tuples; the first is
    the default when autotuning is off. Under the interpreter: one small config."""
    if interpret_mode():
        return [triton.Config(dict(zip(names, interpret_values)), num_warps=4, num_stages=1)]
    return [triton.Config(dict(zip(names, v[:-2])), num_warps=v[-2], num_stages=v[-1]) for v in values]


def _sdd_configs():  # the output tile is the B x B block; BLOCK_K chunks the dense reduction
    return _configs(["BLOCK_K"], [(64, 8, 3), (64, 4, 3), (32, 4, 4), (32, 8, 4), (64, 8, 4)], [16])


def _dsd_configs():  # (BLOCK_N, BLOCK_K): tile [B, BLOCK_N], BLOCK_K chunks the blocks
    return _configs(["BLOCK_N", "BLOCK_K"], [
        (128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 4), (256, 32, 8, 4),
    ], [32, 16])


def _dds_configs():  # (BLOCK_M, BLOCK_P): tile [BLOCK_M, B], BLOCK_P chunks the rows of a block
    return _configs(["BLOCK_M", "BLOCK_P"], [
        (128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 32, 4, 4), (256, 64, 8, 3),
    ], [32, 16])


def _tsd_configs():  # (BLOCK_N, BLOCK_P): tile [B, BLOCK_N], BLOCK_P chunks the rows of a block
    return _configs(["BLOCK_N", "BLOCK_P"], [
        (128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 32, 4, 4), (256, 64, 8, 3),
    ], [32, 16])


def _prune_to_block(name):
    """Drop configs whose reduction chunk ``name`` exceeds the block size B (chunks must divide B);
    with MEGATRON_MOE_AUTOTUNE=0 keep only the first that fits."""

    def prune(configs, named_args, **kwargs):
        B = {**named_args, **kwargs}["B"]
        kept = [c for c in configs if c.kwargs[name] <= B]
        kept = kept or [triton.Config({**configs[0].kwargs, name: B}, num_warps=4, num_stages=3)]
        return switches.tuning_candidates(kept)

    return {"early_config_prune": prune}


# ----------------------------------------------------------------------------------------------
# SDD: dense x dense -> block sparse (+ activation epilogue, forward or backward)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sdd_forward_epilogue(acc, acc_up, c_ptr, h_ptr, offs_blk, stride_g, ACTIVATION: tl.constexpr):
    """c = act(acc) ('none': acc itself) and h = the pre-activation (swiglu: acc, and acc_up one
    group further)."""
    out_ty = c_ptr.dtype.element_ty
    if ACTIVATION == "none":
        tl.store(c_ptr + offs_blk, acc.to(out_ty))
    else:
        tl.store(h_ptr + offs_blk, acc.to(out_ty))
        if ACTIVATION == "swiglu":
            tl.store(h_ptr + stride_g + offs_blk, acc_up.to(out_ty))
        tl.store(c_ptr + offs_blk, activation_fwd(acc, acc_up, ACTIVATION, False).to(out_ty))


@triton.jit
def _sdd_backward_epilogue(acc, valid, c_ptr, h_ptr, offs_blk, stride_g, ACTIVATION: tl.constexpr):
    """c = dL/dh from acc = dL/d act and the saved pre-activation h ('none': acc itself; swiglu:
    d gate, and d up one group further). An unused block's h may be garbage: it is read as 0."""
    if ACTIVATION == "none":
        tl.store(c_ptr + offs_blk, acc.to(c_ptr.dtype.element_ty))
    elif ACTIVATION == "gelu":
        h = tl.where(valid, tl.load(h_ptr + offs_blk).to(tl.float32), 0.0)
        gelu_bwd(h, acc, c_ptr + offs_blk, None, False)
    else:
        gate = tl.where(valid, tl.load(h_ptr + offs_blk).to(tl.float32), 0.0)
        up = tl.where(valid, tl.load(h_ptr + stride_g + offs_blk).to(tl.float32), 0.0)
        swiglu_bwd(gate, up, acc, c_ptr + offs_blk, stride_g, None, False, G_GATE_FIRST=True)


@triton.autotune(configs=_sdd_configs(), key=["K", "F", "B", "ACTIVATION", "BACKWARD"],
                 prune_configs_by=_prune_to_block("BLOCK_K"))
@triton.jit
def _sdd_kernel(
    # pointers
    a_ptr, w_ptr, c_ptr, h_ptr, row_indices_ptr, column_indices_ptr,
    # sizes
    K, F, Fb,
    # strides (block data is contiguous [G, Z, B, B]; stride_g is its group stride)
    stride_am, stride_ak, stride_we, stride_wk, stride_wf, stride_g,
    # meta-parameters
    B: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "none", "gelu" or "swiglu"
    BACKWARD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Forward:  c = act(A @ W) on block z, h = the pre-activation (swiglu: h[0] gate, h[1] up).
    Backward: c = (A @ W) * act'(h) (swiglu: c[0] d gate, c[1] d up); 'none' has no h."""
    z = tl.program_id(0).to(tl.int64)
    r = tl.load(row_indices_ptr + z).to(tl.int64)
    col = tl.load(column_indices_ptr + z).to(tl.int64)
    valid = r >= 0
    r = tl.where(valid, r, 0)
    col = tl.where(valid, col, 0)
    e = col // Fb
    j = col % Fb

    offs_b = tl.arange(0, B)
    offs_m = r * B + offs_b
    offs_f = j * B + offs_b
    mask_f = offs_f < F
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_f[None, :] * stride_wf

    acc = tl.zeros((B, B), dtype=tl.float32)
    acc_up = tl.zeros((B, B), dtype=tl.float32)
    k_end = tl.where(valid, K, 0)  # unused block: no trips, zeros written
    for k0 in range(0, k_end, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_f[None, :], other=0.0)
        acc = dot(a, w, acc, INPUT_PRECISION)
        if ACTIVATION == "swiglu":
            if not BACKWARD:  # SwiGLU forward: the up half starts F columns right of the gate half
                w_up = tl.load(w_ptrs + F * stride_wf, mask=mask_k[:, None] & mask_f[None, :], other=0.0)
                acc_up = dot(a, w_up, acc_up, INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    offs_blk = z * (B * B) + offs_b[:, None] * B + offs_b[None, :]
    if BACKWARD:
        _sdd_backward_epilogue(acc, valid, c_ptr, h_ptr, offs_blk, stride_g, ACTIVATION)
    else:
        _sdd_forward_epilogue(acc, acc_up, c_ptr, h_ptr, offs_blk, stride_g, ACTIVATION)


def _sdd_launch(a, w, c, h, topology: Topology, activation, backward):
    B = topology.block_size
    Z = topology.max_blocks
    h_arg = c if h is None else h
    _sdd_kernel[(Z,)](
        a, w, c, h_arg, topology.row_indices_Z, topology.column_indices_Z,
        a.shape[1], topology.num_columns, topology.blocks_per_row,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), Z * B * B,
        B=B, ACTIVATION=activation or "none", BACKWARD=backward,
        INPUT_PRECISION=input_precision(a.dtype),
    )


def sdd_triton(a_PK, w_EKF, topology: Topology, activation=None, out=None):
    act, pre = _sdd_outputs(a_PK, topology, activation, out)
    _sdd_launch(a_PK, w_EKF, act, pre, topology, activation, backward=False)
    return act if activation is None else (act, pre)


def sdd_activation_grad_triton(dy_PN, w_ENF, topology: Topology, pre, activation, out=None):
    d_pre = torch.empty_like(pre) if out is None else out
    _sdd_launch(dy_PN, w_ENF, d_pre, pre, topology, activation, backward=True)
    return d_pre


def _sdd_outputs(a, topology: Topology, activation, out):
    Z, B = topology.max_blocks, topology.block_size
    act = torch.empty(Z, B, B, dtype=a.dtype, device=a.device) if out is None else out
    pre = None
    if activation is not None:
        G = pre_width_factor(activation)
        pre = torch.empty(G, Z, B, B, dtype=a.dtype, device=a.device)
        pre = pre[0] if G == 1 else pre
    return act, pre


# ----------------------------------------------------------------------------------------------
# DSD: block sparse x dense -> dense
# ----------------------------------------------------------------------------------------------


@triton.autotune(configs=_dsd_configs(), key=["N", "F", "G", "B"], prune_configs_by=_prune_to_block("BLOCK_K"))
@triton.jit
def _dsd_kernel(
    # pointers
    s_ptr, w_ptr, c_ptr, column_indices_ptr,
    # sizes
    N, F, Fb, G,
    # strides
    stride_sg, stride_we, stride_wf, stride_wn, stride_cm, stride_cn,
    # meta-parameters
    B: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    col = tl.load(column_indices_ptr + r * Fb).to(tl.int64)  # row r's first block
    valid = col >= 0
    e = tl.where(valid, col // Fb, 0)

    offs_b = tl.arange(0, B)
    offs_k = tl.arange(0, BLOCK_K)
    width = Fb * B  # reduction length of one group
    acc = tl.zeros((B, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(valid, G * width, 0)
    for kk in range(0, k_end, BLOCK_K):
        grp = kk // width
        j = (kk % width) // B
        off = tl.multiple_of(kk % B, BLOCK_K)  # BLOCK_K divides B: a chunk never straddles two blocks
        z = r * Fb + j
        s = tl.load(s_ptr + grp * stride_sg + z * (B * B) + offs_b[:, None] * B + (off + offs_k)[None, :])
        f = j * B + off + offs_k
        w = tl.load(w_ptr + e * stride_we + (grp * F + f)[:, None] * stride_wf + offs_n[None, :] * stride_wn,
                    mask=(f < F)[:, None] & mask_n[None, :], other=0.0)
        acc = dot(s, w, acc, INPUT_PRECISION)

    offs_m = r * B + offs_b
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask_n[None, :])


def dsd_triton(s, w_EFN, topology: Topology, out=None):
    s_GZBB = _grouped(s)
    G, Z, B, _ = s_GZBB.shape
    N = w_EFN.shape[2]
    P = topology.routing.max_padded_rows
    out = torch.empty(P, N, dtype=s.dtype, device=s.device) if out is None else out
    grid = lambda META: (topology.routing.max_row_blocks, cdiv(N, META["BLOCK_N"]))  # noqa: E731
    _dsd_kernel[grid](
        s_GZBB, w_EFN, out, topology.column_indices_Z,
        N, topology.num_columns, topology.blocks_per_row, G,
        s_GZBB.stride(0), w_EFN.stride(0), w_EFN.stride(1), w_EFN.stride(2), out.stride(0), out.stride(1),
        B=B, INPUT_PRECISION=input_precision(s.dtype),
    )
    return out


# ----------------------------------------------------------------------------------------------
# DDS: dense-transposed x block sparse -> per-expert dense (through the transpose indices)
# ----------------------------------------------------------------------------------------------


@triton.autotune(configs=_dds_configs(), key=["M", "F", "B"], prune_configs_by=_prune_to_block("BLOCK_P"))
@triton.jit
def _dds_kernel(
    # pointers
    a_ptr, s_ptr, c_ptr, row_indices_ptr, offsets_t_ptr, block_offsets_t_ptr,
    # sizes
    M, F, Fb, C,
    # strides
    stride_ap, stride_am, stride_sg, stride_ce, stride_cm, stride_cf,
    # meta-parameters
    B: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    grp = pid // C
    c = pid % C  # global column block: expert c // Fb, block c % Fb
    e = (c // Fb).to(tl.int64)
    j = (c % Fb).to(tl.int64)
    offs_m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    start = tl.load(offsets_t_ptr + c)
    end = tl.load(offsets_t_ptr + c + 1)

    offs_b = tl.arange(0, B)
    offs_p = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_M, B), dtype=tl.float32)
    for t in range(0, (end - start) * B, BLOCK_P):
        i = start + t // B
        off = tl.multiple_of(t % B, BLOCK_P)
        z = tl.load(block_offsets_t_ptr + i).to(tl.int64)
        r = tl.load(row_indices_ptr + z).to(tl.int64)
        rows = r * B + off + offs_p
        a_t = tl.load(a_ptr + offs_m[:, None] * stride_am + rows[None, :] * stride_ap, mask=mask_m[:, None], other=0.0)
        s = tl.load(s_ptr + grp * stride_sg + z * (B * B) + (off + offs_p)[:, None] * B + offs_b[None, :])
        acc = dot(a_t, s, acc, INPUT_PRECISION)

    f = j * B + offs_b
    tl.store(c_ptr + e * stride_ce + offs_m[:, None] * stride_cm + (grp * F + f)[None, :] * stride_cf,
             acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & (f < F)[None, :])


def dds_triton(a_PM, s, topology: Topology, out=None):
    s_GZBB = _grouped(s)
    G, Z, B, _ = s_GZBB.shape
    M, E, F = a_PM.shape[1], topology.routing.num_experts, topology.num_columns
    C = E * topology.blocks_per_row
    out = torch.empty(E, M, G * F, dtype=a_PM.dtype, device=a_PM.device) if out is None else out
    grid = lambda META: (G * C, cdiv(M, META["BLOCK_M"]))  # noqa: E731
    _dds_kernel[grid](
        a_PM, s_GZBB, out, topology.row_indices_Z, topology.offsets_t_C1, topology.block_offsets_t_Z,
        M, F, topology.blocks_per_row, C,
        a_PM.stride(0), a_PM.stride(1), s_GZBB.stride(0), out.stride(0), out.stride(1), out.stride(2),
        B=B, INPUT_PRECISION=input_precision(a_PM.dtype),
    )
    return out


# ----------------------------------------------------------------------------------------------
# TSD: block-sparse-transposed x dense -> per-expert dense (through the transpose indices)
# ----------------------------------------------------------------------------------------------


@triton.autotune(configs=_tsd_configs(), key=["N", "F", "B"], prune_configs_by=_prune_to_block("BLOCK_P"))
@triton.jit
def _tsd_kernel(
    # pointers
    s_ptr, d_ptr, c_ptr, row_indices_ptr, offsets_t_ptr, block_offsets_t_ptr,
    # sizes
    N, F, Fb, C,
    # strides
    stride_sg, stride_dp, stride_dn, stride_ce, stride_cf, stride_cn,
    # meta-parameters
    B: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    grp = pid // C
    c = pid % C
    e = (c // Fb).to(tl.int64)
    j = (c % Fb).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    start = tl.load(offsets_t_ptr + c)
    end = tl.load(offsets_t_ptr + c + 1)

    offs_b = tl.arange(0, B)
    offs_p = tl.arange(0, BLOCK_P)
    acc = tl.zeros((B, BLOCK_N), dtype=tl.float32)
    for t in range(0, (end - start) * B, BLOCK_P):
        i = start + t // B
        off = tl.multiple_of(t % B, BLOCK_P)
        z = tl.load(block_offsets_t_ptr + i).to(tl.int64)
        r = tl.load(row_indices_ptr + z).to(tl.int64)
        s_t = tl.load(s_ptr + grp * stride_sg + z * (B * B) + offs_b[:, None] + (off + offs_p)[None, :] * B)
        rows = r * B + off + offs_p
        d = tl.load(d_ptr + rows[:, None] * stride_dp + offs_n[None, :] * stride_dn, mask=mask_n[None, :], other=0.0)
        acc = dot(s_t, d, acc, INPUT_PRECISION)

    f = j * B + offs_b
    tl.store(c_ptr + e * stride_ce + (grp * F + f)[:, None] * stride_cf + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(f < F)[:, None] & mask_n[None, :])


def tsd_triton(s, d_PN, topology: Topology, out=None):
    s_GZBB = _grouped(s)
    G, Z, B, _ = s_GZBB.shape
    N, E, F = d_PN.shape[1], topology.routing.num_experts, topology.num_columns
    C = E * topology.blocks_per_row
    out = torch.empty(E, G * F, N, dtype=d_PN.dtype, device=d_PN.device) if out is None else out
    grid = lambda META: (G * C, cdiv(N, META["BLOCK_N"]))  # noqa: E731
    _tsd_kernel[grid](
        s_GZBB, d_PN, out, topology.row_indices_Z, topology.offsets_t_C1, topology.block_offsets_t_Z,
        N, F, topology.blocks_per_row, C,
        s_GZBB.stride(0), d_PN.stride(0), d_PN.stride(1), out.stride(0), out.stride(1), out.stride(2),
        B=B, INPUT_PRECISION=input_precision(s.dtype),
    )
    return out


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch references (also the CPU path when Triton is not launched)
#
# They loop over experts with host-side offsets (.tolist()): clear, and cheap on the CPU.
# Expert e owns the padded rows padded_offsets_E1[e] .. padded_offsets_E1[e+1], i.e. the row
# blocks s/B .. t/B and the blocks (s/B)*Fb .. (t/B)*Fb.
# ----------------------------------------------------------------------------------------------


def _blocks_to_rows(s_GZBB, topology: Topology, start: int, end: int) -> torch.Tensor:
    """Blocks of rows start..end -> dense [end - start, G*F], group-major columns."""
    G, _, B, _ = s_GZBB.shape
    Fb, F = topology.blocks_per_row, topology.num_columns
    blocks = s_GZBB[:, start // B * Fb:end // B * Fb]
    dense = blocks.reshape(G, (end - start) // B, Fb, B, B).permute(0, 1, 3, 2, 4)
    return dense.reshape(G, end - start, Fb * B)[:, :, :F].transpose(0, 1).reshape(end - start, G * F)


def _rows_to_blocks(dense_MX, out_GZBB, topology: Topology, start: int, end: int) -> None:
    """Dense [end - start, G*F] (group-major columns) -> the blocks of rows start..end of the G
    groups of out_GZBB (columns past F zero)."""
    G, M, F = out_GZBB.shape[0], end - start, topology.num_columns
    B, Fb = topology.block_size, topology.blocks_per_row
    padded = torch.nn.functional.pad(dense_MX.view(M, G, F).transpose(0, 1), (0, Fb * B - F))
    blocks = padded.reshape(G, M // B, B, Fb, B).permute(0, 1, 3, 2, 4).reshape(G, M // B * Fb, B, B)
    out_GZBB[:, start // B * Fb:end // B * Fb] = blocks.to(out_GZBB.dtype)


def sdd_reference(a_PK, w_EKF, topology: Topology, activation=None, out=None):
    act, pre = _sdd_outputs(a_PK, topology, activation, out)
    act.zero_()
    if pre is not None:
        pre.zero_()
    for e, s, t in expert_segments(topology.routing.padded_offsets_E1):
        h_MX = a_PK[s:t].float() @ w_EKF[e].float()  # swiglu: [gate | up]
        _rows_to_blocks(h_MX if activation is None else activate(h_MX, activation), _grouped(act), topology, s, t)
        if pre is not None:
            _rows_to_blocks(h_MX, _grouped(pre), topology, s, t)
    return act if activation is None else (act, pre)


def sdd_activation_grad_reference(dy_PN, w_ENF, topology: Topology, pre, activation, out=None):
    d_pre = torch.zeros_like(pre) if out is None else out.zero_()
    for e, s, t in expert_segments(topology.routing.padded_offsets_E1):
        dact_MF = dy_PN[s:t].float() @ w_ENF[e].float()
        if activation is None:
            dh_MX = dact_MF
        else:
            dh_MX, _ = activation_bwd_reference(_blocks_to_rows(_grouped(pre), topology, s, t), dact_MF, activation)
        _rows_to_blocks(dh_MX, _grouped(d_pre), topology, s, t)
    return d_pre


def dsd_reference(s, w_EFN, topology: Topology, out=None):
    s_GZBB = _grouped(s)
    P, N = topology.routing.max_padded_rows, w_EFN.shape[2]
    out = torch.zeros(P, N, dtype=s.dtype, device=s.device) if out is None else out.zero_()
    for e, start, end in expert_segments(topology.routing.padded_offsets_E1):
        dense = _blocks_to_rows(s_GZBB, topology, start, end).float()  # [M, G*F]
        out[start:end] = (dense @ w_EFN[e].float()).to(out.dtype)
    return out


def dds_reference(a_PM, s, topology: Topology, out=None):
    s_GZBB = _grouped(s)
    G = s_GZBB.shape[0]
    E, M, F = topology.routing.num_experts, a_PM.shape[1], topology.num_columns
    out = torch.zeros(E, M, G * F, dtype=a_PM.dtype, device=a_PM.device) if out is None else out.zero_()
    for e, start, end in expert_segments(topology.routing.padded_offsets_E1):
        dense = _blocks_to_rows(s_GZBB, topology, start, end).float()
        out[e] = (a_PM[start:end].float().t() @ dense).to(out.dtype)
    return out


def tsd_reference(s, d_PN, topology: Topology, out=None):
    s_GZBB = _grouped(s)
    G = s_GZBB.shape[0]
    E, N, F = topology.routing.num_experts, d_PN.shape[1], topology.num_columns
    out = torch.zeros(E, G * F, N, dtype=d_PN.dtype, device=d_PN.device) if out is None else out.zero_()
    for e, start, end in expert_segments(topology.routing.padded_offsets_E1):
        dense = _blocks_to_rows(s_GZBB, topology, start, end).float()
        out[e] = (dense.t() @ d_PN[start:end].float()).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Public entry points: check shapes, then Triton (GPU / interpreter) or the reference
# ----------------------------------------------------------------------------------------------


def sdd(a_PK, w_EKF, topology: Topology, activation=None, out=None):
    """Block-sparse S = A @ W restricted to ``topology`` (block z = A[rows of r] @ W[e][:, cols of j]).

    activation None: returns S data [Z, B, B] (written into ``out`` when given).
    'gelu':   returns (gelu_tanh(S), S) as two [Z, B, B].
    'swiglu': W has 2F columns (gate half first); returns (silu(gate) * up [Z, B, B],
              pre-activations [2, Z, B, B] = gate, up).
    """
    G = _check_activation(activation)
    _check_dense_rows(a_PK, topology, "a_PK")
    _check_weight(w_EKF, topology, "w_EKF", rows=a_PK.shape[1], cols=G * topology.num_columns, dtype=a_PK.dtype)
    _check_out(out, (topology.max_blocks, topology.block_size, topology.block_size), a_PK.dtype)
    if use_triton(a_PK, w_EKF):
        return sdd_triton(a_PK, w_EKF, topology, activation, out)
    return sdd_reference(a_PK, w_EKF, topology, activation, out)


def sdd_activation_grad(dy_PN, w_ENF, topology: Topology, pre, activation, out=None):
    """Backward SDD: d_pre = (dY @ W restricted to ``topology``) * act'(pre), shaped like ``pre``.

    For the MLP: dY = dy_P [P_max, H], W = w2ᵀ [E, H, F] (a view). 'swiglu' returns
    [2, Z, B, B] (d gate, d up); None returns the plain product."""
    G = _check_activation(activation)
    _check_dense_rows(dy_PN, topology, "dy_PN")
    _check_weight(w_ENF, topology, "w_ENF", rows=dy_PN.shape[1], cols=topology.num_columns, dtype=dy_PN.dtype)
    _check_blocks(pre, topology, "pre", dy_PN.dtype, groups=G)
    _check_out(out, tuple(pre.shape), dy_PN.dtype)
    if use_triton(dy_PN, w_ENF, pre):
        return sdd_activation_grad_triton(dy_PN, w_ENF, topology, pre, activation, out)
    return sdd_activation_grad_reference(dy_PN, w_ENF, topology, pre, activation, out)


def dsd(s, w_EFN, topology: Topology, out=None):
    """Dense [P_max, N] = S @ W: row block r (expert e) sums S[g, z] @ W[e][g*F + cols of j]
    over its groups g and blocks j. ``s`` is [Z, B, B] or [G, Z, B, B], W is [E, G*F, N] (any
    strides: w1ᵀ is a view). Unused row blocks give zero rows."""
    G = _check_blocks(s, topology, "s", s.dtype)
    _check_weight(w_EFN, topology, "w_EFN", rows=G * topology.num_columns, cols=None, dtype=s.dtype)
    _check_out(out, (topology.routing.max_padded_rows, w_EFN.shape[2]), s.dtype)
    if use_triton(s, w_EFN):
        return dsd_triton(s, w_EFN, topology, out)
    return dsd_reference(s, w_EFN, topology, out)


def dds(a_PM, s, topology: Topology, out=None):
    """Per-expert dense [E, M, G*F] = Aᵀ @ S: out[e][:, g*F + cols of j] sums A[rows of r]ᵀ @ S[g, z]
    over expert e's row blocks r (the w1 gradient; zero for an expert without tokens)."""
    _check_dense_rows(a_PM, topology, "a_PM")
    G = _check_blocks(s, topology, "s", a_PM.dtype)
    _check_out(out, (topology.routing.num_experts, a_PM.shape[1], G * topology.num_columns), None)
    if use_triton(a_PM, s):
        return dds_triton(a_PM, s, topology, out)
    return dds_reference(a_PM, s, topology, out)


def tsd(s, d_PN, topology: Topology, out=None):
    """Per-expert dense [E, G*F, N] = Sᵀ @ D: out[e][g*F + cols of j] sums S[g, z]ᵀ @ D[rows of r]
    over expert e's row blocks r (the w2 gradient; zero for an expert without tokens)."""
    _check_dense_rows(d_PN, topology, "d_PN")
    G = _check_blocks(s, topology, "s", d_PN.dtype)
    _check_out(out, (topology.routing.num_experts, G * topology.num_columns, d_PN.shape[1]), None)
    if use_triton(s, d_PN):
        return tsd_triton(s, d_PN, topology, out)
    return tsd_reference(s, d_PN, topology, out)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _grouped(s: torch.Tensor) -> torch.Tensor:
    """Block data as [G, Z, B, B] (a [Z, B, B] tensor is one group)."""
    return s[None] if s.dim() == 3 else s


def _check_activation(activation) -> int:
    """The pre-activation's groups (2 for swiglu: gate, up) of a valid activation (or None)."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is invalid: expected None or one of {list(ACTIVATIONS)}")
    return pre_width_factor(activation)


def _check_dense_rows(a, topology: Topology, name: str) -> None:
    P = topology.routing.max_padded_rows
    if a.dim() != 2 or a.shape[0] != P:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected [{P}, *] (P_max rows)")


def _check_weight(w, topology: Topology, name: str, rows: int, cols, dtype) -> None:
    E = topology.routing.num_experts
    if w.dim() != 3 or w.shape[0] != E or w.shape[1] != rows or (cols is not None and w.shape[2] != cols):
        want = f"[{E}, {rows}, {'*' if cols is None else cols}]"
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {want}")
    if w.dtype != dtype:
        raise ValueError(f"{name} has dtype {w.dtype}, expected {dtype} (the other operand's)")


def _check_blocks(s, topology: Topology, name: str, dtype, groups=None) -> int:
    Z, B = topology.max_blocks, topology.block_size
    s_GZBB = _grouped(s)
    if s.dim() not in (3, 4) or tuple(s_GZBB.shape[1:]) != (Z, B, B) or not s.is_contiguous():
        raise ValueError(f"{name} has shape {tuple(s.shape)}, "
                         f"expected contiguous [{Z}, {B}, {B}] or [G, {Z}, {B}, {B}]")
    if groups is not None and s_GZBB.shape[0] != groups:
        raise ValueError(f"{name} has {s_GZBB.shape[0]} groups, expected {groups}")
    if s.dtype != dtype:
        raise ValueError(f"{name} has dtype {s.dtype}, expected {dtype} (the other operand's)")
    if B < 16 or B & (B - 1):
        raise ValueError(f"block size {B} is invalid: expected a power of two >= 16")
    return s_GZBB.shape[0]


def _check_out(out, shape, dtype) -> None:
    if out is None:
        return
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}, expected {dtype}")
