"""Permutation metadata: sort assignments by expert, count, pad bins, block-sparse topology.

Legend (shape suffixes):
  T tokens, K top_k, N = T*K assignments (assignment a = t*K + k), E experts,
  B block size, R_max row blocks (upper bound), P_max = R_max*B padded rows,
  Fb column blocks per expert, C = E*Fb column blocks, Z = R_max*Fb blocks (upper bound).

Everything here is computed on the device with shapes bounded up front (``R_max``), so no
host synchronisation is needed: unused row blocks have expert -1 and kernels skip them.

The Triton path sorts by expert with a stable counting sort in four launches (per-chunk
histograms -> scan over chunks -> scan over experts -> scatter) and builds the topology in one
more; its results are bit-identical to the plain-PyTorch references below.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2, use_triton
from .launcher import launch


def max_row_blocks(num_assignments: int, num_experts: int, block_size: int) -> int:
    """Upper bound of sum_e ceil(n_e / B) over all ways to split N assignments over E experts."""
    n, e, b = num_assignments, num_experts, block_size
    return max(1, min((n + e * (b - 1)) // b, e * cdiv(n, b)))


@dataclass
class Routing:
    """Where every (token, k) assignment goes. Built by :func:`routing_metadata`."""

    num_tokens: int
    top_k: int
    num_experts: int
    block_size: int
    expert_ids_N: torch.Tensor  # int32 [N]: expert of assignment a
    sort_order_N: torch.Tensor  # int32 [N]: sorted position s -> assignment a (stable by expert)
    tokens_per_expert_E: torch.Tensor  # int32 [E]
    expert_offsets_E1: torch.Tensor  # int32 [E+1]: exclusive cumsum of tokens_per_expert
    padded_offsets_E1: torch.Tensor  # int32 [E+1]: cumsum of counts rounded up to B
    padded_row_N: torch.Tensor  # int32 [N]: assignment a -> its row in the padded layout
    padded_src_P: torch.Tensor  # int32 [P_max]: padded row -> assignment a, -1 for padding
    row_block_expert_R: torch.Tensor  # int32 [R_max]: row block -> expert, -1 when unused
    sorted_row_N: torch.Tensor  # int32 [N]: assignment a -> its sorted position (sort_order_N's inverse)

    @property
    def num_assignments(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def max_row_blocks(self) -> int:
        return self.row_block_expert_R.numel()

    @property
    def max_padded_rows(self) -> int:
        return self.padded_src_P.numel()

    @property
    def sorted_token_N(self) -> torch.Tensor:
        """Token index of each sorted position (the gather index of the grouped path); top-1:
        the sort order itself (no op)."""
        if self.top_k == 1:
            return self.sort_order_N
        return torch.div(self.sort_order_N, self.top_k, rounding_mode="floor")


@dataclass
class Topology:
    """Block-sparse [P_max, E*F] matrix: row block r of expert e holds column blocks e*Fb..e*Fb+Fb-1.

    Blocks are stored row-major as ``data[Z, B, B]``; block z = r*Fb + j (so row r's blocks are
    contiguous). Unused blocks (r past the last used row block) have row/column index -1.
    The transposed (column-major) order is given by ``offsets_t_C1`` / ``block_offsets_t_Z``:
    column block g's blocks are ``block_offsets_t_Z[offsets_t_C1[g]:offsets_t_C1[g+1]]``.
    """

    routing: Routing
    num_columns: int  # F: columns per expert (the last column block may be partial)
    blocks_per_row: int  # Fb = ceil(F / B)
    row_indices_Z: torch.Tensor  # int32 [Z]: row block of block z, -1 when unused
    column_indices_Z: torch.Tensor  # int32 [Z]: global column block (e*Fb + j), -1 when unused
    offsets_t_C1: torch.Tensor  # int32 [C+1]: column pointers of the transposed order
    block_offsets_t_Z: torch.Tensor  # int32 [Z]: transposed position -> block z, -1 past the end

    @property
    def block_size(self) -> int:
        return self.routing.block_size

    @property
    def max_blocks(self) -> int:
        return self.row_indices_Z.numel()


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch reference (also the CPU path when Triton is not launched)
# ----------------------------------------------------------------------------------------------


def routing_metadata_reference(expert_ids_TK: torch.Tensor, num_experts: int, block_size: int) -> Routing:
    T, K = expert_ids_TK.shape
    N, E, B = T * K, num_experts, block_size
    dev = expert_ids_TK.device
    ids_N = expert_ids_TK.reshape(-1).to(torch.int64)
    sort_order_N = torch.sort(ids_N, stable=True).indices
    counts_E = torch.bincount(ids_N, minlength=E)[:E]
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    offsets_E1 = torch.cat([zero, torch.cumsum(counts_E, 0)])
    padded_E1 = torch.cat([zero, torch.cumsum(torch.div(counts_E + B - 1, B, rounding_mode="floor") * B, 0)])
    sorted_expert_N = ids_N[sort_order_N]
    pos_N = torch.arange(N, device=dev)
    padded_row_sorted_N = padded_E1[sorted_expert_N] + pos_N - offsets_E1[sorted_expert_N]
    padded_row_N = torch.empty_like(padded_row_sorted_N)
    padded_row_N[sort_order_N] = padded_row_sorted_N
    sorted_row_N = torch.empty_like(pos_N)
    sorted_row_N[sort_order_N] = pos_N
    R_max = max_row_blocks(N, E, B)
    padded_src_P = torch.full((R_max * B,), -1, dtype=torch.int64, device=dev)
    padded_src_P[padded_row_sorted_N] = sort_order_N
    row_start_R = torch.arange(R_max, device=dev) * B
    row_expert_R = torch.searchsorted(padded_E1[1:], row_start_R, right=True)
    row_expert_R = torch.where(row_start_R < padded_E1[-1], row_expert_R, torch.full_like(row_expert_R, -1))
    i32 = torch.int32
    return Routing(
        num_tokens=T, top_k=K, num_experts=E, block_size=B,
        expert_ids_N=ids_N.to(i32), sort_order_N=sort_order_N.to(i32),
        tokens_per_expert_E=counts_E.to(i32), expert_offsets_E1=offsets_E1.to(i32),
        padded_offsets_E1=padded_E1.to(i32), padded_row_N=padded_row_N.to(i32),
        padded_src_P=padded_src_P.to(i32), row_block_expert_R=row_expert_R.to(i32),
        sorted_row_N=sorted_row_N.to(i32),
    )


def block_topology_reference(routing: Routing, num_columns: int) -> Topology:
    B, E = routing.block_size, routing.num_experts
    Fb = cdiv(num_columns, B)
    R_max = routing.max_row_blocks
    dev = routing.row_block_expert_R.device
    row_expert_R = routing.row_block_expert_R.to(torch.int64)
    row_Z = torch.arange(R_max, device=dev).repeat_interleave(Fb)
    j_Z = torch.arange(Fb, device=dev).repeat(R_max)
    expert_Z = row_expert_R[row_Z]
    valid_Z = expert_Z >= 0
    minus1 = torch.full_like(row_Z, -1)
    row_indices_Z = torch.where(valid_Z, row_Z, minus1)
    column_indices_Z = torch.where(valid_Z, expert_Z * Fb + j_Z, minus1)
    # Transposed order: column block g (expert g // Fb) holds that expert's row blocks, in order.
    row_blocks_E = torch.div(routing.padded_offsets_E1[1:] - routing.padded_offsets_E1[:-1], B,
                             rounding_mode="floor").to(torch.int64)
    row_block_start_E = torch.div(routing.padded_offsets_E1[:-1], B, rounding_mode="floor").to(torch.int64)
    blocks_C = row_blocks_E.repeat_interleave(Fb)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    offsets_t_C1 = torch.cat([zero, torch.cumsum(blocks_C, 0)])
    i_Z = torch.arange(R_max * Fb, device=dev)
    g_Z = torch.searchsorted(offsets_t_C1[1:], i_Z, right=True).clamp(max=E * Fb - 1)
    e_Z = torch.div(g_Z, Fb, rounding_mode="floor")
    r_Z = row_block_start_E[e_Z] + (i_Z - offsets_t_C1[g_Z])
    block_offsets_t_Z = torch.where(i_Z < offsets_t_C1[-1], r_Z * Fb + (g_Z % Fb), torch.full_like(i_Z, -1))
    i32 = torch.int32
    return Topology(
        routing=routing, num_columns=num_columns, blocks_per_row=Fb,
        row_indices_Z=row_indices_Z.to(i32), column_indices_Z=column_indices_Z.to(i32),
        offsets_t_C1=offsets_t_C1.to(i32), block_offsets_t_Z=block_offsets_t_Z.to(i32),
    )


# ----------------------------------------------------------------------------------------------
# Triton kernels: a stable counting sort by expert (no general sort, no atomics)
#
# Assignments are cut into chunks of CHUNK (chunk c = assignments [c*CHUNK, (c+1)*CHUNK)).
#   _histogram_kernel    per chunk: hist[e, c] = assignments of chunk c routed to e, and
#                        rank_N[a] = earlier assignments of a's chunk with a's expert
#   _chunk_scan_kernel   per expert: hist[e, :] -> exclusive cumsum over chunks; counts[e]
#   _expert_scan_kernel  one program: counts -> expert_offsets_E1, padded_offsets_E1
#   _scatter_kernel      per assignment a of expert e in chunk c:
#                          before = prefix[e, c] + rank_N[a]   (earlier assignments of e)
#                          sorted row = offsets[e] + before, padded row = padded_offsets[e] + before
# The chunk statistics come from one of two equivalent methods, picked by E:
#   one-hot   [CHUNK, BLOCK_E] one-hot tiles: column sums and an exclusive cumsum down the chunk
#             (work ~ CHUNK * E per chunk; best for few experts);
#   pairwise  [CHUNK, CHUNK] equality matrix of the chunk with itself (work ~ CHUNK^2 per chunk,
#             independent of E; best for many experts, with a small CHUNK).
# hist is expert-major [E, num_chunks] so each scan program reads one contiguous row. Pointer
# offsets are formed in int64 (program ids promoted first); every stored value fits int32 as it is
# bounded by N, P_max or Z.
# ----------------------------------------------------------------------------------------------

_PAIRWISE_MIN_EXPERTS = 32  # E above this: pairwise chunk statistics, else one-hot
_CHUNK_ONEHOT = 256  # assignments per histogram program, one-hot method
_CHUNK_PAIRWISE = 64  # assignments per histogram program, pairwise method
_MAX_BLOCK_E = 16  # experts per one-hot tile
_BLOCK_C = 1024  # chunks per step of the chunk-scan kernel
_BLOCK_SCATTER = 1024  # assignments per program of the scatter kernel
_BLOCK_Z = 1024  # blocks per program of the topology kernel


@triton.jit
def _histogram_kernel(
    # pointers
    ids_ptr, ids32_ptr, rank_ptr, hist_ptr, padded_src_ptr, row_expert_ptr,
    # sizes
    N, E, num_chunks, P, R, fill_p, fill_r,
    # meta-parameters
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, PAIRWISE: tl.constexpr,
):
    """Chunk c: hist[:, c], rank_N of its assignments, the int32 copy of the ids, the -1 fill."""
    c = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    offs = c.to(tl.int64) * CHUNK + lane
    mask = offs < N
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)  # -1 matches no expert
    tl.store(ids32_ptr + offs, ids, mask=mask)
    if PAIRWISE:
        # one reduction gives both: low 16 bits count equal ids before i, high bits all equal ids
        same = ids[:, None] == ids[None, :]
        weight = tl.where(lane[None, :] < lane[:, None], 65537, 65536)
        packed = tl.sum(tl.where(same, weight, 0), axis=1)
        rank = packed & 65535
        # hist[:, c] = 0, then every assignment writes its expert's count (equal values when
        # several write one slot); the barrier orders the two within the program
        for e0 in range(0, E, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            tl.store(hist_ptr + e.to(tl.int64) * num_chunks + c, tl.zeros([BLOCK_E], tl.int32), mask=e < E)
        tl.debug_barrier()
        tl.store(hist_ptr + ids.to(tl.int64) * num_chunks + c, packed >> 16, mask=mask)
    else:
        # each assignment matches one expert of one tile, where its inclusive cumsum is rank + 1
        rank = tl.full([CHUNK], -1, dtype=tl.int32)
        for e0 in range(0, E, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            onehot = (ids[:, None] == e[None, :]).to(tl.int32)
            rank += tl.sum(onehot * tl.cumsum(onehot, axis=0), axis=1)
            tl.store(hist_ptr + e.to(tl.int64) * num_chunks + c, tl.sum(onehot, axis=0), mask=e < E)
    tl.store(rank_ptr + offs, rank, mask=mask)
    # Every padded row and row block starts as -1; the scatter kernel (a later launch) writes the
    # real ones. Program c fills its stripe [c*fill, (c+1)*fill) of each array.
    minus1 = tl.full([CHUNK], -1, tl.int32)
    p0 = c.to(tl.int64) * fill_p
    for i in range(0, fill_p, CHUNK):
        p = p0 + i + lane
        tl.store(padded_src_ptr + p, minus1, mask=(p < P) & (i + lane < fill_p))
    r0 = c.to(tl.int64) * fill_r
    for i in range(0, fill_r, CHUNK):
        r = r0 + i + lane
        tl.store(row_expert_ptr + r, minus1, mask=(r < R) & (i + lane < fill_r))


@triton.jit
def _chunk_scan_kernel(
    # pointers
    hist_ptr, counts_ptr,
    # sizes
    num_chunks,
    # meta-parameters
    BLOCK_C: tl.constexpr,
):
    """In place: hist[e, :] -> its exclusive cumsum over chunks; counts[e] = the row total."""
    e = tl.program_id(0)
    row_ptr = hist_ptr + e.to(tl.int64) * num_chunks
    carry = 0
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = c < num_chunks
        h = tl.load(row_ptr + c, mask=mask, other=0)
        tl.store(row_ptr + c, tl.cumsum(h, axis=0) - h + carry, mask=mask)
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + e, carry)


@triton.jit
def _expert_scan_kernel(
    # pointers
    counts_ptr, offsets_ptr, padded_offsets_ptr,
    # sizes
    E, B,
    # meta-parameters
    BLOCK_E: tl.constexpr,
):
    """One program: offsets = [0, cumsum(counts)], padded = [0, cumsum(counts rounded up to B)]."""
    lane = tl.arange(0, BLOCK_E)
    tl.store(offsets_ptr + lane, tl.zeros([BLOCK_E], tl.int32), mask=lane == 0)
    tl.store(padded_offsets_ptr + lane, tl.zeros([BLOCK_E], tl.int32), mask=lane == 0)
    carry = 0
    padded_carry = 0
    for e0 in range(0, E, BLOCK_E):
        e = e0 + lane
        mask = e < E
        counts = tl.load(counts_ptr + e, mask=mask, other=0)
        padded_counts = (counts + B - 1) // B * B
        tl.store(offsets_ptr + e + 1, tl.cumsum(counts, axis=0) + carry, mask=mask)
        tl.store(padded_offsets_ptr + e + 1, tl.cumsum(padded_counts, axis=0) + padded_carry, mask=mask)
        carry += tl.sum(counts, axis=0)
        padded_carry += tl.sum(padded_counts, axis=0)


@triton.jit
def _scatter_kernel(
    # pointers
    ids32_ptr, rank_ptr, prefix_ptr, offsets_ptr, padded_offsets_ptr,
    sort_order_ptr, sorted_row_ptr, padded_row_ptr, padded_src_ptr, row_expert_ptr,
    # sizes
    N, B, num_chunks,
    # meta-parameters
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Sorted and padded row of each assignment, and their inverses."""
    a = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = a < N
    e = tl.load(ids32_ptr + a, mask=mask, other=0)
    before = tl.load(prefix_ptr + e.to(tl.int64) * num_chunks + a // CHUNK, mask=mask, other=0)
    before += tl.load(rank_ptr + a, mask=mask, other=0)
    sorted_row = tl.load(offsets_ptr + e, mask=mask, other=0) + before
    padded_row = tl.load(padded_offsets_ptr + e, mask=mask, other=0) + before
    tl.store(sort_order_ptr + sorted_row, a.to(tl.int32), mask=mask)
    tl.store(sorted_row_ptr + a, sorted_row, mask=mask)
    tl.store(padded_row_ptr + a, padded_row, mask=mask)
    tl.store(padded_src_ptr + padded_row, a.to(tl.int32), mask=mask)
    # A used row block always starts with a real row, whose expert is the block's expert.
    tl.store(row_expert_ptr + padded_row // B, e, mask=mask & (padded_row % B == 0))


@triton.jit
def _topology_kernel(
    # pointers
    row_expert_ptr, padded_offsets_ptr,
    row_indices_ptr, column_indices_ptr, offsets_t_ptr, block_offsets_t_ptr,
    # sizes
    Z, C, E, B, Fb,
    # meta-parameters
    BLOCK_Z: tl.constexpr,
):
    """Block z = r*Fb + j: its row/column, and its slot in the transposed (column-major) order.

    Used row blocks are a prefix, so the used blocks are exactly z < total = used_rows * Fb and
    they map one-to-one onto the transposed slots [0, total): block z of expert e goes to slot
    offsets_t[e*Fb + j] + (r - first row block of e). Slots z >= total get -1, written by the
    (unused) block z itself, so no two programs write one slot.
    offsets_t[g] (g = e*Fb + j, up to C) = first_row_block[e]*Fb + j*row_blocks[e] in closed form.
    """
    z = tl.program_id(0).to(tl.int64) * BLOCK_Z + tl.arange(0, BLOCK_Z)
    z_mask = z < Z
    r = z // Fb
    j = z - r * Fb
    e = tl.load(row_expert_ptr + r, mask=z_mask, other=-1)
    used = e >= 0
    e_safe = tl.where(used, e, 0)
    start = tl.load(padded_offsets_ptr + e_safe, mask=z_mask, other=0) // B
    end = tl.load(padded_offsets_ptr + e_safe + 1, mask=z_mask, other=0) // B
    tl.store(row_indices_ptr + z, tl.where(used, r, -1).to(tl.int32), mask=z_mask)
    tl.store(column_indices_ptr + z, tl.where(used, e_safe * Fb + j, -1).to(tl.int32), mask=z_mask)
    slot = tl.where(used, start * Fb + j * (end - start) + (r - start), z)
    tl.store(block_offsets_t_ptr + slot, tl.where(used, z, -1).to(tl.int32), mask=z_mask)
    # column pointers of the transposed order (the same program ids cover g in [0, C])
    g = z
    g_mask = g <= C
    eg = g // Fb
    jg = g - eg * Fb
    g_start = tl.load(padded_offsets_ptr + eg, mask=g_mask, other=0) // B
    g_end = tl.load(padded_offsets_ptr + eg + 1, mask=g_mask & (eg < E), other=0) // B
    g_blocks = tl.where(eg < E, g_end - g_start, 0)
    tl.store(offsets_t_ptr + g, (g_start * Fb + jg * g_blocks).to(tl.int32), mask=g_mask)


def _routing_metadata_triton(
    expert_ids_TK: torch.Tensor, num_experts: int, block_size: int,
    pairwise: bool | None = None, chunk_size: int | None = None,
    max_block_e: int = _MAX_BLOCK_E, block_c: int = _BLOCK_C,
) -> Routing:
    """Triton launcher of :func:`routing_metadata`: four launches, no host synchronisation.

    ``pairwise`` picks the chunk-statistics method (default: by E); it and the tile sizes
    (powers of two) are arguments so tests can force both methods, many chunks and E tiles.
    """
    T, K = expert_ids_TK.shape
    N, E, B = T * K, num_experts, block_size
    dev = expert_ids_TK.device
    ids_N = expert_ids_TK.reshape(-1).contiguous()
    if pairwise is None:
        pairwise = E > _PAIRWISE_MIN_EXPERTS
    chunk = chunk_size or (_CHUNK_PAIRWISE if pairwise else _CHUNK_ONEHOT)
    assert chunk < 2**15, "the pairwise method packs two counts of at most CHUNK into one int32"
    R_max = max_row_blocks(N, E, B)
    P_max = R_max * B
    num_chunks = max(1, cdiv(N, chunk))
    i32 = torch.int32

    def empty(*shape):
        return torch.empty(shape, dtype=i32, device=dev)

    ids32_N, rank_N, hist_EC = empty(N), empty(N), empty(E, num_chunks)
    counts_E, offsets_E1, padded_E1 = empty(E), empty(E + 1), empty(E + 1)
    sort_order_N, sorted_row_N, padded_row_N = empty(N), empty(N), empty(N)
    padded_src_P, row_expert_R = empty(P_max), empty(R_max)
    launch(_histogram_kernel, (num_chunks,),
           (ids_N, ids32_N, rank_N, hist_EC, padded_src_P, row_expert_R, N, E, num_chunks, P_max, R_max,
            cdiv(P_max, num_chunks), cdiv(R_max, num_chunks)),
           dict(CHUNK=chunk, BLOCK_E=min(next_power_of_2(E), 64 if pairwise else max_block_e),
                PAIRWISE=pairwise))
    launch(_chunk_scan_kernel, (E,), (hist_EC, counts_E, num_chunks), dict(BLOCK_C=block_c))
    launch(_expert_scan_kernel, (1,),
           (counts_E, offsets_E1, padded_E1, E, B),
           dict(BLOCK_E=min(next_power_of_2(E), 1024)))
    if N:
        launch(_scatter_kernel, (cdiv(N, _BLOCK_SCATTER),),
               (ids32_N, rank_N, hist_EC, offsets_E1, padded_E1, sort_order_N, sorted_row_N, padded_row_N, padded_src_P,
                row_expert_R, N, B, num_chunks),
               dict(CHUNK=chunk, BLOCK=_BLOCK_SCATTER))
    return Routing(
        num_tokens=T, top_k=K, num_experts=E, block_size=B,
        expert_ids_N=ids32_N, sort_order_N=sort_order_N,
        tokens_per_expert_E=counts_E, expert_offsets_E1=offsets_E1,
        padded_offsets_E1=padded_E1, padded_row_N=padded_row_N,
        padded_src_P=padded_src_P, row_block_expert_R=row_expert_R, sorted_row_N=sorted_row_N,
    )


def _block_topology_triton(routing: Routing, num_columns: int) -> Topology:
    """Triton launcher of :func:`block_topology` (one launch)."""
    B, E = routing.block_size, routing.num_experts
    Fb = cdiv(num_columns, B)
    Z, C = routing.max_row_blocks * Fb, E * Fb
    dev = routing.row_block_expert_R.device
    i32 = torch.int32
    row_indices_Z = torch.empty(Z, dtype=i32, device=dev)
    column_indices_Z = torch.empty(Z, dtype=i32, device=dev)
    offsets_t_C1 = torch.empty(C + 1, dtype=i32, device=dev)
    block_offsets_t_Z = torch.empty(Z, dtype=i32, device=dev)
    grid = (cdiv(max(Z, C + 1), _BLOCK_Z),)
    launch(_topology_kernel, grid,
           (routing.row_block_expert_R, routing.padded_offsets_E1, row_indices_Z, column_indices_Z, offsets_t_C1,
            block_offsets_t_Z, Z, C, E, B, Fb),
           dict(BLOCK_Z=_BLOCK_Z))
    return Topology(
        routing=routing, num_columns=num_columns, blocks_per_row=Fb,
        row_indices_Z=row_indices_Z, column_indices_Z=column_indices_Z,
        offsets_t_C1=offsets_t_C1, block_offsets_t_Z=block_offsets_t_Z,
    )


# ----------------------------------------------------------------------------------------------
# Public entry points (Triton on the GPU / under the interpreter, the reference otherwise)
# ----------------------------------------------------------------------------------------------


def routing_metadata(expert_ids_TK: torch.Tensor, num_experts: int, block_size: int) -> Routing:
    """Routing metadata of ``expert_ids_TK`` (int, [T, K], values in [0, E)). No host sync."""
    if expert_ids_TK.dim() != 2:
        raise ValueError(f"expert_ids_TK must be [T, K], got shape {tuple(expert_ids_TK.shape)}")
    if use_triton(expert_ids_TK):
        return _routing_metadata_triton(expert_ids_TK, num_experts, block_size)
    return routing_metadata_reference(expert_ids_TK, num_experts, block_size)


def block_topology(routing: Routing, num_columns: int) -> Topology:
    """Block-sparse topology of the [P_max, E*num_columns] hidden matrix of ``routing``. No host sync."""
    if use_triton(routing.row_block_expert_R):
        return _block_topology_triton(routing, num_columns)
    return block_topology_reference(routing, num_columns)
