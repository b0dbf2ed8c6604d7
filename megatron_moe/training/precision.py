"""bf16 compute parameters over fp32 master weights (``train.bf16_params``, the default with bf16).

    bf16 = BF16Params(model, params, grad_ready=reducer.grad_ready)
    with bf16.compute():          # the modules hold bf16 copies of their parameters
        loss = model(...)
    loss.backward()               # each copy's gradient is added into its master's fp32 .grad
    ...reduce, clip, optimizer.step() on the fp32 masters...
    bf16.refresh()                # round the updated masters into the copies (optim.AdamW
                                  # does this in its step after opt.set_copies(bf16.masters, bf16.copies))

The same arithmetic as Megatron-LM's ``--bf16`` (bf16 parameters, fp32 main parameters and
gradients in the optimizer), kept on our side of the model: the model holds its fp32
parameters at all times except inside ``compute()``, so the optimizer, the gradient reduction,
clipping and checkpoints see only fp32 masters, exactly as without this class.

Against autocast over fp32 parameters (``train.bf16_params=false``): autocast re-casts every
weight in every micro-batch, runs LayerNorm in fp32 and adds the fp32 biases to bf16 GEMM
outputs, so the residual stream, the norms and the activations' elementwise ops all run on fp32
tensors (twice the bytes) with casts in between. Here everything between the GEMMs stays bf16
(torch's LayerNorm and softmax still accumulate in fp32), and the copies are rounded once per
optimizer step. Gradients: each micro-batch's bf16 weight gradient is added into an fp32
buffer as soon as the backward has produced it (a post-accumulate hook), then freed, so
accumulation over micro-batches happens in fp32. Buffers (e.g. the routers' expert biases) stay
fp32.

Gradient-accumulation fusion (``train.grad_accumulation_fusion``, as Megatron-LM's
--gradient-accumulation-fusion): each copy carries a ``MasterGrad`` (megatron_moe/ops/master_grad.py)
through which a weight-gradient kernel adds its fp32 result straight into the master's ``.grad``
and returns no gradient for the copy: no bf16 gradient tensor, no separate add, and no bf16
rounding of each micro-batch's gradient. The grouped experts' kernels do this
(megatron_moe/ops/triton_grouped_mlp.py); for the experts of dmoe-small that add is 3.6B parameters per micro-batch.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from megatron_moe.ops.master_grad import MasterGrad, attach_master_grad

__all__ = ["BF16Params"]


class BF16Params:
    """bf16 copies of ``params`` (a model's unique trainable fp32 parameters) for compute.

    ``grad_ready(master)`` is called when a master's gradient for this backward is complete
    (e.g. ``GradReducer.grad_ready``, which starts overlapped bucket reductions): the
    masters themselves take no part in the autograd graph, so their own hooks never fire.
    ``fuse_grad_accumulation``: give each copy a :class:`MasterGrad` (module docstring).
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], *,
                 dtype: torch.dtype = torch.bfloat16,
                 grad_ready: Callable[[torch.nn.Parameter], None] | None = None,
                 fuse_grad_accumulation: bool = False):
        self.masters = list(params)
        for p in self.masters:
            if p.dtype != torch.float32:
                raise ValueError(f"BF16Params: master parameters must be fp32, got {p.dtype}")
        self.copies = [torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                       for p in self.masters]
        for c, p in zip(self.copies, self.masters):
            c.__dict__.update(p.__dict__)  # marks such as expert_parallel / allreduce
        # the one way into a master's gradient: this class's hook, or a fused kernel (MasterGrad)
        self._sink_of = {id(c): MasterGrad(m, self._ready) for c, m in zip(self.copies, self.masters)}
        copy_of = {id(m): c for m, c in zip(self.masters, self.copies)}
        # every place a master sits in the module tree (a tied weight sits in two)
        self._slots = [(mod, name, copy_of[id(p)], p) for mod in model.modules()
                       for name, p in mod._parameters.items() if p is not None and id(p) in copy_of]
        self.grad_ready = grad_ready
        for c in self.copies:
            if c.requires_grad:
                c.register_post_accumulate_grad_hook(self._accumulate)
                if fuse_grad_accumulation:
                    attach_master_grad(c, self._sink_of[id(c)])

    def _ready(self, master: torch.nn.Parameter) -> None:
        if self.grad_ready is not None:
            self.grad_ready(master)

    @torch.no_grad()
    def _accumulate(self, copy: torch.nn.Parameter) -> None:
        if copy.grad is None:  # a kernel added it into the master already (MasterGrad)
            return
        sink = self._sink_of[id(copy)]
        out, accumulate = sink.buffer()
        if accumulate:
            out.add_(copy.grad)
        else:
            out.copy_(copy.grad)
        copy.grad = None
        sink.done()

    @contextlib.contextmanager
    def compute(self):
        """The modules hold the bf16 copies inside the block (forward; the backward of what
        it built may run after it). Not re-entrant."""
        for mod, name, copy, _ in self._slots:
            mod._parameters[name] = copy
        try:
            yield
        finally:
            for mod, name, _, master in self._slots:
                mod._parameters[name] = master

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters into the copies: after every optimizer step or checkpoint load."""
        torch._foreach_copy_(self.copies, self.masters)
