"""Parameter and FLOP counts of the GPT that ``megatron_moe.megatron.build_gpt_model`` builds, and GPU peaks.

    from megatron_moe.training.flops import count_parameters, flops_per_token, peak_tflops
    count_parameters(cfg)   # {'total', 'embedding', 'non_embedding', 'active', ...}
    flops_per_token(cfg)    # training FLOPs per token (forward + backward)
    peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16)   # 989.0 (dense, no sparsity)

MFU = flops_per_token * tokens/s per GPU / (peak_tflops * 1e12).

Parameters (analytic; tests/megatron/test_model.py checks them against the built model): word embeddings
V*h, learned positions s*h (not for rope), the output layer V*h unless tied; per layer two
LayerNorms (2h each), QKV h*3h + 3h, projection h*h + h, then either the dense MLP
(h*F*g + F*g + F*h + h, g = 2 for swiglu, else 1) or the MoE (router E*h, experts E*(h*Fe*g + Fe*h),
no biases, plus an optional shared expert h*Fs*g + Fs*h); a final LayerNorm 2h. "active" counts
each MoE layer's experts top_k times instead of E times (the parameters one token uses).

FLOPs (as in the MegaBlocks paper, which follows Narayanan et al. 2021, "Efficient large-scale
language model training on GPU clusters", without activation recomputation): only matrix
multiplies, 2 FLOPs per multiply-add, backward = 2x forward, so training = 3 x forward. Forward
per token and layer: QKV 6h^2, attention scores and values 4*s*h (the full s x s matrices, as in
the paper, not halved for the causal mask), projection 2h^2, and 2*(g*h*F + F*h) for the dense MLP
or top_k * 2*(g*h*Fe + Fe*h) + 2*h*E (router) (+ the shared expert) for a MoE layer; plus the
logits 2*h*V. For a dense GELU model with F = 4h this is Narayanan's
72*L*h^2 * (1 + s/(6h) + V/(12*L*h)) per token. Capacity-factor padding and dropped tokens are not
counted (model FLOPs, not hardware FLOPs).
"""
from __future__ import annotations

import re

from megatron_moe.kernels.activation import pre_width_factor
from megatron_moe.megatron.model_config import ModelConfig


def _mlp_shapes(cfg: ModelConfig) -> dict:
    g = pre_width_factor(cfg.activation)
    moe = cfg.moe
    fe = (moe.ffn_hidden_size or cfg.ffn_hidden_size) if moe else 0
    fs = moe.shared_expert_ffn_hidden_size if moe else 0
    return {"g": g, "fe": fe, "fs": fs}


def count_parameters(model_cfg: ModelConfig) -> dict:
    """Parameters of the built model. Keys: total, embedding (word + position tables, and the
    output layer when untied), non_embedding, active (per token: experts counted top_k times per
    MoE layer), plus dense_layers, moe_layers, expert (all expert weights)."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"count_parameters: expected a ModelConfig, got {type(model_cfg).__name__}")
    c = model_cfg
    h, F, V, s, L = c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.seq_length, c.num_layers
    m = _mlp_shapes(c)
    g, fe, fs = m["g"], m["fe"], m["fs"]

    embedding = V * h
    if c.position_embedding_type == "learned_absolute":
        embedding += s * h
    if not c.share_embeddings_and_output_weights:
        embedding += V * h

    attn_block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h  # two LNs, QKV, proj
    dense_mlp = h * F * g + F * g + F * h + h
    n_moe = len(c.moe_layer_numbers)
    n_dense = L - n_moe
    per_expert = h * fe * g + fe * h
    if c.moe is not None:
        E, k = c.moe.num_experts, c.moe.top_k
        shared = (h * fs * g + fs * h) if fs else 0
        moe_mlp = E * h + E * per_expert + shared
        moe_mlp_active = E * h + k * per_expert + shared
    else:
        E = k = 0
        moe_mlp = moe_mlp_active = 0

    layers = L * attn_block + n_dense * dense_mlp + n_moe * moe_mlp
    final_ln = 2 * h
    total = embedding + layers + final_ln
    active = total - n_moe * (moe_mlp - moe_mlp_active)
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "active": active,
        "dense_layers": n_dense,
        "moe_layers": n_moe,
        "expert": n_moe * E * per_expert,
    }


def flops_per_token(model_cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward, no recomputation), see the module docstring."""
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"flops_per_token: expected a ModelConfig, got {type(model_cfg).__name__}")
    c = model_cfg
    h, F, V, s, L = c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.seq_length, c.num_layers
    m = _mlp_shapes(c)
    g, fe, fs = m["g"], m["fe"], m["fs"]
    n_moe = len(c.moe_layer_numbers)
    n_dense = L - n_moe

    attn = 2 * 3 * h * h + 2 * 2 * s * h + 2 * h * h
    dense_mlp = 2 * (g * h * F + F * h)
    if c.moe is not None:
        moe_mlp = (c.moe.top_k * 2 * (g * h * fe + fe * h) + 2 * h * c.moe.num_experts
                   + (2 * (g * h * fs + fs * h) if fs else 0))
    else:
        moe_mlp = 0
    forward = L * attn + n_dense * dense_mlp + n_moe * moe_mlp + 2 * h * V
    return float(3 * forward)


# Dense (no structured sparsity) peak TFLOP/s per GPU: (bf16/fp16 tensor cores, fp32 without TF32).
# Patterns are tried in order against torch.cuda.get_device_name(); the first match wins.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    (r"GB200", 2500.0, 80.0),
    (r"B200", 2250.0, 80.0),
    (r"B100", 1750.0, 60.0),
    (r"GH200", 989.0, 67.0),
    (r"H200", 989.0, 67.0),
    (r"H100.*PCIe", 756.0, 51.0),
    (r"H100.*NVL", 835.0, 60.0),
    (r"H100", 989.0, 67.0),        # SXM ("NVIDIA H100 80GB HBM3")
    (r"H800.*PCIe", 756.0, 51.0),
    (r"H800", 989.0, 67.0),
    (r"\bH20\b", 148.0, 44.0),
    (r"A100", 312.0, 19.5),
    (r"A800", 312.0, 19.5),
    (r"L40S", 362.0, 91.6),
    (r"\bL4\b", 121.0, 30.3),
]

_HALF = {"bf16", "bfloat16", "fp16", "float16", "half", "torch.bfloat16", "torch.float16"}
_FULL = {"fp32", "float32", "float", "torch.float32"}


def peak_tflops(device_name: str, dtype) -> float | None:
    """Dense peak TFLOP/s of one GPU for ``dtype`` (torch.bfloat16 / torch.float16 -> tensor-core
    peak; torch.float32 -> fp32 peak without TF32); None for an unknown GPU or the CPU."""
    if not isinstance(device_name, str):
        return None
    key = str(dtype).lower()
    if key in _HALF:
        col = 1
    elif key in _FULL:
        col = 2
    else:
        raise ValueError(f"peak_tflops: dtype={dtype!r} is invalid: expected torch.bfloat16, "
                         "torch.float16 or torch.float32")
    for pattern, *peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks[col - 1]
    return None


__all__ = ["count_parameters", "flops_per_token", "peak_tflops", "PEAK_TFLOPS"]
