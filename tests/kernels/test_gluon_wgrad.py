"""The Gluon weight gradient (kernels/gluon_wgrad.py): which calls it takes, and on an sm_90 GPU
its results against the float64 reference.

    pytest tests/kernels/test_gluon_wgrad.py          # CPU: the dispatch rules
    pytest tests/kernels/test_gluon_wgrad.py -m gpu   # sm_90: the kernel against the reference

Gluon does not run under Triton's interpreter; tests/kernels/test_compile_hopper.py compiles the
kernel for sm_90 on the CPU.
"""
import pytest
import torch

from megatron_moe.kernels import gluon_wgrad as GW
from megatron_moe.kernels import grouped as G
from megatron_moe.kernels.switches import WGRAD_ADD_WAYS

bf16 = torch.bfloat16


def _operands(S, K, N, counts, device, gen):
    offsets = torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32).to(device)
    a = torch.randn(S + 5, K, generator=gen).to(bf16).to(device)  # 5 rows no sorted position reads
    b = torch.randn(S, N, generator=gen).to(bf16).to(device)
    return a, b, offsets


# ----------------------------------------------------------------------------------------------
# Dispatch (CPU): what ``supported`` accepts, with the GPU and Gluon made to look present
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def as_if_sm90(monkeypatch):
    monkeypatch.setattr(GW, "on_sm90", lambda t: True)
    monkeypatch.setattr(GW, "available", lambda: True)
    monkeypatch.delenv("MEGATRON_MOE_GLUON_WGRAD", raising=False)
    monkeypatch.delenv("MEGATRON_MOE_GLUON_WGRAD_FP32", raising=False)


def test_supported_takes_a_new_bf16_gradient_with_either_gather(as_if_sm90):
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = _operands(300, 256, 160, [100, 0, 200], "cpu", gen)
    token = torch.randperm(305, generator=gen)[:300].to(torch.int32)
    assert GW.supported(a, b, offsets, gather_a_S=token)
    assert GW.supported(a[:300], b, offsets, gather_b_S=token.clamp_max(299))
    assert GW.supported(a[:300], b, offsets, out_dtype=bf16)


def test_supported_takes_fp32_gradients_new_written_or_added(as_if_sm90):
    """The trainer's master gradients: fp32 [E, K, N], written by a step's first micro-batch and
    added to by the rest."""
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = _operands(300, 256, 160, [100, 0, 200], "cpu", gen)
    token = torch.randperm(305, generator=gen)[:300].to(torch.int32)
    out = torch.zeros(3, 256, 160)
    assert GW.supported(a, b, offsets, gather_a_S=token, out_dtype=torch.float32)
    assert GW.supported(a, b, offsets, gather_a_S=token, out=out)
    assert GW.supported(a[:300], b, offsets, gather_b_S=token.clamp_max(299), out=out, accumulate=True)


@pytest.mark.parametrize("case", ["switch off", "fp32 switch off", "fp32 operands", "bf16 out given",
                                  "bf16 accumulate", "accumulate without out", "fp32 out misshapen",
                                  "fp32 out not contiguous", "fp16 out", "scale", "activation",
                                  "K not a multiple of 128", "N not a multiple of 16", "strided columns", "no rows",
                                  "no experts"])
