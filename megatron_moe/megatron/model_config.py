"""ModelConfig and MoESection: the ``model:`` section of a run config (YAML), validated on construction.

A dense GPT has ``moe: null``; a MoE GPT has a ``moe:`` mapping (a :class:`MoESection`). Every
invalid value raises one ``ValueError`` naming the key as it is written in the YAML
(``model.hidden_size``, ``model.moe.top_k``) and what would be valid.

    from megatron_moe.megatron.model_config import ModelConfig
    cfg = ModelConfig(num_layers=6, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                      moe={"num_experts": 64, "top_k": 1})
    cfg.moe_config(1)      # the MoEConfig of layer 1 (1-based), or None for a dense layer
    cfg.moe_layer_numbers  # [1, 2, ..., 6]

MoE layers: with ``moe_layer_freq = N`` the layers with (layer_number - 1) % N == 0 are MoE
(layer 1, N+1, 2N+1, ...; 1 = every layer), as megatron-core counts ``moe_layer_freq``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_moe._validation import check_bool, check_choice, check_int, check_number, invalid, is_int
from megatron_moe.config import ACTIVATIONS, MoEConfig, canonical_mlp_impl

from .yaml_config import build_dataclass

POSITION_EMBEDDINGS = ("learned_absolute", "rope")

# MoEConfig fields that the model section sets for every layer, not model.moe.
_FROM_MODEL = ("hidden_size", "ffn_hidden_size", "activation", "init_method_std", "output_init_std")


def _section_fields() -> list[tuple]:
    """model.moe's fields: every MoEConfig field the model does not set (same names, types,
    defaults and documentation: megatron_moe/config.py), then the section's own."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default))
              for f in dataclasses.fields(MoEConfig) if f.name not in _FROM_MODEL]
    return fields + [
        # Width of each expert's MLP; null = model.ffn_hidden_size.
        ("ffn_hidden_size", "int | None", dataclasses.field(default=None)),
        # Every N-th layer is MoE, starting with layer 1 (1 = every layer, the paper's dMoE).
        ("moe_layer_freq", "int", dataclasses.field(default=1)),
        # Ranks the experts are split over (1 = every rank holds all experts); divides
        # num_experts and the world size. Dense parameters stay data-parallel over all ranks.
        ("expert_parallel_size", "int", dataclasses.field(default=1)),
    ]


def _section_post_init(self) -> None:
    p = "model.moe"
    for name in ("moe_layer_freq", "expert_parallel_size"):
        check_int(f"{p}.{name}", getattr(self, name), 1)
    if self.ffn_hidden_size is not None and (not is_int(self.ffn_hidden_size) or self.ffn_hidden_size < 1):
        invalid(f"{p}.ffn_hidden_size", self.ffn_hidden_size,
                "expected a positive integer or null (= model.ffn_hidden_size)")
    if is_int(self.capacity_factor):
        self.capacity_factor = float(self.capacity_factor)
    self.mlp_impl = canonical_mlp_impl(self.mlp_impl, f"{p}.mlp_impl")
    # MoEConfig validates its own fields; its errors are renamed to our keys.
    self.to_moe_config(hidden_size=8, ffn_hidden_size=self.ffn_hidden_size or 8)
    if self.num_experts % self.expert_parallel_size:
        invalid(f"{p}.expert_parallel_size", self.expert_parallel_size,
                f"expected a divisor of model.moe.num_experts ({self.num_experts})")


def _to_moe_config(self, *, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                   init_method_std: float = 0.02, output_init_std: float | None = None) -> MoEConfig:
    """The layer's MoEConfig; errors name ``model.moe.<field>``."""
    given = {f.name: getattr(self, f.name) for f in dataclasses.fields(MoEConfig)
             if f.name not in _FROM_MODEL}
    try:
        return MoEConfig(hidden_size=hidden_size, ffn_hidden_size=self.ffn_hidden_size or ffn_hidden_size,
                         activation=activation, init_method_std=init_method_std,
                         output_init_std=output_init_std, **given)
    except ValueError as e:
        raise ValueError(str(e).replace("MoEConfig.", "model.moe.", 1)) from None


@classmethod
def _section_from_dict(cls, data: dict):
    """From the YAML mapping: unknown keys and wrong types named as ``model.moe.<key>``."""
    if not isinstance(data, dict):
        raise ValueError(f"model.moe={data!r} is invalid: expected a mapping of MoE settings or null")
    return build_dataclass(cls, data, "model.moe")


MoESection = dataclasses.make_dataclass(
    "MoESection", _section_fields(),
    namespace={"__doc__": "``model.moe``: the Mixture-of-Experts settings (absent / null = a dense "
                          "model); the fields of MoEConfig that the model does not set, plus "
                          "ffn_hidden_size, moe_layer_freq and expert_parallel_size.",
               "__post_init__": _section_post_init, "to_moe_config": _to_moe_config,
               "from_dict": _section_from_dict})
MoESection.__module__ = __name__  # type hints resolve here


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
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "vocab_size"):
            check_int(f"{p}.{name}", getattr(self, name), 1)
        if self.hidden_size % self.num_attention_heads:
            invalid(f"{p}.num_attention_heads", self.num_attention_heads,
                    f"must divide model.hidden_size={self.hidden_size} (head size = hidden / heads)")
        check_choice(f"{p}.position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            invalid(f"{p}.num_attention_heads", self.num_attention_heads,
                    f"rope needs an even head size, got hidden/heads = {self.head_dim}")
        check_choice(f"{p}.activation", self.activation, ACTIVATIONS)
        check_number(f"{p}.init_method_std", self.init_method_std, 0, exclusive=True)
        check_bool(f"{p}.share_embeddings_and_output_weights", self.share_embeddings_and_output_weights)
        if isinstance(self.moe, dict):
            self.moe = MoESection.from_dict(self.moe)
        elif self.moe is not None and not isinstance(self.moe, MoESection):
            invalid(f"{p}.moe", self.moe, "expected a mapping of MoE settings or null (dense)")
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
        if not is_int(layer_number) or not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer_number={layer_number!r} is invalid: expected 1..{self.num_layers} "
                             "(1-based, model.num_layers)")

    # ---- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """From the YAML mapping: unknown keys (with a "did you mean") and wrong types named as
        ``model.<key>``."""
        if not isinstance(data, dict):
            raise ValueError(f"model={data!r} is invalid: expected a mapping")
        return build_dataclass(cls, data, "model")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


__all__ = ["ModelConfig", "MoESection", "POSITION_EMBEDDINGS", "ACTIVATIONS"]
