"""bf16 compute copies over fp32 masters (megatron_moe/training/precision.py): gradients accumulated in
fp32 over micro-batches, tied and unused parameters, refresh, the reducer's readiness calls
(the megatron-core GPT with our MoE: tests/megatron/test_model.py; training: tests/training/test_train.py).

    pytest tests/training/test_precision.py -q        # seconds on the CPU

The independent reference throughout: a deep copy of the model cast to bf16 with ``.to()``,
run on the same micro-batches, each micro-batch's gradients summed in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from megatron_moe.training.precision import BF16Params

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class Tiny(nn.Module):
    """Embedding tied to the output, a LayerNorm, a biased Linear, an unused parameter, a buffer."""

    def __init__(self, vocab=11, hidden=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.unused = nn.Parameter(torch.ones(3))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + torch.nn.functional.gelu(self.fc(self.norm(h))) * self.scale.to(h.dtype)
        return self.out(h).float().logsumexp(-1).mean()


def _unique(model):
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _micro_batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (4, 7), generator=g).to(DEVICE) for _ in range(n)]


def test_master_grads_are_the_fp32_sum_of_the_bf16_micro_batch_grads():
    torch.manual_seed(0)
    model = Tiny().to(DEVICE)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    ready = []
    bf16 = BF16Params(model, _unique(model), grad_ready=lambda p: ready.append((p, p.grad.clone())))
    masters = bf16.masters
    batches = _micro_batches()
    for tokens in batches:
        with bf16.compute():
            loss = model(tokens)
        loss.backward()
    # outside compute(): the modules hold the fp32 masters again, no grad on any bf16 copy
    assert [p for p in _unique(model)] == masters
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(c.grad is None for c in bf16.copies)
    # reference: each micro-batch on the bf16 model, gradients summed in float64
    want = {id(p): torch.zeros(p.shape, dtype=torch.float64, device=DEVICE) for p in _unique(ref)}
    for tokens in batches:
        for p in _unique(ref):
            p.grad = None
        ref(tokens).backward()
        for p in _unique(ref):
            if p.grad is not None:
                want[id(p)] += p.grad.double()
    for m, r in zip(masters, _unique(ref)):
        if m is model.unused:
            assert m.grad is None  # never used: no gradient, no readiness call
            continue
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad.double(), want[id(r)], rtol=1e-6, atol=1e-7)
    # one readiness call per used master per backward, with its complete gradient so far
    used = [m for m in masters if m is not model.unused]
    assert len(ready) == len(used) * len(batches)
    last = {id(p): g for p, g in ready}
    for m in used:
        assert torch.equal(last[id(m)], m.grad)


def test_tied_weight_has_one_copy_in_both_places_and_refresh_rounds_the_masters():
    model = Tiny().to(DEVICE)
    bf16 = BF16Params(model, _unique(model))
    with bf16.compute():
        assert model.out.weight is model.emb.weight
        assert model.emb.weight.dtype == torch.bfloat16
        assert model.scale.dtype == torch.float32  # buffers are not converted
    with torch.no_grad():
        for p in bf16.masters:
            p.add_(0.1234567)
    fc_master = model.fc.weight  # outside compute(): the master
    with bf16.compute():  # not refreshed yet: the old rounding
        assert model.fc.weight is not fc_master
        assert not torch.equal(model.fc.weight, fc_master.detach().to(torch.bfloat16))
    bf16.refresh()
    for c, m in zip(bf16.copies, bf16.masters):
        assert torch.equal(c, m.detach().to(torch.bfloat16))
    # a forward in compute() equals the plain bf16 model's
    ref = copy.deepcopy(model).to(torch.bfloat16)
    tokens = _micro_batches(1)[0]
    with bf16.compute():
        got = model(tokens)
    assert torch.equal(got, ref(tokens))


def test_compute_restores_the_masters_after_an_error():
    model = Tiny().to(DEVICE)
    bf16 = BF16Params(model, _unique(model))
    with pytest.raises(RuntimeError, match="boom"):
        with bf16.compute():
            raise RuntimeError("boom")
    assert _unique(model) == bf16.masters


def test_masters_must_be_fp32():
    model = Tiny().to(DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="master parameters must be fp32"):
        BF16Params(model, _unique(model))


# ------------------------------------------------------------- gradient-accumulation fusion
class TinyMoE(nn.Module):
    """A dense Linear then the grouped expert MLP (kernels/grouped.py) over fixed routing."""

    def __init__(self, E=4, H=24, F=20):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.proj = nn.Linear(H, H)  # (initialised below: every TinyMoE() is the same model)
        self.w1 = nn.Parameter(torch.randn(E, H, F, generator=g) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, F, H, generator=g) / F ** 0.5)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(H, H, generator=g) / H ** 0.5)
            self.proj.bias.copy_(torch.randn(H, generator=g) * 0.1)

    def hidden(self, x):
        return self.proj(x.to(self.proj.weight.dtype))

    def forward(self, x, ids, weights):
        from megatron_moe.kernels.metadata import routing_metadata
        from megatron_moe.ops.triton_grouped_mlp import triton_grouped_mlp

        y = triton_grouped_mlp(self.hidden(x), self.w1, self.w2, weights, routing_metadata(ids, self.w1.shape[0], 16),
                        "gelu")
        return y.float().square().mean()


def _moe_micro_batches(n=3, T=19, H=24, E=4, seed=5):
    """[T, 2] expert ids (expert E-1 never chosen; expert 0 takes most rows), fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:2] for _ in range(T)])
        ids[: T // 2, 0] = 0
        ids[: T // 2, 1] = 1 + torch.randint(0, E - 2, (T // 2,), generator=g)
        out.append((torch.randn(T, H, generator=g).to(DEVICE), ids.to(DEVICE),
                    torch.rand(T, 2, generator=g).to(DEVICE)))
    return out


def _fused_and_plain(batches):
    """(fused, plain): the same TinyMoE under BF16Params with and without the fusion, each
    micro-batch's backward run; returns the BF16Params and their readiness logs."""
    runs = []
    for fuse in (True, False):
        model = TinyMoE().to(DEVICE)
        ready = []
        bf16 = BF16Params(model, list(model.parameters()), grad_ready=lambda p, r=ready: r.append(p),
                          fuse_grad_accumulation=fuse)
        for x, ids, w in batches:
            with bf16.compute():
                loss = model(x, ids, w)
            loss.backward()
        runs.append((model, bf16, ready))
    return runs


def test_fused_grad_accumulation_matches_float64_and_the_unfused_path():
    """train.grad_accumulation_fusion: the experts' master gradients are the fp32 sums of each
    micro-batch's gradient (no bf16 rounding of each): within bf16 noise of a float64 loop and
    of the unfused path, not equal to the unfused path's bit for bit; the dense Linear's
    gradient is untouched (bit-equal); one readiness call per master per backward either way;
    no bf16 gradient is ever kept on a copy."""
    from megatron_moe.experts import reference_experts

    batches = _moe_micro_batches()
    (fused, fbf, fready), (plain, pbf, pready) = _fused_and_plain(batches)
    assert all(c.grad is None for c in fbf.copies)
    for run, ready in ((fused, fready), (plain, pready)):
        counts = {n: sum(p is q for q in ready) for n, p in run.named_parameters()}
        assert counts == {n: len(batches) for n in counts}, counts
    # float64: each micro-batch through the plain loop on the bf16 copies' values
    copy_of = {id(m): c for m, c in zip(fbf.masters, fbf.copies)}
    c_w1, c_w2, c_proj_w, c_proj_b = (copy_of[id(p)].detach().double().requires_grad_()
                                      for p in (fused.w1, fused.w2, fused.proj.weight, fused.proj.bias))
    for x, ids, w in batches:
        h = (x.to(torch.bfloat16) @ c_proj_w.to(torch.bfloat16).t() + c_proj_b.to(torch.bfloat16)).double()
        y = reference_experts(h, c_w1, c_w2, ids, w.double(), "gelu")
        (y.square().mean()).backward()
    for name, got, want in (("w1", fused.w1.grad, c_w1.grad), ("w2", fused.w2.grad, c_w2.grad)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert got.dtype == torch.float32 and err < 2e-2, (name, err)
        other = getattr(plain, name).grad
        err = ((got - other).abs().max() / other.abs().max()).item()
        assert 0 < err < 1e-2, (name, err)  # the unfused sum rounded each micro-batch to bf16
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # expert 3 never chosen
    for n in ("weight", "bias"):
        assert torch.equal(getattr(fused.proj, n).grad, getattr(plain.proj, n).grad), n


def test_fused_grad_accumulation_adds_in_fp32():
    """Micro-batch 2's gradient added into micro-batch 1's in the kernel's epilogue equals the
    two gradients computed apart (each from an empty .grad) and summed in float64, to fp32
    rounding: the accumulate path and the first-write path agree."""
    b1, b2 = _moe_micro_batches(2)
    grads = []
    for batches in ([b1], [b2], [b1, b2]):
        model = TinyMoE().to(DEVICE)
        bf16 = BF16Params(model, list(model.parameters()), fuse_grad_accumulation=True)
        for x, ids, w in batches:
            with bf16.compute():
                loss = model(x, ids, w)
            loss.backward()
        grads.append((model.w1.grad.clone(), model.w2.grad.clone()))
    for g1, g2, g12 in zip(*grads):
        want = g1.double() + g2.double()
        assert ((g12.double() - want).abs().max() / want.abs().max()).item() < 1e-6
