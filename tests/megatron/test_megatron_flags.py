"""Megatron's MoE flags configure our layer; the aux-loss scale and the expert-bias update follow
megatron-core's own mechanisms (one process, gloo; the multi-rank wiring is test_megatron_parallel.py).

    pytest tests/megatron/test_megatron_flags.py       # about 20 s on 2 CPU cores

References: hand-written expectations of the flag table, megatron-core's own TopKRouter routing
on the same logits, plain autograd of the loss with the aux losses added, the bias update formula.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_moe.megatron.model_config import ModelConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_model import DEVICE, _ensure_megatron, batch, tiny  # noqa: E402


@pytest.fixture
def ad(monkeypatch):
    """The adapter, megatron initialised (gloo, world 1), no MEGATRON_MOE_* variables, the aux
    scale derived at run time, megatron-core's aux-loss scale and logging tracker cleared."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    adapter = _ensure_megatron()
    for var in ("MEGATRON_MOE_CONFIG", "MEGATRON_MOE_OVERRIDES", "MEGATRON_MOE_AUX_LOSS_SCALE"):
        monkeypatch.delenv(var, raising=False)
    adapter.set_aux_loss_scale(None)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_layer_wise_logging_tracker().clear()
    yield adapter
    adapter.set_aux_loss_scale(1.0)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_layer_wise_logging_tracker().clear()


def megatron_config(model_cfg: ModelConfig | None = None, **moe_flags):
    """The TransformerConfig Megatron-LM would make for ``model_cfg``'s sizes plus ``moe_flags``
    (TransformerConfig field names, as core_transformer_config_from_args sets them)."""
    from megatron_moe.megatron.model import transformer_config

    return dataclasses.replace(transformer_config(model_cfg or tiny()), **moe_flags)


def mlp(config, layer_number=1, model_cfg=None):
    from megatron_moe.megatron.spec import DenseOrMoEMLP

    return DenseOrMoEMLP(config, model_cfg=model_cfg, layer_number=layer_number)


# ----------------------------------------------------------------------------- the flag table
FLAG_CASES = [
    pytest.param(dict(num_moe_experts=4),
                 dict(num_experts=4, top_k=2, aux_loss_coeff=0.0, z_loss_coeff=0.0, ffn_hidden_size=64,
                      score_function="softmax", normalize_top_k=True, jitter_eps=0.0, expert_bias=False,
                      shared_expert_ffn_hidden_size=0), id="megatron-defaults"),
    pytest.param(dict(num_moe_experts=8, moe_router_topk=1, moe_router_pre_softmax=True,
                      moe_aux_loss_coeff=0.02, moe_z_loss_coeff=0.003, moe_ffn_hidden_size=24,
                      moe_input_jitter_eps=0.1, moe_shared_expert_intermediate_size=16),
                 dict(num_experts=8, top_k=1, normalize_top_k=False, aux_loss_coeff=0.02, z_loss_coeff=0.003,
                      ffn_hidden_size=24, jitter_eps=0.1, shared_expert_ffn_hidden_size=16), id="softmax-pre"),
    pytest.param(dict(num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01),
                 dict(score_function="sigmoid", normalize_top_k=True, expert_bias=True,
                      expert_bias_update_rate=0.01), id="sigmoid-top2-bias"),
    pytest.param(dict(num_moe_experts=8, moe_router_topk=1, moe_router_score_function="sigmoid",
                      moe_router_pre_softmax=True),
                 dict(score_function="sigmoid", normalize_top_k=False), id="sigmoid-top1"),
    pytest.param(dict(num_moe_experts=4, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.5),
                 dict(aux_loss_coeff=0.0), id="balancing-none"),
]


@pytest.mark.parametrize("flags, expected", FLAG_CASES)
def test_megatron_moe_flags_configure_our_layer(ad, flags, expected):
    layer = mlp(megatron_config(**flags)).moe
    got = {k: getattr(layer.cfg, k) for k in expected}
    assert got == expected
    assert (layer.cfg.hidden_size, layer.cfg.activation, layer.cfg.mlp_impl) == (32, "gelu", "auto")
    assert layer.ep_size == 1


