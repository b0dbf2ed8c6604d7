"""The Gluon row-grouped GEMMs (kernels/gluon_gemm.py): their tile table and which calls they take
on the CPU, and on an sm_90 GPU their results against the float64 reference (the up and down
projections, the input gradient's wᵀ).

    pytest tests/kernels/test_gluon_gemm.py          # CPU: the tile table, the dispatch rules
    pytest tests/kernels/test_gluon_gemm.py -m gpu   # sm_90: the kernels against the reference

Gluon does not run under Triton's interpreter; tests/kernels/test_compile_hopper.py compiles the
kernels for sm_90 on the CPU.
"""
import pytest
import torch

from megatron_moe.kernels import gluon_gemm as GG
from megatron_moe.kernels import grouped as G

bf16 = torch.bfloat16


def _offsets(counts, device="cpu"):
    return torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32).to(device)


# ----------------------------------------------------------------------------------------------
# The tile table (CPU): against a loop over the experts
# ----------------------------------------------------------------------------------------------


TABLE_COUNTS = [[0, 100, 0, 200], [256, 0, 0], [1, 127, 128, 129, 0, 383], [0, 0, 0], [5000],
                [3] * 70 + [0] * 59 + [300]]  # one expert with many tiles; 130 experts (BLOCK_E 256)


