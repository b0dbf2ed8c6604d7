"""The megatron-core GPT with our MoE: config validation, attention, losses, aux-loss gradient,
expert marks, parameter and FLOP counts, bf16 autocast and bf16 parameters, the Megatron-LM --spec path,
the paper configs.

    pytest tests/megatron/test_model.py            # about a minute on 2 CPU cores

Tiny shapes throughout (2-3 layers, hidden 32); the paper configs are only counted, never built.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from _util import needs_triton_kernels
from megatron_moe.training.flops import count_parameters, flops_per_token, peak_tflops
from megatron_moe.megatron.model_config import ModelConfig, MoESection

DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


# ----------------------------------------------------------------------------- fixtures / helpers
def _ensure_megatron(seed: int = 1234):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import megatron_moe.megatron as megatron_adapter

    megatron_adapter.init_megatron(seed)
    return megatron_adapter


@pytest.fixture
def ad():
    """The adapter module, with megatron initialised (gloo, world size 1) and aux scale 1."""
    adapter = _ensure_megatron()
    adapter.set_aux_loss_scale(1.0)
    yield adapter
    adapter.set_aux_loss_scale(1.0)


def tiny(moe=None, **kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                seq_length=16, vocab_size=128)
    base.update(kw)
    return ModelConfig(moe=moe, **base)


def batch(cfg: ModelConfig, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    pos = torch.arange(cfg.seq_length)[None].expand(b, -1)
    return tokens.to(DEVICE), pos.to(DEVICE), labels.to(DEVICE)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _impl_param(impl):
    needs = {"triton_grouped": "megatron_moe.ops.triton_grouped_mlp", "blocksparse": "megatron_moe.ops.blocksparse_mlp"}
    mod = needs.get(impl)
    marks = [pytest.mark.skipif(not _has(mod), reason=f"{mod} not present")] if mod else []
    return pytest.param(impl, marks=marks, id=impl)


# ----------------------------------------------------------------------------- ModelConfig
def test_model_config_layers_and_moe_config():
    cfg = tiny(moe={"num_experts": 4, "top_k": 2, "moe_layer_freq": 2, "mlp_impl": "reference",
                    "capacity_factor": 2}, num_layers=5, activation="swiglu")
    assert isinstance(cfg.moe, MoESection)
    assert cfg.moe.capacity_factor == 2.0 and isinstance(cfg.moe.capacity_factor, float)
    assert cfg.moe_layer_numbers == [1, 3, 5]
    assert cfg.moe_config(2) is None and cfg.moe_config(4) is None
    mc = cfg.moe_config(3)
    assert (mc.hidden_size, mc.ffn_hidden_size, mc.num_experts, mc.top_k) == (32, 64, 4, 2)
    assert mc.activation == "swiglu" and mc.mlp_impl == "reference"
    assert mc.output_init_std == pytest.approx(0.02 / math.sqrt(10))
    assert tiny().moe_config(1) is None and tiny().moe_layer_numbers == []
    # moe.ffn_hidden_size overrides the expert width only
    assert tiny(moe={"num_experts": 2, "ffn_hidden_size": 48}).moe_config(1).ffn_hidden_size == 48
    with pytest.raises(ValueError, match=r"layer_number=0 .*1\.\.2"):
        tiny().moe_config(0)
    with pytest.raises(ValueError, match=r"layer_number=3"):
        tiny().is_moe_layer(3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=33), r"model\.num_attention_heads=2 .*divide model\.hidden_size=33"),
    (dict(num_layers=0), r"model\.num_layers=0 is invalid"),
    (dict(vocab_size=True), r"model\.vocab_size=True is invalid"),
    (dict(activation="relu"), r"model\.activation='relu' is invalid: expected one of gelu, swiglu"),
    (dict(position_embedding_type="alibi"), r"model\.position_embedding_type='alibi'"),
    (dict(init_method_std=0), r"model\.init_method_std=0"),
    (dict(share_embeddings_and_output_weights="yes"), r"model\.share_embeddings_and_output_weights"),
    (dict(moe={"topk": 1}), r"unknown key 'model\.moe\.topk': did you mean 'model\.moe\.top_k'\?"),
    (dict(moe={"num_experts": 4, "top_k": 5}), r"model\.moe\.top_k=5 .*num_experts \(4\)"),
    (dict(moe={"mlp_impl": "dense"}), r"model\.moe\.mlp_impl='dense' is invalid"),
    (dict(moe={"block_size": 48}), r"model\.moe\.block_size=48"),
    (dict(moe={"capacity_factor": 0}), r"model\.moe\.capacity_factor=0"),
    (dict(moe={"aux_loss_coeff": -1}), r"model\.moe\.aux_loss_coeff=-1"),
    (dict(moe={"score_function": "relu"}), r"model\.moe\.score_function='relu'"),
    (dict(moe={"moe_layer_freq": 0}), r"model\.moe\.moe_layer_freq=0"),
    (dict(moe={"num_experts": 6, "expert_parallel_size": 4}),
     r"model\.moe\.expert_parallel_size=4 .*divisor of model\.moe\.num_experts \(6\)"),
    (dict(moe={"ffn_hidden_size": 0}), r"model\.moe\.ffn_hidden_size=0"),
    (dict(moe=[1, 2]), r"model\.moe=\[1, 2\] is invalid"),
])
def test_model_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


def test_model_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown key 'model\.hidden_sise': did you mean 'model\.hidden_size'\?"):
        ModelConfig.from_dict({"hidden_sise": 64})
    cfg = ModelConfig.from_dict({"num_layers": 2, "moe": {"num_experts": 4}})
    assert cfg.moe.num_experts == 4 and ModelConfig.from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------- attention
def _reference_attention(q, k, v, keep=None):
    """float64 softmax(Q Kᵀ / sqrt(d) + causal mask) V on [s, b, n, d] -> [s, b, n*d]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    s_q, s_k, d = q.shape[2], k.shape[2], q.shape[3]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q)
    allowed = causal if keep is None else causal & keep
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.permute(2, 0, 1, 3).reshape(s_q, q.shape[0], -1)