def test_supported_refuses(as_if_sm90, monkeypatch, case):
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = _operands(300, 256, 160, [100, 0, 200], "cpu", gen)
    a = a[:300]
    kw = {}
    if case == "switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_WGRAD", "0")
    elif case == "fp32 switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_WGRAD_FP32", "0")
        kw = dict(out=torch.zeros(3, 256, 160), accumulate=True)
    elif case == "fp32 operands":
        a, b = a.float(), b.float()
    elif case == "bf16 out given":
        kw = dict(out=torch.empty(3, 256, 160, dtype=bf16))
    elif case == "bf16 accumulate":
        kw = dict(out=torch.zeros(3, 256, 160, dtype=bf16), accumulate=True)
    elif case == "accumulate without out":
        kw = dict(out_dtype=torch.float32, accumulate=True)
    elif case == "fp32 out misshapen":
        kw = dict(out=torch.zeros(3, 160, 256), accumulate=True)
    elif case == "fp32 out not contiguous":
        kw = dict(out=torch.zeros(3, 160, 256).transpose(1, 2), accumulate=True)
    elif case == "fp16 out":
        kw = dict(out_dtype=torch.float16)
    elif case == "scale":
        kw = dict(scale_S=torch.ones(300))
    elif case == "activation":
        a = torch.randn(300, 512).to(bf16)
        kw = dict(a_activation="swiglu", a_scale_S=torch.ones(300))
    elif case == "K not a multiple of 128":
        a = a[:, :192]
    elif case == "N not a multiple of 16":  # 8: a multiple of 16 bytes, not what the kernel was tested at
        b = b[:, :152].contiguous()
    elif case == "strided columns":
        b = torch.randn(160, 300).to(bf16).t()
    elif case == "no rows":
        a, b, offsets = a[:0], b[:0], torch.zeros(4, dtype=torch.int32)
    elif case == "no experts":
        offsets = offsets[:1]
    assert GW.supported(a, b, offsets, **kw) is False


def test_supported_refuses_without_a_gpu(monkeypatch):
    monkeypatch.delenv("MEGATRON_MOE_GLUON_WGRAD", raising=False)
    a, b, offsets = _operands(300, 256, 160, [100, 0, 200], "cpu", torch.Generator().manual_seed(0))
    assert GW.supported(a[:300], b, offsets) is False


# ----------------------------------------------------------------------------------------------
# The kernel (GPU)
# ----------------------------------------------------------------------------------------------

CASES = {  # rows, K, N, rows per expert
    "empty experts, partial row blocks and column tiles": (300, 256, 160, [0, 100, 0, 200]),
    "all rows to one expert": (256, 128, 256, [0, 256, 0]),
    "rows not a multiple of 64, several tiles per expert": (1000, 384, 528, [130, 1, 63, 64, 65, 677]),
    "no expert with rows": (1, 128, 64, [0, 0, 0]),
    "top_k = num_experts (every token in every expert)": (4 * 90, 128, 96, [90, 90, 90, 90]),
}


def _on_gpu_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GW.available()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", ["one per SM", "three"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gather", ["a", "b", "both", "none"])
@pytest.mark.parametrize("output", ["bf16 new", "fp32 written", "fp32 added"]
                         + [f"fp32 added, {way}" for way in WGRAD_ADD_WAYS[1:]])  # "fp32 added": the default way
