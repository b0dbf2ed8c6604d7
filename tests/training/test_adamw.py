"""The fused AdamW step (kernels/adamw.py, megatron_moe/training/optimizer.py) against a float64 loop of the
AdamW update and against torch.optim.AdamW (scaled gradients, copies refreshed by hand).

On the CPU the kernel runs under the Triton interpreter (tests/conftest.py): small sizes only.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_moe.kernels.adamw import BLOCK, adamw_step_, adamw_step_reference, hyperparameters
from megatron_moe.training.optimizer import AdamW
from megatron_moe.training.grad_reduce import clip_coefficient, clip_grad_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# sizes: one element, a small matrix, more than one block with a partial last one, empty
SHAPES = [(1,), (7, 3), (BLOCK + 904,), (0, 4)]


def float64_adamw(p, g, m, v, *, lr, wd, beta1, beta2, eps, step, scale):
    """One AdamW update (decoupled weight decay, bias-corrected moments) in float64, element by
    element as the paper writes it: returns the new (p, m, v)."""
    p, g, m, v = (t.double().clone() for t in (p, g, m, v))
    g = g * scale
    p = p * (1 - lr * wd)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** step)
    v_hat = v / (1 - beta2 ** step)
    return p - lr * m_hat / (v_hat.sqrt() + eps), m, v


def _rounded(copy, master):
    """copy is master rounded to copy's dtype, bit for bit (as torch's .to() rounds)."""
    assert copy.dtype != master.dtype and torch.equal(copy, master.to(copy.dtype))


@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_kernel_matches_float64_over_steps(copy_dtype):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen) for s in SHAPES]
    ms = [torch.zeros(s) for s in SHAPES]
    vs = [torch.zeros(s) for s in SHAPES]
    want = [(p.double(), m.double(), v.double()) for p, m, v in zip(ps, ms, vs)]
    dev = [[t.to(DEVICE) for t in ts] for ts in (ps, ms, vs)]
    copies = [torch.empty(s, dtype=copy_dtype, device=DEVICE) for s in SHAPES] if copy_dtype else None
    wds = [0.1, 0.0, 0.1, 0.1]
    for step, (lr, scale) in enumerate([(1e-2, 1.0), (3e-3, 0.25), (5e-4, 0.7)], start=1):
        gs = [torch.randn(s, generator=gen) * 10 ** (k - 2) for k, s in enumerate(SHAPES)]
        hyper = [hyperparameters(lr, wd, 0.9, 0.95, 1e-8, step) for wd in wds]
        adamw_step_(dev[0], [g.to(DEVICE) for g in gs], dev[1], dev[2], hyper, copies=copies,
                    grad_scale=torch.tensor(scale, device=DEVICE))
        want = [float64_adamw(p, g, m, v, lr=lr, wd=wd, beta1=0.9, beta2=0.95, eps=1e-8, step=step,
                              scale=scale) for (p, m, v), g, wd in zip(want, gs, wds)]
        for k, (p, m, v) in enumerate(want):
            for got, ref in zip((dev[0][k], dev[1][k], dev[2][k]), (p, m, v)):
                torch.testing.assert_close(got.cpu().double(), ref, rtol=2e-6,
                                           atol=1e-7 * (ref.abs().max().item() if ref.numel() else 1))
            if copies is not None:
                _rounded(copies[k].cpu(), dev[0][k].cpu())



@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's fp16 inf
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copies_round_to_nearest_even_at_the_edges(copy_dtype):
    """lr 0 leaves p as it is: its copy must be torch's rounding of ties (both ways), values
    beyond the copy's range, denormals, signed zeros, infinities and NaN."""
    p = torch.tensor([1.00390625, 1.01171875, -1.00390625, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 3.4e38,
                      -7e4, 1e-40, 6e-8, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), 0.1, -2.5e-3])
    p = torch.cat([p, torch.randn(1000, generator=torch.Generator().manual_seed(9)) * 1e3]).to(DEVICE)
    c = torch.empty_like(p, dtype=copy_dtype)
    z = torch.zeros_like(p)
    adamw_step_([p], [z.clone()], [z.clone()], [z.clone()], [hyperparameters(0.0, 0.0, 0.9, 0.95, 1e-8, 1)],
                copies=[c])
    want = p.to(copy_dtype)
    assert torch.equal(c.isnan(), want.isnan())
    assert torch.equal(c[~want.isnan()], want[~want.isnan()])


