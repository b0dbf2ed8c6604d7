"""The MoE aux losses' gradient without adding them to the loss, at the scale the LM loss has.

``AuxLossToGrad.apply(output, aux_loss, config)`` returns ``output`` unchanged; in backward,
``aux_loss`` gets the gradient :func:`aux_loss_scale`, as megatron-core's own
``MoEAuxLossAutoScaler`` gives its routers' losses. The scale is the factor the LM loss's gradient
carries: 1 / micro-batches per step when the loss is averaged over them (times the fp16 loss scale).
It is derived at run time, first of:

1. a fixed value: ``set_aux_loss_scale(x)`` or ``$MEGATRON_MOE_AUX_LOSS_SCALE`` (an override; our
   training program sets 1 / micro-batches);
2. megatron-core's ``MoEAuxLossAutoScaler.main_loss_backward_scale``: its pipeline schedules set it
   before each micro-batch's backward when the TransformerConfig has ``num_moe_experts``
   (Megatron-LM's ``--num-experts``) to loss scale x context-parallel size / micro-batches (loss
   scale alone with ``calculate_per_token_loss``; schedules.py, ``forward_step_calc_loss``);
3. megatron-core's micro-batch calculator, once initialised (Megatron-LM without
   ``--num-experts``): ``config.grad_scale_func(1) / get_num_microbatches()``;
4. 1.0 (as if the aux losses were added to the loss).

:func:`log_aux_losses` also records the losses in megatron-core's MoE logging tracker, which
Megatron-LM reports (``load_balancing_loss``, ``z_loss``) when it runs with ``--num-experts``.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["AuxLossToGrad", "set_aux_loss_scale", "get_aux_loss_scale", "aux_loss_scale", "log_aux_losses"]

_fixed_scale: Optional[float] = None  # None: derived at run time (aux_loss_scale)


def set_aux_loss_scale(scale: Optional[float]) -> None:
    """Fix the gradient the MoE aux losses get in backward (1.0 = as if added to the loss; our
    training program sets 1 / num_micro_batches); None goes back to deriving it."""
    global _fixed_scale
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale < 0):
        raise ValueError(f"set_aux_loss_scale({scale!r}): expected a finite number >= 0, or None "
                         "(derive it at run time)")
    _fixed_scale = None if scale is None else float(scale)


def _num_microbatches() -> Optional[int]:
    try:
        return get_num_microbatches()
    except AttributeError:  # the calculator is not initialised (no Megatron-LM around)
        return None


def aux_loss_scale(config: Optional[TransformerConfig] = None,
                   device: Optional[torch.device] = None) -> Union[float, torch.Tensor]:
    """The gradient of the aux losses in this backward (see the module docstring for the order);
    a float, or megatron-core's one-element tensor (no host synchronisation)."""
    if _fixed_scale is not None:
        return _fixed_scale
    if MoEAuxLossAutoScaler.main_loss_backward_scale is not None:
        return MoEAuxLossAutoScaler.main_loss_backward_scale
    n = _num_microbatches()
    if n is None:
        return 1.0
    loss_scale = 1.0
    if config is not None and config.grad_scale_func is not None:
        loss_scale = config.grad_scale_func(torch.ones(1, device=device))
    if config is not None and config.calculate_per_token_loss:
        return loss_scale
    return loss_scale / n


def get_aux_loss_scale(config: Optional[TransformerConfig] = None) -> float:
    """:func:`aux_loss_scale` as a Python float (reads a tensor back to the host)."""
    return float(aux_loss_scale(config))


class AuxLossToGrad(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` gets the gradient :func:`aux_loss_scale`.

    The gradient is given each time a backward pass runs through this node (as megatron-core's
    MoEAuxLossAutoScaler does): one ``loss.backward()`` per forward. A second differentiation
    through the same graph (``autograd.grad`` of another loss) would add it again."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor,
                config: Optional[TransformerConfig] = None) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.aux_device = aux_loss.shape, aux_loss.dtype, aux_loss.device
        ctx.config = config
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        scale = aux_loss_scale(ctx.config, ctx.aux_device)
        if isinstance(scale, torch.Tensor):
            scale = scale.to(ctx.aux_device, ctx.aux_dtype).reshape(())
            grad_aux = torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=ctx.aux_device) * scale
        else:
            grad_aux = torch.full(ctx.aux_shape, scale, dtype=ctx.aux_dtype, device=ctx.aux_device)
        return grad_output, grad_aux, None


def log_aux_losses(layer, layer_number: int, config: TransformerConfig) -> None:
    """Record a DroplessMoE's last losses (without their coefficients) in megatron-core's MoE
    logging tracker, as megatron-core's TopKRouter does: Megatron-LM's ``training_log`` reads
    ``load_balancing_loss`` and ``z_loss`` from it when ``--num-experts`` is given."""
    cfg = layer.cfg
    num_layers = config.num_layers + (config.mtp_num_layers or 0)
    if cfg.aux_loss_coeff > 0 and layer.load_balancing_loss is not None:
        group = parallel_state.get_tensor_and_context_parallel_group(check_initialized=False)
        save_to_aux_losses_tracker("load_balancing_loss", layer.load_balancing_loss / cfg.aux_loss_coeff,
                                   layer_number, num_layers, reduce_group=group)
    if cfg.z_loss_coeff > 0 and layer.z_loss is not None:
        save_to_aux_losses_tracker("z_loss", layer.z_loss / cfg.z_loss_coeff, layer_number, num_layers)
