"""The ping-pong Gluon kernel of the activation's backward (kernels/gluon_dact.py): which calls it
takes (CPU), and on an sm_90 GPU its results against float64 (a loop over the rows).

    pytest tests/kernels/test_gluon_dact.py          # CPU: what supported() takes
    pytest tests/kernels/test_gluon_dact.py -m gpu   # sm_90: the kernel against the reference

Gluon does not run under Triton's interpreter; tests/kernels/test_compile_hopper.py compiles the kernel for
sm_90 (ptxas) on the CPU.
"""
import os
import sys

import pytest
import torch

from megatron_moe.kernels import gluon_dact as GD
from megatron_moe.kernels import grouped as G

sys.path.insert(0, os.path.dirname(__file__))
import _float64 as f64  # noqa: E402

bf16 = torch.bfloat16


def _offsets(counts, device="cpu"):
    return torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32).to(device)


@pytest.fixture
def as_if_sm90(monkeypatch):
    monkeypatch.setattr(GD, "on_sm90", lambda t: True)
    monkeypatch.setattr(GD, "available", lambda: True)
    monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM", raising=False)  # both on by default
    monkeypatch.delenv("MEGATRON_MOE_GLUON_DACT", raising=False)


def _operands(activation="swiglu", S=300, K=192, N=256, E=3, device="cpu"):
    X = 2 * N if activation == "swiglu" else N
    gen = torch.Generator().manual_seed(3)
    counts = [100, 0, 200][:E] if S == 300 else None
    return ((torch.randn(40, K, generator=gen).to(bf16).to(device),
             (torch.randn(E, N, K, generator=gen) / K ** 0.5).to(bf16).to(device).transpose(1, 2),
             _offsets(counts, device), torch.randn(S, X, generator=gen).to(bf16).to(device), activation),
            dict(gather_S=torch.randint(0, 40, (S,), generator=gen).to(torch.int32).to(device),
                 scale_S=torch.rand(S, generator=gen).to(device)))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_supported_takes(as_if_sm90, activation):
    args, kw = _operands(activation)
    assert GD.supported(*args, **kw)
    assert GD.supported(torch.randn(300, 192).to(bf16), *args[1:])  # sorted rows, no scale


@pytest.mark.parametrize("case", ["switch off", "its own switch off", "fp32", "contiguous w",
                                  "N not a multiple of 128", "K not a multiple of 64", "pre of another width",
                                  "bf16 scale", "unknown activation", "no rows"])
def test_supported_refuses(as_if_sm90, monkeypatch, case):
    (a, w, offsets, pre, act), kw = _operands()
    if case == "switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "0")
    elif case == "its own switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_DACT", "0")
    elif case == "fp32":
        a, w, pre = a.float(), w.float(), pre.float()
    elif case == "contiguous w":
        w = w.contiguous()
    elif case == "N not a multiple of 128":
        (a, w, offsets, pre, act), kw = _operands(N=192)
    elif case == "K not a multiple of 64":
        a, w = a[:, :160].contiguous(), torch.randn(3, 256, 160).to(bf16).transpose(1, 2)
    elif case == "pre of another width":
        pre = pre[:, :256].contiguous()
    elif case == "bf16 scale":
        kw["scale_S"] = kw["scale_S"].to(bf16)
    elif case == "unknown activation":
        act = "relu"
    elif case == "no rows":
        offsets, pre, kw = torch.zeros(4, dtype=torch.int32), pre[:0], {}
        a = a[:0]
    assert GD.supported(a, w, offsets, pre, act, **kw) is False


def test_grouped_gemm_dact_sends_what_the_kernel_takes_there(monkeypatch):
    calls = []
    monkeypatch.setattr(GD, "supported", lambda *a, **kw: True)
    monkeypatch.setattr(GD, "grouped_gemm_dact_pingpong", lambda *a, **kw: calls.append(kw) or "gluon")
    args, kw = _operands()
    assert G.grouped_gemm_dact(*args, **kw, inplace=True) == "gluon"
    assert calls == [dict(kw, inplace=True)]
    with pytest.raises(ValueError, match="pre_SX"):  # the Triton path's checks run first
        G.grouped_gemm_dact(*args[:3], args[3][:, :256], "swiglu", **kw)