def _attention(num_heads=4, head_dim=8, groups=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.megatron.attention import SDPAttention

    tc = TransformerConfig(num_layers=1, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                           num_query_groups=groups, attention_dropout=0.0, use_cpu_initialization=True)
    return SDPAttention(tc, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def test_attention_matches_float64_reference():
    torch.manual_seed(0)
    s, b, n, d = 12, 3, 4, 8
    attn = _attention(n, d)
    q, k, v = (torch.randn(s, b, n, d, requires_grad=True) for _ in range(3))
    out = attn(q, k, v, None)
    assert out.shape == (s, b, n * d) and out.dtype == torch.float32
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference_attention(q64, k64, v64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # gradients too
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), go.double())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)
    # token 0 attends only to itself: its output is its own value vector
    torch.testing.assert_close(out[0].view(b, n, d), v[0].detach(), rtol=1e-5, atol=1e-6)


def test_attention_padding_mask_gqa_and_decoding():
    torch.manual_seed(1)
    s, b, n, d = 10, 2, 4, 8
    # megatron's mask convention: True = masked out; here the last 3 keys of batch 1 are padding
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[1, :, :, -3:] = True
    attn = _attention(n, d)
    q, k, v = (torch.randn(s, b, n, d) for _ in range(3))
    out = attn(q, k, v, mask)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, keep=~mask), rtol=1e-5, atol=1e-5)
    # grouped-query attention: 2 key/value heads shared by 4 query heads
    attn_gqa = _attention(n, d, groups=2)
    kg, vg = torch.randn(s, b, 2, d), torch.randn(s, b, 2, d)
    ref = _reference_attention(q, kg.repeat_interleave(2, dim=2), vg.repeat_interleave(2, dim=2))
    torch.testing.assert_close(attn_gqa(q, kg, vg, None).double(), ref, rtol=1e-5, atol=1e-5)
    # a single query (decoding) sees every key: the causal mask is aligned bottom-right
    out1 = attn(q[-1:], k, v, None)
    torch.testing.assert_close(out1.double(), _reference_attention(q, k, v)[-1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1))


# ----------------------------------------------------------------------------- the model
MODEL_CASES = [
    pytest.param(None, {}, id="dense-gelu"),
    pytest.param(None, dict(activation="swiglu", position_embedding_type="rope",
                            share_embeddings_and_output_weights=False), id="dense-swiglu-rope"),
    pytest.param({"num_experts": 4, "top_k": 2, "mlp_impl": "reference"}, {}, id="moe-reference"),
    pytest.param({"num_experts": 4, "top_k": 1, "mlp_impl": "capacity", "capacity_factor": 1.0},
                 dict(activation="swiglu", position_embedding_type="rope"), id="moe-capacity"),
]


