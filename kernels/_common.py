"""Shared helpers of the Triton kernels: when to launch Triton, the tile product, small index math."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .switches import getenv


def interpret_mode() -> bool:
    """True when Triton runs its kernels on the CPU (TRITON_INTERPRET=1)."""
    return getenv("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    """A CUDA device's compute capability, read once per process (torch's query costs host time
    at every launch that asks)."""
    return torch.cuda.get_device_capability(index)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (persistent grids, the blocks of a split
    reduction), read once per device; 4 elsewhere (the interpreter's stand-in)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def use_triton(*tensors: torch.Tensor) -> bool:
    """Launch the Triton kernel when the tensors are on a GPU, or on the CPU under the interpreter.

    Otherwise (CPU without the interpreter) each op runs its plain-PyTorch reference, so the
    same layer trains on a laptop and on a GPU.
    """
    if all(t.is_cuda for t in tensors):
        return True
    return interpret_mode() and all(t.device.type == "cpu" for t in tensors)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``, which in
    Triton 3.6 is a constexpr function whose host call costs microseconds."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def expert_segments(offsets_E1: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every expert with rows, from offsets [E+1]. Reads them on the
    host: for the plain-PyTorch references, never on a kernel's path."""
    bounds = offsets_E1.tolist()
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1) if bounds[e + 1] > bounds[e]]


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: IEEE fp32 products for fp32 operands ("tf32" is ignored for
    bf16/fp16, which multiply on the tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# The interpreter's tl.dot mis-reads 16-bit operands (Triton 3.9): there, dot in fp32 instead.
# (Fixed for the process: triton.jit chooses the interpreter when a kernel is defined.)
UPCAST_DOT = tl.constexpr(interpret_mode())


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in fp32 (under the interpreter, from fp32 copies of a and b)."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def round_bf16(x):
    """fp32 -> bf16 rounded to nearest even on the bits, NaN kept: torch's .to(bfloat16) on the
    GPU and under the interpreter (whose own conversion truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    r = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, float("nan"), r)


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """fp32 ``x`` in DTYPE, rounded to nearest even (bf16 too under the interpreter: round_bf16)."""
    y = x.to(DTYPE)
    if DTYPE == tl.bfloat16:
        y = round_bf16(x)
    return y
