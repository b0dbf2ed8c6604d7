"""The ping-pong Gluon kernel of the row-grouped GEMM's forward (kernels/gluon_pingpong.py): which calls
it takes (CPU), and on an sm_90 GPU its results against float64 (a loop over the experts).

    pytest tests/kernels/test_gluon_pingpong.py          # CPU: what supported() takes, the dispatch
    pytest tests/kernels/test_gluon_pingpong.py -m gpu   # sm_90: the kernel against the reference

Gluon does not run under Triton's interpreter; tests/kernels/test_compile_hopper.py compiles the kernel for
sm_90 (ptxas) on the CPU.
"""
import os
import sys

import pytest
import torch

from megatron_moe.kernels import gluon_gemm as GG
from megatron_moe.kernels import gluon_pingpong as GP
from megatron_moe.kernels import grouped as G

sys.path.insert(0, os.path.dirname(__file__))
import _float64 as f64  # noqa: E402

bf16 = torch.bfloat16


def _offsets(counts, device="cpu"):
    return torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32).to(device)


@pytest.fixture
def as_if_sm90(monkeypatch):
    for mod in (GG, GP):
        monkeypatch.setattr(mod, "on_sm90", lambda t: True)
        monkeypatch.setattr(mod, "available", lambda: True)
    monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM", raising=False)  # both on by default
    monkeypatch.delenv("MEGATRON_MOE_GLUON_PINGPONG", raising=False)


def _gelu_call(S=300, K=192, N=256, E=3):
    """The GELU up projection's arguments: 40 tokens gathered, the router weights as act_scale."""
    return ((torch.randn(40, K).to(bf16), torch.randn(E, K, N).to(bf16), _offsets([100, 0, 200][:E])),
            dict(gather_S=torch.randint(0, 40, (S,)).to(torch.int32), activation="gelu",
                 act_scale_S=torch.rand(S)))


@pytest.mark.parametrize("case", ["gelu, gathered, scaled", "gelu, sorted rows", "gelu, long K",
                                  "plain, K at the limit", "plain, transposed w (input gradient)"])
def test_supported_takes(as_if_sm90, case):
    (a, w, offsets), kw = _gelu_call()
    if case == "gelu, sorted rows":
        a, kw = torch.randn(300, 192).to(bf16), dict(activation="gelu")
    elif case == "gelu, long K":  # GELU's epilogue pays at every K
        (a, w, offsets), kw = _gelu_call(K=4096)
    elif case == "plain, K at the limit":
        a, w, kw = torch.randn(300, GP.PLAIN_MAX_K).to(bf16), torch.randn(3, GP.PLAIN_MAX_K, 256).to(bf16), {}
    elif case == "plain, transposed w (input gradient)":
        a, w, kw = torch.randn(300, 256).to(bf16), torch.randn(3, 384, 256).to(bf16).transpose(1, 2), {}
    assert GP.supported(a, w, offsets, **kw)


@pytest.mark.parametrize("case", ["switch off", "its own switch off", "swiglu (gluon_gemm's)",
                                  "plain, K past the limit (gluon_gemm's)", "scale", "scatter",
                                  "gather without an activation", "act_scale without an activation", "bf16 act_scale",
                                  "fp32", "fp32 out", "N not a multiple of 128", "K not a multiple of 64",
                                  "gelu, transposed w", "a's rows not 16-element aligned", "no rows",
                                  "offsets of another E"])
def test_supported_refuses(as_if_sm90, monkeypatch, case):
    (a, w, offsets), kw = _gelu_call()
    if case == "switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "0")
    elif case == "its own switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_PINGPONG", "0")
    elif case == "swiglu (gluon_gemm's)":
        kw["activation"] = "swiglu"
        assert GG.supported(a, w, offsets, **kw)
    elif case == "plain, K past the limit (gluon_gemm's)":
        K = GP.PLAIN_MAX_K + 64
        a, w, kw = torch.randn(300, K).to(bf16), torch.randn(3, K, 256).to(bf16), {}
        assert GG.supported(a, w, offsets)
    elif case == "scale":
        kw["scale_S"] = torch.ones(300)
    elif case == "scatter":
        a, kw = torch.randn(300, 192).to(bf16), dict(scatter_S=torch.randperm(300).to(torch.int32))
    elif case == "gather without an activation":
        del kw["activation"], kw["act_scale_S"]
    elif case == "act_scale without an activation":
        a, kw = torch.randn(300, 192).to(bf16), dict(act_scale_S=torch.ones(300))
    elif case == "bf16 act_scale":
        kw["act_scale_S"] = kw["act_scale_S"].to(bf16)
    elif case == "fp32":
        a, w = a.float(), w.float()
    elif case == "fp32 out":
        kw["out_dtype"] = torch.float32
    elif case == "N not a multiple of 128":
        w = w[..., :192].contiguous()
    elif case == "K not a multiple of 64":
        a, w = a[:, :160].contiguous(), w[:, :160].contiguous()
    elif case == "gelu, transposed w":
        w = torch.randn(3, 256, 192).to(bf16).transpose(1, 2)
    elif case == "a's rows not 16-element aligned":
        a = torch.randn(40, 200).to(bf16)[:, :192]
    elif case == "no rows":
        offsets, kw = torch.zeros(4, dtype=torch.int32), dict(activation="gelu")
        a = a[:0]
    elif case == "offsets of another E":
        offsets = offsets[:-1]
    assert GP.supported(a, w, offsets, **kw) is False


def test_supported_refuses_without_a_gpu():
    args, kw = _gelu_call()
    assert GP.supported(*args, **kw) is False


