"""DroplessMoE end to end against an independent float64 per-token loop.

Every mlp_impl, forward and the gradients of x, the router, w1 and w2, on the edge cases:
1 expert, 64 experts top-1, top_k = num_experts, empty experts, all tokens to one expert,
token counts not a multiple of the block; fp32 (tight) and bf16 (loose).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_moe import DroplessMoE, MoEConfig

DROPLESS = ["reference", "triton_grouped", "torch_grouped_mm", "blocksparse"]
# On a GPU machine the layer runs on the GPU (Triton kernels compiled); on the CPU the kernels
# run under the Triton interpreter (tests/conftest.py). The loop reference always runs in
# float64 on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loop_reference(x_TH, router_EH, w1, w2, cfg: MoEConfig, bias_E=None):
    """float64, one token at a time: logits, scores, top-k, Σ_k weight·expert(x)."""
    x_TH, router_EH, w1, w2 = (t.double().cpu() for t in (x_TH, router_EH, w1, w2))
    ys = []
    for t in range(x_TH.shape[0]):
        logits = router_EH @ x_TH[t]
        scores = torch.softmax(logits, 0) if cfg.score_function == "softmax" else torch.sigmoid(logits)
        select = scores.detach() + (bias_E.double() if bias_E is not None else 0)
        ids = torch.topk(select, cfg.top_k).indices
        w = scores[ids]
        if cfg.normalize_top_k:
            w = w / w.sum()
        y = torch.zeros_like(x_TH[t])
        for k in range(cfg.top_k):
            h = x_TH[t] @ w1[ids[k]]
            if cfg.activation == "gelu":
                a = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
            else:
                g, u = h.chunk(2)
                a = g * torch.sigmoid(g) * u
            y = y + w[k] * (a @ w2[ids[k]])
        ys.append(y)
    return torch.stack(ys)


def make_layer(cfg, seed=0, device="cpu"):
    torch.manual_seed(seed)
    layer = DroplessMoE(cfg).to(device)
    with torch.no_grad():  # weights large enough that the outputs are not tiny
        layer.experts.w1.normal_(0, 0.3)
        layer.experts.w2.normal_(0, 0.3)
        layer.router.weight.normal_(0, 1.0)
    return layer


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_against_loop(cfg, T, dtype=torch.float32, tol=1e-5, x=None, setup=None, device=DEVICE):
    if cfg.mlp_impl == "torch_grouped_mm" and device == "cuda" and dtype != torch.bfloat16:
        pytest.skip("torch._grouped_mm runs bfloat16 on CUDA (its fp32 path is the CPU fallback)")
    layer = make_layer(cfg, device=device)
    if setup is not None:
        setup(layer)
    if x is None:
        x = torch.randn(T, cfg.hidden_size)
    x = x.to(device, dtype).requires_grad_(True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype
    dy = torch.randn_like(y)
    (y * dy).sum().backward()

    params = [layer.router.weight, layer.experts.w1, layer.experts.w2]
    ref_params = [p.detach().double().cpu().requires_grad_(True) for p in params]
    x_ref = x.detach().double().cpu().requires_grad_(True)
    y_ref = loop_reference(x_ref, *ref_params, cfg)
    (y_ref * dy.double().cpu()).sum().backward()

    assert torch.isfinite(y).all()
    assert rel(y, y_ref) < tol, f"forward rel err {rel(y, y_ref)}"
    assert rel(x.grad, x_ref.grad) < tol, f"dx rel err {rel(x.grad, x_ref.grad)}"
    for name, p, r in zip(("router", "w1", "w2"), params, ref_params):
        assert p.grad is not None, name
        if r.grad.norm() == 0:
            assert p.grad.norm() == 0, name
        else:
            assert rel(p.grad, r.grad) < tol, f"d{name} rel err {rel(p.grad, r.grad)}"
    return layer


def cfg_(**kw):
    base = dict(hidden_size=32, ffn_hidden_size=48, num_experts=4, top_k=1, block_size=16,
                aux_loss_coeff=0.0, mlp_impl="reference")
    base.update(kw)
    return MoEConfig(**base)


# ------------------------------------------------------------------------- correctness cases


@pytest.mark.parametrize("impl", DROPLESS)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_matches_loop_top2(impl, activation):
    check_against_loop(cfg_(mlp_impl=impl, activation=activation, top_k=2), T=37)


@pytest.mark.parametrize("impl", DROPLESS)
def test_one_expert(impl):
    check_against_loop(cfg_(mlp_impl=impl, num_experts=1), T=20)


@pytest.mark.parametrize("impl", DROPLESS)
def test_64_experts_top1_with_empty_experts(impl):
    # 40 tokens over 64 experts: most experts are empty.
    layer = check_against_loop(cfg_(mlp_impl=impl, num_experts=64, hidden_size=16, ffn_hidden_size=16), T=40)
    assert (layer.tokens_per_expert == 0).sum() >= 24


@pytest.mark.parametrize("impl", DROPLESS)
def test_top_k_equals_num_experts(impl):
    check_against_loop(cfg_(mlp_impl=impl, num_experts=3, top_k=3, normalize_top_k=True), T=19)


@pytest.mark.parametrize("impl", DROPLESS)
def test_all_tokens_to_one_expert(impl):
    cfg = cfg_(mlp_impl=impl, num_experts=8)

    def setup(layer):
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[5] = 0.1  # wins, without saturating the softmax

    x = torch.rand(33, cfg.hidden_size) + 0.1  # positive: expert 5 wins for every token
    layer = check_against_loop(cfg, T=33, x=x, setup=setup)
    assert layer.tokens_per_expert.cpu().tolist() == [0, 0, 0, 0, 0, 33, 0, 0]


@pytest.mark.parametrize("impl", DROPLESS)
def test_sigmoid_scores_shared_expert_free(impl):
    check_against_loop(cfg_(mlp_impl=impl, score_function="sigmoid", top_k=2), T=21)


@pytest.mark.parametrize("impl", DROPLESS)
def test_bf16(impl):
    check_against_loop(cfg_(mlp_impl=impl, top_k=2), T=37, dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_adds_its_dx_into_the_experts(top_k, monkeypatch):
    """bf16 triton_grouped on local experts: the experts' backward hands dL/dx to the router's
    (ops/router_logits.py's ExpertDx), which adds its own part in its kernel. Against the same step
    with MEGATRON_MOE_ROUTER_DX_ADD=0 (autograd adds the two): the weight gradients the same bits,
    dL/dx within one bf16 rounding of the parts (the fused sum is rounded once, autograd's twice)."""
    from megatron_moe.kernels.switches import setting
    from megatron_moe.ops import router_logits as rl

    cfg = cfg_(mlp_impl="triton_grouped", top_k=top_k, num_experts=8, aux_loss_coeff=0.01)
    handed = []
    monkeypatch.setattr(rl.ExpertDx, "put", lambda self, dx: (handed.append(dx.shape), setattr(self, "dx", dx)))
    grads = {}
    for on in (True, False):
        layer = make_layer(cfg, device=DEVICE)
        x = torch.randn(45, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
        x.requires_grad_(True)
        with setting("MEGATRON_MOE_ROUTER_DX_ADD", on):
            y = layer(x)
            ((y.float() * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum()
             + layer.aux_loss).backward()
        grads[on] = [t.grad.clone() for t in (x, layer.router.weight, layer.experts.w1, layer.experts.w2)]
    assert handed == [(45, cfg.hidden_size)]  # the switch on: one hand-over; off: none
    (dx_on, *w_on), (dx_off, *w_off) = grads[True], grads[False]
    for a, b in zip(w_on, w_off):
        assert torch.equal(a, b)
    assert dx_on.abs().sum() > 0
    # one bf16 rounding of the parts (up to half an ulp of the larger part, more than of their sum
    # where they cancel): a lost or doubled part would be off by the part itself (rel ~0.1-1)
    d = (dx_on.double() - dx_off.double()).abs()
    assert rel(dx_on, dx_off) < 2 ** -8 and (d <= 2 ** -6 * dx_off.double().abs().max()).all()


def test_capacity_without_drops_equals_dropless():
    # capacity_factor = E guarantees room for every assignment: then capacity == dropless.
    layer = check_against_loop(cfg_(mlp_impl="capacity", capacity_factor=4.0, top_k=2), T=29)
    assert layer.dropped_fraction.item() == 0.0


def test_seq_batch_input_shape():
    layer = make_layer(cfg_(top_k=2))
    x = torch.randn(5, 3, 32)
    y = layer(x)
    assert y.shape == (5, 3, 32)
    torch.testing.assert_close(y, layer(x.reshape(15, 32)).reshape(5, 3, 32))


@pytest.mark.parametrize("impl", DROPLESS)
def test_empty_batch(impl):
    """No tokens (e.g. an expert-parallel rank that received none): empty output, zero gradients."""
    layer = make_layer(cfg_(mlp_impl=impl, top_k=2), device=DEVICE)
    dtype = torch.bfloat16 if impl == "torch_grouped_mm" and DEVICE == "cuda" else torch.float32
    x = torch.randn(0, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert x.grad.shape == (0, 32)
    for p in (layer.experts.w1, layer.experts.w2):
        assert p.grad is None or not p.grad.any()


@pytest.mark.parametrize("impl", ["triton_grouped", "torch_grouped_mm", "blocksparse", "capacity"])
def test_weights_interchangeable_between_impls(impl):
    ref = make_layer(cfg_(top_k=2, mlp_impl="reference"), seed=3)
    other = DroplessMoE(cfg_(top_k=2, mlp_impl=impl, capacity_factor=4.0))
    other.load_state_dict(ref.state_dict())
    x = torch.randn(23, 32)
    torch.testing.assert_close(other(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton_grouped", "torch_grouped_mm"])
def test_second_backward_is_a_clear_error(impl):
    """Both fused paths write dL/d(pre) over the saved pre-activation: a second backward through
    the same forward must refuse with a message, not return wrong gradients."""
    layer = make_layer(cfg_(top_k=2, mlp_impl=impl))
    y = layer(torch.randn(17, 32))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.sum().backward()


def test_auto_impl_follows_the_benchmark():
    """'auto' (the default): torch._grouped_mm for wide experts where it runs, our kernels otherwise."""
    from megatron_moe.experts import resolve_mlp_impl

    assert MoEConfig(hidden_size=8, ffn_hidden_size=8).mlp_impl == "auto"
    wide = dict(mlp_impl="auto", hidden_size=4096, ffn_hidden_size=14336)
    assert resolve_mlp_impl(cfg_(**wide), torch.bfloat16, "cuda") == "torch_grouped_mm"
    assert resolve_mlp_impl(cfg_(**wide), torch.bfloat16, "cpu") == "torch_grouped_mm"
    assert resolve_mlp_impl(cfg_(**wide), torch.float32, "cuda") == "triton_grouped"  # bf16-only on CUDA
    assert resolve_mlp_impl(cfg_(**wide, a2a_splits="padded"), torch.bfloat16, "cuda") == "triton_grouped"
    assert resolve_mlp_impl(cfg_(**wide, recompute_activation=True), torch.bfloat16, "cuda") == "triton_grouped"
    for h, f in ((1024, 4096), (2048, 1024), (4096, 4092)):  # narrow, or not a multiple of 8
        assert resolve_mlp_impl(cfg_(mlp_impl="auto", hidden_size=h, ffn_hidden_size=f),
                                torch.bfloat16, "cuda") == "triton_grouped", (h, f)
    for impl in ("blocksparse", "triton_grouped", "torch_grouped_mm", "capacity", "reference"):
        assert resolve_mlp_impl(cfg_(**dict(wide, mlp_impl=impl)), torch.bfloat16, "cuda") == impl


@pytest.mark.parametrize("threshold, expected", [(32, "torch_grouped_mm"), (4096, "triton_grouped")])
def test_auto_impl_runs_the_resolved_path(monkeypatch, threshold, expected):
    """The layer with 'auto' computes through the resolved op and still matches the loop."""
    import megatron_moe.experts as ex

    calls = []
    for name in ("triton_grouped_mlp", "torch_grouped_mm_mlp"):
        fn = getattr(ex, name)
        monkeypatch.setattr(ex, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    monkeypatch.setattr(ex, "AUTO_GROUPED_MM_MIN_WIDTH", threshold)
    check_against_loop(cfg_(mlp_impl="auto", top_k=2), T=19, device="cpu")
    assert calls == [{"torch_grouped_mm": "torch_grouped_mm_mlp", "triton_grouped": "triton_grouped_mlp"}[expected]]


# ------------------------------------------------------------------------- capacity-factor MoE


def capacity_loop(x, wr, w1, w2, top_k, C):
    """Independent capacity MoE, differentiable: walk the assignments k-major (token order within
    each k), count per expert, serve the first C. Returns (y [T, H], assignments kept)."""
    top = torch.topk(torch.softmax(x @ wr.t(), -1), top_k, -1)
    used, rows, kept = [0] * wr.shape[0], [torch.zeros_like(x[0])] * x.shape[0], 0
    for k in range(top_k):
        for t in range(x.shape[0]):
            e = top.indices[t, k].item()
            if used[e] < C:
                used[e] += 1
                kept += 1
                rows[t] = rows[t] + top.values[t, k] * (F.gelu(x[t] @ w1[e], approximate="tanh") @ w2[e])
    return torch.stack(rows), kept


def test_capacity_drops_exactly_the_overflow():
    """k-major, token-order priority: per expert the first `capacity` assignments are served."""
    cfg = cfg_(mlp_impl="capacity", num_experts=4, top_k=2, capacity_factor=1.0)
    layer = make_layer(cfg).double()
    T = 24
    x = torch.randn(T, cfg.hidden_size, dtype=torch.float64)
    y = layer(x)
    C = math.ceil(1.0 * T * 2 / 4)
    assert cfg.capacity(T) == C
    with torch.no_grad():
        y_ref, kept = capacity_loop(x, layer.router.weight, layer.experts.w1, layer.experts.w2, 2, C)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)  # the router runs in fp32
    assert layer.dropped_fraction.item() == pytest.approx(1 - kept / (2 * T))
    assert kept < 2 * T, "the case must actually drop something"


def test_capacity_gradients_with_drops_match_a_loop():
    """The backward through the drop: every gradient equals autograd through the loop, float64."""
    cfg = cfg_(mlp_impl="capacity", num_experts=4, top_k=2, capacity_factor=1.0)
    layer = make_layer(cfg).double()
    T = 21
    x = torch.randn(T, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    g = torch.randn(T, cfg.hidden_size, dtype=torch.float64)
    (layer(x) * g).sum().backward()
    ref = [t.detach().clone().requires_grad_(True)
           for t in (x, layer.router.weight, layer.experts.w1, layer.experts.w2)]
    y_ref, kept = capacity_loop(*ref, 2, cfg.capacity(T))
    assert kept < 2 * T, "the case must actually drop something"
    (y_ref * g).sum().backward()
    for got, want in zip((x, layer.router.weight, layer.experts.w1, layer.experts.w2), ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)  # the router runs in fp32


def test_capacity_all_to_one_expert_drops_the_rest():
    cfg = cfg_(mlp_impl="capacity", num_experts=4, top_k=1, capacity_factor=1.0)
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0
    x = torch.rand(16, 32) + 0.1
    y = layer(x)
    C = cfg.capacity(16)  # 4
    assert (y[:C].abs().sum(-1) > 0).all() and (y[C:] == 0).all()
    assert layer.dropped_fraction.item() == pytest.approx(12 / 16)


# ------------------------------------------------------------------------- router losses


def test_aux_and_z_loss_match_formulas():
    cfg = cfg_(num_experts=6, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    layer = make_layer(cfg)
    x = torch.randn(50, 32)
    layer(x)
    with torch.no_grad():
        logits = (x.double() @ layer.router.weight.double().t())
        p = torch.softmax(logits, -1)
        ids = torch.topk(p, 2, -1).indices
        f = torch.stack([(ids == e).sum() for e in range(6)]).double() / (50 * 2)
        aux = 0.1 * 6 * (f * p.mean(0)).sum()
        z = 0.01 * (torch.logsumexp(logits, -1) ** 2).mean()
    assert layer.load_balancing_loss.item() == pytest.approx(aux.item(), rel=1e-5)
    assert layer.z_loss.item() == pytest.approx(z.item(), rel=1e-5)
    assert layer.aux_loss.item() == pytest.approx((aux + z).item(), rel=1e-5)
    layer.aux_loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.norm() > 0


def test_balanced_routing_aux_loss_is_one():
    from megatron_moe.router import load_balancing_loss

    probs = torch.full((8, 4), 0.25)
    counts = torch.tensor([2, 2, 2, 2])
    assert load_balancing_loss(probs, counts, top_k=1).item() == pytest.approx(1.0)


def test_jitter_only_while_training():
    layer = make_layer(cfg_(jitter_eps=0.5, top_k=2))
    x = torch.randn(10, 32)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_expert_bias_moves_towards_balance():
    cfg = cfg_(expert_bias=True, expert_bias_update_rate=0.1, num_experts=4)
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[1] = 1.0
    x = torch.rand(40, 32) + 0.1
    layer.train()
    layer(x)
    layer.update_expert_bias()
    b = layer.router.expert_bias
    assert b[1] < 0 and (b[[0, 2, 3]] > 0).all()
    # the bias changes selection only, not the combine weights' gradient path
    check_against_loop(cfg, T=12, setup=lambda layer: layer.router.expert_bias.fill_(0.0))


def test_shared_expert_adds_dense_mlp():
    cfg = cfg_(shared_expert_ffn_hidden_size=24)
    layer = make_layer(cfg)
    x = torch.randn(9, 32)
    routed_only = DroplessMoE(cfg_())
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if "shared" not in k})
    shared = F.gelu(x @ layer.shared_expert.w1, approximate="tanh") @ layer.shared_expert.w2
    torch.testing.assert_close(layer(x), routed_only(x) + shared)


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw, field", [
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(num_experts=0), "num_experts"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(hidden_size=32.0), "hidden_size"),
    (dict(mlp_impl="dense"), "mlp_impl"),
    (dict(activation="relu"), "activation"),
    (dict(score_function="tanh"), "score_function"),
    (dict(block_size=100), "block_size"),
    (dict(capacity_factor=0), "capacity_factor"),
    (dict(jitter_eps=1.5), "jitter_eps"),
    (dict(a2a_splits="exact"), "a2a_splits"),
    (dict(a2a_splits="padded", mlp_impl="blocksparse"), "a2a_splits"),
    (dict(aux_loss_coeff=-1), "aux_loss_coeff"),
    (dict(normalize_top_k="yes"), "normalize_top_k"),
    (dict(recompute_activation=1), "recompute_activation"),
    (dict(recompute_activation=True, mlp_impl="torch_grouped_mm"), "recompute_activation"),
    (dict(shared_expert_ffn_hidden_size=-2), "shared_expert_ffn_hidden_size"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field}=.*expected"):
        cfg_(**kw)


def test_bad_input_shape_and_dtype():
    layer = make_layer(cfg_())
    with pytest.raises(ValueError, match="hidden_size=32"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match="floating-point"):
        layer(torch.ones(4, 32, dtype=torch.long))


def test_count_ids_matches_a_loop():
    from megatron_moe.router import count_ids

    ids = torch.randint(0, 7, (50, 3))
    counts = count_ids(ids, 9)
    assert counts.tolist() == [int((ids == e).sum()) for e in range(9)]
    assert count_ids(torch.zeros(0, 2, dtype=torch.long), 4).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, E", [(300, 96, 16), (5, 40, 64), (0, 32, 4)])
def test_router_logits_bf16_split_is_fp32_accurate(device, w_dtype, T, H, E):
    """bf16 x against an fp32 (or bf16) weight: logits and the weight gradient as accurate as an
    fp32 GEMM (float64 reference; one bf16 part alone would be off by ~2^-9), dx to bf16 rounding."""
    from megatron_moe.router import router_logits

    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, H, generator=g).bfloat16().to(device).requires_grad_()
    w = (torch.randn(E, H, generator=g) * 0.02 + 0.5e-3).to(w_dtype).to(device).requires_grad_()
    dl = torch.randn(T, E, generator=g).to(device)
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    logits.backward(dl)
    xd, wd = (t.detach().cpu().double().requires_grad_() for t in (x, w))
    ref = xd @ wd.t()
    ref.backward(dl.cpu().double())
    scale = (xd.abs() @ wd.abs().t()).max().clamp_min(1e-30) if T else 1.0
    assert ((logits.cpu().double() - ref).abs().max() / scale).item() < 1e-6 if T else True
    assert w.grad.dtype == w_dtype and x.grad.dtype == torch.bfloat16
    if T:
        dw_scale = (dl.cpu().double().abs().t() @ xd.abs()).max()
        dw_tol = 1e-6 if w_dtype == torch.float32 else 2 ** -8  # bf16 w: the gradient is rounded to bf16
        assert ((w.grad.cpu().double() - wd.grad).abs().max() / dw_scale).item() < dw_tol
        # dx is bf16: one rounding of the value plus the dropped products (< 2^-15 of Σ|g||w|)
        bound = 2 ** -8 * xd.grad.abs() + 2 ** -15 * (dl.cpu().double().abs() @ wd.detach().abs())
        assert ((x.grad.cpu().double() - xd.grad).abs() <= bound).all()
    else:
        assert w.grad.abs().sum().item() == 0


def test_router_logits_other_dtypes_are_plain_fp32():
    from megatron_moe.router import router_logits

    x, w = torch.randn(7, 12), torch.randn(3, 12)
    assert torch.equal(router_logits(x, w), x @ w.t())
    assert torch.equal(router_logits(x.half(), w), x.half().float() @ w.t())


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton_grouped", "blocksparse"])
def test_layer_forward_backward_without_host_sync(impl):
    """The whole layer (router, metadata, experts, combine), not just the expert op."""
    layer = DroplessMoE(cfg_(mlp_impl=impl, block_size=128, top_k=2, num_experts=8)).cuda()
    x = torch.randn(300, 32, device="cuda", requires_grad=True)
    (layer(x).sum() + layer.aux_loss).backward()  # compile / autotune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (layer(x).sum() + layer.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("impl, dtype", [("triton_grouped", torch.float32), ("triton_grouped", torch.bfloat16),
                                         ("torch_grouped_mm", torch.bfloat16), ("blocksparse", torch.float32),
                                         ("blocksparse", torch.bfloat16)])
def test_layer_replays_from_a_cuda_graph(impl, dtype):
    """Forward + backward captured once in a CUDA graph, replayed on new data (new tokens and
    router weights: other routing, then every token's first choice on one expert) equal the
    float64 loop on that data: sizes are bounded up front and the routing is read on the GPU
    only, so no routing decision of the capture is baked into the replays. bf16 takes the
    kernels' TMA paths on Hopper. An eager step on the default stream comes first: the layer must
    not keep autograd state from it into the capture (it kept its last aux loss's graph once, and
    the capture failed)."""
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    # an aux loss with a graph (not part of the compared backward): what the layer kept
    cfg = cfg_(mlp_impl=impl, block_size=128, top_k=2, num_experts=8, aux_loss_coeff=0.01)
    layer = make_layer(cfg, device="cuda")
    T = 300  # not a multiple of the block
    x = torch.randn(T, cfg.hidden_size, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(T, cfg.hidden_size, device="cuda", dtype=dtype)
    params = [layer.router.weight, layer.experts.w1, layer.experts.w2]

    def step():
        for t in params + [x]:
            t.grad = None
        y = layer(x)
        y.backward(dy)
        return y

    step()  # eager steps on the default stream first, as a training loop would run before capturing
    torch.cuda.synchronize()
    side = torch.cuda.Stream()  # warm-up (compile, autotune) off the capture, as torch's recipe does
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()

    g = torch.Generator().manual_seed(7)
    spread = torch.randn(T, cfg.hidden_size, generator=g), torch.randn(8, cfg.hidden_size, generator=g)
    router_one = torch.randn(8, cfg.hidden_size, generator=g) * 0.01
    router_one[5] = 0.1  # with positive tokens expert 5 is everyone's first choice
    one = torch.rand(T, cfg.hidden_size, generator=g) + 0.1, router_one
    for x_new, router_new in (spread, one):
        with torch.no_grad():
            x.copy_(x_new)
            layer.router.weight.copy_(router_new)
            dy.copy_(torch.randn(T, cfg.hidden_size, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        ref_params = [p.detach().double().cpu().requires_grad_(True) for p in params]
        x_ref = x.detach().double().cpu().requires_grad_(True)
        y_ref = loop_reference(x_ref, *ref_params, cfg)
        y_ref.backward(dy.double().cpu())
        assert rel(y, y_ref) < tol, f"forward rel err {rel(y, y_ref)}"
        assert rel(x.grad, x_ref.grad) < tol, f"dx rel err {rel(x.grad, x_ref.grad)}"
        for name, p, r in zip(("router", "w1", "w2"), params, ref_params):
            assert rel(p.grad, r.grad) < tol, f"d{name} rel err {rel(p.grad, r.grad)}"
    assert layer.tokens_per_expert[5].item() == T  # the last replay's routing, counted on the GPU