@pytest.mark.parametrize("moe, kw", MODEL_CASES)
def test_forward_per_token_loss_and_backward(ad, moe, kw):
    cfg = tiny(moe=moe, **kw)
    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg)
    loss = model(tokens, pos, attention_mask=None, labels=labels)
    assert loss.shape == (2, cfg.seq_length) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all()
    # near log(V) at init (std 0.02 weights: nearly uniform predictions)
    assert abs(loss.mean().item() - math.log(cfg.vocab_size)) < 0.3
    # the loss is the cross entropy of the logits the same model returns without labels
    logits = model(tokens, pos, attention_mask=None)
    assert logits.shape == (2, cfg.seq_length, cfg.vocab_size)
    ref = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, rtol=1e-5, atol=1e-5)
    loss.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    for layer in ad.moe_layers(model):
        assert layer.router.weight.grad.abs().sum() > 0
        assert int(layer.tokens_per_expert.sum()) == 2 * cfg.seq_length * cfg.moe.top_k
        if cfg.moe.mlp_impl == "capacity":
            assert layer.dropped_fraction is not None and 0 <= float(layer.dropped_fraction) < 1


def test_fused_loss_and_gradients_equal_megatron_cross_entropy(ad):
    """build_gpt_model's fused cross-entropy against the same model with megatron-core's loss
    (GPTModel's own compute_language_model_loss)."""
    cfg = tiny(vocab_size=200)
    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg, seed=3)
    results = []
    for fused in (True, False):
        if not fused:
            del model.compute_language_model_loss  # back to megatron-core's GPTModel method
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, attention_mask=None, labels=labels)
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_f, grads_f), (loss_m, grads_m) = results
    assert loss_f.shape == (2, cfg.seq_length)
    torch.testing.assert_close(loss_f, loss_m, rtol=1e-5, atol=1e-5)
    for name in grads_m:
        torch.testing.assert_close(grads_f[name], grads_m[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("impl", [_impl_param("triton_grouped"), _impl_param("blocksparse")])
def test_triton_paths_match_reference_in_the_model(ad, impl):
    """The same weights through the grouped / block-sparse path give the reference path's loss
    (Triton under the interpreter on the CPU, or its plain-PyTorch fallback)."""
    cfg_ref = tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": "reference", "block_size": 16},
                   seq_length=8, num_layers=1)
    cfg = tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": impl, "block_size": 16},
               seq_length=8, num_layers=1)
    ref_model = ad.build_gpt_model(cfg_ref)
    model = ad.build_gpt_model(cfg)
    model.load_state_dict(ref_model.state_dict())
    tokens, pos, labels = batch(cfg)
    ref = ref_model(tokens, pos, attention_mask=None, labels=labels)
    out = model(tokens, pos, attention_mask=None, labels=labels)
    tol = 1e-2 if DEVICE.type == "cuda" else 1e-4  # Triton's fp32 dots may use TF32 on GPUs
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    out.mean().backward()
    ref.mean().backward()
    w, w_ref = ad.moe_layers(model)[0].experts.w1, ad.moe_layers(ref_model)[0].experts.w1
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=10 * tol, atol=tol / 10)


@needs_triton_kernels
def test_layer_norms_are_ours_and_the_fused_norm_changes_no_result(ad, monkeypatch):
    """Every norm of the model (two per layer, the final one) is megatron_moe's LayerNorm, with
    torch's state-dict keys; with MEGATRON_MOE_FUSED_NORM=1 (the Triton kernels) the loss and every
    gradient equal torch's LayerNorm path's."""
    from megatron_moe.megatron.norm import LayerNorm

    cfg = tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": "reference"}, seq_length=8)
    model = ad.build_gpt_model(cfg)
    norms = [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * cfg.num_layers + 1
    assert all(isinstance(model.get_submodule(n), LayerNorm) for n in norms)
    assert "decoder.final_layernorm.weight" in model.state_dict()
    _switch_changes_no_result(model, batch(cfg), monkeypatch, "MEGATRON_MOE_FUSED_NORM")


def _switch_changes_no_result(model, batch_, monkeypatch, variable: str, check=lambda on: None) -> None:
    """The model's loss and every gradient with ``variable`` 0 and 1: equal (fp32 on the CPU);
    ``check(value)`` after each backward."""
    tokens, pos, labels = batch_
    results = []
    for on in ("0", "1"):
        monkeypatch.setenv(variable, on)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, attention_mask=None, labels=labels)
        loss.mean().backward()
        check(on)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_0, grads_0), (loss_1, grads_1) = results
    torch.testing.assert_close(loss_1, loss_0, rtol=1e-5, atol=1e-5)
    assert grads_1.keys() == grads_0.keys()
    for name in grads_0:
        torch.testing.assert_close(grads_1[name], grads_0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_norm_module_is_torchs_layer_norm_elsewhere_megatrons_norm(ad, monkeypatch):
    """Our LayerNorm module: torch's LayerNorm forward with the switch off, copyable; under
    another normalization (RMSNorm) megatron-core's own module, as the local spec gave; a config
    flag it cannot honour is one clear error."""
    import copy

    from megatron.core.transformer import TransformerConfig

    from megatron_moe.megatron.norm import LayerNorm

    monkeypatch.setenv("MEGATRON_MOE_FUSED_NORM", "0")
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    norm = LayerNorm(cfg, 16, eps=1e-5)
    x = torch.randn(4, 16)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5),
                               rtol=0, atol=0)
    assert torch.equal(copy.deepcopy(norm)(x), norm(x))
    rms = LayerNorm(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm"), 16)
    assert type(rms) is torch.nn.RMSNorm
    with pytest.raises(ValueError, match="TransformerConfig.persist_layer_norm=True"):
        LayerNorm(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, persist_layer_norm=True), 16)


