"""Row blocks copied up to counts that live on the device: the data movement of the exact-size,
host-sync-free token exchange (``a2a_splits='symmetric'``, :mod:`megatron_moe.symmetric`).

    copy_row_blocks(src, dst, counts_B, block_rows, src_row0=0, dst_row0=0,
                    src_starts_B=None, dst_starts_B=None, src_ptrs_B=None, first_block=0,
                    persistent=True)

copies, for every block b of ``counts_B`` (B blocks of at most ``block_rows`` rows), rows
[0, counts_B[b]) of block b from ``src`` (rows from src_row0 + b * block_rows) to ``dst`` (rows
from dst_row0 + b * block_rows). A block's first row may instead come from the device:
``src_starts_B[b]`` / ``dst_starts_B[b]`` (added to src_row0 / dst_row0), for blocks packed one
after another (rows sorted by destination). Each block may read its own tensor: ``src_ptrs_B[b]``,
a 16-byte-aligned device address of a tensor laid out as ``src`` (its dtype, width and row
stride; ``src`` itself is then not read), from its row src_row0 (+ src_starts_B[b]), e.g. every peer's symmetric-memory
buffer, read over NVLink, in one launch.
Rows past a block's count are not touched. The counts, starts and addresses are read by the
kernel, never by the host, so a CUDA graph can hold the copy.

Two grids: persistent (the default), a few programs per SM that walk the blocks in turn from
``first_block`` (mod B), each block's row tiles strided over the programs, so no program is
launched for rows past a count and, with ``first_block`` = rank, each rank of an exchange reads a
different peer's buffer at each stage; or (``persistent=False``) one program per row tile of
every block, those past the block's count returning at once (the form measured on 2026-11-28,
kept for A/B: ``MEGATRON_MOE_PEER_READS=per_peer``).

Legend: B blocks, C = block_rows, H hidden (row width).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpret_mode, next_power_of_2, num_sms, use_triton
from .launcher import launch

# ----------------------------------------------------------------------------------------------
# Configuration (a copy: no autotuning; rows x columns per program sized for 16-byte accesses)
# ----------------------------------------------------------------------------------------------

BLOCK_R = 16
PROGRAMS_PER_SM = 4  # persistent grid: 16 warps an SM, each program one 16-row tile in flight


def _block_h(H: int) -> int:
    if interpret_mode():
        return 16
    return min(1024, next_power_of_2(H))


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _copy_block(
    src_ptr, dst_ptr, counts_ptr, src_starts_ptr, dst_starts_ptr, src_ptrs_ptr,
    b, r_first, r_step, block_rows, H, src_row0, dst_row0,
    stride_src, stride_dst,
    HAS_SRC_STARTS: tl.constexpr, HAS_DST_STARTS: tl.constexpr, HAS_SRC_PTRS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rows r_first, r_first + r_step, ... (tiles of BLOCK_R) of block b, up to its count."""
    n = tl.load(counts_ptr + b).to(tl.int32)
    if HAS_SRC_STARTS:
        src_first = tl.load(src_starts_ptr + b).to(tl.int64)
    elif HAS_SRC_PTRS:  # a tensor of its own: from src_row0
        src_first = b.to(tl.int64) * 0
    else:
        src_first = b.to(tl.int64) * block_rows
    if HAS_DST_STARTS:
        dst_first = tl.load(dst_starts_ptr + b).to(tl.int64)
    else:
        dst_first = b.to(tl.int64) * block_rows
    src = src_ptr
    if HAS_SRC_PTRS:
        # (16-byte aligned, as the launcher's caller promises: vector loads, as from src_ptr)
        src = tl.multiple_of(tl.load(src_ptrs_ptr + b).to(tl.pointer_type(src_ptr.dtype.element_ty)), 16)
    for r0 in range(r_first, n, r_step):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < n
        src_rows = (src_row0 + src_first + offs_r.to(tl.int64)) * stride_src
        dst_rows = (dst_row0 + dst_first + offs_r.to(tl.int64)) * stride_dst
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = mask_r[:, None] & (offs_h < H)[None, :]
            x = tl.load(src + src_rows[:, None] + offs_h[None, :], mask=mask)
            tl.store(dst_ptr + dst_rows[:, None] + offs_h[None, :], x, mask=mask)


