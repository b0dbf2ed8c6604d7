"""What the Gluon kernels (gluon_wgrad.py, gluon_gemm.py) share: Gluon's Hopper imports, the names
Triton 3.9 renamed, and the launch rules every one of them checks (sm_90, 16-byte rows, the SM
count)."""
from __future__ import annotations

import torch

from ._common import capability, interpret_mode, num_sms  # noqa: F401  (num_sms: the Gluon kernels' grids)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon's Hopper ops: the Triton kernels run everything
    gluon = gl = async_copy = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None

if gluon is not None:
    # Triton 3.9 renamed the cp.async copy, the TMA copies and the CTA barrier; either release's name
    async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def available() -> bool:
    """Gluon's Hopper ops import, and this is not the interpreter (which cannot run Gluon)."""
    return gluon is not None and not interpret_mode()


def on_sm90(t: torch.Tensor) -> bool:
    return t.is_cuda and capability(t.device.index) == (9, 0)


def rows_ok(t: torch.Tensor) -> bool:
    """Unit column stride, a row stride of a multiple of 16 elements and a 16-byte aligned start:
    what Triton's specialisation must see for 16-byte copies (rows of an 8-element multiple gave
    wrong sums in gluon_wgrad's kernel on an H200, 2026-11-29)."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def maxnreg(num_warps: int, worker_warps: int) -> int:
    """The register cap that lets the default partition's and the workers' warps (rounded up to
    whole warpgroups) share an SM's 64K registers."""
    total = num_warps + -(-worker_warps // 4) * 4
    return min(256, 65536 // (32 * total)) // 8 * 8