@pytest.mark.parametrize("activation, K, step", [("gelu", 128, 128), ("gelu", 2048, 128), ("gelu", 192, 64),
                                                 ("gelu", 64, 64), ("swiglu", 128, 64), ("swiglu", 192, 64)])
def test_tile_for_takes_gelus_deep_steps_where_k_allows(activation, K, step):
    """GELU's ring of 128-deep steps where they divide K, else 64-deep ones; every tile fits the
    227 KB of an SM's shared memory beside its pre-activation buffer, and its step divides K."""
    tile = rows, cols, got_step, slots = GD.tile_for(activation, K)
    assert got_step == step and K % got_step == 0 and (rows, cols) == (GD.BLOCK_M, GD.BLOCK_N)
    assert GD.smem_bytes(tile, activation) <= 227 * 1024 and slots >= 3


def test_smem_bytes_counts_the_ring_and_the_pre_activation_buffer():
    """(128 + 128) rows of 64 bf16 a slot; the pre-activation's 128 x 128 bf16 (swiglu: two)."""
    assert GD.smem_bytes((128, 128, 64, 6), "gelu") == 6 * 32768 + 32768
    assert GD.smem_bytes((128, 128, 128, 3), "gelu") == 3 * 65536 + 32768
    assert GD.smem_bytes((64, 256, 64, 4), "swiglu") == 4 * 40960 + 65536


def test_a_tile_the_call_cannot_take_is_refused():
    """One clear error before anything is launched: a tile whose columns do not divide N (its w block
    would reach into the next expert's rows) or whose step does not divide K."""
    dy, w2 = torch.zeros(4, 192, dtype=bf16), torch.zeros(1, 384, 192, dtype=bf16)
    call = (dy, w2.transpose(1, 2), torch.tensor([0, 4], dtype=torch.int32), torch.zeros(4, 384, dtype=bf16), "gelu")
    with pytest.raises(ValueError, match=r"needs N \(384\) a multiple of 256"):
        GD.grouped_gemm_dact_pingpong(*call, tile=(64, 256, 64, 4))
    with pytest.raises(ValueError, match=r"and K \(192\) of 128"):
        GD.grouped_gemm_dact_pingpong(*call, tile=(128, 128, 128, 3))


# ----------------------------------------------------------------------------------------------
# The kernel (GPU)
# ----------------------------------------------------------------------------------------------

CASES = {  # K, N, rows per expert (tiles alternate between the two consumers: odd and even counts)
    "empty experts, partial tiles": (192, 256, [0, 100, 0, 200]),
    "all rows to one expert": (128, 256, [0, 384, 0]),
    "rows not a multiple of 128, short and long experts": (768, 384, [130, 1, 63, 64, 65, 677]),
    "every tile full": (256, 128, [128, 128, 256]),
    "one tile": (64, 128, [5]),
    "more tiles than programs walk twice": (128, 128, [128 * 9 + 17] * 40),
    # both consumers a tile a program or more, each 16 ring steps deep (more than twice the ring: a
    # consumer that waited on a slot out of turn would read another tile's operands)
    "long K, several tiles a program": (1024, 256, [300] * 70),
}


def _on_gpu_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GD.available()


# every case with dy's rows gathered and scaled (the layer's calls); two with sorted rows, unscaled
GPU_CALLS = ([(case, act, True) for case in CASES for act in ("swiglu", "gelu")]
             + [(case, act, False) for case in ("rows not a multiple of 128, short and long experts",
                                                 "long K, several tiles a program") for act in ("swiglu", "gelu")])


