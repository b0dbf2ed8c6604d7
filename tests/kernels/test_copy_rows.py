"""copy_row_blocks (the symmetric exchange's data movement) against a per-row Python loop:
counts read on the device, empty and full blocks, block sizes not a multiple of the kernel's row
tile, widths not a multiple of its column tile, row offsets, bf16 and fp32, int32 and int64
counts, counts that are a strided view, blocks whose first rows come from the device (packed one
after another on either side), each block read from its own tensor by address (the exchange's
peer buffers: one launch, blocks visited from a given one on), both grids (persistent, with more
row tiles than programs, and one program per tile); rows past each count are never written."""
import os
import sys

import pytest
import torch

from megatron_moe.kernels.copy_rows import copy_row_blocks, copy_row_blocks_reference

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _util import needs_triton_kernels  # noqa: E402


def _loop(src, dst, counts, C, src_row0, dst_row0):
    out = dst.clone()
    for b, n in enumerate(counts.reshape(-1).tolist()):
        for i in range(n):
            out[dst_row0 + b * C + i] = src[src_row0 + b * C + i]
    return out


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("C, H, counts, offsets", [
    (37, 20, [0, 37, 5], (0, 0)),        # empty, full, partial; 37 rows not a multiple of 16
    (16, 16, [16, 16], (3, 40)),         # whole tiles, offsets on both sides
    (5, 3, [1, 0, 0, 4], (2, 1)),        # tiny rows, four blocks
    (40, 33, [0, 0, 0], (0, 0)),         # nothing to copy
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("persistent", [True, False])
def test_copy_row_blocks_equals_a_row_loop(C, H, counts, offsets, dtype, count_dtype, persistent):
    dev = _device()
    src_row0, dst_row0 = offsets
    B = len(counts)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(src_row0 + B * C + 2, H, generator=g).to(dtype).to(dev)
    dst = torch.full((dst_row0 + B * C + 3, H), -7.0, dtype=dtype, device=dev)  # untouched rows stay -7
    counts_B = torch.tensor(counts, dtype=count_dtype, device=dev)
    want = _loop(src.cpu(), dst.cpu(), counts_B.cpu(), C, src_row0, dst_row0)
    copy_row_blocks(src, dst, counts_B, C, src_row0=src_row0, dst_row0=dst_row0, persistent=persistent)
    assert torch.equal(dst.cpu(), want)
    ref = torch.full_like(dst, -7.0)
    copy_row_blocks_reference(src, ref, counts_B, C, src_row0, dst_row0)
    assert torch.equal(ref.cpu(), want)


def _loop_starts(src, dst, counts, src_first, dst_first):
    out = dst.clone()
    for n, s0, d0 in zip(counts.tolist(), src_first, dst_first):
        for i in range(n):
            out[d0 + i] = src[s0 + i]
    return out


@pytest.mark.parametrize("side", ["src", "dst", "both"])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_blocks_packed_one_after_another(side, count_dtype):
    """Rows sorted by destination (the exchange's send side): block b starts where block b - 1's
    valid rows end; on the other side whole blocks of C rows. Counts 0, C, and partial; C = 21 is
    not a multiple of the row tile."""
    dev = _device()
    C, H, row0 = 21, 19, 2
    counts = torch.tensor([5, 0, 21, 17, 1], dtype=count_dtype)
    packed = (torch.cumsum(counts, 0) - counts).to(count_dtype)
    B = counts.numel()
    blocks = [b * C for b in range(B)]
    g = torch.Generator().manual_seed(1)
    src = torch.randn(row0 + B * C + 4, H, generator=g).to(dev)
    dst = torch.full((row0 + B * C + 4, H), -7.0, device=dev)
    src_first = [row0 + int(v) for v in packed] if side in ("src", "both") else [row0 + b for b in blocks]
    dst_first = [row0 + int(v) for v in packed] if side in ("dst", "both") else [row0 + b for b in blocks]
    want = _loop_starts(src.cpu(), dst.cpu(), counts, src_first, dst_first)
    starts = dict(src_starts_B=packed.to(dev) if side in ("src", "both") else None,
                  dst_starts_B=packed.to(dev) if side in ("dst", "both") else None)
    copy_row_blocks(src, dst, counts.to(dev), C, src_row0=row0, dst_row0=row0, **starts)
    assert torch.equal(dst.cpu(), want)
    ref = torch.full_like(dst, -7.0)
    copy_row_blocks_reference(src, ref, counts.to(dev), C, row0, row0, starts["src_starts_B"], starts["dst_starts_B"])
    assert torch.equal(ref.cpu(), want)


@needs_triton_kernels
@pytest.mark.parametrize("first_block", [0, 2])
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("starts", ["src", "dst"])
def test_each_block_from_its_own_tensor(first_block, persistent, starts):
    """Three source tensors of different lengths, read by address in one launch (the exchange's
    reads of its peers' buffers): from a start on the device into block b of dst, or from row 7 of
    each into rows packed one after another from starts on the device. 300-row blocks: more row
    tiles than the persistent grid's programs (on the CPU, 16)."""
    dev = _device()
    C, H, row0 = 300, 20, 7
    g = torch.Generator().manual_seed(2)
    srcs = [torch.randn(rows, H, generator=g).to(dev) for rows in (310, 600, 5)]
    counts = torch.tensor([300, 257, 0])
    first = torch.tensor([10, 343, 5]) if starts == "src" else torch.tensor([0, 300, 557])
    dst = torch.full((3 * C, H), -7.0, device=dev)
    want = dst.cpu().clone()
    for b, (src, n, f) in enumerate(zip(srcs, counts.tolist(), first.tolist())):
        if starts == "src":
            want[b * C:b * C + n] = src[f:f + n].cpu()
        else:
            want[f:f + n] = src[row0:row0 + n].cpu()
    ptrs = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64, device=dev)
    kw = dict(src_starts_B=first.to(dev)) if starts == "src" else dict(dst_starts_B=first.to(dev), src_row0=row0)
    copy_row_blocks(srcs[0], dst, counts.to(dev), C, src_ptrs_B=ptrs, first_block=first_block,
                    persistent=persistent, **kw)
    assert torch.equal(dst.cpu(), want)


def test_source_addresses_need_the_kernel(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import megatron_moe.kernels.copy_rows as copy_rows
    monkeypatch.setattr(copy_rows, "use_triton", lambda *t: False)
    src = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="src_ptrs_B needs the kernel"):
        copy_row_blocks(src, torch.zeros(4, 3), torch.tensor([1]), 4, src_ptrs_B=torch.tensor([src.data_ptr()]))


def test_counts_from_a_strided_view():
    """The exchange passes the last column of a cumulative count matrix: a view with stride El."""
    dev = _device()
    cum_PE = torch.tensor([[1, 3, 4], [0, 0, 2]], device=dev)  # last column: 4, 2
    src = torch.randn(10, 8, device=dev)
    dst = torch.zeros(10, 8, device=dev)
    copy_row_blocks(src, dst, cum_PE[:, -1], 5)
    want = _loop(src.cpu(), torch.zeros(10, 8), torch.tensor([4, 2]), 5, 0, 0)
    assert torch.equal(dst.cpu(), want)


def test_bad_shapes_are_refused_in_one_line():
    src, dst = torch.zeros(8, 4), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="need the same width and dtype"):
        copy_row_blocks(src, torch.zeros(8, 5), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="need the same width and dtype"):
        copy_row_blocks(src, dst.double(), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match=r"2 blocks of 4 rows from row 1 / 0 run past src \(8 rows\)"):
        copy_row_blocks(src, dst, torch.tensor([1, 1]), 4, src_row0=1)
    with pytest.raises(ValueError, match="dst_starts_B has 1 entries, expected one per block \\(2\\)"):
        copy_row_blocks(src, dst, torch.tensor([1, 1]), 4, dst_starts_B=torch.tensor([0]))