@pytest.mark.parametrize("freq, moe_layers", [(1, [1, 2, 3, 4]), (2, [1, 3]), (3, [1, 4]),
                                              ([1, 0, 1, 0], [1, 3]), ([1, 1, 1, 1], [1, 2, 3, 4])])
def test_moe_layer_freq_places_moe_layers(ad, freq, moe_layers):
    config = megatron_config(tiny(num_layers=4), num_moe_experts=4, moe_layer_freq=freq)
    assert [n for n in range(1, 5) if mlp(config, n).is_moe] == moe_layers


def test_swiglu_and_init_std_come_from_megatron(ad):
    config = megatron_config(tiny(activation="swiglu", init_method_std=0.01), num_moe_experts=4)
    layer = mlp(config).moe
    assert layer.cfg.activation == "swiglu" and layer.experts.w1.shape == (4, 32, 128)
    assert layer.cfg.init_method_std == 0.01 and layer.cfg.output_init_std == pytest.approx(0.01 / 2)


# ----------------------------------------------------------------------------- precedence
def _write(tmp_path, monkeypatch, text, overrides=None):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    monkeypatch.setenv("MEGATRON_MOE_CONFIG", str(path))
    if overrides is not None:
        monkeypatch.setenv("MEGATRON_MOE_OVERRIDES", overrides)


def test_our_config_gives_what_megatron_has_no_flag_for(ad, tmp_path, monkeypatch):
    _write(tmp_path, monkeypatch, "model:\n  moe:\n    top_k: 2\n    mlp_impl: reference\n", "model.moe.block_size=16")
    layer = mlp(megatron_config(num_moe_experts=4, moe_aux_loss_coeff=0.01)).moe
    assert (layer.cfg.mlp_impl, layer.cfg.block_size, layer.cfg.top_k, layer.cfg.num_experts) == ("reference", 16, 2, 4)
    assert layer.cfg.aux_loss_coeff == 0.01  # not in the YAML: Megatron's
    monkeypatch.delenv("MEGATRON_MOE_CONFIG")  # the overrides alone
    monkeypatch.setenv("MEGATRON_MOE_OVERRIDES", "model.moe.mlp_impl=capacity model.moe.capacity_factor=2")
    layer = mlp(megatron_config(num_moe_experts=4)).moe
    assert (layer.cfg.mlp_impl, layer.cfg.capacity_factor, layer.cfg.hidden_size) == ("capacity", 2.0, 32)


@pytest.mark.parametrize("yaml_text, flags, message", [
    ("model:\n  moe:\n    top_k: 1\n", {}, r"model\.moe\.top_k=1 in MEGATRON_MOE_CONFIG=\S+run\.yaml but megatron's "
     r"TransformerConfig has moe_router_topk=2 \(--moe-router-topk\): they disagree; make them equal "
     r"\(e\.g\. MEGATRON_MOE_OVERRIDES='model\.moe\.top_k=2'\)"),
    ("model:\n  hidden_size: 64\n  moe: {}\n", {}, r"model\.hidden_size=64 .* hidden_size=32 \(--hidden-size\)"),
    ("model:\n  moe: null\n", {}, r"model\.moe=None .* num_moe_experts=4 \(--num-experts\)"),
    ("model:\n  moe:\n    normalize_top_k: false\n", {},
     r"model\.moe\.normalize_top_k=False .*--moe-router-pre-softmax"),
    ("model:\n  moe:\n    ffn_hidden_size: null\n", dict(moe_ffn_hidden_size=48),
     r"model\.moe\.ffn_hidden_size=None .* moe_ffn_hidden_size=48 \(--moe-ffn-hidden-size\)"),
    ("model:\n  moe:\n    expert_parallel_size: 2\n", {}, r"expert_parallel_size=2 .*--expert-model-parallel-size"),
    ("model:\n  moe:\n    score_function: sigmoid\n", {}, r"score_function='sigmoid' .*--moe-router-score-function"),
])
def test_a_setting_stated_on_both_sides_must_agree(ad, tmp_path, monkeypatch, yaml_text, flags, message):
    _write(tmp_path, monkeypatch, yaml_text)
    with pytest.raises(ValueError, match=message):
        mlp(megatron_config(num_moe_experts=4, **flags))


