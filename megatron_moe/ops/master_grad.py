"""How a weight-gradient kernel adds straight into an fp32 master gradient (gradient-accumulation
fusion, as Megatron-LM's ``--gradient-accumulation-fusion``).

A compute copy of a parameter (e.g. bf16 over an fp32 master, training/precision.py) may carry
a :class:`MasterGrad`. An autograd op whose backward computes that weight's gradient asks for it
with :func:`fp32_grad_of` and, when there is one, accumulates its fp32 result into the master's
``.grad`` in the kernel's epilogue and returns no gradient for the copy:

    sink = fp32_grad_of(w)            # None: return the gradient to autograd as usual
    out, accumulate = sink.buffer()   # master.grad (new and unset on the first micro-batch)
    kernel(..., out=out, accumulate=accumulate)
    sink.done()                       # the readiness call
    return sink.autograd_grad(out, w.dtype)   # what the Function returns for w: None here

Megatron-LM's fp32 ``main_grad`` buffers are such a master gradient too
(megatron_moe/megatron/grad_accum.py): there the Function returns an unread placeholder, as
megatron-core's own fused linear layers do, so that Megatron's per-parameter hooks still run.

Inside :func:`overwriting` every gradient asked for is written, not added into, even where one
exists: the first micro-batch of a step captured in a CUDA graph (training/cuda_graphs.py)
overwrites the previous step's gradients instead of adding into gradients zeroed beforehand.

This module is the whole contract between the ops and whoever owns the masters.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["MasterGrad", "fp32_grad_of", "attach_master_grad", "overwriting"]

_ATTR = "_fp32_master_grad"
_overwrite = False


@contextlib.contextmanager
def overwriting():
    """Within the block :meth:`MasterGrad.buffer` says "write" for gradients that exist too."""
    global _overwrite
    before, _overwrite = _overwrite, True
    try:
        yield
    finally:
        _overwrite = before


class MasterGrad:
    """A compute copy's way into its fp32 master's gradient.

    ``on_ready(master)`` is called by ``done()`` once the master's gradient for this backward is
    complete (e.g. to start an overlapped gradient reduction). ``done()`` belongs once per
    backward: a copy fed to two accumulating kernels in one graph would be reported twice (each
    expert weight is used once per forward).
    """

    __slots__ = ("master", "on_ready")

    def __init__(self, master: torch.nn.Parameter,
                 on_ready: Callable[[torch.nn.Parameter], None] | None = None):
        self.master, self.on_ready = master, on_ready

    def buffer(self) -> tuple[torch.Tensor, bool]:
        """(the master's fp32 gradient, whether to add into it): a new uninitialised buffer and
        False on the first micro-batch of a step; the existing one and False inside
        :func:`overwriting`."""
        g = self.master.grad
        if g is None:
            self.master.grad = g = torch.empty_like(self.master, memory_format=torch.contiguous_format)
            return g, False
        return g, not _overwrite

    def done(self) -> None:
        if self.on_ready is not None:
            self.on_ready(self.master)

    def autograd_grad(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """What the op returns to autograd for the copy once its gradient is in ``out``: None
        (no gradient for the copy)."""
        return None


def attach_master_grad(copy: torch.Tensor, sink: MasterGrad) -> None:
    """Let the ops that support it accumulate ``copy``'s gradient through ``sink``."""
    setattr(copy, _ATTR, sink)


def fp32_grad_of(param: torch.Tensor) -> MasterGrad | None:
    """The :class:`MasterGrad` of a compute copy (None for any other tensor)."""
    return getattr(param, _ATTR, None)
