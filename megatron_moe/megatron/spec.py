"""The layer spec: megatron-core's local GPT layer with our attention and our MoE as its MLP.

    spec = moe_layer_spec(model_cfg)      # a ModuleSpec for megatron-core's TransformerLayer
    # or, from Megatron-LM: pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec

megatron-core's local GPT layer spec (``get_gpt_layer_local_spec()``) with these submodules
replaced:

* core attention -> :class:`~megatron_moe.megatron.attention.SDPAttention` (torch's
  scaled_dot_product_attention: flash attention on the GPU, runs on the CPU);
* the MLP -> :class:`DenseOrMoEMLP`, which runs, per layer (``ModelConfig.moe_config(layer_number)``),
  megatron-core's dense ``MLP`` or our ``DroplessMoE`` (any ``mlp_impl``, the capacity-factor
  MoE included), and returns ``(output, None)`` as megatron-core expects.
* the two norms -> :class:`~megatron_moe.megatron.norm.LayerNorm` (torch's LayerNorm, the same
  parameters and keys; the Triton kernels on a GPU).

The MoE layer's aux loss (load balancing + z-loss) reaches the LM loss's gradient: the MLP
output passes through an autograd function that returns it unchanged and, in backward, gives the
aux loss the gradient the LM loss has (aux_loss.py: derived at run time from megatron-core's
schedule; our training program fixes it with ``set_aux_loss_scale``), so a plain
``lm_loss.backward()`` trains the router. Expert weights carry ``expert_parallel = True`` (ours)
and ``allreduce = False`` (megatron-core's mark of expert params: its DDP reduces them over the
expert-data-parallel group, its optimizer and gradient clipping count them in the expert groups).

Linear layers: megatron-core's own linear autograd function has custom_fwd/custom_bwd bound to
CUDA, so under CPU autocast its backward fails (bf16 gradient times fp32 weight). The spec uses
``ColumnLinear`` / ``RowLinear``: the same megatron-core layers (same parameters, init and state
dict) whose matmul is ``F.linear`` when nothing tensor-parallel is asked for.

From Megatron-LM's own training script (``--spec <module> <attribute>``: Megatron-LM imports the
module and takes the attribute, a layer ``ModuleSpec``, as ``transformer_layer_spec``), configured
by Megatron's own MoE flags (flags.py maps them onto our layer)::

    torchrun --nproc-per-node 8 pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec \\
        --num-experts 64 --moe-router-topk 1 --moe-router-pre-softmax --moe-aux-loss-coeff 0.0166667 \\
        --transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion \\
        --num-layers 6 --hidden-size 512 ...

Megatron's ``--gradient-accumulation-fusion`` (on by default) works without Apex: importing this
module gives megatron-core's linear layers a stand-in for Apex's extension, and our experts add
their weight gradients straight into Megatron's fp32 ``main_grad`` buffers (grad_accum.py).

Our settings that Megatron has no flag for (``mlp_impl``, ``block_size``, ...) come from
``MEGATRON_MOE_CONFIG`` (a run config of this project, by path or shipped name: its ``model:``
section) and ``MEGATRON_MOE_OVERRIDES`` (``key=value`` pairs, space separated), both optional
with ``--num-experts``; without ``--num-experts`` the config gives the MoE settings (and no MoE
section means dense layers: our SDPA attention with megatron-core's MLP). Expert biases
(``--moe-router-enable-expert-bias``) are updated by megatron-core's ``finalize_model_grads``
after each backward, as for its own router; Megatron's distributed checkpoints hold our experts
as shards of the expert-parallel-size-1 tensors (``DenseOrMoEMLP.sharded_state_dict``).

Limits: tensor-model-parallel size 1 for MoE layers (dense layers follow megatron-core), no
sequence/context parallelism, no dropout, LayerNorm, biases in attention and the dense MLP (none
in the experts).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shlex
from typing import Optional

from megatron_moe.megatron import require

require("megatron")  # megatron-core, before its imports below

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe.layer import DroplessMoE
from megatron_moe.ops.linear import linear, linear_gelu
from megatron_moe.parallel import init_parallel_groups

from .attention import SDPAttention
from .aux_loss import AuxLossToGrad, get_aux_loss_scale, log_aux_losses, set_aux_loss_scale
from .flags import resolve_model_config
from .grad_accum import attach_main_grad_sinks, install_wgrad_accumulation
from .model_config import ModelConfig
from .norm import LayerNorm
from .yaml_config import ConfigError, apply_overrides, build_dataclass, find_config, read_config_file

__all__ = ["moe_layer_spec", "layer_spec", "DenseOrMoEMLP", "AuxLossToGrad", "ColumnLinear", "RowLinear",
           "set_aux_loss_scale", "get_aux_loss_scale", "model_config_from_env", "gelu_tanh",
           "use_plain_linear"]

# Megatron-LM's --gradient-accumulation-fusion (its default) without Apex: grad_accum.py
install_wgrad_accumulation()

ENV_CONFIG = "MEGATRON_MOE_CONFIG"
ENV_OVERRIDES = "MEGATRON_MOE_OVERRIDES"
ENV_AUX_LOSS_SCALE = "MEGATRON_MOE_AUX_LOSS_SCALE"


# ---------------------------------------------------------------------------------------------
# linear layers
# ---------------------------------------------------------------------------------------------
def _linear_forward(base_impl, layer, input, weight, bias=None, **kwargs):
    """``F.linear`` when nothing tensor-parallel is asked for (TP = 1, no sequence parallelism,
    no fused grad accumulation), else megatron-core's own implementation ``base_impl``.

    megatron-core's linear autograd function is decorated with custom_fwd/custom_bwd bound to
    device_type="cuda": under CPU autocast its backward multiplies a bf16 gradient with the fp32
    weight and fails. F.linear is the same math and autocasts on every device; with a bias,
    megatron_moe/ops/linear.py's ``linear`` (F.linear, the bias gradient summed by our kernel)."""
    if (kwargs.get("gradient_accumulation_fusion") or kwargs.get("allreduce_dgrad")
            or kwargs.get("sequence_parallel") or kwargs.get("grad_output_buffer") is not None):
        return base_impl(layer, input, weight, bias=bias, **kwargs)
    return linear(input, weight, bias)


