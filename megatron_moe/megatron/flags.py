"""Megatron's MoE flags and our model config: one description of the model from both.

Under Megatron-LM, ``--num-experts`` and the ``--moe-*`` flags land in megatron-core's
``TransformerConfig`` (``num_moe_experts``, ``moe_router_topk``, ...), which every layer built
from our spec receives. Where a flag means what a field of our ``model:`` section means, it
configures our layer (the table below). Our settings that have no Megatron flag (``mlp_impl``,
``block_size``, ``a2a_splits``, ``recompute_activation``, ...) come from our config:
``$MEGATRON_MOE_CONFIG`` / ``$MEGATRON_MOE_OVERRIDES`` (spec.py), else their defaults.

    model_cfg = resolve_model_config(transformer_config, ours, source="MEGATRON_MOE_CONFIG=x.yaml")

Precedence (:func:`resolve_model_config`):
  * With ``num_moe_experts`` set (``--num-experts``), the TransformerConfig gives every mapped
    MoE field, its defaults included (they are what Megatron-LM itself logs and counts FLOPs
    with). Without it, the MoE settings come from our config alone (our training program, and
    Megatron-LM without ``--num-experts``).
  * The model's sizes (layers, hidden, heads, ffn, activation, init std) always come from the
    TransformerConfig.
  * Our config may repeat a mapped field: the same value is fine, another is an error naming
    both. A ``ModelConfig`` object states every field; a config file only the keys it has
    (``base:`` chain and overrides included).
  * Megatron MoE options our layer does not have (other load-balancing types, capacity factor,
    group-limited routing, ...) are refused with the flag's name; options that only choose
    among megatron-core's own MoE implementations (dispatcher, grouped GEMM, fusions) do not
    apply to our layer and are ignored.

| our key | TransformerConfig field | Megatron-LM flag |
|---|---|---|
| model.num_layers, hidden_size, num_attention_heads, ffn_hidden_size, init_method_std | same names | --num-layers, --hidden-size, ... |
| model.activation (gelu / swiglu) | gated_linear_unit, activation_func | --swiglu |
| model.moe.num_experts | num_moe_experts | --num-experts |
| model.moe.top_k | moe_router_topk | --moe-router-topk |
| model.moe.aux_loss_coeff | moe_aux_loss_coeff (0 with load balancing 'none') | --moe-aux-loss-coeff |
| model.moe.z_loss_coeff | moe_z_loss_coeff (None = 0) | --moe-z-loss-coeff |
| model.moe.ffn_hidden_size | moe_ffn_hidden_size | --moe-ffn-hidden-size |
| model.moe.moe_layer_freq | moe_layer_freq (an int, or a list with that int's pattern) | --moe-layer-freq |
| model.moe.score_function | moe_router_score_function | --moe-router-score-function |
| model.moe.normalize_top_k | softmax: not moe_router_pre_softmax; sigmoid: top_k > 1 | --moe-router-pre-softmax |
| model.moe.jitter_eps | moe_input_jitter_eps (None = 0) | --moe-input-jitter-eps |
| model.moe.expert_bias | moe_router_enable_expert_bias | --moe-router-enable-expert-bias |
| model.moe.expert_bias_update_rate | moe_router_bias_update_rate | --moe-router-bias-update-rate |
| model.moe.shared_expert_ffn_hidden_size | moe_shared_expert_intermediate_size (None = 0) | --moe-shared-expert-intermediate-size |
| model.moe.expert_parallel_size | expert_model_parallel_size | --expert-model-parallel-size |
"""  # noqa: E501 (the table rows above)
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Union

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from .model_config import ModelConfig

__all__ = ["resolve_model_config", "megatron_model_values", "megatron_moe_values"]


class _Mapped:
    """One field of ours as Megatron states it: its value, and how to name it in an error."""

    def __init__(self, value: Any, field: str, flag: str):
        self.value, self.field, self.flag = value, field, flag


def _activation(config: TransformerConfig) -> Optional[str]:
    """'swiglu' (gated silu), 'gelu' (erf or tanh form: our experts use the tanh form), else None."""
    fn = config.activation_func
    if config.gated_linear_unit:
        return "swiglu" if fn is F.silu else None
    name = getattr(fn, "__name__", "")  # F.gelu, megatron's erf_gelu / openai_gelu, our gelu_tanh
    return "gelu" if "gelu" in name and "quick" not in name else None


def megatron_model_values(config: TransformerConfig) -> dict[str, _Mapped]:
    """The model-level fields of ours that the TransformerConfig states."""
    act = _activation(config)
    values = {name: _Mapped(getattr(config, name), name, "--" + name.replace("_", "-"))
              for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                           "init_method_std")}
    fn = getattr(config.activation_func, "__name__", repr(config.activation_func))
    values["activation"] = _Mapped(act, f"gated_linear_unit={config.gated_linear_unit}, activation_func={fn}",
                                   "--swiglu")
    return values