@pytest.mark.gpu
@pytest.mark.parametrize("case, activation, gathered", GPU_CALLS)
def test_pingpong_dact_matches_float64_reference(case, activation, gathered, monkeypatch):
    """g = dy[t(s)] @ w2[e]ᵀ, dpre = scale(s)·g·act'(pre) over pre, dscale = Σ_n g·act(pre), in float64;
    in place and not; the same bits as a second call."""
    monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM", raising=False)  # both on by default
    monkeypatch.delenv("MEGATRON_MOE_GLUON_DACT", raising=False)
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    K, N, counts = CASES[case]
    gen = torch.Generator().manual_seed(3)
    offsets = _offsets(counts, "cuda")
    S, E = sum(counts), len(counts)
    X = 2 * N if activation == "swiglu" else N
    T = 40 if gathered else S
    dy = torch.randn(T, K, generator=gen).to(bf16).cuda()
    w2 = (torch.randn(E, N, K, generator=gen) / K ** 0.5).to(bf16).cuda()
    pre = torch.randn(S, X, generator=gen).to(bf16).cuda()
    token = torch.randint(0, T, (S,), generator=gen).to(torch.int32).cuda() if gathered else None
    scale = torch.rand(S, generator=gen).cuda() if gathered else None
    args = (dy, w2.transpose(1, 2), offsets, pre, activation)
    assert GD.supported(*args, gather_S=token, scale_S=scale), "the kernel must take this call"
    pre_in = pre.clone()
    dpre, dscale = GD.grouped_gemm_dact_pingpong(*args[:3], pre_in, activation, gather_S=token, scale_S=scale,
                                                 inplace=True)
    torch.cuda.synchronize()
    assert dpre.data_ptr() == pre_in.data_ptr() and dpre.dtype == bf16 and dscale.dtype == torch.float32
    tok = token.cpu().long() if gathered else torch.arange(S)
    bounds, w64 = offsets.cpu().tolist(), w2.double().cpu()
    g = torch.cat([dy.double().cpu()[tok[lo:hi]] @ w64[e].t() for e, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
    h = pre.double().cpu()
    if activation == "gelu":
        act, dact = f64.gelu_and_grad(h)
        want = g * dact
    else:
        act, dgate, dup = f64.swiglu_and_grads(*h.chunk(2, dim=1))
        want = torch.cat([g * dgate, g * dup], 1)
    if gathered:
        want = want * scale.double().cpu()[:, None]
    # bf16's rounding of each value, the hardware tanh's 2^-11 and the fp32 sums' order
    err = (dpre.cpu().double() - want).abs()
    bound = want.abs() * 2.0 ** -7 + 2e-3 * want.abs().max()
    assert (err <= bound).all(), f"dpre: max error {err.max().item():.3e}, {(err > bound).sum().item()} over"
    want_s = (g * act).sum(1)
    assert ((dscale.cpu().double() - want_s).abs() <= 2e-3 * want_s.abs().max()).all(), "dscale"
    # not in place: pre kept, the same bits
    pre2 = pre.clone()
    dpre2, dscale2 = GD.grouped_gemm_dact_pingpong(*args[:3], pre2, activation, gather_S=token, scale_S=scale)
    assert torch.equal(pre2, pre) and torch.equal(dpre2, dpre) and torch.equal(dscale2, dscale)
    # against the Triton kernel (the one the layer runs)
    tri, tri_s = G.grouped_gemm_dact_triton(*args, gather_S=token, scale_S=scale)
    assert (dpre.float() - tri.float()).abs().max() <= 2e-2 * tri.float().abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["rows not a multiple of 128, short and long experts",
                                  "long K, several tiles a program"])
def test_gelus_deep_and_shallow_rings_give_the_same_bits(case, monkeypatch):
    """The 128-deep ring of three slots (GELU's default where K allows) and the 64-deep ring of six
    sum each output in the same order: the same dpre and Σ g·act(pre), bit for bit."""
    monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM", raising=False)
    monkeypatch.delenv("MEGATRON_MOE_GLUON_DACT", raising=False)
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    K, N, counts = CASES[case]
    gen = torch.Generator().manual_seed(5)
    S, E = sum(counts), len(counts)
    dy = torch.randn(40, K, generator=gen).to(bf16).cuda()
    w2 = (torch.randn(E, N, K, generator=gen) / K ** 0.5).to(bf16).cuda().transpose(1, 2)
    pre = torch.randn(S, N, generator=gen).to(bf16).cuda()
    kw = dict(gather_S=torch.randint(0, 40, (S,), generator=gen).to(torch.int32).cuda(),
              scale_S=torch.rand(S, generator=gen).cuda())
    assert GD.tile_for("gelu", K)[2] == 128
    deep = GD.grouped_gemm_dact_pingpong(dy, w2, _offsets(counts, "cuda"), pre, "gelu", **kw)
    shallow = GD.grouped_gemm_dact_pingpong(dy, w2, _offsets(counts, "cuda"), pre, "gelu",
                                            tile=GD.TILE_K64["gelu"], **kw)
    assert torch.equal(deep[0], shallow[0]) and torch.equal(deep[1], shallow[1])