def test_equal_settings_on_both_sides_are_fine(ad, tmp_path, monkeypatch):
    _write(tmp_path, monkeypatch, "model:\n  num_layers: 2\n  hidden_size: 32\n  moe:\n    num_experts: 4\n"
           "    top_k: 1\n    normalize_top_k: false\n    ffn_hidden_size: null\n    aux_loss_coeff: 0.01\n"
           "    expert_parallel_size: 1\n")
    cfg = mlp(megatron_config(num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True,
                              moe_aux_loss_coeff=0.01)).moe.cfg
    assert (cfg.top_k, cfg.normalize_top_k, cfg.aux_loss_coeff, cfg.ffn_hidden_size) == (1, False, 0.01, 64)


def test_a_model_config_object_states_every_field(ad):
    ours = tiny(moe={"num_experts": 4, "top_k": 2, "normalize_top_k": True, "aux_loss_coeff": 0.0,
                     "mlp_impl": "reference"})
    assert mlp(megatron_config(num_moe_experts=4), model_cfg=ours).moe.cfg.mlp_impl == "reference"
    # MoEConfig's default aux_loss_coeff (0.01) is not megatron-core's (0.0)
    with pytest.raises(ValueError, match=r"model\.moe\.aux_loss_coeff=0\.01 in the ModelConfig given to the "
                                         r"spec .* moe_aux_loss_coeff=0\.0 \(--moe-aux-loss-coeff\)"):
        mlp(megatron_config(num_moe_experts=4),
            model_cfg=tiny(moe={"num_experts": 4, "top_k": 2, "normalize_top_k": True}))


@pytest.mark.parametrize("flags, message", [
    (dict(moe_expert_capacity_factor=1.0, moe_token_dispatcher_type="alltoall"), r"--moe-expert-capacity-factor"),
    (dict(moe_router_load_balancing_type="seq_aux_loss"), r"moe_router_load_balancing_type='seq_aux_loss'"),
    (dict(moe_router_topk_scaling_factor=2.5, moe_router_pre_softmax=True), r"--moe-router-topk-scaling-factor"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), r"--moe-router-num-groups"),
    (dict(moe_router_dtype="fp64"), r"moe_router_dtype='fp64'"),
    (dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True), r"--moe-shared-expert-gate"),
    (dict(moe_aux_loss_coeff=[0.01, 0.02], moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"]),
     r"moe_router_load_balancing_type"),
    (dict(activation_func=F.relu), r"activation_func=relu: megatron-moe's experts run gelu or swiglu"),
])
def test_megatron_moe_options_our_layer_lacks_are_refused(ad, flags, message):
    with pytest.raises(ValueError, match=message):
        mlp(megatron_config(num_moe_experts=4, **flags))


def test_a_moe_layer_pattern_we_cannot_express_is_refused(ad):
    with pytest.raises(ValueError, match=r"moe_layer_freq=\[1, 1, 0, 1\] \(--moe-layer-freq\)"):
        mlp(megatron_config(tiny(num_layers=4), num_moe_experts=4, moe_layer_freq=[1, 1, 0, 1]))


# ----------------------------------------------------------------------------- routing = megatron-core's
ROUTING_CASES = [
    dict(moe_router_topk=2),                                     # softmax after top-k: renormalised
    dict(moe_router_topk=2, moe_router_pre_softmax=True),        # softmax before top-k
    dict(moe_router_topk=1, moe_router_pre_softmax=True),
    dict(moe_router_topk=2, moe_router_score_function="sigmoid"),
    dict(moe_router_topk=1, moe_router_score_function="sigmoid"),
]