def test_kernel_equals_reference_and_checks_inputs():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(300, generator=gen)
    g = torch.randn(300, generator=gen)
    hyper = [hyperparameters(1e-3, 0.1, 0.9, 0.999, 1e-8, 3)]
    a = [p.clone().to(DEVICE), torch.full_like(p, 0.1).to(DEVICE), torch.full_like(p, 0.01).to(DEVICE)]
    b = [t.clone() for t in a]
    adamw_step_([a[0]], [g.to(DEVICE)], [a[1]], [a[2]], hyper, grad_scale=torch.tensor(0.5, device=DEVICE))
    adamw_step_reference([b[0]], [g.to(DEVICE)], [b[1]], [b[2]], hyper, grad_scale=torch.tensor(0.5, device=DEVICE))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="1 params but 2 grads"):
        adamw_step_([p], [g, g], [p.clone()], [p.clone()], hyper)
    with pytest.raises(ValueError, match="contiguous float32"):
        adamw_step_([p], [g.double()], [p.clone()], [p.clone()], hyper)
    with pytest.raises(ValueError, match="contiguous float32"):
        q = torch.randn(4, 6)
        adamw_step_([q.t()], [q.t()], [q.t().clone()], [q.t().clone()], hyper)
    with pytest.raises(ValueError, match="copy 0 must be a contiguous bfloat16 or float16"):
        adamw_step_([p], [g], [p.clone()], [p.clone()], hyper, copies=[p.clone()])
    with pytest.raises(ValueError, match="grad_scale must be a scalar"):
        adamw_step_([p.to(DEVICE)], [g.to(DEVICE)], [p.clone().to(DEVICE)], [p.clone().to(DEVICE)], hyper,
                    grad_scale=torch.ones(2, device=DEVICE))


def float64_adamw_bf16_moments(p, g, m, v, **kw):
    """The float64 update from moments stored in bf16: the step uses the unrounded moments, the
    stored ones are rounded to nearest (returns p, m, v with m and v rounded to bf16)."""
    p, m, v = float64_adamw(p, g, m.double(), v.double(), **kw)
    return p, m.to(torch.bfloat16), v.to(torch.bfloat16)


