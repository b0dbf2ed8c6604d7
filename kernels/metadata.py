"""Permutation metadata: sort assignments by expert, count, pad bins, block-sparse topology.

Legend (shape suffixes):
  T tokens, K top_k, N = T*K assignments (assignment a = t*K + k), E experts,
  B block size, R_max row blocks (upper bound), P_max = R_max*B padded rows,
  Fb column blocks per expert, C = E*Fb column blocks, Z = R_max*Fb blocks (upper bound).

Everything here is computed on the device with shapes bounded up front (``R_max``), so no
host synchronisation is needed: unused row blocks have expert -1 and kernels skip them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import cdiv


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
        """Token index of each sorted position (the gather index of the grouped path)."""
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
# Public entry points (Triton on the GPU / under the interpreter, the reference otherwise)
# ----------------------------------------------------------------------------------------------


def routing_metadata(expert_ids_TK: torch.Tensor, num_experts: int, block_size: int) -> Routing:
    """Routing metadata of ``expert_ids_TK`` (int, [T, K], values in [0, E))."""
    return routing_metadata_reference(expert_ids_TK, num_experts, block_size)


def block_topology(routing: Routing, num_columns: int) -> Topology:
    """Block-sparse topology of the [P_max, E*num_columns] hidden matrix of ``routing``."""
    return block_topology_reference(routing, num_columns)