def test_grouped_gemm_sends_what_the_kernel_takes_there(monkeypatch):
    calls = []
    monkeypatch.setattr(GP, "supported", lambda *a, **kw: True)
    monkeypatch.setattr(GP, "grouped_gemm_pingpong", lambda a, w, offsets, **kw: calls.append(kw) or "pingpong")
    args, kw = _gelu_call()
    assert G.grouped_gemm(*args, **kw) == "pingpong"
    assert calls == [kw]
    with pytest.raises(ValueError, match="gather_S"):  # the Triton path's checks run first
        G.grouped_gemm(*args, **dict(kw, gather_S=kw["gather_S"].float()))


# ----------------------------------------------------------------------------------------------
# The kernel (GPU)
# ----------------------------------------------------------------------------------------------

CASES = {  # K, N, rows per expert (tiles alternate between the two consumers: odd and even counts)
    "empty experts, partial tiles": (192, 256, [0, 100, 0, 200]),
    "all rows to one expert": (128, 256, [0, 384, 0]),
    "rows not a multiple of 128, short and long experts": (512, 384, [130, 1, 63, 64, 65, 677]),
    "every tile full": (256, 128, [128, 128, 256]),
    "one tile": (64, 128, [5]),
    "more tiles than programs walk twice": (128, 128, [128 * 9 + 17] * 40),
    # both consumers a tile a program or more, each 16 ring steps deep (more than three times the
    # ring: a consumer that waited on a slot out of turn would read another tile's operands)
    "long K, several tiles a program": (1024, 256, [300] * 70),
}
VARIANTS = {  # gathered, activation, act_scale, w the transposed view of a contiguous [E, N, K]
    "gelu, gathered, scaled (up projection)": (True, "gelu", True, False),
    "gelu, sorted rows": (False, "gelu", False, False),
    "plain (down projection)": (False, None, False, False),
    "plain, transposed w (input gradient)": (False, None, False, True),
}


def _on_gpu_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GP.available()


def _close(got, want, what, rel=2.0 ** -8):
    """bf16's rounding of each value and the fp32 sums' order (1e-4 of the largest)."""
    err = (got.double() - want).abs()
    bound = want.abs() * rel + 1e-4 * want.abs().max().item()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3e}, {(err > bound).sum().item()} over"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_pingpong_gemm_matches_float64_reference(case, variant, monkeypatch):
    """out = a[gather(s)] @ w[e] (GELU: pre, and act_scale(s)·gelu(pre) of the rounded pre) against a
    float64 loop over the experts; the same bits as a second call and as the Triton kernel's pre."""
    monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM", raising=False)  # both on by default
    monkeypatch.delenv("MEGATRON_MOE_GLUON_PINGPONG", raising=False)
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    K, N, counts = CASES[case]
    gathered, activation, scaled, transposed = VARIANTS[variant]
    if activation is None and K > GP.PLAIN_MAX_K:
        K = GP.PLAIN_MAX_K  # the plain product's longest reduction here
    gen = torch.Generator().manual_seed(4)
    offsets = _offsets(counts, "cuda")
    S, E = sum(counts), len(counts)
    # the sorted a: 9 padding rows past the last expert (their output rows are not written); a
    # gathered a: 40 source rows (repeats, as top-k > 1 has), read in a random order
    a = torch.randn(40 if gathered else S + 9, K, generator=gen).to(bf16).cuda()
    if transposed:
        w = (torch.randn(E, N, K, generator=gen) / K ** 0.5).to(bf16).cuda().transpose(1, 2)
    else:
        w = (torch.randn(E, K, N, generator=gen) / K ** 0.5).to(bf16).cuda()
    kw = dict(activation=activation) if activation else {}
    if gathered:
        kw["gather_S"] = torch.randint(0, 40, (S,), generator=gen).to(torch.int32).cuda()
    if scaled:
        kw["act_scale_S"] = torch.rand(S, generator=gen).cuda()
    assert GP.supported(a, w, offsets, **kw), "the kernel must take this call"
    got = G.grouped_gemm(a, w, offsets, **kw)
    got = (got,) if activation is None else got
    torch.cuda.synchronize()
    rows = torch.arange(S) if not gathered else kw["gather_S"].cpu().long()
    bounds, w64, a64 = offsets.cpu().tolist(), w.double().cpu(), a.double().cpu()
    want = torch.cat([a64[rows[lo:hi]] @ w64[e] for e, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
    # a sorted a's output has its 9 padding rows too (not written)
    assert all(g.dtype == bf16 and g.shape == (S if gathered else S + 9, N) for g in got)
    _close(got[0][:S].cpu(), want, f"{variant}: pre" if activation else f"{variant}: out")
    if activation:  # of the kernel's own rounded pre-activation (the hardware tanh: 2^-11)
        want_act = f64.gelu(got[0][:S].cpu().double())
        if scaled:
            want_act = want_act * kw["act_scale_S"].cpu().double()[:, None]
        _close(got[1][:S].cpu(), want_act, f"{variant}: act", rel=2.0 ** -7)
    again = G.grouped_gemm(a, w, offsets, **kw)
    again = (again,) if activation is None else again
    assert all(torch.equal(x[:S], y[:S]) for x, y in zip(got, again)), "a second call gave other bits"
    tri = G.grouped_gemm_triton(a, w, offsets, **kw)
    tri = (tri,) if activation is None else tri
    for x, y, what in zip(got, tri, ("pre", "act")):  # the same sums in another order: within rounding
        x, y = x[:S].float(), y[:S].float()
        assert (x - y).abs().max() <= 2e-2 * y.abs().max(), f"{what} against Triton's"
