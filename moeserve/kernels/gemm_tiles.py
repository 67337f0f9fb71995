"""Where a GEMM tile's data lives: the order tiles are visited in, the rows of a tile over
expert-aligned pairs, and, for block-scaled FP8 weights, the scale each output column reads.
Shared by the fused MoE, the packed-expert MoE and the w8a8 linear.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block), GROUP_M row blocks at a time so tiles running
    together share weight columns in L2."""
    group_width = GROUP_M * num_pid_n
    first_m = (tile // group_width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_width) % group_rows
    pid_n = (tile % group_width) // group_rows
    return pid_m, pid_n


@triton.jit
def aligned_tile(tile, num_pid_m, num_pid_n, sorted_ids_ptr, block_experts_ptr, num_pairs, BLOCK_M, GROUP_M):
    """A persistent grid's tile over pairs aligned by expert (`AlignedPairs`): (its column
    block, its sorted slots, their pairs, which are live (padding holds the sentinel
    `num_pairs`), and the one expert its rows belong to)."""
    pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + slots)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    return pid_n, slots, pair, pair < num_pairs, expert


@triton.jit
def weight_scale_offsets(cols, rows_per_part, stride_part, stride_row, SCALE_N: tl.constexpr):
    """Offsets into a `BlockFP8Weight`'s scales `[parts, grid_rows, grid_cols]` (first K tile) of
    output features `cols`: feature n is row `n % rows_per_part` of part `n // rows_per_part`, and
    each part's rows have their own tile grid. Per column rather than per tile, so a GEMM tile
    may straddle a scale tile or a part boundary (our gate/up parts need not align to 128)."""
    part = cols // rows_per_part
    return part.to(tl.int64) * stride_part + ((cols - part * rows_per_part) // SCALE_N).to(tl.int64) * stride_row
