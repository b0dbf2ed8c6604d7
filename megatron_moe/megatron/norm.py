"""LayerNorm for megatron-core's layers: torch's LayerNorm (the same parameters, state-dict keys and
initialisation) whose forward is megatron_moe.ops.layer_norm: the Triton kernels on a GPU
(``MEGATRON_MOE_FUSED_NORM=0``: torch's), else ``F.layer_norm``.

A drop-in for megatron-core's ``WrappedTorchNorm`` (the local spec's norm), with its constructor:
``LayerNorm(config, hidden_size, eps=1e-5)``; with ``config.normalization`` other than LayerNorm
it gives ``WrappedTorchNorm``'s module (torch's RMSNorm, ...), as the local spec did. Used by
``megatron_moe.megatron.spec`` for each layer's two norms and by ``build_gpt_model`` for the
final one.
"""
from __future__ import annotations

from megatron_moe.megatron import require

require("megatron")  # megatron-core, before its imports below

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_moe.ops.layer_norm import layer_norm


class LayerNorm(torch.nn.LayerNorm):
    def __new__(cls, config: TransformerConfig | None = None, hidden_size: int | None = None, eps: float = 1e-5,
                **kwargs):  # no arguments: copy.deepcopy and pickle make the instance this way
        if config is not None and config.normalization != "LayerNorm":  # RMSNorm, L2Norm: megatron-core's
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        return super().__new__(cls)

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused_kwargs):
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "sequence_parallel",
                     "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"megatron-moe's LayerNorm does not support TransformerConfig.{flag}=True "
                                 f"(set it False; Megatron-LM: leave its flag off)")
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