@pytest.mark.parametrize("moe", [None, {"num_experts": 4, "top_k": 2, "mlp_impl": "reference"}], ids=["dense", "moe"])
def test_biases_added_inside_the_gemms_change_no_result(ad, monkeypatch, moe):
    """With MEGATRON_MOE_BIAS_IN_GEMM (the default) the linear layers whose bias megatron-core
    adds after the GEMM (attention's projection, the dense MLP's two) add it inside and hand back
    None; the loss and every gradient equal the switch-off path's, where they hand it back."""
    cfg = tiny(moe=moe, seq_length=8)
    model = ad.build_gpt_model(cfg)
    handed_back = {}

    def record(name):
        return lambda module, args, out: handed_back.__setitem__(name, out[1])

    names = [n for n, m in model.named_modules() if n.endswith(("linear_proj", "linear_fc1", "linear_fc2"))]
    assert len(names) == cfg.num_layers * (3 if moe is None else 1)
    hooks = [model.get_submodule(n).register_forward_hook(record(n)) for n in names]

    def check(on):
        assert all((handed_back[n] is None) == (on == "1") for n in names), (on, handed_back)

    _switch_changes_no_result(model, batch(cfg), monkeypatch, "MEGATRON_MOE_BIAS_IN_GEMM", check)
    for h in hooks:
        h.remove()


def test_fused_gelu_in_the_dense_mlp_changes_no_result(ad, monkeypatch):
    """A dense MLP's first layer and GELU as one op (MEGATRON_MOE_FUSED_GELU, the default): the
    loss and every gradient equal the switch-off path's; the fused backward ran once per dense
    layer with the switch on and never with it off."""
    import megatron_moe.ops.linear as ops_linear

    cfg = tiny(moe=None, seq_length=8)
    model = ad.build_gpt_model(cfg)
    calls = []
    real = ops_linear.dgelu_column_sum_triton
    monkeypatch.setattr(ops_linear, "dgelu_column_sum_triton", lambda *a, **k: calls.append(1) or real(*a, **k))

    def check(on):
        assert len(calls) == (cfg.num_layers if on == "1" else 0), (on, calls)
        calls.clear()

    _switch_changes_no_result(model, batch(cfg), monkeypatch, "MEGATRON_MOE_FUSED_GELU", check)


def test_a_bias_inside_the_gemm_is_the_float64_product_plus_bias(ad, monkeypatch):
    """One RowLinear and one ColumnLinear that hand their bias back, against x @ W^T + b in
    float64 (output and the gradients of x, W and b); not taken where megatron-core's own path is
    asked for (fused weight-gradient accumulation, sequence parallelism) or the switch is 0; the
    column layer hands its bias back where megatron-core fuses it into the activation."""
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.megatron.spec import ColumnLinear, RowLinear

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    init = torch.nn.init.normal_
    row = RowLinear(24, 16, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=True)
    col = ColumnLinear(16, 24, config=cfg, init_method=init, bias=True, gather_output=False, skip_bias_add=True)
    for layer, n_in in ((row, 24), (col, 16)):
        with torch.no_grad():
            layer.bias.normal_()
        x = torch.randn(5, 3, n_in, requires_grad=True)
        out, bias = layer(x)
        assert bias is None and layer.bias_in_gemm()
        x64 = x.detach().double().requires_grad_()
        w64, b64 = (t.detach().double().requires_grad_() for t in (layer.weight, layer.bias))
        ref = x64 @ w64.T + b64
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        dy = torch.randn_like(ref)
        (out.double() * dy).sum().backward()
        (ref * dy).sum().backward()
        for got, want in ((x.grad, x64.grad), (layer.weight.grad, w64.grad), (layer.bias.grad, b64.grad)):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        for attr in ("gradient_accumulation_fusion", "sequence_parallel"):
            monkeypatch.setattr(layer, attr, True)
            assert not layer.bias_in_gemm()
            monkeypatch.undo()
        monkeypatch.setenv("MEGATRON_MOE_BIAS_IN_GEMM", "0")
        assert not layer.bias_in_gemm()
        out, bias = layer(x)
        assert bias is layer.bias
        torch.testing.assert_close(out + bias, ref.detach().float(), rtol=1e-5, atol=1e-5)
        monkeypatch.undo()
    monkeypatch.setattr(col.config, "bias_activation_fusion", True)
    out, bias = col(torch.randn(5, 3, 16))
    assert bias is col.bias and not col.bias_in_gemm()