def _bf16_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 tensors equal but for rare ties (at most 1% of the elements, one rounding step
    apart): rounding to nearest from values a few fp32 ulps apart. Truncation would differ in
    about half of them."""
    got, want = got.cpu().float(), want.cpu().float()
    assert (got != want).float().mean().item() <= 0.01 if got.numel() else True
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)


def test_bf16_moments_match_float64_with_rounded_storage():
    """Moments in bf16 over 3 steps (sizes as above, incl. a partial block and an empty one):
    the masters within fp32 rounding of the float64 update that reads the bf16-stored moments,
    the stored moments within one bf16 rounding step of its rounded ones (a float64 value near a
    tie may round the other way from the kernel's fp32 value), and the kernel as close to its
    reference (the CPU path, fp32 in another order)."""
    gen = torch.Generator().manual_seed(11)
    ps = [torch.randn(s, generator=gen) for s in SHAPES]
    zeros = [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]
    dev = [[t.clone().to(DEVICE) for t in ts] for ts in (ps, zeros, zeros)]
    ref = [[t.clone() for t in ts] for ts in (ps, zeros, zeros)]
    for step, (lr, scale) in enumerate([(1e-2, 1.0), (3e-3, 0.25), (5e-4, 0.7)], start=1):
        gs = [torch.randn(s, generator=gen) * 10 ** (k - 2) for k, s in enumerate(SHAPES)]
        hyper = [hyperparameters(lr, 0.1, 0.9, 0.95, 1e-8, step)] * len(SHAPES)
        # the float64 update starts from the kernel's stored values (a tie rounded the other
        # way in an earlier step must not carry over into this step's comparison)
        want = [float64_adamw_bf16_moments(p.cpu(), g, m.cpu(), v.cpu(), lr=lr, wd=0.1, beta1=0.9,
                                           beta2=0.95, eps=1e-8, step=step, scale=scale)
                for p, g, m, v in zip(dev[0], gs, dev[1], dev[2])]
        adamw_step_(dev[0], [g.to(DEVICE) for g in gs], dev[1], dev[2], hyper,
                    grad_scale=torch.tensor(scale, device=DEVICE))
        adamw_step_reference(ref[0], gs, ref[1], ref[2], hyper, grad_scale=torch.tensor(scale))
        for k, (p, m, v) in enumerate(want):
            assert dev[1][k].dtype == dev[2][k].dtype == torch.bfloat16
            torch.testing.assert_close(dev[0][k].cpu().double(), p, rtol=2e-6,
                                       atol=1e-7 * (p.abs().max().item() if p.numel() else 1))
            for got, r in ((dev[1][k], m), (dev[2][k], v), (dev[1][k], ref[1][k]), (dev[2][k], ref[2][k])):
                assert r.dtype == torch.bfloat16
                _bf16_agree(got, r)
            torch.testing.assert_close(dev[0][k].cpu(), ref[0][k], rtol=1e-6, atol=1e-7)


def test_bf16_moments_refuse_mixed_dtypes():
    p, g = torch.randn(8), torch.randn(8)
    hyper = [hyperparameters(1e-3, 0.0, 0.9, 0.95, 1e-8, 1)] * 2
    bf = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"exp_avg and exp_avg_sq contiguous torch.bfloat16 \(one dtype"):
        adamw_step_([p, p.clone()], [g, g], [bf, torch.zeros(8)], [bf.clone(), torch.zeros(8)], hyper)
    with pytest.raises(ValueError, match="the moments must be float32 or bfloat16"):
        adamw_step_([p], [g], [torch.zeros(8, dtype=torch.float16)], [torch.zeros(8, dtype=torch.float16)],
                    hyper[:1])


def test_optimizer_with_bf16_moments_tracks_fp32_moments_and_moves_checkpoints():
    """AdamW(state_dtype=bf16) against the fp32-moment optimizer over 20 steps of random
    gradients (beta2 0.95): moments stored in bf16 (half the bytes), parameters within 1% of the
    fp32 run's total movement. Checkpoints move both ways: fp32 moments load rounded into bf16,
    bf16 ones load widened into fp32."""
    bf_p, fp_p = _model_params(6), _model_params(6)
    bf = AdamW(_groups(bf_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, state_dtype=torch.bfloat16)
    fp = AdamW(_groups(fp_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    start = [p.detach().clone() for p in fp_p]
    gen = torch.Generator().manual_seed(8)
    for _ in range(20):
        for a, b in zip(bf_p, fp_p):
            a.grad = torch.randn(a.shape, generator=gen).to(DEVICE) * (
                1 + torch.rand(a.shape, generator=gen).to(DEVICE))
            b.grad = a.grad.clone()
        bf.step()
        fp.step()
    for p in bf_p:
        st = bf.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert st["exp_avg"].element_size() * st["exp_avg"].numel() == 2 * p.numel()
    for a, b, s in zip(bf_p, fp_p, start):
        moved = (b.detach() - s).norm()
        assert (a.detach() - b.detach()).norm() < 0.01 * moved
    # fp32 state into a bf16 optimizer, and bf16 state into an fp32 one
    c_p, d_p = _model_params(6), _model_params(6)
    c = AdamW(_groups(c_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, state_dtype=torch.bfloat16)
    c.load_state_dict(copy.deepcopy(fp.state_dict()))
    d = AdamW(_groups(d_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    d.load_state_dict(copy.deepcopy(bf.state_dict()))
    for (pc, pf), (pd, pb) in zip(zip(c_p, fp_p), zip(d_p, bf_p)):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(c.state[pc][k], fp.state[pf][k].to(torch.bfloat16))
            assert d.state[pd][k].dtype == torch.float32
            assert torch.equal(d.state[pd][k], bf.state[pb][k].float())
    with pytest.raises(ValueError, match="bf16 moments need fused_kernel=True"):
        AdamW(_groups(_model_params(6)), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused_kernel=False,
              state_dtype=torch.bfloat16)


def _model_params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(DEVICE).requires_grad_() for s in [(9, 5), (BLOCK + 3,), (5,)]]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


@pytest.mark.parametrize("fused_kernel", [True, False])
def test_optimizer_matches_torch_adamw(fused_kernel):
    """Scaled gradients, a learning rate that changes every step, no decay on one group, and a
    parameter without a gradient for one step (its own step count lags, as in torch)."""
    ours_p, torch_p = _model_params(2), _model_params(2)
    copies = [p.detach().to(torch.bfloat16) for p in ours_p]
    ours = AdamW(_groups(ours_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused_kernel=fused_kernel)
    ours.set_copies(ours_p, copies)
    ref = torch.optim.AdamW(_groups(torch_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        for opt in (ours, ref):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (0.7 ** step)
        grads = [torch.randn(p.shape, generator=gen).to(DEVICE) for p in ours_p]
        scale = torch.tensor(0.5 + 0.1 * step, device=DEVICE)
        for k, (a, b) in enumerate(zip(ours_p, torch_p)):
            skip = step == 2 and k == 0
            a.grad = None if skip else grads[k].clone()
            b.grad = None if skip else grads[k] * scale
        ours.step(grad_scale=scale)
        ref.step()
        for a, b, c in zip(ours_p, torch_p, copies):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
            _rounded(c.cpu(), a.detach().cpu())
    assert ours.fused_kernel == fused_kernel
    assert int(ours.state[ours_p[0]]["step"]) == 4 and int(ours.state[ours_p[1]]["step"]) == 5


def test_prepared_steps_equal_plain_steps(monkeypatch):
    """prepare() then step() (the training step's order) gives the same bits as step() alone: a
    plain sequence, a learning rate changed after prepare() (the step sees the new one), a step
    prepared and then skipped (the counts stay), a gradient replaced after prepare(), and a
    state loaded after it. Only an unchanged preparation is reused."""
    import megatron_moe.training.optimizer as opt_mod

    built = []
    real = opt_mod.adamw_prepare
    monkeypatch.setattr(opt_mod, "adamw_prepare", lambda *a, **k: built.append(1) or real(*a, **k))
    a_p, b_p = _model_params(7), _model_params(7)
    a_c, b_c = ([p.detach().to(torch.bfloat16) for p in ps] for ps in (a_p, b_p))
    a = AdamW(_groups(a_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    b = AdamW(_groups(b_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    a.set_copies(a_p, a_c)
    b.set_copies(b_p, b_c)
    gen = torch.Generator().manual_seed(8)
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen).to(DEVICE) for p in a_p]
        scale = torch.tensor(0.5 + 0.1 * step, device=DEVICE)
        for ps in (a_p, b_p):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        n = len(built)
        a.prepare()
        if step == 1:  # the schedule moves after the preparation
            for opt in (a, b):
                for group in opt.param_groups:
                    group["lr"] = 3e-3
        if step == 2:  # prepared, then skipped (a non-finite step): nothing changes, counts included
            continue
        if step == 3:  # a gradient replaced by another tensor after the preparation
            for ps in (a_p, b_p):
                ps[1].grad = ps[1].grad * 2.0
        if step == 4:  # a checkpoint loaded after the preparation
            state = copy.deepcopy(b.state_dict())
            a.load_state_dict(copy.deepcopy(state))
            b.load_state_dict(state)
        assert len(built) - n == a.fused_kernel  # prepare()'s own build
        n = len(built)
        a.step(grad_scale=scale)
        assert len(built) - n == int(a.fused_kernel and step in (1, 3, 4)), step  # built again or reused
        b.step(grad_scale=scale)
        for x, y, cx, cy in zip(a_p, b_p, a_c, b_c):
            assert torch.equal(x.detach(), y.detach()) and torch.equal(cx, cy), step
    for x, y in zip(a_p, b_p):
        assert int(a.state[x]["step"]) == int(b.state[y]["step"]) == 5
        assert torch.equal(a.state[x]["exp_avg"], b.state[y]["exp_avg"])


def test_state_dict_moves_between_ours_and_torch():
    """Checkpoints: our state loads into torch.optim.AdamW and back, and both go on alike."""
    a_p, b_p, c_p = _model_params(4), _model_params(4), _model_params(4)
    a = AdamW(_groups(a_p), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        for p in a_p:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
        a.step()
    for p, q in zip(b_p + c_p, a_p + a_p):
        p.data.copy_(q.detach())
    b = torch.optim.AdamW(_groups(b_p), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                          fused=True if DEVICE == "cuda" else None)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # load_state_dict keeps the tensors it is given
    c = AdamW(_groups(c_p), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for p in c_p:  # a step of its own first: loading must replace its step counts (host ones too)
        p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
    c.step()
    for p, q in zip(c_p, a_p):
        p.data.copy_(q.detach())
    c.load_state_dict(copy.deepcopy(b.state_dict()))  # torch's (fused on CUDA: steps on the device) back into ours
    if c.fused_kernel:  # the kernel path keeps step counts on the host
        assert all(s["step"].device.type == "cpu" for s in c.state.values())
    grads = [torch.randn(p.shape, generator=gen).to(DEVICE) for p in a_p]
    for opt, ps in ((a, a_p), (b, b_p), (c, c_p)):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    for x, y, z in zip(a_p, b_p, c_p):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(x.detach(), z.detach())
    assert int(c.state[c_p[0]]["step"]) == 3


def test_nothing_to_update_and_no_closures():
    ps = _model_params(6)
    opt = AdamW(_groups(ps), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    before = [p.detach().clone() for p in ps]
    opt.step(grad_scale=torch.tensor(0.5, device=DEVICE))  # no gradients: no change, no state
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, ps)) and not opt.state
    with pytest.raises(ValueError, match="closures are not supported"):
        opt.step(closure=lambda: 0.0)
    with pytest.raises(ValueError, match="2 masters but 1 copies"):
        opt.set_copies(ps[:2], ps[:1])
    if opt.fused_kernel:  # copies for some parameters only: refused, nothing updated
        opt.set_copies(ps[:1], [ps[0].detach().to(torch.bfloat16)])
        for p in ps:
            p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match="2 of 3 parameters have no compute copy"):
            opt.step()
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, ps)) and not opt.state
        # copies of two dtypes: refused by the kernel's checks before any update or step count
        opt.set_copies(ps, [p.detach().to(torch.bfloat16 if k else torch.float16) for k, p in enumerate(ps)])
        with pytest.raises(ValueError, match="the copies must share one dtype"):
            opt.step()
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, ps))
        assert all(float(opt.state[p]["step"]) == 0 for p in ps) and not opt._host_step


def test_zeroing_in_place_is_one_call_per_dtype_and_keeps_the_tensors(monkeypatch):
    """zero_grad(set_to_none=False), as CUDA-graph steps call it: every gradient is zero, is the
    same tensor as before (the graph adds into it), no longer requires grad, and the zeroing is
    one torch._foreach_zero_ per device and dtype; a parameter without a gradient keeps None.
    set_to_none=True frees them as torch's does."""
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((3, 4), (5,), (2, 2))]
    half = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    idle = torch.nn.Parameter(torch.randn(2))
    opt = AdamW([{"params": ps + [idle]}, {"params": [half], "weight_decay": 0.0}], lr=1e-3,
                betas=(0.9, 0.95), eps=1e-8, fused_kernel=False)
    for p in ps + [half]:
        p.grad = torch.randn_like(p)
    ps[0].grad.requires_grad_(True)
    before = [p.grad for p in ps + [half]]
    calls = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (calls.append([t.dtype for t in ts]), real(ts)))
    opt.zero_grad(set_to_none=False)
    assert sorted(calls, key=len) == [[torch.float64], [torch.float32] * 3]
    assert all(p.grad is g and not g.requires_grad and not g.any() for p, g in zip(ps + [half], before))
    assert idle.grad is None
    opt.zero_grad()
    assert all(p.grad is None for p in ps + [half])


