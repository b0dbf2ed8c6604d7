"""Megatron-LM's ``--gradient-accumulation-fusion`` (its default) without Apex.

Megatron's DDP keeps an fp32 ``main_grad`` buffer per parameter; after each backward a hook adds
the parameter's bf16 ``.grad`` into it, unless the layer already did (``grad_added_to_main_grad``).
With gradient-accumulation fusion the layers' weight-gradient GEMMs add into ``main_grad``
themselves: no bf16 gradient per micro-batch, no separate add, fp32 sums throughout.
megatron-core does this through Apex's ``fused_weight_gradient_mlp_cuda`` and refuses the flag
when that extension is missing. Two pieces make it work without Apex:

* :func:`install_wgrad_accumulation` (run when the spec module is imported) gives megatron-core's
  linear layers (attention, the dense MLP, the output layer) a stand-in for the extension when
  it is absent: the same two functions, ``main_grad += grad_outputᵀ @ input`` with fp32
  products (a GEMM with fp32 output, then an add: megatron-core's semantics and precision,
  though not the fused epilogue of Apex's kernel);
* :func:`attach_main_grad_sinks` gives our experts' weights a :class:`MainGradSink`: the grouped
  weight-gradient kernels (``mlp_impl='triton_grouped'``) then add their fp32 results into
  ``main_grad`` in their epilogues (master_grad.py's contract), mark the parameter, and hand
  autograd an unread placeholder so that Megatron's hooks still run, as megatron-core's own
  fused linear layers do. The experts hold most parameters of a MoE model: for dmoe-xs 0.72B of
  0.84B, whose bf16 gradients (1.4 GB per micro-batch) are never written.

With ``--no-gradient-accumulation-fusion`` neither applies and the hooks add bf16 gradients.
"""
from __future__ import annotations

import types

import torch

from megatron_moe.ops.master_grad import MasterGrad, attach_master_grad, fp32_grad_of

__all__ = ["MainGradSink", "attach_main_grad_sinks", "install_wgrad_accumulation",
           "wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]


class MainGradSink(MasterGrad):
    """A parameter's way into its Megatron ``main_grad`` (always added into: Megatron zeroes
    the buffers at the start of each step, ``zero_grad_buffer``)."""

    __slots__ = ()

    def buffer(self) -> tuple[torch.Tensor, bool]:
        return self.master.main_grad, True

    def done(self) -> None:
        self.master.grad_added_to_main_grad = True  # Megatron's hook then skips its add

    def autograd_grad(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # A new unread tensor (not a cached one: autograd would copy a tensor held elsewhere);
        # Megatron's hook sets .grad back to None.
        return torch.empty(out.shape, dtype=dtype, device=out.device)


def attach_main_grad_sinks(params) -> int:
    """Give each parameter with an fp32 Megatron ``main_grad`` a :class:`MainGradSink` (once);
    returns how many have one."""
    n = 0
    for p in params:
        main = getattr(p, "main_grad", None)
        if main is None or main.dtype != torch.float32 or main.shape != p.shape:
            continue
        sink = fp32_grad_of(p)
        if not (isinstance(sink, MainGradSink) and sink.master is p):
            attach_master_grad(p, MainGradSink(p))
        n += 1
    return n


def _wgrad(total_input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """grad_outputᵀ @ total_input over all leading dimensions, fp32 products and sums."""
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    if g.is_cuda and g.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(g.t(), x, out_dtype=torch.float32)
    return g.t().float() @ x.float()


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``: main_grad (fp32, [out, in])
    += grad_output [.., out]ᵀ @ total_input [.., in]."""
    main_grad.add_(_wgrad(total_input, grad_output))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same into a 16-bit main_grad (the sum in fp32, then rounded)."""
    main_grad.copy_(main_grad.float() + _wgrad(total_input, grad_output))


_STAND_IN = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                                  wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16,
                                  __name__="megatron_moe.megatron.grad_accum")


def install_wgrad_accumulation() -> bool:
    """Let megatron-core's linear layers take ``gradient_accumulation_fusion`` without Apex: the
    stand-in above becomes their ``fused_weight_gradient_mlp_cuda`` where Apex's is missing.
    Idempotent; returns whether the stand-in is what they use."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _STAND_IN
        layers._grad_accum_fusion_available = True
    return getattr(layers, "fused_weight_gradient_mlp_cuda", None) is _STAND_IN