ENV_BIAS_IN_GEMM = "MEGATRON_MOE_BIAS_IN_GEMM"


def _bias_in_gemm(layer, partition_size: int, full_size: int) -> bool:
    """Whether a linear layer whose bias megatron-core adds after the GEMM (a layer that hands it
    back, ``skip_bias_add``, to the MLP or the residual's bias-dropout-add; or a row-parallel
    layer after its all-reduce) may add it inside the GEMM instead: it has a bias, the layer is
    whole (TP = 1), nothing tensor-parallel or fused is asked for, and
    ``MEGATRON_MOE_BIAS_IN_GEMM`` is not "0". The add then happens in the GEMM's epilogue, not in
    a broadcast pass over the output (a read and a write of it). The layer returns
    ``(output + bias, None)``: megatron-core's MLP and bias-dropout-add take a None bias."""
    config = layer.config
    return (layer.bias is not None and partition_size == full_size
            and not (layer.sequence_parallel or layer.gradient_accumulation_fusion or layer.explicit_expert_comm
                     or getattr(config, "defer_embedding_wgrad_compute", False)
                     or getattr(config, "_cpu_offloading_context", None) is not None)
            and os.environ.get(ENV_BIAS_IN_GEMM, "1") != "0")


class ColumnLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear; plain F.linear at TP = 1 (see _linear_forward), with
    a handed-back bias added inside the GEMM (returned as None; see _bias_in_gemm)."""

    def bias_in_gemm(self) -> bool:
        """A handed-back bias goes inside the GEMM (_bias_in_gemm); the MLP's first layer keeps
        handing it back where megatron-core fuses the bias into the activation
        (bias_activation_fusion, Megatron-LM's default)."""
        return (self.skip_bias_add and not self.config.bias_activation_fusion
                and _bias_in_gemm(self, self.output_size_per_partition, self.output_size))

    def forward(self, input_, weight=None, runtime_gather_output=None, then_gelu: bool = False):
        """``then_gelu`` (DenseMLP, only where :meth:`bias_in_gemm`): return gelu_tanh of the output,
        the layer and the GELU as one op (ops/linear.py's ``linear_gelu``)."""
        if weight is None and self.bias_in_gemm():
            if then_gelu:
                return linear_gelu(input_, self.weight, self.bias), None
            return linear(input_, self.weight, self.bias), None
        if then_gelu:
            raise ValueError("ColumnLinear(then_gelu=True) needs the bias inside the GEMM (bias_in_gemm())")
        return super().forward(input_, weight, runtime_gather_output)

    def _forward_impl(self, input, weight, bias=None, **kwargs):
        return _linear_forward(ColumnParallelLinear._forward_impl, self, input, weight, bias, **kwargs)


def use_plain_linear(layer: ColumnParallelLinear) -> None:
    """Give a ColumnParallelLinear built outside the spec (GPTModel's output layer) the forward of
    :class:`ColumnLinear`."""
    layer._forward_impl = functools.partial(_linear_forward, ColumnParallelLinear._forward_impl, layer)


class RowLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear; plain F.linear at TP = 1 (see _linear_forward), with
    a handed-back bias added inside the GEMM (returned as None; see _bias_in_gemm)."""

    def bias_in_gemm(self) -> bool:
        """The bias goes inside the GEMM (_bias_in_gemm)."""
        return _bias_in_gemm(self, self.input_size_per_partition, self.input_size)

    def forward(self, input_):
        if self.bias_in_gemm():
            return linear(input_, self.weight, self.bias), None
        return super().forward(input_)

    def _forward_impl(self, input, weight, bias=None, **kwargs):
        return _linear_forward(RowParallelLinear._forward_impl, self, input, weight, bias, **kwargs)


# ---------------------------------------------------------------------------------------------
# the MLP submodule
# ---------------------------------------------------------------------------------------------
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2 / the paper; also what our experts use)."""
    return F.gelu(x, approximate="tanh")


class DenseMLP(MLP):
    """megatron-core's MLP; where its first layer puts the bias inside the GEMM (ColumnLinear) and
    the activation is :func:`gelu_tanh` (not gated, no per-token scale), that layer and the GELU
    run as one op (megatron_moe/ops/linear.py's ``linear_gelu``: the GELU's backward and the
    first layer's bias gradient in one pass). Same parameters, same math."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        fc1 = self.linear_fc1
        if (per_token_scale is None and self.activation_func is gelu_tanh and not self.config.gated_linear_unit
                and isinstance(fc1, ColumnLinear) and fc1.bias_in_gemm()):
            act, _ = fc1(hidden_states, then_gelu=True)
            return self.linear_fc2(act)
        return super().forward(hidden_states, per_token_scale, **kwargs)


def _init_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class DenseOrMoEMLP(MegatronModule):
    """The MLP of one transformer layer: megatron-core's dense MLP or our MoE, by layer number.

    Built from a ModuleSpec: ``ModuleSpec(DenseOrMoEMLP, params={"model_cfg": cfg})``. The layer number
    comes from ``params["layer_number"]`` or, as megatron-core's TransformerLayer does for every
    MLP right after building it, from ``set_layer_number`` (global, 1-based, pipeline offset
    included). The layer's settings: ``resolve_model_config(config, model_cfg)`` (flags.py):
    Megatron's MoE flags where ``config.num_moe_experts`` is set, else ``model_cfg``;
    ``model_cfg=None`` reads $MEGATRON_MOE_CONFIG / $MEGATRON_MOE_OVERRIDES (optional with
    ``--num-experts``).

    Expert parallelism: with megatron-core's parallel state initialised with an
    expert-model-parallel size > 1, or ``num_moe_experts`` set, the experts are split over
    megatron-core's expert-model-parallel group (Megatron-LM's ``--expert-model-parallel-size``);
    otherwise over our own groups (``model.moe.expert_parallel_size``, our training program).
    """

    def __init__(self, config: TransformerConfig, model_cfg: Optional[ModelConfig] = None,
                 layer_number: Optional[int] = None, **unused_kwargs):
        super().__init__(config=config)
        if model_cfg is None:
            ours, source = _env_model_section()
            if config.num_moe_experts is None and not os.environ.get(ENV_CONFIG):
                raise RuntimeError(
                    f"megatron_moe layer_spec needs the MoE settings: Megatron's MoE flags "
                    f"(--num-experts ...) or {ENV_CONFIG}=path/to/config.yaml (a megatron-moe run "
                    "config, e.g. configs/dmoe-xs.yaml)")
        elif isinstance(model_cfg, ModelConfig):
            ours, source = model_cfg, "the ModelConfig given to the spec"
        else:
            raise TypeError(f"DenseOrMoEMLP(model_cfg=...): expected a ModelConfig, got {type(model_cfg).__name__}")
        self.model_cfg = resolve_model_config(config, ours, source)
        self.layer_number: Optional[int] = None
        self.dense: Optional[MLP] = None
        self.moe: Optional[DroplessMoE] = None
        self._edp_rank = 0
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
            self.dense = DenseMLP(
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
            ep_group = self._expert_parallel_group(moe_cfg.num_experts)
            with torch.device(_init_device(self.config)):
                self.moe = DroplessMoE(moe_cfg, ep_group=ep_group)
            for p in self.moe.experts.parameters():
                # megatron-core's mark of expert params: its DDP reduces their gradients over the
                # expert-data-parallel group, its optimizer keeps them in the expert param groups
                # (their grad norm summed over the expert-model-parallel group)
                p.allreduce = False
                p.expert_parallel = True  # ours (training/grad_reduce.py, checkpoints)

    def _expert_parallel_group(self, num_experts: int):
        """megatron-core's expert-model-parallel group, or ours (see the class docstring)."""
        ep = self.model_cfg.moe.expert_parallel_size
        megatron_ep = 1
        if parallel_state.model_parallel_is_initialized():
            megatron_ep = parallel_state.get_expert_model_parallel_world_size()
            etp = parallel_state.get_expert_tensor_parallel_world_size()
            if etp != 1:
                raise ValueError(f"megatron-moe MoE layers need expert-tensor-parallel size 1, got {etp} "
                                 "(--expert-tensor-parallel-size 1)")
        if megatron_ep > 1 or self.config.num_moe_experts is not None:
            if ep != megatron_ep:
                raise ValueError(
                    f"model.moe.expert_parallel_size={ep} but megatron-core's parallel state has "
                    f"expert-model-parallel size {megatron_ep} (--expert-model-parallel-size; "
                    "parallel_state.initialize_model_parallel(expert_model_parallel_size=...)): "
                    "make them equal")
            if ep == 1:
                return None
            self._edp_rank = parallel_state.get_expert_data_parallel_rank()
            return parallel_state.get_expert_model_parallel_group()
        if ep == 1:
            return None
        groups = init_parallel_groups(ep, num_experts)
        self._edp_rank = groups.rank // ep  # our expert-data-parallel groups: {j, j + P, j + 2P, ...}
        return groups.ep_group

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron-core's distributed checkpoint of this MLP: its default (every tensor replicated
        over data parallelism), with each expert weight under expert parallelism a shard of the
        EP = 1 tensor [E, ...] along the expert axis, replicated over the expert-data-parallel
        group, as megatron-core's own experts do. Checkpoints thus hold the same global tensors at
        any expert-parallel size."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.moe is not None and self.moe.ep_size > 1:
            axis = len(sharded_offsets)
            replica = (0, 0, self._edp_rank)  # the expert-data-parallel rank
            for name, param in self.moe.experts.named_parameters():
                key = f"{prefix}moe.experts.{name}"
                sharded[key] = ShardedTensor.from_rank_offsets(
                    key, param, *sharded_offsets, (axis, self.moe.ep_rank, self.moe.ep_size),
                    replica_id=replica, prepend_axis_num=axis)
        return sharded

    def _apply(self, fn, *args, **kwargs):
        # Megatron-LM's Float16Module casts every floating buffer to bf16/fp16; the router's
        # expert bias and the loads counted for it stay fp32 (as megatron-core's TopKRouter keeps
        # its expert_bias), so small bias updates and large counts are not rounded away.
        super()._apply(fn, *args, **kwargs)
        if self.moe is not None:
            router = self.moe.router
            for name in ("expert_bias", "local_tokens_per_expert"):
                buf = getattr(router, name)
                if buf.is_floating_point() and buf.dtype != torch.float32:
                    setattr(router, name, buf.float())
        return self

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
        if self.config.gradient_accumulation_fusion and self.training:
            # the experts' weight gradients go straight into Megatron's main_grad (grad_accum.py)
            attach_main_grad_sinks(self.moe.experts.parameters())
        out = self.moe(hidden_states)
        aux = self.moe.aux_loss
        if torch.is_grad_enabled() and aux is not None and aux.requires_grad:
            if self.config.calculate_per_token_loss:
                # Megatron divides every gradient by the global batch's token count: give the aux
                # loss this rank's token count, as megatron-core's router does
                aux = aux * (hidden_states.numel() // hidden_states.shape[-1])
            out = AuxLossToGrad.apply(out, aux, self.config)
            if self.training and self.config.num_moe_experts is not None:
                log_aux_losses(self.moe, self.layer_number, self.config)
        return out, None


_env_config_cache: dict = {}


def _env_model_section() -> tuple[Optional[dict], str]:
    """The ``model:`` mapping of $MEGATRON_MOE_CONFIG with $MEGATRON_MOE_OVERRIDES applied (only
    the keys they state), or None when neither is set; and how to name it in errors. Sets the aux
    loss scale from $MEGATRON_MOE_AUX_LOSS_SCALE when that is set."""
    scale = os.environ.get(ENV_AUX_LOSS_SCALE)
    if scale:
        try:
            set_aux_loss_scale(float(scale))
        except ValueError:
            raise ValueError(f"{ENV_AUX_LOSS_SCALE}={scale!r} is invalid: expected a number >= 0 "
                             "(1 / micro-batches per step; unset, it is derived at run time)") from None
    path = os.environ.get(ENV_CONFIG) or None
    overrides = os.environ.get(ENV_OVERRIDES, "")
    if path is None and not overrides.strip():
        return None, ""
    source = " + ".join(([f"{ENV_CONFIG}={path}"] if path else []) + ([f"{ENV_OVERRIDES}"] if overrides else []))
    key = (os.path.abspath(path) if path else None, overrides)
    if key not in _env_config_cache:  # every layer asks: load the YAML once
        try:
            data = read_config_file(find_config(path)) if path else {}
            _env_config_cache[key] = apply_overrides(data, shlex.split(overrides)).get("model") or {}
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return _env_config_cache[key], source


def model_config_from_env() -> ModelConfig:
    """The ModelConfig that $MEGATRON_MOE_CONFIG (+ $MEGATRON_MOE_OVERRIDES) states by itself,
    without Megatron's flags (the layers resolve it with them: :func:`resolve_model_config`)."""
    section, source = _env_model_section()
    if section is None:
        raise RuntimeError(f"set {ENV_CONFIG}=path/to/config.yaml (a megatron-moe run config, e.g. "
                           f"configs/dmoe-xs.yaml) or {ENV_OVERRIDES}")
    try:
        return build_dataclass(ModelConfig, section, "model")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


# ---------------------------------------------------------------------------------------------
# specs and the model
# ---------------------------------------------------------------------------------------------
def moe_layer_spec(model_cfg: Optional[ModelConfig] = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with SDPAttention, DenseOrMoEMLP and our LayerNorm
    (megatron_moe/megatron/norm.py; ``model_cfg=None``: read from $MEGATRON_MOE_CONFIG when the
    layers are built)."""
    spec = get_gpt_layer_local_spec()
    sub = spec.submodules
    attn = sub.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, linear_qkv=ColumnLinear, core_attention=SDPAttention, linear_proj=RowLinear))
    mlp = ModuleSpec(module=DenseOrMoEMLP, params={"model_cfg": model_cfg})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, self_attention=attn, mlp=mlp, input_layernorm=LayerNorm, pre_mlp_layernorm=LayerNorm))


# The attribute for Megatron-LM: pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec
layer_spec = moe_layer_spec()


