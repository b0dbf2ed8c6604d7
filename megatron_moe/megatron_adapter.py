"""megatron-core GPT with our MoE: the one module that imports megatron.core for the model.

A megatron-core layer spec (megatron-core's local GPT layer spec, ``get_gpt_layer_local_spec()``)
with two submodules replaced:

* core attention -> ``megatron_moe.attention.SDPAttention`` (torch's scaled_dot_product_attention:
  flash attention on the GPU, runs on the CPU), for dense and MoE models alike;
* the MLP -> :class:`MoEMLP`, which runs, per layer (``ModelConfig.moe_config(layer_number)``),
  megatron-core's dense ``MLP`` (gelu (tanh) or swiglu, biases), our dropless ``DroplessMoE``
  (mlp_impl blocksparse / grouped / reference) or the capacity-factor MoE (mlp_impl capacity),
  and returns ``(output, None)`` as megatron-core expects.

``build_gpt_model`` also gives the model our fused LM cross-entropy
(``megatron_moe.ops.cross_entropy``: one pass over the bf16 logits forward, one backward, no
fp32 copy of the [tokens, vocab] logits) in place of megatron-core's
``vocab_parallel_cross_entropy`` (same loss; tensor-parallel size 1). Models that Megatron-LM
builds from ``layer_spec`` keep megatron-core's loss.

The MoE layer's aux loss (load balancing + z-loss) reaches the LM loss's gradient: the MLP
output passes through an autograd function that returns it unchanged and, in backward, gives the
aux loss the gradient ``aux_loss_scale`` (``set_aux_loss_scale``, default 1.0; the train loop sets
1 / num_micro_batches), so a plain ``lm_loss.backward()`` trains the router. Expert weights carry
``expert_parallel = True`` (ours) and ``allreduce = False`` (megatron-core's mark of expert params).

Use from Python (the training program does this)::

    torch.distributed.init_process_group("gloo")   # or "nccl"; torchrun sets the environment
    from megatron_moe.megatron_adapter import init_megatron, build_gpt_model, moe_layers
    init_megatron(seed=1234)                         # TP = PP = 1 model-parallel state, RNG seeds
    model = build_gpt_model(model_cfg)               # fp32 params on the current device
    loss_bs = model(tokens_bs, position_ids_bs, attention_mask=None, labels=labels_bs)  # [b, s]
    loss_bs.mean().backward()                        # LM loss + aux losses (router included)
    [layer.tokens_per_expert for layer in moe_layers(model)]

bf16: the model is built with fp32 params; training (megatron_moe/precision.py) swaps bf16 copies
of them in for each forward, so every module simply runs in bf16. The other way, forward + loss
under ``torch.autocast(device_type, dtype=torch.bfloat16)`` over the fp32 params
(``train.bf16_params=false``), also works: megatron-core's own linear autograd function
(ColumnParallelLinear / RowParallelLinear) has custom_fwd/custom_bwd bound to CUDA: on a GPU it
works under autocast, on the CPU its backward fails (bf16 gradient times fp32 weight). So the
spec uses ``ColumnLinear`` / ``RowLinear``, the same megatron-core layers (same parameters, init
and state dict) whose matmul is ``F.linear`` at tensor-parallel size 1 (megatron's function
otherwise), and GPTModel's output layer is switched the same way: autocast then works on every
device (tests/test_model.py checks forward + backward under CPU autocast).

CPU: ``init_megatron`` seeds torch / numpy / random everywhere but seeds megatron-core's CUDA RNG
tracker only when CUDA is available; nothing here needs the tracker on the CPU (dropout is 0, no
sequence parallelism, no activation recompute, SDPAttention never forks it; a test makes the
tracker raise and trains anyway). Params are created with ``use_cpu_initialization=True`` there,
and megatron-core's RotaryEmbedding (which moves its table to ``torch.cuda.current_device()``) is
replaced by a CPU-safe subclass when CUDA is unavailable.

Limits: tensor-model-parallel size 1 for MoE layers (dense layers follow megatron-core), no
sequence/context parallelism, no dropout (the config has no dropout keys; MegaBlocks' scripts kept
Megatron-LM's default 0.1), LayerNorm, biases in attention and the dense MLP (none in the experts).

From Megatron-LM's own training script (``--spec <module> <attribute>``: Megatron-LM imports the
module and takes the attribute, a layer ``ModuleSpec``, as ``transformer_layer_spec``)::

    MEGATRON_MOE_CONFIG=configs/dmoe-xs.yaml \\
    MEGATRON_MOE_OVERRIDES="model.moe.mlp_impl=grouped" \\
    MEGATRON_MOE_AUX_LOSS_SCALE=0.0625 \\
    torchrun --nproc-per-node 8 pretrain_gpt.py --spec megatron_moe.megatron_adapter layer_spec \\
        --transformer-impl local --num-layers 6 --hidden-size 512 --num-attention-heads 8 \\
        --ffn-hidden-size 2048 --seq-length 1024 --max-position-embeddings 1024 \\
        --micro-batch-size 4 --global-batch-size 512 --bf16 ...     # (no --num-experts)

(0.0625 = 1 / (512 / (4 * 8)) micro-batches per step.)

Our MoE settings reach the layers through the environment, read when the model is built:
``MEGATRON_MOE_CONFIG`` (a run config YAML of this project; its ``model:`` section, with ``base:``
inheritance, is used), ``MEGATRON_MOE_OVERRIDES`` (optional ``key=value`` overrides, space
separated) and ``MEGATRON_MOE_AUX_LOSS_SCALE`` (optional: Megatron-LM divides the LM loss by the
number of micro-batches per step but its schedule only rescales its own MoE aux losses, and it
refuses ``--num-experts`` together with ``--spec``, so set 1 / num_micro_batches here).
Megatron-LM's model sizes must match the YAML's (a clear error says which does not). Under
Megatron-LM, ``expert_bias`` biases are not updated (call ``megatron_moe.update_expert_biases``
after the optimizer step if you use them).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import random
import shlex
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from .attention import SDPAttention
from .layer import DroplessMoE
from .ops.cross_entropy import lm_cross_entropy
from .parallel import init_parallel_groups
from .model_config import ModelConfig

ENV_CONFIG = "MEGATRON_MOE_CONFIG"
ENV_OVERRIDES = "MEGATRON_MOE_OVERRIDES"
ENV_AUX_LOSS_SCALE = "MEGATRON_MOE_AUX_LOSS_SCALE"

# ---------------------------------------------------------------------------------------------
# aux loss -> gradient
# ---------------------------------------------------------------------------------------------
_aux_loss_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """The gradient the MoE aux losses get in backward (1.0 = as if added to the loss; the
    train loop sets 1 / num_micro_batches, matching its scaling of the LM loss)."""
    global _aux_loss_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or scale < 0:
        raise ValueError(f"set_aux_loss_scale({scale!r}): expected a finite number >= 0")
    _aux_loss_scale = float(scale)


def get_aux_loss_scale() -> float:
    return _aux_loss_scale


class AuxLossToGrad(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` gets the gradient ``aux_loss_scale``.

    The gradient is given each time a backward pass runs through this node (as megatron-core's
    MoEAuxLossAutoScaler does): one ``loss.backward()`` per forward. A second differentiation
    through the same graph (``autograd.grad`` of another loss) would add it again."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.aux_device = aux_loss.shape, aux_loss.dtype, aux_loss.device
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, _aux_loss_scale, dtype=ctx.aux_dtype, device=ctx.aux_device)
        return grad_output, grad_aux


# ---------------------------------------------------------------------------------------------
# linear layers
# ---------------------------------------------------------------------------------------------
def _linear_forward(base_impl, layer, input, weight, bias=None, **kwargs):
    """``F.linear`` when nothing tensor-parallel is asked for (TP = 1, no sequence parallelism,
    no fused grad accumulation), else megatron-core's own implementation ``base_impl``.

    megatron-core's linear autograd function is decorated with custom_fwd/custom_bwd bound to
    device_type="cuda": under CPU autocast its backward multiplies a bf16 gradient with the fp32
    weight and fails. F.linear is the same math and autocasts on every device."""
    if (kwargs.get("gradient_accumulation_fusion") or kwargs.get("allreduce_dgrad")
            or kwargs.get("sequence_parallel") or kwargs.get("grad_output_buffer") is not None):
        return base_impl(layer, input, weight, bias=bias, **kwargs)
    return F.linear(input, weight, bias)


class ColumnLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear; plain F.linear at TP = 1 (see _linear_forward)."""

    def _forward_impl(self, input, weight, bias=None, **kwargs):
        return _linear_forward(ColumnParallelLinear._forward_impl, self, input, weight, bias, **kwargs)


class RowLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear; plain F.linear at TP = 1 (see _linear_forward)."""

    def _forward_impl(self, input, weight, bias=None, **kwargs):
        return _linear_forward(RowParallelLinear._forward_impl, self, input, weight, bias, **kwargs)


# ---------------------------------------------------------------------------------------------
# the MLP submodule
# ---------------------------------------------------------------------------------------------
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2 / the paper; also what our experts use)."""
    return F.gelu(x, approximate="tanh")


def _init_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class MoEMLP(MegatronModule):
    """The MLP of one transformer layer: megatron-core's dense MLP or our MoE, by layer number.

    Built from a ModuleSpec: ``ModuleSpec(MoEMLP, params={"model_cfg": cfg})``. The layer number
    comes from ``params["layer_number"]`` or, as megatron-core's TransformerLayer does for every
    MLP right after building it, from ``set_layer_number`` (global, 1-based, pipeline offset
    included). ``model_cfg=None`` reads the config named by ``$MEGATRON_MOE_CONFIG``.
    """

    def __init__(self, config: TransformerConfig, model_cfg: Optional[ModelConfig] = None,
                 layer_number: Optional[int] = None, **unused_kwargs):
        super().__init__(config=config)
        if model_cfg is None:
            model_cfg = model_config_from_env()
        if not isinstance(model_cfg, ModelConfig):
            raise TypeError(f"MoEMLP(model_cfg=...): expected a ModelConfig, got {type(model_cfg).__name__}")
        _check_matches(model_cfg, config)
        self.model_cfg = model_cfg
        self.layer_number: Optional[int] = None
        self.dense: Optional[MLP] = None
        self.moe: Optional[DroplessMoE] = None
        if layer_number is not None:
            self.set_layer_number(layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        if self.layer_number is not None:
            if layer_number != self.layer_number:
                raise RuntimeError(f"MoEMLP was built for layer {self.layer_number}; "
                                   f"cannot change it to {layer_number}")
            return
        moe_cfg = self.model_cfg.moe_config(layer_number)
        self.layer_number = layer_number
        if moe_cfg is None:
            self.dense = MLP(
                self.config,
                MLPSubmodules(linear_fc1=ColumnLinear, linear_fc2=RowLinear),
                ffn_hidden_size=self.model_cfg.ffn_hidden_size,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
            )
        else:
            tp = parallel_state.get_tensor_model_parallel_world_size() \
                if parallel_state.model_parallel_is_initialized() else 1
            if tp != 1:
                raise ValueError(f"megatron-moe MoE layers need tensor-model-parallel size 1, got {tp} "
                                 "(--tensor-model-parallel-size 1; data parallelism is fine)")
            ep = self.model_cfg.moe.expert_parallel_size
            ep_group = init_parallel_groups(ep, moe_cfg.num_experts).ep_group if ep > 1 else None
            with torch.device(_init_device(self.config)):
                self.moe = DroplessMoE(moe_cfg, ep_group=ep_group)
            for p in self.moe.experts.parameters():
                p.allreduce = False  # megatron-core's mark of expert params
                p.expert_parallel = True

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def forward(self, hidden_states: torch.Tensor, padding_mask=None, **unused_kwargs):
        if self.layer_number is None:
            raise RuntimeError("MoEMLP.forward before set_layer_number: build it inside a "
                               "megatron-core TransformerLayer or pass params={'layer_number': n}")
        if self.moe is None:
            out, bias = self.dense(hidden_states)
            if bias is not None:
                out = out + bias
            return out, None
        out = self.moe(hidden_states)
        aux = self.moe.aux_loss
        if torch.is_grad_enabled() and aux is not None and aux.requires_grad:
            out = AuxLossToGrad.apply(out, aux)
        return out, None


def _check_matches(model_cfg: ModelConfig, config: TransformerConfig) -> None:
    """The megatron TransformerConfig and our ModelConfig must describe the same layer."""
    pairs = [("hidden_size", model_cfg.hidden_size, config.hidden_size, "--hidden-size"),
             ("ffn_hidden_size", model_cfg.ffn_hidden_size, config.ffn_hidden_size, "--ffn-hidden-size"),
             ("num_layers", model_cfg.num_layers, config.num_layers, "--num-layers")]
    for key, ours, theirs, flag in pairs:
        if ours != theirs:
            raise ValueError(f"model.{key}={ours} in the megatron-moe config but megatron's "
                             f"TransformerConfig has {key}={theirs} ({flag}): make them equal")
    gated = model_cfg.activation == "swiglu"
    if bool(config.gated_linear_unit) != gated:
        raise ValueError(f"model.activation={model_cfg.activation!r} in the megatron-moe config but "
                         f"megatron's gated_linear_unit={config.gated_linear_unit} (--swiglu): make them agree")


_env_config_cache: dict = {}


def model_config_from_env() -> ModelConfig:
    """The ``model:`` section of the run config named by $MEGATRON_MOE_CONFIG (+ $MEGATRON_MOE_OVERRIDES)."""
    path = os.environ.get(ENV_CONFIG)
    if not path:
        raise RuntimeError(f"megatron_moe layer_spec needs the model config: set {ENV_CONFIG}=path/to/"
                           "config.yaml (a megatron-moe run config, e.g. configs/dmoe-xs.yaml)")
    overrides = os.environ.get(ENV_OVERRIDES, "")
    key = (os.path.abspath(path), overrides)
    if key not in _env_config_cache:  # every layer asks: load the YAML once
        from .run_config import load_config

        _env_config_cache[key] = load_config(path, shlex.split(overrides)).model
    cfg = _env_config_cache[key]
    scale = os.environ.get(ENV_AUX_LOSS_SCALE)
    if scale:
        try:
            set_aux_loss_scale(float(scale))
        except ValueError:
            raise ValueError(f"{ENV_AUX_LOSS_SCALE}={scale!r} is invalid: expected a number >= 0 "
                             "(1 / micro-batches per step)") from None
    return cfg


# ---------------------------------------------------------------------------------------------
# specs and the model
# ---------------------------------------------------------------------------------------------
def moe_layer_spec(model_cfg: Optional[ModelConfig] = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with SDPAttention and MoEMLP (``model_cfg=None``:
    read from $MEGATRON_MOE_CONFIG when the layers are built)."""
    spec = get_gpt_layer_local_spec()
    sub = spec.submodules
    attn = sub.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, linear_qkv=ColumnLinear, core_attention=SDPAttention, linear_proj=RowLinear))
    mlp = ModuleSpec(module=MoEMLP, params={"model_cfg": model_cfg})
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp))


# The attribute for Megatron-LM: pretrain_gpt.py --spec megatron_moe.megatron_adapter layer_spec
layer_spec = moe_layer_spec()


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
        raise RuntimeError("build_gpt_model: call megatron_moe.megatron_adapter.init_megatron(seed) first")
    tcfg = transformer_config(model_cfg)
    with _quiet_unknown_mlp_warning():
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=moe_layer_spec(model_cfg),
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
        model.output_layer._forward_impl = functools.partial(
            _linear_forward, ColumnParallelLinear._forward_impl, model.output_layer)
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


def moe_mlps(model: torch.nn.Module) -> list[MoEMLP]:
    """Every MoEMLP (dense or MoE) in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def moe_layers(model: torch.nn.Module) -> list[DroplessMoE]:
    """The DroplessMoE layers of ``model`` in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, DroplessMoE)]


__all__ = ["init_megatron", "build_gpt_model", "moe_layers", "moe_mlps", "set_aux_loss_scale",
           "get_aux_loss_scale", "moe_layer_spec", "layer_spec", "transformer_config", "MoEMLP",
           "AuxLossToGrad", "ColumnLinear", "RowLinear", "SDPAttention", "model_config_from_env"]