def test_aux_loss_gradient_reaches_router_through_lm_loss_alone(ad):
    cfg = tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": "reference", "aux_loss_coeff": 0.5,
                    "z_loss_coeff": 0.1, "moe_layer_freq": 2}, num_layers=3)
    model = ad.build_gpt_model(cfg)
    layers = ad.moe_layers(model)
    assert len(layers) == 2
    routers = [m.router.weight for m in layers]
    tokens, pos, labels = batch(cfg)

    def forward():  # deterministic (no jitter, no dropout): every call builds the same graph
        lm = model(tokens, pos, attention_mask=None, labels=labels).mean()
        return lm, sum(m.aux_loss for m in layers)

    def reference(scale):
        """Plain autograd of lm + scale * sum(aux), with the adapter's aux gradient off (scale 0)."""
        ad.set_aux_loss_scale(0.0)
        lm, aux = forward()
        assert aux.requires_grad and aux.item() > 0
        return lm.item(), torch.autograd.grad(lm + scale * aux, routers)

    lm_value, g_lm = reference(0.0)
    _, g_ref = reference(0.25)
    ad.set_aux_loss_scale(0.25)
    lm, _ = forward()
    assert lm.item() == lm_value                       # the forward value is untouched
    g = torch.autograd.grad(lm, routers)               # the LM loss alone
    for a, r, l0 in zip(g, g_ref, g_lm):
        assert (r - l0).abs().sum() > 1e-4             # the aux loss does move the router
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)
    # a plain backward() with the default scale 1 fills .grad as lm + aux would
    _, g_ref1 = reference(1.0)
    ad.set_aux_loss_scale(1.0)
    forward()[0].backward()
    for r, r1 in zip(routers, g_ref1):
        torch.testing.assert_close(r.grad, r1, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="set_aux_loss_scale"):
        ad.set_aux_loss_scale(-1.0)


def test_no_aux_loss_and_eval_mode(ad):
    cfg = tiny(moe={"num_experts": 4, "mlp_impl": "reference", "aux_loss_coeff": 0.0})
    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg)
    model(tokens, pos, attention_mask=None, labels=labels).mean().backward()  # no aux graph: fine
    model.eval()
    with torch.no_grad():
        assert model(tokens, pos, attention_mask=None, labels=labels).shape == (2, cfg.seq_length)


def test_expert_params_marked_and_layers_in_order(ad):
    cfg = tiny(moe={"num_experts": 4, "mlp_impl": "reference", "moe_layer_freq": 2,
                    "shared_expert_ffn_hidden_size": 16}, num_layers=3)
    model = ad.build_gpt_model(cfg)
    mlps = ad.layer_mlps(model)
    assert [m.layer_number for m in mlps] == [1, 2, 3]
    assert [m.is_moe for m in mlps] == [True, False, True]
    assert len(ad.moe_layers(model)) == 2
    expert = {n for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}
    assert expert == {f"decoder.layers.{i}.mlp.moe.experts.{w}" for i in (0, 2) for w in ("w1", "w2")}
    for n, p in model.named_parameters():
        assert (getattr(p, "allreduce", True) is False) == (n in expert), n
    dense = ad.build_gpt_model(tiny())
    assert ad.moe_layers(dense) == [] and not any(getattr(p, "expert_parallel", False)
                                                  for p in dense.parameters())


def test_seeded_init_is_reproducible(ad):
    cfg = tiny(moe={"num_experts": 4, "mlp_impl": "reference"})
    ad.init_megatron(7)
    a = ad.build_gpt_model(cfg).state_dict()
    ad.init_megatron(7)  # idempotent: same parallel state, same seeds
    b = ad.build_gpt_model(cfg).state_dict()
    ad.init_megatron(8)
    c = ad.build_gpt_model(cfg).state_dict()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a[k], b[k]) for k in tensors)
    assert not torch.equal(a["decoder.layers.0.mlp.moe.experts.w1"], c["decoder.layers.0.mlp.moe.experts.w1"])
    with pytest.raises(ValueError, match="init_megatron"):
        ad.init_megatron("7")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; on GPUs megatron's init forks the tracker")
