"""The Megatron integration: our dropless MoE as the MLP of megatron-core's GPT, through a
layer spec (no fork of Megatron).

    from megatron_moe.megatron import init_megatron, build_gpt_model, moe_layers, moe_layer_spec
    # Megatron-LM: pretrain_gpt.py --spec megatron_moe.megatron.spec layer_spec ...

- spec.py: ``moe_layer_spec`` / ``layer_spec`` (megatron-core's local GPT layer with SDPA
  attention and :class:`DenseOrMoEMLP`: its expert-parallel group and expert marks), the
  Megatron-LM environment.
- flags.py: ``resolve_model_config``: Megatron's MoE flags (TransformerConfig) and our config as
  one model description, with the precedence between them.
- aux_loss.py: the aux-loss gradient at the LM loss's scale, derived at run time
  (``set_aux_loss_scale`` overrides it).
- model.py: ``init_megatron``, ``build_gpt_model`` (a GPTModel with our fused LM loss),
  ``moe_layers``.
- attention.py: ``SDPAttention`` (torch's scaled_dot_product_attention; flash attention on GPUs
  without Transformer Engine).
- model_config.py: ``ModelConfig``, the ``model:`` section of a config (``model.moe`` derives
  from :class:`megatron_moe.MoEConfig`); yaml_config.py: config files, ``base:`` and overrides.

Needs megatron-core (``pip install "megatron-moe[megatron]"``); Transformer Engine and Apex are
not used.
"""
import importlib
import importlib.util
import warnings

# megatron-core announces at import that Transformer Engine and Apex are absent: this
# integration uses neither, by design, so those notices are not shown.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex|Apex is not installed"
                                          r"|full scope is deprecated).*")

# Attributes load their module on first use, so reading a config (model_config, yaml_config)
# does not import megatron-core.
_EXPORTS = {
    "SDPAttention": "attention",
    "build_gpt_model": "model", "init_megatron": "model", "layer_mlps": "model", "moe_layers": "model",
    "transformer_config": "model",
    "ModelConfig": "model_config", "MoESection": "model_config",
    "DenseOrMoEMLP": "spec", "layer_spec": "spec", "model_config_from_env": "spec", "moe_layer_spec": "spec",
    "aux_loss_scale": "aux_loss", "get_aux_loss_scale": "aux_loss", "set_aux_loss_scale": "aux_loss",
    "resolve_model_config": "flags",
}
__all__ = sorted(_EXPORTS) + ["require"]


def require(*packages: str, extra: str = "megatron") -> None:
    """Raise one ImportError naming the missing packages and the install that brings them."""
    dists = {"megatron": "megatron-core", "yaml": "pyyaml"}  # import name -> what pip installs
    missing = [dists.get(p, p) for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(f"megatron-moe: {', '.join(missing)} not installed: pip install "
                          f"\"megatron-moe[{extra}]\" (or pip install {' '.join(missing)})")


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