@triton.jit
def _copy_row_blocks_kernel(
    src_ptr, dst_ptr, counts_ptr, src_starts_ptr, dst_starts_ptr, src_ptrs_ptr,
    B, first_block, block_rows, H, src_row0, dst_row0,
    stride_src, stride_dst,
    HAS_SRC_STARTS: tl.constexpr, HAS_DST_STARTS: tl.constexpr, HAS_SRC_PTRS: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    if PERSISTENT:
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_R
        for i in range(0, B):
            b = (first_block + i) % B
            _copy_block(src_ptr, dst_ptr, counts_ptr, src_starts_ptr, dst_starts_ptr, src_ptrs_ptr,
                        b, pid * BLOCK_R, step, block_rows, H, src_row0, dst_row0, stride_src, stride_dst,
                        HAS_SRC_STARTS, HAS_DST_STARTS, HAS_SRC_PTRS, BLOCK_R, BLOCK_H)
    else:  # one tile: the step past any count
        _copy_block(src_ptr, dst_ptr, counts_ptr, src_starts_ptr, dst_starts_ptr, src_ptrs_ptr,
                    tl.program_id(1), tl.program_id(0) * BLOCK_R, block_rows + BLOCK_R, block_rows, H,
                    src_row0, dst_row0, stride_src, stride_dst,
                    HAS_SRC_STARTS, HAS_DST_STARTS, HAS_SRC_PTRS, BLOCK_R, BLOCK_H)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def copy_row_blocks(src: torch.Tensor, dst: torch.Tensor, counts_B: torch.Tensor, block_rows: int,
                    src_row0: int = 0, dst_row0: int = 0, src_starts_B: torch.Tensor | None = None,
                    dst_starts_B: torch.Tensor | None = None, src_ptrs_B: torch.Tensor | None = None,
                    first_block: int = 0, persistent: bool = True) -> None:
    """In place into ``dst`` (see the module docstring). src, dst: 2-D, the same width and dtype,
    rows contiguous; counts_B: int32/int64 on the same device, each in [0, block_rows]; starts
    (optional, [B] on the device, not checked by the host): each block's first row, such that its
    rows stay inside the tensor; src_ptrs_B (optional, int64 [B] on the device, not checked by the
    host): each block's source tensor, laid out as ``src``, at a 16-byte-aligned address (the loads
    are vectorised on that promise); it needs the kernel (a GPU, or the CPU under
    TRITON_INTERPRET=1)."""
    counts_B = counts_B.reshape(-1).contiguous()  # the kernel reads counts_B[b] at offset b
    starts = [None if s is None else s.reshape(-1).contiguous() for s in (src_starts_B, dst_starts_B)]
    B = counts_B.numel()
    H = src.shape[1]
    if src.dtype != dst.dtype or dst.shape[1] != H or src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError(f"copy_row_blocks: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} need the same width and dtype, each row contiguous")
    for name, s in zip(("src_starts_B", "dst_starts_B", "src_ptrs_B"), starts + [src_ptrs_B]):
        if s is not None and s.numel() != B:
            raise ValueError(f"copy_row_blocks: {name} has {s.numel()} entries, expected one per block ({B})")
    if ((starts[0] is None and src_ptrs_B is None and src_row0 + B * block_rows > src.shape[0])
            or (starts[1] is None and dst_row0 + B * block_rows > dst.shape[0])):
        raise ValueError(f"copy_row_blocks: {B} blocks of {block_rows} rows from row {src_row0} / "
                         f"{dst_row0} run past src ({src.shape[0]} rows) or dst ({dst.shape[0]} rows)")
    tensors = [src, dst, counts_B] + [s for s in starts + [src_ptrs_B] if s is not None]
    kernel = use_triton(*tensors)
    if src_ptrs_B is not None and not kernel:
        raise ValueError("copy_row_blocks: src_ptrs_B needs the kernel (a GPU, or the CPU under "
                         "TRITON_INTERPRET=1); otherwise copy one source tensor per call")
    if B == 0 or block_rows == 0 or H == 0:
        return
    if not kernel:
        copy_row_blocks_reference(src, dst, counts_B, block_rows, src_row0, dst_row0, *starts)
        return
    tiles = cdiv(block_rows, BLOCK_R)
    grid = (min(tiles * B, num_sms(dst.device) * PROGRAMS_PER_SM),) if persistent else (tiles, B)
    launch(_copy_row_blocks_kernel, grid,
           (src, dst, counts_B, counts_B if starts[0] is None else starts[0],
            counts_B if starts[1] is None else starts[1],  # (dummy pointers where there are none)
            counts_B if src_ptrs_B is None else src_ptrs_B,
            B, first_block % B, block_rows, H, src_row0, dst_row0, src.stride(0), dst.stride(0)),
           dict(HAS_SRC_STARTS=starts[0] is not None, HAS_DST_STARTS=starts[1] is not None,
                HAS_SRC_PTRS=src_ptrs_B is not None, PERSISTENT=persistent,
                BLOCK_R=BLOCK_R, BLOCK_H=_block_h(H), num_warps=4))


# ----------------------------------------------------------------------------------------------
# Reference (plain PyTorch; also the CPU path). No host read of the counts: a mask per block.
# ----------------------------------------------------------------------------------------------


def copy_row_blocks_reference(src, dst, counts_B, block_rows, src_row0=0, dst_row0=0,
                              src_starts_B=None, dst_starts_B=None) -> None:
    B = counts_B.numel()
    dev = counts_B.device
    j_C = torch.arange(block_rows, device=dev)
    valid_BC = j_C[None, :] < counts_B.reshape(B, 1)

    def rows_BC(row0, starts_B):
        first_B = torch.arange(B, device=dev) * block_rows if starts_B is None else starts_B.reshape(B).long()
        return row0 + first_B[:, None] + j_C[None, :]

    dst[rows_BC(dst_row0, dst_starts_B)[valid_BC]] = src[rows_BC(src_row0, src_starts_B)[valid_BC]]