def test_cpu_path_never_uses_the_cuda_rng_tracker(ad, monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    def boom(*a, **k):
        raise AssertionError("the CUDA RNG tracker was used")

    monkeypatch.setattr(mrandom.CudaRNGStatesTracker, "fork", boom)
    cfg = tiny(moe={"num_experts": 4, "mlp_impl": "capacity"}, position_embedding_type="rope")
    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg)
    model(tokens, pos, attention_mask=None, labels=labels).mean().backward()


def test_bf16_autocast_forward_backward(ad):
    cfg = tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": "reference", "moe_layer_freq": 2},
               num_layers=2, position_embedding_type="rope", activation="swiglu",
               share_embeddings_and_output_weights=False)
    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg)
    ref = model(tokens, pos, attention_mask=None, labels=labels).detach()
    device = tokens.device.type
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(tokens, pos, attention_mask=None, labels=labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=0.05, atol=0.05)
    assert not torch.equal(loss.detach(), ref)  # it really ran in bf16
    loss.mean().backward()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
        assert torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("impl", ["triton_grouped", "capacity"])
def test_bf16_params_gpt_with_moe_matches_a_bf16_copy(ad, impl):
    """The megatron-core GPT with our MoE (experts keep their expert_parallel mark on the copies):
    loss and every master gradient equal a deep copy cast to bf16 (megatron_moe/training/precision.py;
    buffers stay fp32 in both)."""
    from megatron_moe.training.precision import BF16Params

    cfg = tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": impl}, position_embedding_type="rope",
               activation="swiglu")
    model = ad.build_gpt_model(cfg)
    ref = ad.build_gpt_model(cfg)  # (megatron modules hold process groups: no deepcopy)
    ref.load_state_dict(model.state_dict())
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    bf16 = BF16Params(model, list(model.parameters()))
    with bf16.compute():
        marks = [n for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)]
        assert marks and all(p.dtype == torch.bfloat16 for p in model.parameters())
        tokens, pos, labels = batch(cfg)
        loss = model(tokens, pos, attention_mask=None, labels=labels).float().mean()
    want = ref(tokens, pos, attention_mask=None, labels=labels).float().mean()
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    loss.backward()
    want.backward()
    for (n, m), r in zip(model.named_parameters(), ref.parameters()):
        assert m.dtype == torch.float32 and m.grad is not None, n
        torch.testing.assert_close(m.grad, r.grad.float(), rtol=0, atol=0, msg=n)


