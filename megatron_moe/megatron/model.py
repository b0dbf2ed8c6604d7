"""A megatron-core GPTModel built from our layer spec, for programs that build the model
themselves (the training program does; Megatron-LM builds its own from ``layer_spec``).

    torch.distributed.init_process_group("gloo")   # or "nccl"; torchrun sets the environment
    from megatron_moe.megatron import init_megatron, build_gpt_model, moe_layers
    init_megatron(seed=1234)                         # TP = PP = 1 model-parallel state, RNG seeds
    model = build_gpt_model(model_cfg)               # fp32 params on the current device
    loss_bs = model(tokens_bs, position_ids_bs, attention_mask=None, labels=labels_bs)  # [b, s]
    loss_bs.mean().backward()                        # LM loss + aux losses (router included)
    [layer.tokens_per_expert for layer in moe_layers(model)]

``build_gpt_model`` also gives the model our fused LM cross-entropy
(``megatron_moe.ops.cross_entropy``: one pass over the bf16 logits forward, one backward, no
fp32 copy of the [tokens, vocab] logits) in place of megatron-core's
``vocab_parallel_cross_entropy`` (same loss; tensor-parallel size 1).

bf16: the model is built with fp32 params; the training program swaps bf16 copies of them in for
each forward (megatron_moe/training/precision.py), so every module simply runs in bf16.
Autocast over the fp32 params also works, on every device (the spec's linear layers are plain
``F.linear`` at tensor-parallel size 1).

CPU: ``init_megatron`` seeds torch / numpy / random everywhere but seeds megatron-core's CUDA RNG
tracker only when CUDA is available; nothing here needs the tracker on the CPU (dropout is 0, no
sequence parallelism, no activation recompute, SDPAttention never forks it). Params are created
with ``use_cpu_initialization=True`` there, and megatron-core's RotaryEmbedding (which moves its
table to ``torch.cuda.current_device()``) is replaced by a CPU-safe subclass.
"""
from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe.layer import DroplessMoE
from megatron_moe.ops.cross_entropy import lm_cross_entropy

from .model_config import ModelConfig
from .norm import LayerNorm
from .spec import DenseOrMoEMLP, gelu_tanh, moe_layer_spec, use_plain_linear

__all__ = ["transformer_config", "init_megatron", "build_gpt_model", "layer_mlps", "moe_layers"]


def transformer_config(model_cfg: ModelConfig, *, use_cpu_initialization: Optional[bool] = None
                       ) -> TransformerConfig:
    """megatron-core's TransformerConfig for ``model_cfg``: fp32 params, no dropout, no fusions
    (they need CUDA / Apex / TE), LayerNorm, biases, megatron's (scaled) normal init."""
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    swiglu = model_cfg.activation == "swiglu"
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        kv_channels=model_cfg.head_dim,
        init_method_std=model_cfg.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=True,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else gelu_tanh,
        normalization="LayerNorm",
        layernorm_epsilon=1e-5,
        params_dtype=torch.float32,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