@pytest.mark.parametrize("flags", ROUTING_CASES, ids=lambda f: "-".join(f"{v}" for v in f.values()))
def test_routing_losses_and_gradients_equal_megatron_cores_router(ad, flags):
    """The same flags give our router and megatron-core's TopKRouter the same experts, weights,
    load-balancing and z-losses, and the same gradients (its routing() on the same logits)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    config = megatron_config(num_moe_experts=8, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, **flags)
    ours = mlp(config).moe.router.train()
    theirs = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).train()
    theirs.set_layer_number(1)
    torch.manual_seed(0)
    with torch.no_grad():
        ours.weight.normal_(0, 0.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(40, 32)
    g_TE = torch.randn(40, 8)
    # megatron-core: routing() on the logits its gating() computes (gating moves the weight to CUDA)
    x1 = x.clone().requires_grad_()
    probs_TE, map_TE = theirs.routing(x1 @ theirs.weight.t())
    (probs_TE * g_TE).sum().backward()  # its aux and z losses reach the gradient by themselves (scale 1)
    tracker = get_moe_layer_wise_logging_tracker()
    # ours
    x2 = x.clone().requires_grad_()
    r = ours(x2)
    ours_TE = torch.zeros(40, 8).scatter(1, r.expert_ids_TK, r.weights_TK)
    torch.testing.assert_close(ours_TE.detach() != 0, map_TE)
    torch.testing.assert_close(ours_TE, probs_TE.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r.aux_loss, 0.01 * tracker["load_balancing_loss"]["values"][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(r.z_loss, 0.001 * tracker["z_loss"]["values"][0], rtol=1e-6, atol=0)
    ((ours_TE * g_TE).sum() + r.aux_loss + r.z_loss).backward()
    # our router's backward is one fused kernel (under the Triton interpreter here): fp32 sums in
    # another order than megatron-core's chain of torch ops, so a few ulps of the largest term
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-6)


def test_expert_bias_selection_equals_megatron_cores(ad):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    layer = mlp(megatron_config(num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True)).moe
    torch.manual_seed(1)
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.5)
        layer.router.expert_bias.copy_(torch.randn(8) * 0.3)
    x = torch.randn(30, 32)
    r = layer.router(x)
    probs_TE, _ = topk_routing_with_score_function(x @ layer.router.weight.t(), 2, score_function="sigmoid",
                                                   expert_bias=layer.router.expert_bias)
    ours_TE = torch.zeros(30, 8).scatter(1, r.expert_ids_TK, r.weights_TK)
    torch.testing.assert_close(ours_TE.detach(), probs_TE.detach(), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- the aux-loss scale
def _gpt(ad, config, cfg):
    from megatron.core.models.gpt import GPTModel

    with torch.device("cpu"):
        model = GPTModel(config=config, transformer_layer_spec=ad.moe_layer_spec(None), vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.seq_length)
    return model.to(DEVICE)


def _twins(ad, config, cfg):
    a = _gpt(ad, config, cfg)
    b = _gpt(ad, config, cfg)
    b.load_state_dict(a.state_dict())
    return a, b


def _routers(model):
    from megatron_moe.megatron import moe_layers

    return [m.router.weight for m in moe_layers(model)]


@pytest.mark.parametrize("per_token", [False, True], ids=["mean-loss", "per-token-loss"])
def test_megatron_schedule_sets_our_aux_loss_scale(ad, monkeypatch, per_token):
    """megatron-core's own forward_step / backward_step (the no-pipelining schedule's steps) over 3
    micro-batches with an fp16-style loss scale of 8: every gradient equals plain autograd of
    8 * sum over micro-batches of (lm + aux) / 3 (per-token: 8 * (lm_sum + tokens * aux))."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    cfg = tiny(seq_length=8)
    config = megatron_config(cfg, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.5,
                             moe_z_loss_coeff=0.1, calculate_per_token_loss=per_token)
    config.grad_scale_func = lambda loss: loss * 8.0
    monkeypatch.setenv("MEGATRON_MOE_OVERRIDES", "model.moe.mlp_impl=reference")
    model, ref = _twins(ad, config, cfg)
    micro = [batch(cfg, b=2, seed=s) for s in range(3)]

    def forward_step_func(data_iterator, model):
        tokens, pos, labels = next(data_iterator)
        loss_BS = model(tokens, pos, attention_mask=None, labels=labels)

        def loss_func(loss_BS):
            if per_token:
                return loss_BS.sum(), torch.tensor(loss_BS.numel()), {}
            return loss_BS.mean(), {}
        return loss_BS, loss_func

    data = iter(micro)
    for _ in micro:
        out, _ = schedules.forward_step(forward_step_func, data, model, 3, None, [], config, 1)
        schedules.backward_step(None, out, None, ModelType.encoder_or_decoder, config)

    ad.set_aux_loss_scale(0.0)  # the reference adds the aux losses to the loss itself
    layers = [m for m in ref.modules() if type(m).__name__ == "DroplessMoE"]
    for tokens, pos, labels in micro:
        loss_BS = ref(tokens, pos, attention_mask=None, labels=labels)
        aux = sum(m.aux_loss for m in layers)
        total = loss_BS.sum() + loss_BS.numel() * aux if per_token else (loss_BS.mean() + aux) / 3
        (8.0 * total).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all(w.grad.abs().sum() > 0 for w in _routers(model))


