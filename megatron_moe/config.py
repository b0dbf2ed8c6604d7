"""MoEConfig: every knob of the dropless MoE layer, validated on construction.

    cfg = MoEConfig(hidden_size=1024, ffn_hidden_size=4096, num_experts=64, top_k=1)

Each field's docstring is its documentation; the run config's ``model.moe`` section is built
from these same fields (megatron_moe/megatron/model_config.py). Invalid values raise one
``ValueError`` that names the field and what would be valid.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

from .kernels.activation import ACTIVATIONS, pre_width_factor
from ._validation import check_bool, check_choice, check_int, check_number, invalid, is_number

MLP_IMPLS = ("auto", "triton_grouped", "torch_grouped_mm", "blocksparse", "capacity", "reference")
DEPRECATED_MLP_IMPLS = {"grouped": "triton_grouped", "grouped_mm": "torch_grouped_mm"}
AUTO_GROUPED_MM_MIN_WIDTH = 4096
"""mlp_impl='auto' picks torch_grouped_mm when hidden and ffn are both at least this wide."""
SCORE_FUNCTIONS = ("softmax", "sigmoid")
A2A_SPLITS = ("host", "padded", "symmetric")
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass
class MoEConfig:
    hidden_size: int
    """Model width H: the layer maps [..., H] -> [..., H]."""
    ffn_hidden_size: int
    """Width F of each expert's MLP (for swiglu, w1 holds 2F columns: gate half first)."""
    num_experts: int = 8
    """Number of experts E."""
    top_k: int = 1
    """Experts per token, 1 <= top_k <= num_experts."""
    activation: str = "gelu"
    """'gelu' (tanh approximation, as in the paper) or 'swiglu' (silu(gate) * up)."""
    mlp_impl: str = "auto"
    """Expert compute, all dropless except 'capacity':
    'triton_grouped' (our Triton grouped GEMMs, the gather, scatter, router weight and activation
    fused in), 'torch_grouped_mm' (the same math with the GEMMs on torch._grouped_mm, CUTLASS on
    Hopper; bf16 on CUDA), 'blocksparse' (the paper's block-sparse SDD/DSD products),
    'capacity' (Tutel/GShard capacity factor: drops tokens), 'reference' (a plain PyTorch loop
    over experts) or 'auto' (:func:`megatron_moe.experts.resolve_mlp_impl`). The old names
    'grouped' and 'grouped_mm' are still accepted."""
    block_size: int = 128
    """Block size of the block-sparse path: each expert's token bin is padded to it."""
    recompute_activation: bool = False
    """mlp_impl='triton_grouped' only: keep only the pre-activation for the backward (one
    [N, F] tensor per layer instead of two) and recompute the activation inside the dw2 kernel:
    less activation memory, a slower dw2. 'torch_grouped_mm' always recomputes."""
    a2a_splits: str = "host"
    """Expert parallelism only: how the token all-to-all is sized. 'host': exact split sizes,
    read on the host once per layer forward (one sync). 'padded': no host sync; every rank sends
    each peer a fixed block of tokens*top_k rows (the worst case, so nothing is dropped), P times
    the bytes and the MoE activation memory of 'host' for P ranks; triton_grouped or
    reference. 'symmetric': the padded blocks, but only their valid rows move (the bytes of
    'host', no host sync): each rank reads its rows from its peers' buffers in PyTorch's
    symmetric memory, so every expert-parallel group must sit on one node (on the CPU:
    shared-memory files); triton_grouped or reference."""
    capacity_factor: float = 1.0
    """mlp_impl='capacity' only: each expert takes at most ceil(cf * tokens * top_k / E)."""
    normalize_top_k: bool = False
    """Re-normalise the top-k combine weights to sum to 1."""
    score_function: str = "softmax"
    """Router scores: 'softmax' over experts (in fp32) or 'sigmoid' per expert."""
    jitter_eps: float = 0.0
    """Multiplicative uniform noise (1 +- eps) on the router input while training; 0 = off."""
    aux_loss_coeff: float = 0.01
    """Switch/GShard load-balancing loss coefficient; 0 = off."""
    z_loss_coeff: float = 0.0
    """Router z-loss coefficient (mean squared logsumexp of the logits); 0 = off."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for selection only,
    nudged towards balance by ``update_expert_biases(model)`` after each optimizer step."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (sign of the load error times this)."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of a dense shared expert added to every token's output; 0 = none."""
    init_method_std: float = 0.02
    """Std of the normal init of router and w1 (and w2 unless output_init_std is set)."""
    output_init_std: float | None = None
    """Std of the normal init of w2 (Megatron scales it by 1/sqrt(2*num_layers)); None = init_method_std."""

    def __post_init__(self) -> None:
        self.mlp_impl = canonical_mlp_impl(self.mlp_impl, "MoEConfig.mlp_impl")
        validate_moe_config(self)

    @property
    def w1_columns(self) -> int:
        return pre_width_factor(self.activation) * self.ffn_hidden_size

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity of the capacity-factor MoE for ``num_tokens`` tokens."""
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)


def canonical_mlp_impl(name, key: str):
    """The current name of an ``mlp_impl`` value; an old name gets a one-line FutureWarning."""
    if isinstance(name, str) and name in DEPRECATED_MLP_IMPLS:
        new = DEPRECATED_MLP_IMPLS[name]
        warnings.warn(f"{key}={name!r} is deprecated: use {new!r} (the same code)", FutureWarning,
                      stacklevel=3)
        return new
    return name


def validate_moe_config(cfg: MoEConfig) -> None:
    def key(name: str) -> str:
        return f"MoEConfig.{name}"

    for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k", "block_size"):
        check_int(key(name), getattr(cfg, name), 1)
    if not (1 <= cfg.top_k <= cfg.num_experts):
        invalid(key("top_k"), cfg.top_k, f"expected 1 <= top_k <= num_experts ({cfg.num_experts})")
    check_choice(key("activation"), cfg.activation, ACTIVATIONS)
    check_choice(key("mlp_impl"), cfg.mlp_impl, MLP_IMPLS)
    check_choice(key("a2a_splits"), cfg.a2a_splits, A2A_SPLITS)
    if cfg.a2a_splits != "host" and cfg.mlp_impl not in ("triton_grouped", "reference", "auto"):
        invalid(key("a2a_splits"), cfg.a2a_splits, f"expected 'host' with mlp_impl={cfg.mlp_impl!r} "
                f"('{cfg.a2a_splits}' runs with mlp_impl triton_grouped, reference or auto)")
    if cfg.recompute_activation is True and cfg.mlp_impl not in ("triton_grouped", "auto"):
        invalid(key("recompute_activation"), cfg.recompute_activation,
                f"expected false with mlp_impl={cfg.mlp_impl!r} (it applies to 'triton_grouped'; "
                "'torch_grouped_mm' always recomputes the activation)")
    check_choice(key("score_function"), cfg.score_function, SCORE_FUNCTIONS)
    check_choice(key("block_size"), cfg.block_size, BLOCK_SIZES)
    check_number(key("capacity_factor"), cfg.capacity_factor, 0, exclusive=True)
    for name in ("jitter_eps", "aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate"):
        check_number(key(name), getattr(cfg, name), 0)
    if cfg.jitter_eps >= 1:
        invalid(key("jitter_eps"), cfg.jitter_eps, "expected 0 <= jitter_eps < 1")
    for name in ("normalize_top_k", "expert_bias", "recompute_activation"):
        check_bool(key(name), getattr(cfg, name))
    if not isinstance(cfg.shared_expert_ffn_hidden_size, int) or isinstance(
            cfg.shared_expert_ffn_hidden_size, bool) or cfg.shared_expert_ffn_hidden_size < 0:
        invalid(key("shared_expert_ffn_hidden_size"), cfg.shared_expert_ffn_hidden_size,
                "expected an int >= 0 (0 = no shared expert)")
    check_number(key("init_method_std"), cfg.init_method_std, 0, exclusive=True)
    if cfg.output_init_std is not None and not (is_number(cfg.output_init_std) and cfg.output_init_std > 0):
        invalid(key("output_init_std"), cfg.output_init_std, "expected a number > 0 or null")