@pytest.mark.parametrize("table", ["kernel", "reference"])
@pytest.mark.parametrize("counts", TABLE_COUNTS)
def test_tile_table_lists_each_experts_128_row_tiles_in_order(counts, table, device):
    offsets = _offsets(counts, device)
    S = sum(counts) + 7  # rows past the last expert's end (padding): in no tile
    fn = GG.tile_table if table == "kernel" else GG.tile_table_reference  # kernel: on the CPU, the interpreter's
    tile_e, tile_row, tile_end, num_m = fn(offsets, S)
    want = [(e, start + i * 128, start + n) for e, (start, n) in enumerate(zip(offsets[:-1].tolist(), counts))
            for i in range(-(-n // 128))]
    assert num_m.tolist() == [len(want)]
    assert all(t.dtype == torch.int32 for t in (tile_e, tile_row, tile_end, num_m))
    assert len(tile_e) == -(-S // 128) + len(counts)  # the bound cdiv(S, 128) + E
    got = list(zip(tile_e.tolist(), tile_row.tolist(), tile_end.tolist()))[:len(want)]
    assert got == want


@pytest.mark.parametrize("counts", TABLE_COUNTS)
def test_tile_table_kernel_equals_its_reference_past_the_last_tile_too(counts, device):
    offsets, S = _offsets(counts, device), sum(counts) + 300
    for got, want in zip(GG.tile_table(offsets, S), GG.tile_table_reference(offsets, S)):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# Dispatch (CPU): what ``supported`` accepts, with the GPU and Gluon made to look present
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def as_if_sm90(monkeypatch):
    monkeypatch.setattr(GG, "on_sm90", lambda t: True)
    monkeypatch.setattr(GG, "available", lambda: True)
    monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "1")


def _operands(S=300, K=192, N=512, E=3):
    return torch.randn(S, K).to(bf16), torch.randn(E, K, N).to(bf16), _offsets([100, 0, 200][:E])


def _index(n=300):
    return torch.randperm(n).to(torch.int32)


@pytest.mark.parametrize("case", ["plain", "plain, transposed w (the input gradient's w1ᵀ)", "swiglu",
                                  "gather + swiglu + act_scale", "gelu + act_scale, sorted rows",
                                  "gelu, N not a multiple of 256", "switch unset (on by default)"])
def test_supported_takes(as_if_sm90, monkeypatch, case):
    a, w, offsets = _operands()
    kw = {}
    if case == "plain, transposed w (the input gradient's w1ᵀ)":
        w = torch.randn(3, 512, 192).to(bf16).transpose(1, 2)
    elif case == "swiglu":
        kw = dict(activation="swiglu")
    elif case == "gather + swiglu + act_scale":
        kw = dict(gather_S=_index(), activation="swiglu", act_scale_S=torch.ones(300))
    elif case == "gelu + act_scale, sorted rows":
        kw = dict(activation="gelu", act_scale_S=torch.ones(300))
    elif case == "gelu, N not a multiple of 256":  # the plain kernel's columns: N a multiple of 16
        w = w[..., :272].contiguous()
        kw = dict(activation="gelu")
    elif case == "switch unset (on by default)":
        monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM")
    assert GG.supported(a, w, offsets, out_dtype=bf16, **kw)


@pytest.mark.parametrize("case", ["switch off", "scale", "scatter (top-1: measured slower)",
                                  "gather without an activation", "gelu, gathered rows", "gelu, transposed w",
                                  "gelu and scatter", "swiglu and scatter",
                                  "act_scale without an activation", "unknown activation", "fp32", "fp32 out",
                                  "K not a multiple of 64", "N not a multiple of 16",
                                  "activation, N not a multiple of 256", "swiglu, transposed w",
                                  "w neither contiguous nor transposed", "a's rows not 16-element aligned",
                                  "no rows", "offsets of another E"])
def test_supported_refuses(as_if_sm90, monkeypatch, case):
    a, w, offsets = _operands()
    kw = {}
    if case == "switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "0")
    elif case == "scale":
        kw = dict(scale_S=torch.ones(300))
    elif case == "scatter (top-1: measured slower)":
        kw = dict(scatter_S=_index())
    elif case == "gather without an activation":
        kw = dict(gather_S=_index())
    elif case == "gelu, gathered rows":  # a gathering GELU epilogue measured slower than the Triton kernel's
        kw = dict(gather_S=_index(), activation="gelu", act_scale_S=torch.ones(300))
    elif case == "gelu, transposed w":  # the plain kernel takes wᵀ, its GELU epilogue not
        w = torch.randn(3, 512, 192).to(bf16).transpose(1, 2)
        kw = dict(activation="gelu")
    elif case == "gelu and scatter":
        kw = dict(activation="gelu", scatter_S=_index())
    elif case == "swiglu and scatter":
        kw = dict(activation="swiglu", scatter_S=_index())
    elif case == "act_scale without an activation":
        kw = dict(act_scale_S=torch.ones(300))
    elif case == "unknown activation":
        kw = dict(activation="relu")
    elif case == "fp32":
        a, w = a.float(), w.float()
    elif case == "fp32 out":
        kw = dict(out_dtype=torch.float32)
    elif case == "K not a multiple of 64":
        a, w = a[:, :160].contiguous(), w[:, :160].contiguous()
    elif case == "N not a multiple of 16":
        w = w[..., :264].contiguous()
    elif case == "activation, N not a multiple of 256":  # the plain kernel takes N = 384, the swiglu kernel not
        w = w[..., :384].contiguous()
        assert GG.supported(a, w, offsets)
        kw = dict(activation="swiglu")
    elif case == "swiglu, transposed w":  # the plain kernel takes wᵀ, the swiglu kernel not
        w = torch.randn(3, 512, 192).to(bf16).transpose(1, 2)
        assert GG.supported(a, w, offsets)
        kw = dict(activation="swiglu")
    elif case == "w neither contiguous nor transposed":
        w = torch.randn(3, 192, 1024).to(bf16)[..., ::2]
    elif case == "a's rows not 16-element aligned":
        a = torch.randn(300, 200).to(bf16)[:, :192]
    elif case == "no rows":
        a, offsets = a[:0], torch.zeros(4, dtype=torch.int32)
    elif case == "offsets of another E":
        offsets = offsets[:-1]
    assert GG.supported(a, w, offsets, **kw) is False


def test_supported_refuses_without_a_gpu(monkeypatch):
    monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "1")
    assert GG.supported(*_operands()) is False


def test_grouped_gemm_sends_what_the_kernel_takes_there(monkeypatch):
    calls = []
    monkeypatch.setattr(GG, "supported", lambda *a, **kw: True)
    monkeypatch.setattr(GG, "grouped_gemm_gluon", lambda a, w, offsets, **kw: calls.append(kw) or "gluon")
    a, w, offsets = _operands()
    token, weight = _index(), torch.ones(300)
    assert G.grouped_gemm(a, w, offsets) == "gluon"
    assert G.grouped_gemm(a, w, offsets, gather_S=token, activation="swiglu", act_scale_S=weight) == "gluon"
    assert calls[0] == dict(gather_S=None, activation=None, act_scale_S=None)
    assert calls[1]["gather_S"] is token and calls[1]["activation"] == "swiglu" and calls[1]["act_scale_S"] is weight
    with pytest.raises(ValueError, match="columns"):  # the Triton path's checks run first
        G.grouped_gemm(a[:, :128], w, offsets)
    with pytest.raises(ValueError, match="gather_S"):
        G.grouped_gemm(a, w, offsets, gather_S=token.float())


def test_grouped_gemm_bad_shapes_get_its_own_error(as_if_sm90):
    a, w, offsets = _operands()
    with pytest.raises(ValueError, match="expected a"):
        G.grouped_gemm(a[0], w, offsets)


# ----------------------------------------------------------------------------------------------
# The kernels (GPU)
# ----------------------------------------------------------------------------------------------

CASES = {  # K, N, rows per expert
    "empty experts, partial tiles": (192, 512, [0, 100, 0, 200]),
    "all rows to one expert": (128, 256, [0, 256, 0]),
    "rows not a multiple of 128, short and long experts": (768, 768, [130, 1, 63, 64, 65, 677]),
    "every tile full": (256, 512, [128, 128, 256]),
    "no expert with rows": (64, 256, [0, 0, 0]),
    "K 512, uneven rows (the ring wraps inside a tile)": (512, 512, [130, 1, 63, 300, 0, 129]),
    "K 320, N not a multiple of 128": (320, 272, [200, 57]),
    "one expert, many row tiles, three column blocks": (192, 384, [2000]),
}
VARIANTS = {  # grouped_gemm's options: gather, activation, act_scale, w as the view of a contiguous [E, N, K]
    "plain": (False, None, False, False),
    "plain, transposed w (input gradient)": (False, None, False, True),
    "gather + swiglu + act_scale (up projection)": (True, "swiglu", True, False),
    "swiglu, sorted rows": (False, "swiglu", False, False),
    "gelu + act_scale, sorted rows (top-1 up projection)": (False, "gelu", True, False),
    "gelu, sorted rows": (False, "gelu", False, False),
    "gelu + act_scale, sorted rows, act in 32-column parts": (False, "gelu", True, False),
}


def _on_gpu_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GG.available()


def _close(got, want, what):
    """bf16's rounding of each value (at most 2^-8 of it) and the fp32 sums' order (1e-4 of the largest)."""
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0 ** -8 + 1e-4 * (want.abs().max().item() if want.numel() else 0.0)
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3e}, {(err > bound).sum().item()} over"


@pytest.mark.gpu
@pytest.mark.parametrize("programs", ["one per SM", "three"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_gemm_matches_float64_reference(case, variant, programs, monkeypatch):
    """With three programs each walks several tiles of experts with different row counts (at
    one per SM these shapes give every program one tile at most)."""
    monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "1")
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    if VARIANTS[variant][1] == "swiglu" and CASES[case][1] % 256:
        pytest.skip("the swiglu kernel takes N a multiple of 256 (test_supported_refuses)")
    if programs == "three":
        monkeypatch.setattr(GG, "num_sms", lambda device: 3)
    monkeypatch.setattr(GG, "GELU_ACT_PART", 32 if "parts" in variant else 0)
    K, N, counts = CASES[case]
    gather, activation, act_scale, transposed = VARIANTS[variant]
    gen = torch.Generator().manual_seed(2)
    offsets = _offsets(counts, "cuda")
    S = sum(counts)
    # the sorted a: 9 padding rows past the last expert (their output rows are not written); a
    # gathered a: 40 source rows (repeats, as top-k > 1 has), read in a random order
    a = torch.randn(40 if gather else S + 9, K, generator=gen).to(bf16).cuda()
    if transposed:
        w = torch.randn(len(counts), N, K, generator=gen).to(bf16).cuda().transpose(1, 2)
    else:
        w = torch.randn(len(counts), K, N, generator=gen).to(bf16).cuda()
    kw = {}
    if gather:
        kw["gather_S"] = torch.randint(0, 40, (S,), generator=gen).to(torch.int32).cuda()
    if activation:
        kw["activation"] = activation
    if act_scale:  # a scale per row of a sorted a (its padding rows too), per gathered row otherwise
        kw["act_scale_S"] = torch.rand(S if gather else S + 9, generator=gen).cuda()
    if S == 0 and gather:  # no rows to gather: the Triton launcher's (it launches nothing)
        assert not GG.supported(a, w, offsets, **kw)
        assert all(t.shape == (0, n) for t, n in zip(G.grouped_gemm(a, w, offsets, **kw), (N, N // 2)))
        return
    assert GG.supported(a, w, offsets, **kw), "the Gluon kernel must take this call"
    got = G.grouped_gemm(a, w, offsets, **kw)
    got = (got,) if activation is None else got
    rows = S if gather else S + 9
    assert all(g.dtype == bf16 and g.shape[0] == rows for g in got)
    a_cpu = a.cpu() if gather else a[:S].cpu()
    cpu = {k: v.cpu() for k, v in kw.items() if k not in ("activation", "act_scale_S")}
    want = G.grouped_gemm_reference(a_cpu, w.cpu(), offsets.cpu(), out_dtype=torch.float64, **cpu)  # pre-activation
    _close(got[0][:S].cpu(), want, f"{variant}, {'pre' if activation else 'out'}")
    if activation:  # of the kernel's own rounded pre-activation (the epilogue's tanh: 2^-11)
        scale = kw["act_scale_S"][:S].cpu().double() if act_scale else None
        want_act = G._activation_reference(got[0][:S].cpu().double(), activation, scale, torch.float64)
        _close(got[1][:S].cpu(), want_act, f"{variant}, act")