def test_aux_loss_scale_order(ad, monkeypatch, tmp_path):
    """A fixed value (set_aux_loss_scale / the environment) > megatron-core's schedule's scale >
    megatron-core's micro-batch calculator (times the loss scale) > 1."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    config = megatron_config()
    assert ad.get_aux_loss_scale(config) == 1.0
    init_num_microbatches_calculator(0, None, global_batch_size=24, micro_batch_size=2, data_parallel_size=3)
    try:
        assert ad.get_aux_loss_scale(config) == pytest.approx(1 / 4)
        config.grad_scale_func = lambda loss: loss * 16.0
        assert ad.get_aux_loss_scale(config) == pytest.approx(16 / 4)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([0.125]))
        assert ad.get_aux_loss_scale(config) == 0.125
        _write(tmp_path, monkeypatch, "model:\n  moe:\n    mlp_impl: reference\n")
        monkeypatch.setenv("MEGATRON_MOE_AUX_LOSS_SCALE", "0.5")
        mlp(megatron_config(num_moe_experts=4))
        assert ad.get_aux_loss_scale(config) == 0.5
        with pytest.raises(ValueError, match="set_aux_loss_scale"):
            ad.set_aux_loss_scale(-1.0)
    finally:
        destroy_num_microbatches_calculator()


def test_without_num_experts_the_micro_batch_calculator_sets_the_scale(ad, tmp_path, monkeypatch):
    """Megatron-LM without --num-experts (the MoE settings from MEGATRON_MOE_CONFIG): the router's
    gradient through the LM loss alone equals autograd of lm + aux / micro-batches."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    _write(tmp_path, monkeypatch, "model:\n  num_layers: 2\n  hidden_size: 32\n  moe:\n    num_experts: 4\n"
           "    top_k: 2\n    mlp_impl: reference\n    aux_loss_coeff: 0.5\n")
    cfg = tiny(seq_length=8)
    config = megatron_config(cfg)
    model, ref = _twins(ad, config, cfg)
    tokens, pos, labels = batch(cfg)
    init_num_microbatches_calculator(0, None, global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
    try:
        model(tokens, pos, attention_mask=None, labels=labels).mean().backward()
    finally:
        destroy_num_microbatches_calculator()
    ad.set_aux_loss_scale(0.0)
    layers = [m for m in ref.modules() if type(m).__name__ == "DroplessMoE"]
    loss = ref(tokens, pos, attention_mask=None, labels=labels).mean()
    (loss + sum(m.aux_loss for m in layers) / 4).backward()
    for a, b in zip(_routers(model), _routers(ref)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_megatron_lm_logs_our_aux_losses(ad, monkeypatch):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    cfg = tiny(num_layers=3, seq_length=8)
    monkeypatch.setenv("MEGATRON_MOE_OVERRIDES", "model.moe.mlp_impl=reference")
    model = _gpt(ad, megatron_config(cfg, num_moe_experts=4, moe_layer_freq=2, moe_aux_loss_coeff=0.25,
                                     moe_z_loss_coeff=0.5), cfg)
    tokens, pos, labels = batch(cfg)
    model(tokens, pos, attention_mask=None, labels=labels).mean().backward()
    layers = [m for m in model.modules() if type(m).__name__ == "DroplessMoE"]
    tracker = get_moe_layer_wise_logging_tracker()
    zero = torch.zeros(())
    want_lb = torch.stack([layers[0].load_balancing_loss / 0.25, zero, layers[1].load_balancing_loss / 0.25])
    want_z = torch.stack([layers[0].z_loss / 0.5, zero, layers[1].z_loss / 0.5])
    torch.testing.assert_close(tracker["load_balancing_loss"]["values"], want_lb.detach())
    torch.testing.assert_close(tracker["z_loss"]["values"], want_z.detach())


# ----------------------------------------------------------------------------- the expert bias
def test_megatron_finalize_model_grads_updates_our_expert_biases(ad, monkeypatch):
    """megatron-core's finalize_model_grads (what Megatron-LM runs after the backward, before the
    optimizer step) updates our routers' expert_bias from their local_tokens_per_expert and clears
    the counts: bias += rate * sign(mean load - load), the loads of the step's micro-batches."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    cfg = tiny(num_layers=2, seq_length=8)
    config = megatron_config(cfg, num_moe_experts=4, moe_router_topk=1, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    monkeypatch.setenv("MEGATRON_MOE_OVERRIDES", "model.moe.mlp_impl=reference")
    model = _gpt(ad, config, cfg)
    model.finish_grad_sync = lambda force_all_reduce=False: None  # DDP's; nothing to reduce here
    layers = [m for m in model.modules() if type(m).__name__ == "DroplessMoE"]
    with torch.no_grad():
        for m in layers:
            m.router.weight.normal_(0, 1.0)  # uneven loads
    load_LE = torch.zeros(2, 4)
    for seed in range(2):
        tokens, pos, labels = batch(cfg, seed=seed)
        model(tokens, pos, attention_mask=None, labels=labels).mean().backward()
        load_LE += torch.stack([m.tokens_per_expert.float() for m in layers])
    finalize_model_grads([model])
    want_LE = 0.01 * torch.sign(load_LE.mean(1, keepdim=True) - load_LE)
    assert want_LE.abs().sum() > 0
    torch.testing.assert_close(torch.stack([m.router.expert_bias for m in layers]), want_LE)
    assert all(m.router.local_tokens_per_expert.abs().sum() == 0 for m in layers)


def test_router_bias_and_counts_stay_fp32_under_megatrons_bf16_module(ad, monkeypatch):
    from megatron.core.transformer.module import Float16Module

    cfg = tiny(seq_length=8)
    config = megatron_config(cfg, num_moe_experts=4, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, bf16=True)
    monkeypatch.setenv("MEGATRON_MOE_OVERRIDES", "model.moe.mlp_impl=reference")
    wrapped = Float16Module(config, _gpt(ad, config, cfg))
    router = [m for m in wrapped.modules() if type(m).__name__ == "DroplessMoE"][0].router
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32
    tokens, pos, labels = batch(cfg)
    wrapped(tokens, pos, attention_mask=None, labels=labels).float().mean().backward()
    assert router.local_tokens_per_expert.sum() == tokens.numel() * 2


def test_flag_table_names_real_transformer_config_fields():
    """Every field the flag table reads exists in megatron-core's TransformerConfig."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.megatron import flags

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    config = megatron_config(num_moe_experts=4)
    read = itertools.chain(flags.megatron_model_values(config).values(), flags.megatron_moe_values(config).values())
    fields = {m.field for m in read if "=" not in m.field} | {f for f, _, _ in flags._UNSUPPORTED}
    assert fields <= names, fields - names
