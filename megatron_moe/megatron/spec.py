"""The layer spec: megatron-core's local GPT layer with our attention and our MoE as its MLP.

    spec = moe_layer_spec(model_cfg)      # a ModuleSpec for megatron-core's TransformerLayer
    # or, from Megatron-LM: pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec

megatron-core's local GPT layer spec (``get_gpt_layer_local_spec()``) with two submodules
replaced:

* core attention -> :class:`~megatron_moe.megatron.attention.SDPAttention` (torch's
  scaled_dot_product_attention: flash attention on the GPU, runs on the CPU);
* the MLP -> :class:`DenseOrMoEMLP`, which runs, per layer (``ModelConfig.moe_config(layer_number)``),
  megatron-core's dense ``MLP`` or our ``DroplessMoE`` (any ``mlp_impl``, the capacity-factor
  MoE included), and returns ``(output, None)`` as megatron-core expects.

The MoE layer's aux loss (load balancing + z-loss) reaches the LM loss's gradient: the MLP
output passes through an autograd function that returns it unchanged and, in backward, gives the
aux loss the gradient ``aux_loss_scale`` (``set_aux_loss_scale``, default 1.0; the training
program sets 1 / num_micro_batches), so a plain ``lm_loss.backward()`` trains the router. Expert
weights carry ``expert_parallel = True`` (ours) and ``allreduce = False`` (megatron-core's mark of
expert params).

Linear layers: megatron-core's own linear autograd function has custom_fwd/custom_bwd bound to
CUDA, so under CPU autocast its backward fails (bf16 gradient times fp32 weight). The spec uses
``ColumnLinear`` / ``RowLinear``: the same megatron-core layers (same parameters, init and state
dict) whose matmul is ``F.linear`` when nothing tensor-parallel is asked for.

From Megatron-LM's own training script (``--spec <module> <attribute>``: Megatron-LM imports the
module and takes the attribute, a layer ``ModuleSpec``, as ``transformer_layer_spec``)::

    MEGATRON_MOE_CONFIG=dmoe-xs \\
    MEGATRON_MOE_AUX_LOSS_SCALE=0.0625 \\
    torchrun --nproc-per-node 8 pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec \\
        --transformer-impl local --num-layers 6 --hidden-size 512 --num-attention-heads 8 \\
        --ffn-hidden-size 2048 --seq-length 1024 --max-position-embeddings 1024 \\
        --micro-batch-size 4 --global-batch-size 512 --bf16 \\
        --no-persist-layer-norm --no-masked-softmax-fusion ...     # (no --num-experts)

(0.0625 = 1 / (512 / (4 * 8)) micro-batches per step.) Our MoE settings reach the layers through
the environment, read when the model is built: ``MEGATRON_MOE_CONFIG`` (a run config of this
project, by path or shipped name; its ``model:`` section, with ``base:`` inheritance, is used),
``MEGATRON_MOE_OVERRIDES`` (optional ``key=value`` overrides, space separated) and
``MEGATRON_MOE_AUX_LOSS_SCALE`` (optional: Megatron-LM divides the LM loss by the number of
micro-batches per step but its schedule only rescales its own MoE aux losses, and it refuses
``--num-experts`` together with ``--spec``, so set 1 / num_micro_batches here). Megatron-LM's model
sizes must match the config's (a clear error says which does not). Under Megatron-LM,
``expert_bias`` biases are not updated (call ``megatron_moe.update_expert_biases`` after the
optimizer step if you use them).

Limits: tensor-model-parallel size 1 for MoE layers (dense layers follow megatron-core), no
sequence/context parallelism, no dropout, LayerNorm, biases in attention and the dense MLP (none
in the experts).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
from typing import Optional

from megatron_moe.megatron import require

require("megatron")  # megatron-core, before its imports below

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe.layer import DroplessMoE
from megatron_moe.parallel import init_parallel_groups

from .attention import SDPAttention
from .model_config import ModelConfig
from .yaml_config import ConfigError, apply_overrides, build_dataclass, find_config, read_config_file

__all__ = ["moe_layer_spec", "layer_spec", "DenseOrMoEMLP", "AuxLossToGrad", "ColumnLinear", "RowLinear",
           "set_aux_loss_scale", "get_aux_loss_scale", "model_config_from_env", "gelu_tanh",
           "use_plain_linear"]

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


def use_plain_linear(layer: ColumnParallelLinear) -> None:
    """Give a ColumnParallelLinear built outside the spec (GPTModel's output layer) the forward of
    :class:`ColumnLinear`."""
    layer._forward_impl = functools.partial(_linear_forward, ColumnParallelLinear._forward_impl, layer)


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


class DenseOrMoEMLP(MegatronModule):
    """The MLP of one transformer layer: megatron-core's dense MLP or our MoE, by layer number.

    Built from a ModuleSpec: ``ModuleSpec(DenseOrMoEMLP, params={"model_cfg": cfg})``. The layer number
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
            raise TypeError(f"DenseOrMoEMLP(model_cfg=...): expected a ModelConfig, got {type(model_cfg).__name__}")
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
                raise RuntimeError(f"DenseOrMoEMLP was built for layer {self.layer_number}; "
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
            raise RuntimeError("DenseOrMoEMLP.forward before set_layer_number: build it inside a "
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
        try:
            data = apply_overrides(read_config_file(find_config(path)), shlex.split(overrides))
            _env_config_cache[key] = build_dataclass(ModelConfig, data.get("model") or {}, "model")
        except ConfigError as e:
            raise ConfigError(f"{ENV_CONFIG}={path}: {e}") from None
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
    """megatron-core's local GPT layer spec with SDPAttention and DenseOrMoEMLP (``model_cfg=None``:
    read from $MEGATRON_MOE_CONFIG when the layers are built)."""
    spec = get_gpt_layer_local_spec()
    sub = spec.submodules
    attn = sub.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, linear_qkv=ColumnLinear, core_attention=SDPAttention, linear_proj=RowLinear))
    mlp = ModuleSpec(module=DenseOrMoEMLP, params={"model_cfg": model_cfg})
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp))


# The attribute for Megatron-LM: pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec
layer_spec = moe_layer_spec()


