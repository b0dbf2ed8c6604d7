"""MoEConfig: every knob of the dropless MoE layer, validated on construction.

Each field's comment is its documentation. Invalid values raise one ``ValueError`` that
names the field and what would be valid.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MLP_IMPLS = ("auto", "blocksparse", "grouped", "grouped_mm", "capacity", "reference")
AUTO_GROUPED_MM_MIN_WIDTH = 4096  # mlp_impl='auto': torch._grouped_mm from this hidden and ffn size up
ACTIVATIONS = ("gelu", "swiglu")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
A2A_SPLITS = ("host", "padded")


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
    """Expert compute: 'blocksparse' (the paper's SDD/DSD), 'grouped' (our Triton grouped GEMM
    with the gather/scatter fused), 'grouped_mm' (the same math on torch._grouped_mm, CUTLASS:
    faster for large experts, bf16 on CUDA), 'capacity' (Tutel/GShard capacity-factor, drops
    tokens), 'reference' (plain PyTorch loop over experts) or 'auto' (the faster dropless path
    for the shapes and dtype in the layer benchmark: see :func:`resolve_mlp_impl`)."""
    block_size: int = 128
    """Block size of the block-sparse path: each expert's token bin is padded to it."""
    recompute_activation: bool = False
    """mlp_impl='grouped' only: keep only the pre-activation for the backward (one [N, F] tensor
    per layer instead of two) and recompute the activation inside the dw2 kernel. Costs time
    (H100, 2026-11-22: dw2 0.46 -> 0.73 ms on paper-moe-m); 'grouped_mm' always recomputes."""
    a2a_splits: str = "host"
    """Expert parallelism only: how the token all-to-all is sized. 'host': exact split sizes,
    read on the host once per layer forward (one sync). 'padded': no host sync; every rank sends
    each peer a fixed block of tokens*top_k rows (the worst case, so nothing is dropped), P times
    the bytes and the MoE activation memory of 'host' for P ranks. grouped/reference only.
    Measured on 4 H200 (dmoe-small, 2026-11-22, benchmarks/NOTES.md): no faster than 'host'."""
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
    nudged towards balance by ``update_expert_bias()`` after each optimizer step."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (sign of the load error times this)."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of a dense shared expert added to every token's output; 0 = none."""
    init_method_std: float = 0.02
    """Std of the normal init of router and w1 (and w2 unless output_init_std is set)."""
    output_init_std: float | None = None
    """Std of the normal init of w2 (Megatron scales it by 1/sqrt(2*num_layers)); None = init_method_std."""

    def __post_init__(self) -> None:
        validate_moe_config(self)

    @property
    def w1_columns(self) -> int:
        return 2 * self.ffn_hidden_size if self.activation == "swiglu" else self.ffn_hidden_size

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity of the capacity-factor MoE for ``num_tokens`` tokens."""
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)


def _fail(field: str, value, valid: str) -> None:
    raise ValueError(f"MoEConfig.{field}={value!r} is invalid: {valid}")


def validate_moe_config(cfg: MoEConfig) -> None:
    for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k", "block_size"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(name, v, "expected a positive int")
    if not (1 <= cfg.top_k <= cfg.num_experts):
        _fail("top_k", cfg.top_k, f"expected 1 <= top_k <= num_experts ({cfg.num_experts})")
    if cfg.activation not in ACTIVATIONS:
        _fail("activation", cfg.activation, f"expected one of {ACTIVATIONS}")
    if cfg.mlp_impl not in MLP_IMPLS:
        _fail("mlp_impl", cfg.mlp_impl, f"expected one of {MLP_IMPLS}")
    if cfg.a2a_splits not in A2A_SPLITS:
        _fail("a2a_splits", cfg.a2a_splits, f"expected one of {A2A_SPLITS}")
    if cfg.a2a_splits == "padded" and cfg.mlp_impl not in ("grouped", "reference", "auto"):
        _fail("a2a_splits", cfg.a2a_splits, f"expected 'host' with mlp_impl={cfg.mlp_impl!r} ('padded' "
              "runs with mlp_impl grouped, reference or auto)")
    if cfg.recompute_activation is True and cfg.mlp_impl not in ("grouped", "auto"):
        _fail("recompute_activation", cfg.recompute_activation, f"expected false with mlp_impl={cfg.mlp_impl!r} "
              "(it applies to 'grouped'; 'grouped_mm' always recomputes the activation)")
    if cfg.score_function not in SCORE_FUNCTIONS:
        _fail("score_function", cfg.score_function, f"expected one of {SCORE_FUNCTIONS}")
    if cfg.block_size not in (16, 32, 64, 128, 256):
        _fail("block_size", cfg.block_size, "expected one of 16, 32, 64, 128, 256")
    for name in ("capacity_factor",):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            _fail(name, v, "expected a finite number > 0")
    for name in ("jitter_eps", "aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            _fail(name, v, "expected a finite number >= 0")
    if cfg.jitter_eps >= 1:
        _fail("jitter_eps", cfg.jitter_eps, "expected 0 <= jitter_eps < 1")
    for name in ("normalize_top_k", "expert_bias", "recompute_activation"):
        if not isinstance(getattr(cfg, name), bool):
            _fail(name, getattr(cfg, name), "expected true or false")
    v = cfg.shared_expert_ffn_hidden_size
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        _fail("shared_expert_ffn_hidden_size", v, "expected an int >= 0 (0 = no shared expert)")
    for name in ("init_method_std",):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            _fail(name, v, "expected a number > 0")
    if cfg.output_init_std is not None and not (
        isinstance(cfg.output_init_std, (int, float)) and cfg.output_init_std > 0
    ):
        _fail("output_init_std", cfg.output_init_std, "expected a number > 0 or null")