# (TransformerConfig field, the value it must have, the flag) for Megatron MoE options our layer
# does not have: a different value is refused.
_UNSUPPORTED = [
    ("moe_expert_capacity_factor", None, "--moe-expert-capacity-factor (our layer is dropless; the "
     "capacity-factor baseline is model.moe.mlp_impl=capacity with model.moe.capacity_factor in our config)"),
    ("moe_router_topk_scaling_factor", (None, 1.0), "--moe-router-topk-scaling-factor"),
    ("moe_router_num_groups", None, "--moe-router-num-groups"),
    ("moe_router_group_topk", None, "--moe-router-group-topk"),
    ("moe_router_topk_limited_devices", None, "--moe-router-topk-limited-devices"),
    ("moe_router_dtype", (None, "fp32"), "--moe-router-dtype (our router's logits are fp32)"),
    ("moe_router_force_load_balancing", False, "--moe-router-force-load-balancing"),
    ("moe_shared_expert_gate", False, "--moe-shared-expert-gate"),
    ("moe_latent_size", None, "--moe-latent-size"),
    ("moe_enable_routing_replay", False, "--moe-enable-routing-replay"),
    ("moe_apply_probs_on_input", False, "--moe-apply-probs-on-input"),
    ("expert_tensor_parallel_size", (None, 1), "--expert-tensor-parallel-size (MoE layers need 1)"),
]


def _check_supported(config: TransformerConfig) -> None:
    for field, allowed, flag in _UNSUPPORTED:
        value = getattr(config, field, None)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise ValueError(f"megatron's TransformerConfig has {field}={value!r} ({flag}): "
                             "megatron-moe's layer does not support it; leave the flag out")
    balancing = config.moe_router_load_balancing_type
    if balancing not in ("aux_loss", "none", ["aux_loss"], ["none"]):
        raise ValueError(f"megatron's TransformerConfig has moe_router_load_balancing_type={balancing!r} "
                         "(--moe-router-load-balancing-type): megatron-moe's router has the Switch "
                         "load-balancing loss per micro-batch ('aux_loss') or none ('none')")


def _single(value, field: str, flag: str):
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"megatron's TransformerConfig has {field}={value!r} ({flag}): one value expected")
        return value[0]
    return value


