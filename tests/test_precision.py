"""bf16 compute copies over fp32 masters (megatron_moe/precision.py): gradients accumulated in
fp32 over micro-batches, tied and unused parameters, refresh, the reducer's readiness calls
(the megatron-core GPT with our MoE: tests/test_model.py; training: tests/test_train.py).

    pytest tests/test_precision.py -q        # seconds on the CPU

The independent reference throughout: a deep copy of the model cast to bf16 with ``.to()``,
run on the same micro-batches, each micro-batch's gradients summed in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from megatron_moe.precision import BF16Params

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
