"""The fused LM cross-entropy (kernels/cross_entropy.py, megatron_moe/ops/cross_entropy.py) against
float64 log-softmax (in the GPT model against megatron-core's own loss: tests/test_model.py).

On the CPU the kernels run under the Triton interpreter (tests/conftest.py): small shapes only.
"""
from __future__ import annotations

import pytest
import torch

from megatron_moe.kernels.cross_entropy import (cross_entropy_bwd, cross_entropy_bwd_reference,
                                                cross_entropy_fwd, cross_entropy_fwd_reference)
from megatron_moe.ops.cross_entropy import lm_cross_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def float64_reference(logits, labels, dloss):
    x = logits.detach().cpu().double().requires_grad_()
    loss = -torch.log_softmax(x, -1).gather(1, labels.cpu().long()[:, None])[:, 0]
    loss.backward(dloss.cpu().double())
    return loss.detach(), x.grad


# V: one partial block, exactly a block, several blocks with a partial last one (BLOCK_V <= 4096)
@pytest.mark.parametrize("V", [5, 1024, 4096 + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_match_float64(V, dtype):
    g = torch.Generator().manual_seed(V)
    T = 6
    logits = (torch.randn(T, V, generator=g) * 3).to(dtype)
    logits[1] += 1e4  # large logits: no overflow (the max is taken out)
    logits[2, : V // 2] = -1e4  # far below the rest
    labels = torch.randint(0, V, (T,), generator=g)
    labels[0], labels[3] = 0, V - 1  # first and last column
    dloss = torch.randn(T, generator=g)
    want_loss, want_grad = float64_reference(logits, labels, dloss)
    logits_d, labels_d, dloss_d = logits.to(DEVICE), labels.to(DEVICE), dloss.to(DEVICE)
    loss, stats = cross_entropy_fwd(logits_d, labels_d)
    assert loss.dtype == torch.float32 and loss.shape == (T,)
    torch.testing.assert_close(loss.cpu().double(), want_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(stats[:, 0].cpu(), logits.float().amax(-1))
    torch.testing.assert_close(stats.cpu().double().sum(1), torch.logsumexp(logits.double(), -1), rtol=1e-6, atol=1e-5)
    grad = cross_entropy_bwd(logits_d, labels_d, stats, dloss_d)
    assert grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8  # the gradient is rounded to the logits' dtype
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=tol, atol=tol * want_grad.abs().max().item())
    assert torch.equal(logits_d.cpu(), logits)  # not in place unless asked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_and_empty_input(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g).to(dtype).to(DEVICE)
    labels = torch.randint(0, 300, (5,), generator=g).to(DEVICE)
    dloss = torch.randn(5, generator=g).to(DEVICE)
    loss, stats = cross_entropy_fwd(logits, labels)
    fresh = cross_entropy_bwd(logits, labels, stats, dloss)
    out = cross_entropy_bwd(logits, labels, stats, dloss, inplace=True)
    assert out.data_ptr() == logits.data_ptr() and torch.equal(out, fresh)
    empty = torch.zeros(0, 300, dtype=dtype, device=DEVICE)
    loss0, stats0 = cross_entropy_fwd(empty, labels[:0])
    assert loss0.shape == (0,) and cross_entropy_bwd(empty, labels[:0], stats0, dloss[:0]).shape == (0, 300)


def test_reference_matches_float64():
    """The CPU path without the interpreter (the references) is checked on its own too."""
    g = torch.Generator().manual_seed(1)
    logits, labels, dloss = torch.randn(4, 50, generator=g), torch.randint(0, 50, (4,), generator=g), torch.rand(4)
    want_loss, want_grad = float64_reference(logits, labels, dloss)
    loss, stats = cross_entropy_fwd_reference(logits, labels)
    torch.testing.assert_close(loss.double(), want_loss)
    torch.testing.assert_close(cross_entropy_bwd_reference(logits, labels, stats, dloss).double(), want_grad)


def test_op_gradient_and_second_backward_error():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 90, generator=g).to(DEVICE).requires_grad_()
    labels = torch.randint(0, 90, (7,), generator=g).to(DEVICE)
    scaled = logits * 2.0  # the op's input is an intermediate, as the output layer's logits are
    loss = lm_cross_entropy(scaled, labels)
    want = torch.nn.functional.cross_entropy(logits.detach().double().cpu() * 2.0, labels.cpu(), reduction="none")
    torch.testing.assert_close(loss.detach().cpu().double(), want, rtol=1e-5, atol=1e-6)
    loss.sum().backward(retain_graph=True)
    ref = logits.detach().cpu().double().requires_grad_()
    torch.nn.functional.cross_entropy(ref * 2.0, labels.cpu(), reduction="sum").backward()
    torch.testing.assert_close(logits.grad.cpu().double(), ref.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.sum().backward()


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="labels must be"):
        cross_entropy_fwd(torch.randn(3, 4, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy_fwd(torch.zeros(3, 4, dtype=torch.long, device=DEVICE),
                          torch.zeros(3, dtype=torch.long, device=DEVICE))