class _CPURotaryEmbedding(RotaryEmbedding):
    """megatron-core's RotaryEmbedding moves its frequencies to ``torch.cuda.current_device()`` on
    first use; this one keeps them where they are (used only when CUDA is unavailable)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.rotary_interleaved:
            raise ValueError("rotary_interleaved is not supported on the CPU")
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim / 2]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, dim]


class _DropUnknownMLPWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


@contextmanager
def _quiet_unknown_mlp_warning():
    # megatron-core's TransformerLayer logs a warning for any MLP class it does not know.
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    filt = _DropUnknownMLPWarning()
    logger.addFilter(filt)
    try:
        yield
    finally:
        logger.removeFilter(filt)


_parallel_world = None  # the torch.distributed default group megatron's groups were made in


def init_megatron(seed: int) -> None:
    """megatron-core's model-parallel state (TP = PP = 1) over the initialised torch.distributed
    world, and the RNG seeds (random, numpy, torch; megatron's CUDA RNG tracker on GPUs).
    Idempotent: a second call re-seeds and leaves the parallel state as it is."""
    import torch.distributed as dist

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"init_megatron(seed={seed!r}): expected an int")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_megatron: torch.distributed is not initialised: call "
                           "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on the CPU) "
                           "first (torchrun sets its environment)")
    global _parallel_world
    world = dist.distributed_c10d._get_default_group()
    if (parallel_state.model_parallel_is_initialized() and _parallel_world is not None
            and _parallel_world is not world):
        # The torch.distributed world was destroyed and re-created since megatron's groups
        # were made (e.g. two runs in one process): they are stale, make them again.
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 pipeline_model_parallel_size=1)
    _parallel_world = world
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt_model(model_cfg: ModelConfig) -> GPTModel:
    """A megatron-core GPTModel with our attention and MLP: fp32 params on the current device
    (CUDA if available, else the CPU). ``model(tokens, position_ids, attention_mask=None,
    labels=labels)`` returns the per-token LM loss [b, s] (logits [b, s, vocab] without labels)."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"build_gpt_model: expected a ModelConfig, got {type(model_cfg).__name__}")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model: call megatron_moe.megatron.init_megatron(seed) first")
    tcfg = transformer_config(model_cfg)
    with _quiet_unknown_mlp_warning():
        model = GPTModel(
            config=tcfg,
            # the layers' spec, and our LayerNorm for the final norm too (megatron_moe/megatron/norm.py)
            transformer_layer_spec=TransformerBlockSubmodules(
                layer_specs=[moe_layer_spec(model_cfg)] * model_cfg.num_layers, layer_norm=LayerNorm),
            vocab_size=model_cfg.vocab_size,
            max_sequence_length=model_cfg.seq_length,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
            position_embedding_type=model_cfg.position_embedding_type,
        )
    if isinstance(getattr(model, "output_layer", None), ColumnParallelLinear):
        # GPTModel builds its output layer itself (not from the spec): same F.linear path.
        use_plain_linear(model.output_layer)
    # The LM loss: our fused cross-entropy (one pass over the bf16 logits, no fp32 copy of them)
    # instead of megatron-core's vocab_parallel_cross_entropy (TP = 1 here, so no vocab split).
    model.compute_language_model_loss = _fused_lm_loss
    if not torch.cuda.is_available() and isinstance(getattr(model, "rotary_pos_emb", None), RotaryEmbedding):
        old = model.rotary_pos_emb
        model.rotary_pos_emb = _CPURotaryEmbedding(
            kv_channels=tcfg.kv_channels, rotary_percent=1.0, rotary_base=10000,
            use_cpu_initialization=True, cp_group=old.cp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    model.to(device)
    model.model_cfg = model_cfg
    return model


def _fused_lm_loss(labels_BS: torch.Tensor, logits_SBV: torch.Tensor) -> torch.Tensor:
    """GPTModel.compute_language_model_loss at TP = 1: per-token loss [b, s] in fp32 from logits
    [s, b, vocab] (megatron_moe.ops.cross_entropy; the backward overwrites the logits, which
    GPTModel does not return when it is given labels)."""
    S, B, V = logits_SBV.shape
    labels_T = labels_BS.transpose(0, 1).reshape(-1)
    loss_T = lm_cross_entropy(logits_SBV.reshape(S * B, V), labels_T)
    return loss_T.view(S, B).transpose(0, 1).contiguous()


def layer_mlps(model: torch.nn.Module) -> list[DenseOrMoEMLP]:
    """Every layer's DenseOrMoEMLP in layer order."""
    return [m for m in model.modules() if isinstance(m, DenseOrMoEMLP)]


def moe_layers(model: torch.nn.Module) -> list[DroplessMoE]:
    """The DroplessMoE layers of ``model`` in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, DroplessMoE)]