def test_tiny_moe_gpt_trains(ad):
    """A few AdamW steps on one batch: the loss falls (the model learns, routers included)."""
    cfg = tiny(moe={"num_experts": 4, "top_k": 1, "mlp_impl": "capacity", "capacity_factor": 2.0})
    model = ad.build_gpt_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, pos, labels = batch(cfg, b=4)
    router = ad.moe_layers(model)[0].router.weight
    r0 = router.detach().clone()
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(tokens, pos, attention_mask=None, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert not torch.equal(router.detach(), r0)


# ----------------------------------------------------------------------------- Megatron-LM --spec
TINY_RUN_YAML = """\
name: spec-test
model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 2
  ffn_hidden_size: 64
  seq_length: 16
  vocab_size: 128
  moe:
    num_experts: 4
    top_k: 1
    moe_layer_freq: 2
    mlp_impl: reference
"""


def test_megatron_lm_spec_attribute_builds_from_env(ad, tmp_path, monkeypatch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    path = tmp_path / "run.yaml"
    path.write_text(TINY_RUN_YAML)
    monkeypatch.setenv(ad.spec.ENV_CONFIG, str(path))
    monkeypatch.setenv(ad.spec.ENV_OVERRIDES, "model.moe.mlp_impl=capacity model.moe.capacity_factor=2")
    monkeypatch.setenv(ad.spec.ENV_AUX_LOSS_SCALE, "0.125")
    # what Megatron-LM's gpt_builders does with --spec megatron_moe.megatron.spec layer_spec
    spec = import_module(("megatron_moe.megatron.spec", "layer_spec"))
    assert isinstance(spec, ModuleSpec)
    cfg = ModelConfig.from_dict(yaml.safe_load(TINY_RUN_YAML)["model"])
    tcfg = ad.transformer_config(cfg)  # stands in for Megatron-LM's args -> TransformerConfig
    model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16)
    model.to(DEVICE)  # Megatron-LM's get_model moves it to the GPU the same way
    mlps = ad.layer_mlps(model)
    assert [m.is_moe for m in mlps] == [True, False]
    assert ad.moe_layers(model)[0].cfg.mlp_impl == "capacity"
    assert ad.moe_layers(model)[0].cfg.capacity_factor == 2.0
    assert ad.get_aux_loss_scale() == 0.125
    tokens, pos, labels = batch(cfg)
    assert model(tokens, pos, attention_mask=None, labels=labels).shape == (2, 16)
    # Megatron-LM's sizes must match the YAML's
    bad = ad.transformer_config(cfg.replace(hidden_size=64, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"model\.hidden_size=32 .* hidden_size=64 \(--hidden-size\)"):
        GPTModel(config=bad, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16)
    monkeypatch.delenv(ad.spec.ENV_CONFIG)
    with pytest.raises(RuntimeError, match="MEGATRON_MOE_CONFIG"):
        GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16)


# ----------------------------------------------------------------------------- parameter counts
COUNT_CASES = [
    pytest.param(tiny(), id="dense-tied"),
    pytest.param(tiny(activation="swiglu", position_embedding_type="rope",
                      share_embeddings_and_output_weights=False), id="dense-swiglu-rope-untied"),
    pytest.param(tiny(moe={"num_experts": 4, "top_k": 2, "mlp_impl": "reference", "moe_layer_freq": 2,
                           "shared_expert_ffn_hidden_size": 16, "ffn_hidden_size": 48}, num_layers=3),
                 id="moe-freq2-shared-ffn48"),
    pytest.param(tiny(moe={"num_experts": 3, "mlp_impl": "capacity"}, activation="swiglu",
                      share_embeddings_and_output_weights=False), id="moe-swiglu-untied"),
]


@pytest.mark.parametrize("cfg", COUNT_CASES)
def test_count_parameters_matches_built_model(ad, cfg):
    model = ad.build_gpt_model(cfg)
    params = dict(model.named_parameters())  # tied weights appear once
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in params.values())
    emb = sum(p.numel() for n, p in params.items()
              if n.startswith("embedding.") or n.startswith("output_layer."))
    assert counts["embedding"] == emb
    assert counts["non_embedding"] == counts["total"] - emb
    expert = sum(p.numel() for p in params.values() if getattr(p, "expert_parallel", False))
    assert counts["expert"] == expert
    if cfg.moe is not None:
        unused = sum(p.numel() * (1 - cfg.moe.top_k / cfg.moe.num_experts)
                     for p in params.values() if getattr(p, "expert_parallel", False))
        assert counts["active"] == round(counts["total"] - unused)
    else:
        assert counts["active"] == counts["total"]


@pytest.mark.parametrize("cfg", [
    pytest.param(tiny(num_layers=3), id="dense"),
    pytest.param(tiny(activation="swiglu", moe={"num_experts": 4, "top_k": 2, "mlp_impl": "reference",
                                                  "moe_layer_freq": 2}, num_layers=3), id="moe-top2-swiglu"),
])
def test_flops_per_token_matches_counted_matmuls(ad, cfg):
    """torch's FlopCounterMode counts the model's matmuls (forward, and backward = 2x forward);
    SDPA is left out of the count and its 4*s*h per token and layer added analytically."""
    from torch.utils.flop_counter import FlopCounterMode

    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg)
    n_tok = tokens.numel()
    with FlopCounterMode(display=False) as fwd:
        loss = model(tokens, pos, attention_mask=None, labels=labels)
    with FlopCounterMode(display=False) as bwd:
        loss.mean().backward()
    def matmuls(counter):  # SDPA is counted on GPUs only, and with its own backward formula
        return sum(v for op, v in counter.get_flop_counts()["Global"].items()
                   if "scaled_dot_product" not in str(op))

    attention = 4 * cfg.seq_length * cfg.hidden_size * cfg.num_layers * n_tok
    assert flops_per_token(cfg) * n_tok / 3 == pytest.approx(matmuls(fwd) + attention, rel=1e-9)
    assert matmuls(bwd) == pytest.approx(2 * matmuls(fwd), rel=1e-9)


