"""The Gluon row-grouped GEMM (kernels/gluon_gemm.py): its tile table and which calls it takes on the
CPU, and on an sm_90 GPU its results against the float64 reference.

    pytest tests/kernels/test_gluon_gemm.py          # CPU: the tile table, the dispatch rules
    pytest tests/kernels/test_gluon_gemm.py -m gpu   # sm_90: the kernel against the reference

Gluon does not run under Triton's interpreter; tests/kernels/test_compile_hopper.py compiles the
kernel for sm_90 on the CPU.
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


@pytest.mark.parametrize("counts", [[0, 100, 0, 200], [256, 0, 0], [1, 127, 128, 129, 0, 383], [0, 0, 0]])
def test_tile_table_lists_each_experts_128_row_tiles_in_order(counts):
    offsets = _offsets(counts)
    S = sum(counts) + 7  # rows past the last expert's end (padding): in no tile
    tile_e, tile_row, tile_end, num_m = GG._tile_table(offsets, S)
    want = [(e, start + i * 128, start + n) for e, (start, n) in enumerate(zip(offsets[:-1].tolist(), counts))
            for i in range(-(-n // 128))]
    assert num_m.tolist() == [len(want)]
    assert len(tile_e) >= len(want)  # the bound cdiv(S, 128) + E
    got = list(zip(tile_e.tolist(), tile_row.tolist(), tile_end.tolist()))[:len(want)]
    assert got == want


# ----------------------------------------------------------------------------------------------
# Dispatch (CPU): what ``supported`` accepts, with the GPU and Gluon made to look present
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def as_if_sm90(monkeypatch):
    monkeypatch.setattr(GG, "on_sm90", lambda t: True)
    monkeypatch.setattr(GG, "available", lambda: True)
    monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "1")


def _operands(S=300, K=192, N=272, E=3):
    return torch.randn(S, K).to(bf16), torch.randn(E, K, N).to(bf16), _offsets([100, 0, 200][:E])


def test_supported_takes_the_plain_case(as_if_sm90):
    a, w, offsets = _operands()
    assert GG.supported(a, w, offsets)
    assert GG.supported(a, w, offsets, out_dtype=bf16)


@pytest.mark.parametrize("case", ["switch off", "switch unset (off by default)", "gather", "scatter", "scale",
                                  "activation", "fp32", "fp32 out", "K not a multiple of 64", "N not a multiple of 16",
                                  "transposed w", "a's rows not 16-element aligned", "no rows",
                                  "offsets of another E"])
def test_supported_refuses(as_if_sm90, monkeypatch, case):
    a, w, offsets = _operands()
    kw = {}
    if case == "switch off":
        monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "0")
    elif case == "switch unset (off by default)":
        monkeypatch.delenv("MEGATRON_MOE_GLUON_GEMM")
    elif case == "gather":
        kw = dict(gather_S=torch.arange(300, dtype=torch.int32))
    elif case == "scatter":
        kw = dict(scatter_S=torch.arange(300, dtype=torch.int32))
    elif case == "scale":
        kw = dict(scale_S=torch.ones(300))
    elif case == "activation":
        kw = dict(activation="gelu")
    elif case == "fp32":
        a, w = a.float(), w.float()
    elif case == "fp32 out":
        kw = dict(out_dtype=torch.float32)
    elif case == "K not a multiple of 64":
        a, w = a[:, :160].contiguous(), w[:, :160].contiguous()
    elif case == "N not a multiple of 16":
        w = w[..., :264].contiguous()
    elif case == "transposed w":  # the input gradient's w1ᵀ view: the Triton kernel's
        w = torch.randn(3, 272, 192).to(bf16).transpose(1, 2)
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
    monkeypatch.setattr(GG, "grouped_gemm_gluon", lambda a, w, offsets: calls.append(offsets) or "gluon")
    a, w, offsets = _operands()
    assert G.grouped_gemm(a, w, offsets) == "gluon" and len(calls) == 1
    with pytest.raises(ValueError, match="columns"):  # the Triton path's checks run first
        G.grouped_gemm(a[:, :128], w, offsets)


def test_grouped_gemm_bad_shapes_get_its_own_error(as_if_sm90):
    a, w, offsets = _operands()
    with pytest.raises(ValueError, match="expected a"):
        G.grouped_gemm(a[0], w, offsets)


# ----------------------------------------------------------------------------------------------
# The kernel (GPU)
# ----------------------------------------------------------------------------------------------

CASES = {  # K, N, rows per expert
    "empty experts, partial tiles and a partial column tile": (192, 272, [0, 100, 0, 200]),
    "all rows to one expert": (128, 256, [0, 256, 0]),
    "rows not a multiple of 128, short and long experts": (768, 528, [130, 1, 63, 64, 65, 677]),
    "every tile full": (256, 512, [128, 128, 256]),
    "no expert with rows": (64, 64, [0, 0, 0]),
}


def _on_gpu_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GG.available()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_gemm_matches_float64_reference(case, monkeypatch):
    monkeypatch.setenv("MEGATRON_MOE_GLUON_GEMM", "1")
    if not _on_gpu_sm90():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    K, N, counts = CASES[case]
    gen = torch.Generator().manual_seed(2)
    offsets = _offsets(counts, "cuda")
    S = sum(counts)
    a = torch.randn(S + 9, K, generator=gen).to(bf16).cuda()  # 9 padding rows past the last expert
    w = torch.randn(len(counts), K, N, generator=gen).to(bf16).cuda()
    assert GG.supported(a, w, offsets), "the Gluon kernel must take this call"
    got = G.grouped_gemm(a, w, offsets)
    want = G.grouped_gemm_reference(a[:S], w, offsets, out_dtype=torch.float64)
    assert got.dtype == bf16 and got.shape == (S + 9, N)
    got = got[:S]  # the padding rows are not written
    # bf16's rounding of each sum (at most 2^-8 of it) and the fp32 sums' order (1e-4 of the largest)
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0 ** -8 + 1e-4 * want.abs().max().item()
    assert (err <= bound).all(), f"max error {err.max().item():.3e}, {(err > bound).sum().item()} elements over"