def test_gluon_wgrad_matches_float64_reference(case, gather, programs, output, monkeypatch):
    """With three programs each walks several tiles, of experts with different row counts (its
    producer's and consumer's step counts must agree tile by tile, or the ring deadlocks). fp32:
    written over what out held, or added to it (out + dw rounded once to fp32), each way of adding
    (MEGATRON_MOE_WGRAD_ADD; its L2 prefetch runs where the columns fill whole tiles)."""
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    added = output.startswith("fp32 added")
    if ", " in output:
        monkeypatch.setenv("MEGATRON_MOE_WGRAD_ADD", output.split(", ")[1])
    else:
        monkeypatch.delenv("MEGATRON_MOE_WGRAD_ADD", raising=False)
    if programs == "three":
        monkeypatch.setattr(GW, "num_sms", lambda device: 3)
    S, K, N, counts = CASES[case]
    gen = torch.Generator().manual_seed(1)
    a, b, offsets = _operands(S, K, N, counts, "cuda", gen)
    if "every token" in case:  # sorted rows t, t + 90, ... are token t's: each token read num_experts times
        rows_a = rows_b = (torch.arange(S) % 90).to(torch.int32).cuda()
    else:
        rows_a = torch.randperm(S + 5, generator=gen)[:S].to(torch.int32).cuda()  # into a's S + 5 rows
        rows_b = torch.randperm(S, generator=gen).to(torch.int32).cuda()
    kw = dict(a=dict(gather_a_S=rows_a), b=dict(gather_b_S=rows_b),
              both=dict(gather_a_S=rows_a, gather_b_S=rows_b), none={})[gather]
    if gather in ("b", "none"):
        a = a[:S]  # without its gather a has exactly the S sorted rows
    want = G.grouped_wgrad_reference(a, b, offsets, out_dtype=torch.float64, **kw)
    before = None
    if output != "bf16 new":
        before = torch.randn(want.shape, generator=gen).cuda() * 10  # [E, K, N] fp32, partly cancelling the sums
        kw.update(out=before.clone(), accumulate=added)
    assert GW.supported(a, b, offsets, **kw), "the Gluon kernel must take this call"
    got = G.grouped_wgrad(a, b, offsets, **kw)
    assert got.shape == want.shape and got.dtype == (bf16 if before is None else torch.float32)
    if before is not None:
        assert got.data_ptr() == kw["out"].data_ptr(), "an fp32 gradient goes into the out given"
    if added:
        want = want + before.double()
    # bf16's rounding of each sum (at most 2^-8 of it; fp32's 2^-24), and the tensor cores' fp32
    # accumulation in another order than the reference's (1e-4 of the largest sum)
    scale = want.abs().max().item()
    err = (got.double() - want).abs()
    bound = want.abs() * (2.0 ** -8 if before is None else 2.0 ** -23) + 1e-4 * scale
    assert (err <= bound).all(), f"max error {err.max().item():.3e}, {(err > bound).sum().item()} elements over"
    for e, n in enumerate(counts):
        if n == 0:  # exact zeros, or what out held, unchanged
            empty = before[e] if added else torch.zeros_like(got[e])
            assert torch.equal(got[e], empty), f"expert {e} has no rows: its gradient must be exact zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("gather", ["a", "b", "none"])
def test_gluon_wgrad_keeps_each_experts_rows_apart(gather):
    """An expert's last, partial row block is zero-filled past the expert's end (in both operands:
    zeros in one alone would still turn an infinity into NaN): an infinity in expert 1's rows (its
    first row lies inside expert 0's last 64-row block) reaches expert 1's gradient only."""
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    counts = [100, 64, 30]
    S, K, N = sum(counts), 128, 256
    gen = torch.Generator().manual_seed(3)
    a, b, offsets = _operands(S, K, N, counts, "cuda", gen)
    a = a[:S]
    rows = torch.randperm(S, generator=gen).to(torch.int32).cuda()
    kw = dict(a=dict(gather_a_S=rows), b=dict(gather_b_S=rows), none={})[gather]
    for t, sorted_side in ((a, gather != "a"), (b, gather != "b")):
        if sorted_side:
            t[100:164] = float("inf")  # expert 1's rows
    assert GW.supported(a, b, offsets, **kw), "the Gluon kernel must take this call"
    got = G.grouped_wgrad(a, b, offsets, **kw).double()
    want = G.grouped_wgrad_reference(a, b, offsets, out_dtype=torch.float64, **kw)
    assert not torch.isfinite(want[1]).all() and not torch.isfinite(got[1]).all()
    for e in (0, 2):
        assert torch.isfinite(got[e]).all(), f"expert {e}'s gradient took expert 1's rows"
        err = (got[e] - want[e]).abs()
        assert (err <= want[e].abs() * 2.0 ** -8 + 1e-4 * want[e].abs().max()).all(), f"expert {e}"


# ----------------------------------------------------------------------------------------------
# grouped_wgrad's dispatch (CPU): a call the kernel takes goes there, after the same argument checks
# ----------------------------------------------------------------------------------------------