def test_flops_formula_is_narayanan_for_dense_gelu():
    for h, L in [(512, 6), (2048, 24)]:
        cfg = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=h // 64, ffn_hidden_size=4 * h)
        s, V = 1024, 51200
        assert flops_per_token(cfg) == pytest.approx(72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)))
        moe = cfg.replace(moe=MoESection(num_experts=64, top_k=1))
        # top-1 MoE: the same MLP FLOPs per token plus the router (2hE forward, x3)
        assert flops_per_token(moe) - flops_per_token(cfg) == pytest.approx(3 * 2 * h * 64 * L)


def test_peak_tflops_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", torch.bfloat16) == 756.0
    assert peak_tflops("NVIDIA H100 NVL", "bf16") == 835.0
    assert peak_tflops("NVIDIA H200", torch.float16) == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5
    assert peak_tflops("NVIDIA GeForce GTX 1080", torch.bfloat16) is None
    assert peak_tflops("cpu", torch.bfloat16) is None
    with pytest.raises(ValueError, match="dtype"):
        peak_tflops("NVIDIA H100", torch.int8)


# ----------------------------------------------------------------------------- the paper's configs
# Table 1 (dense) and Table 2 (dMoE) of the MegaBlocks paper; moe-* have the dmoe-* shapes.
PAPER = {
    "gpt-xs": (46e6, 512, 6), "gpt-small": (125e6, 768, 12), "gpt-medium": (356e6, 1024, 24),
    "gpt-large": (760e6, 1536, 24), "gpt-xl": (1.3e9, 2048, 24),
    "dmoe-xs": (839e6, 512, 6), "dmoe-small": (3.69e9, 768, 12), "dmoe-medium": (13.0e9, 1024, 24),
    "moe-xs": (839e6, 512, 6), "moe-small": (3.69e9, 768, 12), "moe-medium": (13.0e9, 1024, 24),
}
LR = {"xs": 6e-4, "small": 6e-4, "medium": 3e-4, "large": 2.5e-4, "xl": 2e-4}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_config_shapes_and_parameter_counts(name):
    from megatron_moe.training.run_config import load_config

    cfg = load_config(CONFIGS / f"{name}.yaml", [])
    paper, h, L = PAPER[name]
    m, t = cfg.model, cfg.train
    size = name.split("-")[1]
    assert cfg.name == name
    assert (m.hidden_size, m.num_layers, m.ffn_hidden_size, m.head_dim) == (h, L, 4 * h, 64)
    assert (m.seq_length, m.vocab_size, m.position_embedding_type, m.activation) == \
        (1024, 51200, "learned_absolute", "gelu")
    assert t.global_batch_size == 512 and t.lr == pytest.approx(LR[size])
    assert t.min_lr == pytest.approx(t.lr / 10) and 0 < t.lr_warmup_iters < t.train_iters
    assert cfg.logging.wandb_group == size
    if name.startswith("gpt"):
        assert m.moe is None
    else:
        assert (m.moe.num_experts, m.moe.top_k, m.moe.moe_layer_freq) == (64, 1, 1)
        assert m.moe.mlp_impl == ("capacity" if name.startswith("moe") else "triton_grouped")
        assert m.moe.capacity_factor == 1.0
    total = count_parameters(m)["total"]
    assert abs(total - paper) / paper < 0.02, f"{name}: {total / 1e6:.1f}M vs the paper's {paper / 1e6:.0f}M"


def test_capacity_factor_override_selects_the_other_moe_points():
    from megatron_moe.training.run_config import load_config

    for cf in (1.5, 2):
        cfg = load_config(CONFIGS / "moe-xs.yaml", [f"model.moe.capacity_factor={cf}"])
        assert cfg.model.moe.capacity_factor == float(cf) and cfg.model.moe.mlp_impl == "capacity"
        assert cfg.model.moe_config(1).capacity(1000) == math.ceil(cf * 1000 / 64)


def test_init_megatron_after_the_world_is_recreated(ad):
    """Two runs in one process (the tests, a notebook): the torch.distributed world is destroyed
    and made again; init_megatron rebuilds megatron's now stale groups."""
    from megatron.core import parallel_state

    old_group = parallel_state.get_tensor_model_parallel_group()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ad.init_megatron(3)
    assert parallel_state.get_tensor_model_parallel_group() is not old_group
    ad.init_megatron(3)  # and a second call keeps them
    kept = parallel_state.get_tensor_model_parallel_group()
    ad.init_megatron(4)
    assert parallel_state.get_tensor_model_parallel_group() is kept
    cfg = tiny(moe={"num_experts": 2, "mlp_impl": "reference"})
    model = ad.build_gpt_model(cfg)
    tokens, pos, labels = batch(cfg)
    model(tokens, pos, attention_mask=None, labels=labels).mean().backward()
