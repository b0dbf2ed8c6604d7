"""megatron-moe: dropless Mixture-of-Experts (MegaBlocks, rebuilt in Triton) for megatron-core.

    from megatron_moe import MoEConfig, DroplessMoE
    layer = DroplessMoE(MoEConfig(hidden_size=1024, ffn_hidden_size=4096, num_experts=64))
    y = layer(x); loss = task_loss + layer.aux_loss
"""
from .config import MoEConfig
from .layer import DroplessMoE, update_expert_biases

__all__ = ["MoEConfig", "DroplessMoE", "update_expert_biases"]
__version__ = "0.1.0"
