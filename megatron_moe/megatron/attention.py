"""SDPAttention: megatron-core core attention through torch.nn.functional.scaled_dot_product_attention.

A drop-in for megatron-core's local ``DotProductAttention`` (same constructor and forward), used
as ``SelfAttentionSubmodules.core_attention`` by ``megatron_moe.megatron.spec`` for dense and
MoE models alike. PyTorch picks the kernel: flash / memory-efficient attention on the GPU (bf16
under autocast), the math kernel on the CPU. megatron-core's own local DotProductAttention
materialises the [b, heads, s, s] scores and allocates them on ``torch.cuda.current_device()``,
so it cannot run on the CPU.

    query, key, value: [s, b, heads, head_dim]  ->  output [s, b, heads * head_dim]

Masking: ``attn_mask_type`` causal -> ``is_causal=True``. An explicit ``attention_mask`` follows
megatron's convention (bool, True = masked out, broadcastable to [b, heads, s_q, s_k]) and is
combined with the causal mask. Grouped-query attention (fewer key/value heads) is supported;
packed sequences, attention bias and context parallelism are not (clear errors).

Run its test: ``pytest tests/megatron/test_model.py -k attention``.
"""
from __future__ import annotations

import math
from typing import Optional

from megatron_moe.megatron import require

require("megatron")  # megatron-core, before its imports below

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Core attention (softmax(Q Kᵀ · scale + mask) V) through PyTorch's fused SDPA kernels."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context_parallel_size must be 1 (context parallelism "
                             "is not supported)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={config.softmax_type!r} is not supported; "
                             "use 'vanilla'")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPAttention: sliding-window attention (window_size) is not supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = 1
        if pg_collection is not None and hasattr(pg_collection, "tp") and pg_collection.tp is not None:
            tp = pg_collection.tp.size()
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
        self.head_dim = config.kv_channels
        # (apply_query_key_layer_scaling divides the scores by layer_number and the softmax
        # multiplies them back: a no-op in exact arithmetic, so the plain scale is right.)
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention: packed sequences (packed_seq_params) are not supported")
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"SDPAttention: expected query/key/value [s, b, heads, head_dim], got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        sq, b, nq, d = query.shape
        sk = key.shape[0]

        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if k.shape[1] != nq:  # grouped-query attention: repeat the key/value heads
            if nq % k.shape[1]:
                raise ValueError(f"SDPAttention: {nq} query heads are not a multiple of "
                                 f"{k.shape[1]} key/value heads")
            rep = nq // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # Under autocast the projections may leave q, k, v in different dtypes; SDPA needs one.
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

        attn_mask = None
        is_causal = causal
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)  # megatron: True = masked out; SDPA: True = attend
            if causal:
                keep = keep & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            attn_mask, is_causal = keep, False
        elif causal and sq != sk:
            # is_causal aligns the mask to the top-left corner; megatron's causal mask for a
            # shorter query (decoding) is aligned to the bottom-right.
            attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            is_causal = False

        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal, scale=self.softmax_scale)
        # [b, n, s, d] -> [s, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * d)
