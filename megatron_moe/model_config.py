"""ModelConfig and MoESection: the ``model:`` section of a run config (YAML), validated on construction.

A dense GPT has ``moe: null``; a MoE GPT has a ``moe:`` mapping (a :class:`MoESection`). Every
invalid value raises one ``ValueError`` naming the key as it is written in the YAML
(``model.hidden_size``, ``model.moe.top_k``) and what would be valid.

    from megatron_moe.model_config import ModelConfig
    cfg = ModelConfig(num_layers=6, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                      moe={"num_experts": 64, "top_k": 1})
    cfg.moe_config(1)      # the MoEConfig of layer 1 (1-based), or None for a dense layer
    cfg.moe_layer_numbers  # [1, 2, ..., 6]

MoE layers: with ``moe_layer_freq = N`` the layers with (layer_number - 1) % N == 0 are MoE
(layer 1, N+1, 2N+1, ...; 1 = every layer), as megatron-core counts ``moe_layer_freq``.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from .config import MLP_IMPLS, MoEConfig

POSITION_EMBEDDINGS = ("learned_absolute", "rope")
ACTIVATIONS = ("gelu", "swiglu")


def _fail(key: str, value: Any, valid: str) -> None:
    raise ValueError(f"{key}={value!r} is invalid: {valid}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_pos_int(prefix: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(obj, name)
        if not _is_int(v) or v < 1:
            _fail(f"{prefix}.{name}", v, "expected a positive integer")


def _unknown_keys(prefix: str, cls: type, data: dict) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix}.{close[0]}?)" if close else ""
            raise ValueError(f"unknown key {prefix}.{key}{hint}; valid keys: {', '.join(known)}")


@dataclass
class MoESection:
    """``model.moe``: the Mixture-of-Experts settings (absent / null = a dense model)."""

    num_experts: int = 64
    """Experts per MoE layer (the paper: 64)."""
    top_k: int = 1
    """Experts per token (the paper: 1)."""
    moe_layer_freq: int = 1
    """Every N-th layer is MoE, starting with layer 1 (1 = every layer, the paper's dMoE)."""
    mlp_impl: str = "auto"
    """'auto' (the faster dropless path for the layer's shapes: 'grouped', or 'grouped_mm' when
    hidden and ffn are both >= 4096; megatron_moe.experts.resolve_mlp_impl), 'blocksparse' (the
    paper's dMoE kernels), 'grouped' (our fused Triton grouped GEMMs), 'grouped_mm'
    (torch._grouped_mm), 'capacity' (token-dropping, capacity_factor) or 'reference' (plain
    PyTorch, slow)."""
    capacity_factor: float = 1.0
    """mlp_impl='capacity' only: each expert takes at most ceil(cf * tokens * top_k / E) tokens."""
    block_size: int = 128
    """Block size of the block-sparse path (16, 32, 64, 128 or 256)."""
    recompute_activation: bool = False
    """mlp_impl grouped: save one [tokens*top_k, ffn] tensor per MoE layer instead of two and
    recompute the activation in the backward (slower: see MoEConfig.recompute_activation)."""
    aux_loss_coeff: float = 0.01
    """Load-balancing loss coefficient, per MoE layer (summed over layers); 0 = off."""
    z_loss_coeff: float = 0.0
    """Router z-loss coefficient, per MoE layer; 0 = off."""
    normalize_top_k: bool = False
    """Re-normalise the top-k combine weights to sum to 1."""
    score_function: str = "softmax"
    """'softmax' or 'sigmoid' router scores."""
    jitter_eps: float = 0.0
    """Multiplicative router-input noise while training; 0 = off."""
    expert_bias: bool = False
    """Aux-loss-free balancing bias (updated by megatron_moe.update_expert_biases after each step)."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of a dense shared expert every token goes through; 0 = none."""
    ffn_hidden_size: int | None = None
    """Width of each expert's MLP; null = model.ffn_hidden_size."""
    expert_parallel_size: int = 1
    """Ranks the experts are split over (1 = every rank holds all experts); divides num_experts
    and the world size. Dense parameters stay data-parallel over all ranks."""
    a2a_splits: str = "host"
    """Expert parallelism: 'host' (exact all-to-all splits, one host sync per layer forward) or
    'padded' (no host sync, worst-case fixed blocks: P x the exchanged bytes and MoE activation
    memory; grouped/reference only; no faster than 'host' on 4 H200, benchmarks/NOTES.md)."""

    def __post_init__(self) -> None:
        p = "model.moe"
        _check_pos_int(p, self, ("num_experts", "top_k", "moe_layer_freq", "block_size",
                                 "expert_parallel_size"))
        if self.ffn_hidden_size is not None and (not _is_int(self.ffn_hidden_size)
                                                 or self.ffn_hidden_size < 1):
            _fail(f"{p}.ffn_hidden_size", self.ffn_hidden_size,
                  "expected a positive integer or null (= model.ffn_hidden_size)")
        if self.top_k > self.num_experts:
            _fail(f"{p}.top_k", self.top_k, f"expected 1 <= top_k <= num_experts ({self.num_experts})")
        if self.mlp_impl not in MLP_IMPLS:
            _fail(f"{p}.mlp_impl", self.mlp_impl, f"expected one of {', '.join(MLP_IMPLS)}")
        if self.num_experts % self.expert_parallel_size:
            _fail(f"{p}.expert_parallel_size", self.expert_parallel_size,
                  f"expected a divisor of model.moe.num_experts ({self.num_experts})")
        if _is_int(self.capacity_factor):
            self.capacity_factor = float(self.capacity_factor)
        # The remaining fields are MoEConfig's own: let it validate them and name our key.
        self.to_moe_config(hidden_size=8, ffn_hidden_size=self.ffn_hidden_size or 8)

    def to_moe_config(self, *, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                      init_method_std: float = 0.02, output_init_std: float | None = None) -> MoEConfig:
        """The layer's MoEConfig; errors name ``model.moe.<field>``."""
        try:
            return MoEConfig(
                hidden_size=hidden_size,
                ffn_hidden_size=self.ffn_hidden_size or ffn_hidden_size,
                num_experts=self.num_experts,
                top_k=self.top_k,
                activation=activation,
                mlp_impl=self.mlp_impl,
                block_size=self.block_size,
                recompute_activation=self.recompute_activation,
                a2a_splits=self.a2a_splits,
                capacity_factor=self.capacity_factor,
                normalize_top_k=self.normalize_top_k,
                score_function=self.score_function,
                jitter_eps=self.jitter_eps,
                aux_loss_coeff=self.aux_loss_coeff,
                z_loss_coeff=self.z_loss_coeff,
                expert_bias=self.expert_bias,
                expert_bias_update_rate=self.expert_bias_update_rate,
                shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size,
                init_method_std=init_method_std,
                output_init_std=output_init_std,
            )
        except ValueError as e:
            raise ValueError(str(e).replace("MoEConfig.", "model.moe.", 1)) from None

    @classmethod
    def from_dict(cls, data: dict) -> "MoESection":
        if not isinstance(data, dict):
            raise ValueError(f"model.moe={data!r} is invalid: expected a mapping of MoE settings or null")
        _unknown_keys("model.moe", cls, data)
        return cls(**data)


@dataclass
class ModelConfig:
    """``model``: the GPT's shape. Parameters are fp32; bf16 runs through autocast."""

    num_layers: int = 6
    """Transformer layers L."""
    hidden_size: int = 512
    """Model width h."""
    num_attention_heads: int = 8
    """Attention heads; hidden_size must be divisible by it (head size = hidden / heads)."""
    ffn_hidden_size: int = 2048
    """Width of the dense MLP (and, unless moe.ffn_hidden_size, of each expert)."""
    seq_length: int = 1024
    """Training sequence length (and the learned position table's size)."""
    vocab_size: int = 51200
    """Embedding rows; must be >= the tokenizer's vocabulary (51200 = GPT-2 BPE padded to 128)."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT-2, the paper) or 'rope'."""
    activation: str = "gelu"
    """'gelu' (tanh approximation) or 'swiglu'."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections get std / sqrt(2 * num_layers)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embeddings."""
    moe: MoESection | None = None
    """null = dense; else the MoE settings (a mapping in the YAML)."""

    def __post_init__(self) -> None:
        p = "model"
        _check_pos_int(p, self, ("num_layers", "hidden_size", "num_attention_heads",
                                 "ffn_hidden_size", "seq_length", "vocab_size"))
        if self.hidden_size % self.num_attention_heads:
            _fail(f"{p}.num_attention_heads", self.num_attention_heads,
                  f"must divide model.hidden_size={self.hidden_size} (head size = hidden / heads)")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            _fail(f"{p}.position_embedding_type", self.position_embedding_type,
                  f"expected one of {', '.join(POSITION_EMBEDDINGS)}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            _fail(f"{p}.num_attention_heads", self.num_attention_heads,
                  f"rope needs an even head size, got hidden/heads = {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            _fail(f"{p}.activation", self.activation, f"expected one of {', '.join(ACTIVATIONS)}")
        if not _is_number(self.init_method_std) or self.init_method_std <= 0:
            _fail(f"{p}.init_method_std", self.init_method_std, "expected a number > 0")
        if not isinstance(self.share_embeddings_and_output_weights, bool):
            _fail(f"{p}.share_embeddings_and_output_weights", self.share_embeddings_and_output_weights,
                  "expected true or false")
        if isinstance(self.moe, dict):
            self.moe = MoESection.from_dict(self.moe)
        elif self.moe is not None and not isinstance(self.moe, MoESection):
            _fail(f"{p}.moe", self.moe, "expected a mapping of MoE settings or null (dense)")
        if self.moe is not None:
            self.moe_config(1)  # cross-field checks (e.g. activation) with the real sizes

    # ---- derived -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def output_init_std(self) -> float:
        """Megatron's scaled init of the output projections (attention proj, MLP fc2, expert w2)."""
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (1-based) is a MoE layer."""
        self._check_layer_number(layer_number)
        return self.moe is not None and (layer_number - 1) % self.moe.moe_layer_freq == 0

    @property
    def moe_layer_numbers(self) -> list[int]:
        return [n for n in range(1, self.num_layers + 1) if self.is_moe_layer(n)]

    def moe_config(self, layer_number: int) -> MoEConfig | None:
        """The MoEConfig of layer ``layer_number`` (1-based), or None for a dense layer."""
        if not self.is_moe_layer(layer_number):
            return None
        return self.moe.to_moe_config(
            hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
            activation=self.activation, init_method_std=self.init_method_std,
            output_init_std=self.output_init_std)

    def _check_layer_number(self, layer_number: int) -> None:
        if not _is_int(layer_number) or not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer_number={layer_number!r} is invalid: expected 1..{self.num_layers} "
                             "(1-based, model.num_layers)")

    # ---- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """From the YAML mapping; unknown keys are rejected with a "did you mean"."""
        if not isinstance(data, dict):
            raise ValueError(f"model={data!r} is invalid: expected a mapping")
        _unknown_keys("model", cls, data)
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


__all__ = ["ModelConfig", "MoESection", "POSITION_EMBEDDINGS", "ACTIVATIONS"]