def test_clip_coefficient_and_measure_only_norm():
    ps = [torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    ps[0].grad = torch.tensor([3.0, 0.0, 0.0])
    ps[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_grad_norm(ps, max_norm=1.0, scale=False)
    assert math.isclose(float(norm), 5.0, rel_tol=1e-6)
    assert float(ps[0].grad[0]) == 3.0  # measured, not scaled
    assert math.isclose(float(clip_coefficient(norm, 1.0)), 1.0 / (5.0 + 1e-6), rel_tol=1e-6)
    assert float(clip_coefficient(norm, 10.0)) == 1.0  # below the limit: unchanged
    assert clip_coefficient(norm, 0.0) is None  # 0 = no clipping



def test_training_steps_with_bf16_copies_match_the_unfused_sequence():
    """BF16Params + clip (measure only) + step(grad_scale) + copies written by the step, against
    the unfused sequence: clip (scaling the grads), torch's AdamW, BF16Params.refresh."""
    from megatron_moe.training.precision import BF16Params

    torch.manual_seed(7)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4)).to(DEVICE)
    runs = []
    for fused in (True, False):
        model = copy.deepcopy(base)
        params = list(model.parameters())
        bf16 = BF16Params(model, params)
        groups = _groups_of(model)
        if fused:
            opt = AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
            opt.set_copies(bf16.masters, bf16.copies)
        else:
            opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        gen = torch.Generator().manual_seed(8)
        losses = []
        for _ in range(4):
            x = torch.randn(32, 8, generator=gen).to(DEVICE)
            opt.zero_grad(set_to_none=True)
            with bf16.compute():
                loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            losses.append(float(loss.detach()))
            norm = clip_grad_norm(params, max_norm=0.05, scale=not fused)  # clipping active
            assert float(norm) > 0.05
            if fused:
                opt.step(grad_scale=clip_coefficient(norm, 0.05))
            else:
                opt.step()
                bf16.refresh()
        runs.append((losses, [p.detach().clone() for p in params], bf16))
    (l_f, p_f, bf16_f), (l_u, p_u, _) = runs
    assert l_f[0] == l_u[0]
    torch.testing.assert_close(torch.tensor(l_f), torch.tensor(l_u), rtol=1e-3, atol=0)  # bf16 forwards
    for a, b in zip(p_f, p_u):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert not torch.equal(p_f[0], base[0].weight.detach())  # it trained
    for c, m in zip(bf16_f.copies, bf16_f.masters):
        _rounded(c.detach().cpu(), m.detach().cpu())


def _groups_of(model):
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.gpu
def test_large_parameter_on_gpu():
    """More than 2^31 bytes in one parameter (int64 offsets), the copy exact (round to nearest even)."""
    n = 2 ** 29 + 5  # 2 GiB of fp32
    p = torch.randn(n, device="cuda")
    g, m, v = torch.randn_like(p), torch.zeros_like(p), torch.zeros_like(p)
    c = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    tail = p[-1000:].clone()
    hyper = [hyperparameters(1e-3, 0.1, 0.9, 0.95, 1e-8, 1)]
    adamw_step_([p], [g], [m], [v], hyper, copies=[c])
    want, _, _ = float64_adamw(tail, g[-1000:], torch.zeros(1000, device="cuda"), torch.zeros(1000, device="cuda"),
                               lr=1e-3, wd=0.1, beta1=0.9, beta2=0.95, eps=1e-8, step=1, scale=1.0)
    torch.testing.assert_close(p[-1000:].double(), want, rtol=2e-6, atol=1e-7)
    assert torch.equal(c, p.to(torch.bfloat16))