def test_grouped_wgrad_sends_what_the_kernel_takes_there(monkeypatch):
    calls = []
    monkeypatch.setattr(GW, "supported", lambda *a, **kw: True)
    monkeypatch.setattr(GW, "grouped_wgrad_gluon", lambda a, b, offsets, **kw: calls.append(kw) or "gluon")
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = _operands(300, 256, 160, [100, 0, 200], "cpu", gen)
    token = torch.randperm(305, generator=gen)[:300].to(torch.int32)
    assert G.grouped_wgrad(a, b, offsets, gather_a_S=token) == "gluon"
    out = torch.zeros(3, 256, 160)
    assert G.grouped_wgrad(a, b, offsets, gather_a_S=token, out=out, accumulate=True) == "gluon"
    assert calls == [dict(gather_a_S=token, gather_b_S=None, out_dtype=None, out=None, accumulate=False),
                     dict(gather_a_S=token, gather_b_S=None, out_dtype=None, out=out, accumulate=True)]
    with pytest.raises(ValueError, match="sorted rows"):  # the Triton path's checks run first
        G.grouped_wgrad(a, b[:299], offsets, gather_a_S=token)


def test_grouped_wgrad_without_the_kernel_matches_the_reference(monkeypatch):
    monkeypatch.setattr(GW, "supported", lambda *a, **kw: False)
    monkeypatch.setattr(GW, "grouped_wgrad_gluon", lambda *a, **kw: pytest.fail("the Gluon kernel ran"))
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = _operands(40, 128, 32, [10, 0, 30], "cpu", gen)  # small: Triton's interpreter runs it
    token = torch.randperm(45, generator=gen)[:40].to(torch.int32)
    got = G.grouped_wgrad(a, b, offsets, gather_a_S=token, out_dtype=torch.float32)
    want = G.grouped_wgrad_reference(a, b, offsets, gather_a_S=token, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_grouped_wgrad_bad_shapes_get_its_own_error(monkeypatch):
    monkeypatch.setattr(GW, "on_sm90", lambda t: True)  # as if the kernel could take the call
    monkeypatch.setattr(GW, "available", lambda: True)
    a, b = torch.zeros(10, dtype=bf16), torch.zeros(10, 128, dtype=bf16)
    with pytest.raises(ValueError, match="expected 2-D a and b"):
        G.grouped_wgrad(a, b, torch.tensor([0, 10], dtype=torch.int32))


@pytest.mark.parametrize("way, N, want", [("prefetch4", 256, (True, 4)), ("prefetch8", 512, (True, 8)),
                                          ("prefetch", 256, (True, 0)), ("atomic", 256, (False, 0)),
                                          ("prefetch4", 160, (False, 0))])
def test_the_add_way_sets_the_kernels_prefetch(monkeypatch, way, N, want):
    """MEGATRON_MOE_WGRAD_ADD reaches the kernel as (PREFETCH, AHEAD), for an added fp32 gradient
    whose columns fill whole tiles only (the prefetch moves half-rows of a 256-column tile); a new or
    written gradient never prefetches."""
    launched = []
    monkeypatch.setattr(GW, "launch", lambda kernel, grid, args, kwargs: launched.append(kwargs))
    monkeypatch.setattr(GW, "num_sms", lambda device: 132)
    monkeypatch.setenv("MEGATRON_MOE_WGRAD_ADD", way)
    a, b = torch.zeros(300, 128, dtype=bf16), torch.zeros(300, N, dtype=bf16)
    offsets = torch.tensor([0, 100, 300], dtype=torch.int32)
    out = torch.zeros(2, 128, N)
    GW.grouped_wgrad_gluon(a, b, offsets, out=out, accumulate=True)
    GW.grouped_wgrad_gluon(a, b, offsets, out=out)
    added, written = launched
    assert (added["PREFETCH"], added["AHEAD"]) == want
    assert written["PREFETCH"] is False and added["OUT_MODE"] == 2 and written["OUT_MODE"] == 1