def _layer_freq(config: TransformerConfig) -> int:
    """``moe_layer_freq`` as our int: an int, or a list that is an int's pattern (layer i, 0-based,
    is MoE iff i % N == 0)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return freq
    pattern = [int(bool(v)) for v in freq]
    for n in range(1, len(pattern) + 1):
        if pattern == [int(i % n == 0) for i in range(len(pattern))]:
            return n
    raise ValueError(f"megatron's TransformerConfig has moe_layer_freq={list(freq)} (--moe-layer-freq): "
                     "megatron-moe places MoE layers every N layers starting with the first "
                     "(an int N, or its pattern [1, 0, ..., 1, 0, ...])")


def megatron_moe_values(config: TransformerConfig) -> dict[str, _Mapped]:
    """The ``model.moe`` fields of ours that a TransformerConfig with ``num_moe_experts`` states."""
    _check_supported(config)
    c = config
    topk = c.moe_router_topk
    aux = _single(c.moe_aux_loss_coeff, "moe_aux_loss_coeff", "--moe-aux-loss-coeff")
    if _single(c.moe_router_load_balancing_type, "moe_router_load_balancing_type",
               "--moe-router-load-balancing-type") == "none":
        aux = 0.0
    if c.moe_router_score_function == "softmax":
        normalize = _Mapped(not c.moe_router_pre_softmax, f"moe_router_pre_softmax={c.moe_router_pre_softmax} "
                            "(softmax after top-k renormalises the top-k weights; before it does not)",
                            "--moe-router-pre-softmax")
    else:
        normalize = _Mapped(topk > 1, f"moe_router_score_function='sigmoid' with moe_router_topk={topk} "
                            "(Megatron renormalises sigmoid top-k weights when top-k > 1)",
                            "--moe-router-topk")
    m = {
        "num_experts": _Mapped(c.num_moe_experts, "num_moe_experts", "--num-experts"),
        "top_k": _Mapped(topk, "moe_router_topk", "--moe-router-topk"),
        "aux_loss_coeff": _Mapped(float(aux), "moe_aux_loss_coeff", "--moe-aux-loss-coeff"),
        "z_loss_coeff": _Mapped(float(c.moe_z_loss_coeff or 0.0), "moe_z_loss_coeff", "--moe-z-loss-coeff"),
        "ffn_hidden_size": _Mapped(c.moe_ffn_hidden_size or c.ffn_hidden_size, "moe_ffn_hidden_size",
                                   "--moe-ffn-hidden-size"),
        "moe_layer_freq": _Mapped(_layer_freq(c), "moe_layer_freq", "--moe-layer-freq"),
        "score_function": _Mapped(c.moe_router_score_function, "moe_router_score_function",
                                  "--moe-router-score-function"),
        "normalize_top_k": normalize,
        "jitter_eps": _Mapped(float(c.moe_input_jitter_eps or 0.0), "moe_input_jitter_eps",
                              "--moe-input-jitter-eps"),
        "expert_bias": _Mapped(bool(c.moe_router_enable_expert_bias), "moe_router_enable_expert_bias",
                               "--moe-router-enable-expert-bias"),
        "expert_bias_update_rate": _Mapped(float(c.moe_router_bias_update_rate), "moe_router_bias_update_rate",
                                           "--moe-router-bias-update-rate"),
        "shared_expert_ffn_hidden_size": _Mapped(c.moe_shared_expert_intermediate_size or 0,
                                                 "moe_shared_expert_intermediate_size",
                                                 "--moe-shared-expert-intermediate-size"),
        "expert_parallel_size": _Mapped(c.expert_model_parallel_size, "expert_model_parallel_size",
                                        "--expert-model-parallel-size"),
    }
    for key, mapped in m.items():
        if key.endswith("_coeff") and mapped.value < 0:
            raise ValueError(f"megatron's TransformerConfig has {mapped.field}={mapped.value} ({mapped.flag}): "
                             "expected >= 0")
    return m


def _yaml(value) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def _disagree(key: str, ours, source: str, mapped: _Mapped, suggest: bool = True) -> ValueError:
    theirs = mapped.field if "=" in mapped.field else f"{mapped.field}={mapped.value!r}"
    hint = ""
    if suggest and source.startswith("MEGATRON_MOE_"):
        hint = f" (e.g. MEGATRON_MOE_OVERRIDES='{key}={_yaml(mapped.value)}')"
    return ValueError(f"{key}={ours!r} in {source} but megatron's TransformerConfig has {theirs} "
                      f"({mapped.flag}): they disagree; make them equal{hint} or leave one out")


def _take(merged: dict, given: dict, values: dict[str, _Mapped], prefix: str, source: str,
          effective: Callable[[str, Any], Any] = lambda key, v: v) -> None:
    """Copy Megatron's values into ``merged``; a key ``given`` by us must agree."""
    for key, mapped in values.items():
        if mapped.value is None:  # Megatron states nothing we can use (e.g. a dense-only activation)
            continue
        if key in given and effective(key, given[key]) != mapped.value:
            raise _disagree(prefix + key, given[key], source, mapped)
        merged.setdefault(key, mapped.value)


def resolve_model_config(config: TransformerConfig, ours: Union[ModelConfig, dict, None] = None,
                         source: str = "the megatron-moe ModelConfig") -> ModelConfig:
    """Our ModelConfig for the layers megatron-core builds with ``config``, from Megatron's values
    and ``ours``: a ModelConfig (every field counts as stated), the ``model:`` mapping of a config
    file (only its keys count as stated) or None. ``source`` names ``ours`` in errors."""
    given = ours.to_dict() if isinstance(ours, ModelConfig) else copy.deepcopy(ours or {})
    if not isinstance(given, dict):
        raise ValueError(f"model={given!r} in {source} is invalid: expected a mapping")
    merged = dict(given)
    model_values = megatron_model_values(config)
    _take(merged, given, model_values, "model.", source)
    if config.num_moe_experts is not None:
        if "moe" in given and not isinstance(given["moe"], dict):
            raise _disagree("model.moe", given["moe"], source, _Mapped(config.num_moe_experts,
                            "num_moe_experts", "--num-experts"), suggest=False)
        moe_given = dict(given.get("moe") or {})
        moe = dict(moe_given)
        ffn = merged["ffn_hidden_size"]

        def effective(key, value):  # model.moe.ffn_hidden_size null means the model's ffn
            return (value or ffn) if key == "ffn_hidden_size" else value

        _take(moe, moe_given, megatron_moe_values(config), "model.moe.", source, effective)
        if moe["ffn_hidden_size"] == ffn and "ffn_hidden_size" not in moe_given:
            moe["ffn_hidden_size"] = None
        merged["moe"] = moe
    if merged.get("moe") is not None and model_values["activation"].value is None:
        raise ValueError(f"megatron's TransformerConfig has {model_values['activation'].field}: "
                         "megatron-moe's experts run gelu or swiglu (--swiglu)")
    return ModelConfig.from_dict(merged)
