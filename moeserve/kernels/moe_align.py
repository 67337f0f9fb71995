"""Expert-sorted block layout of the (token, k) pairs, the input of the grouped GEMM (`fused_moe`).

Pair p = t * K + k of `topk_ids [T, K]` goes to expert `topk_ids[t, k]`. The layout lists, for each
expert e = 0..E-1 in turn, its pairs in ascending p, padded with the sentinel T*K to a multiple
of `block_m`, so every `block_m` consecutive slots belong to one expert:

* `sorted_pair_ids [P_max] int32`: that listing; slots at or beyond `num_padded` hold T*K.
* `block_experts [P_max // block_m] int32`: the expert of each used block, -1 for unused blocks.
* `num_padded [1] int32`: the used length, a multiple of `block_m`.

`P_max = round_up(T*K + E*(block_m - 1), block_m)` bounds the used length from shapes alone, so
nothing is read back to the host and a call is CUDA-graph capturable. Ids outside [0, E) (the
experts of other ranks, marked -1) get no slot.

The Triton path is four small kernels over chunks of `BLOCK_P` pairs:
1. count: per chunk and expert, how many pairs (atomic adds of 1: exact whatever their order);
2. prefix (one program): per expert, the exclusive prefix of the chunk counts (where each chunk's
   pairs start within the expert), the padded sizes and the experts' start slots;
3. scatter: a pair's slot is its expert's start + its chunk's offset + the number of earlier pairs
   of the same expert within the chunk. Derived from counts, not from an atomic counter, so the
   order within an expert is ascending p on every run;
4. blocks: each block's expert is the number of experts whose padded range ends at or before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024  # the prefix over experts runs in one program's registers
BLOCK_P = 128  # pairs per chunk: the scatter compares a chunk's pairs all against all
BLOCK_C = 16  # chunks per step of the prefix kernel
BLOCK_B = 64  # blocks per program of the block kernel


@dataclass(frozen=True)
class AlignedPairs:
    """Pairs sorted by expert, padded per expert to multiples of block_m (see the module doc)."""

    sorted_pair_ids: torch.Tensor  # [P_max] int32
    block_experts: torch.Tensor  # [P_max // block_m] int32
    num_padded: torch.Tensor  # [1] int32


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P_max: the most slots `num_pairs` pairs over `num_experts` experts can take once each
    expert's list is padded to a multiple of `block_m`."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if padded_capacity(topk_ids.numel(), num_experts, block_m) >= 2**31:
        raise ValueError(f"{topk_ids.numel()} pairs overflow the int32 layout")


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """The layout in torch ops, without host syncs: the kernels' test oracle and CPU path."""
    _check(topk_ids, num_experts, block_m)
    device, num_pairs = topk_ids.device, topk_ids.numel()
    p_max = padded_capacity(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    expert = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # E: skipped
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, expert, torch.ones_like(expert)
    )
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = torch.cat([ends - padded, ends.new_full((1,), p_max)])  # skipped pairs go to slot P_max
    order = torch.argsort(expert, stable=True)  # by expert, ascending p within one
    by_expert = expert[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    slots = torch.where(by_expert < num_experts, starts[by_expert] + rank, p_max)
    sorted_pair_ids = torch.full((p_max + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[slots] = order.to(torch.int32)
    blocks = torch.arange(p_max // block_m, device=device)
    block_experts = torch.searchsorted(ends // block_m, blocks, right=True)
    block_experts = torch.where(blocks < ends[-1] // block_m, block_experts, -1).to(torch.int32)
    return AlignedPairs(sorted_pair_ids[:p_max], block_experts, ends[-1:].to(torch.int32))


@triton.jit
def _count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, num_experts, BLOCK_P: tl.constexpr):
    chunk = tl.program_id(0)
    pair = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    expert = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0).to(tl.int32)
    tl.atomic_add(chunk_counts_ptr + chunk * num_experts + expert, 1, mask=valid)


@triton.jit
def _prefix_kernel(
    chunk_counts_ptr,
    starts_ptr,
    num_padded_ptr,
    num_chunks,
    num_experts,
    block_m,
    E_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    expert = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for first in range(0, num_chunks, BLOCK_C):
        chunk = first + tl.arange(0, BLOCK_C)
        ptrs = chunk_counts_ptr + chunk[:, None] * num_experts + expert[None, :]
        mask = (chunk[:, None] < num_chunks) & (expert[None, :] < num_experts)
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + carry[None, :], mask=mask)
        carry += tl.sum(counts, axis=0)
    padded = (carry + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + expert, ends - padded, mask=expert < num_experts)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


@triton.jit
def _scatter_kernel(
    ids_ptr,
    chunk_offsets_ptr,
    starts_ptr,
    sorted_ptr,
    num_pairs,
    num_experts,
    BLOCK_P: tl.constexpr,
):
    chunk = tl.program_id(0)
    lane = tl.arange(0, BLOCK_P)
    pair = chunk * BLOCK_P + lane
    expert = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, -1).to(tl.int32)
    earlier = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(starts_ptr + expert, mask=valid, other=0)
    base += tl.load(chunk_offsets_ptr + chunk * num_experts + expert, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, pair, mask=valid)


@triton.jit
def _block_kernel(
    starts_ptr,
    num_padded_ptr,
    block_experts_ptr,
    num_blocks,
    num_experts,
    block_m,
    E_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    block = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    expert = tl.arange(0, E_PAD)
    num_padded = tl.load(num_padded_ptr)
    # Expert e's blocks end where expert e+1's start; the last expert's end is num_padded.
    ends = tl.load(starts_ptr + expert + 1, mask=expert + 1 < num_experts, other=num_padded)
    ends = tl.where(expert < num_experts, ends // block_m, num_blocks)
    owner = tl.sum((ends[None, :] <= block[:, None]).to(tl.int32), axis=1)
    tl.store(block_experts_ptr + block, tl.where(block < num_padded // block_m, owner, -1), mask=block < num_blocks)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Sort the pairs of `topk_ids [T, K]` by expert into blocks of `block_m` (module doc).

    `num_experts` is the count of experts this rank holds; ids outside [0, num_experts) are skipped.
    """
    _check(topk_ids, num_experts, block_m)
    device, num_pairs = topk_ids.device, topk_ids.numel()
    p_max = padded_capacity(num_pairs, num_experts, block_m)
    num_blocks, num_chunks = p_max // block_m, triton.cdiv(num_pairs, BLOCK_P)
    e_pad = triton.next_power_of_2(num_experts)
    sorted_pair_ids = torch.full((p_max,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunk_counts = torch.zeros(num_chunks, num_experts, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    if num_chunks:
        _count_kernel[(num_chunks,)](topk_ids, chunk_counts, num_pairs, num_experts, BLOCK_P=BLOCK_P)
    _prefix_kernel[(1,)](
        chunk_counts,
        starts,
        num_padded,
        num_chunks,
        num_experts,
        block_m,
        E_PAD=e_pad,
        BLOCK_C=BLOCK_C,
        num_warps=4 if e_pad <= 256 else 8,
    )
    if num_chunks:
        _scatter_kernel[(num_chunks,)](
            topk_ids,
            chunk_counts,
            starts,
            sorted_pair_ids,
            num_pairs,
            num_experts,
            BLOCK_P=BLOCK_P,
            num_warps=8,
        )
    if num_blocks:
        _block_kernel[(triton.cdiv(num_blocks, BLOCK_B),)](
            starts,
            num_padded,
            block_experts,
            num_blocks,
            num_experts,
            block_m,
            E_PAD=e_pad,
            BLOCK_B=BLOCK_B,
        )
    return AlignedPairs(sorted_pair_ids, block_experts, num_padded)
