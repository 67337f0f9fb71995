"""Expert-sorted block layout: the Triton kernels equal the torch reference exactly, and the
reference equals the layout's definition written out as plain Python loops."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe_align import (
    BLOCK_C,
    BLOCK_P,
    AlignedPairs,
    moe_align_block_size,
    moe_align_reference,
    padded_capacity,
)


def _spec(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int], int]:
    """The layout as the format defines it, one pair at a time."""
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    p_max = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids: list[int] = []
    experts: list[int] = []
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        if not pairs:
            continue
        pairs += [num_pairs] * (-len(pairs) % block_m)
        sorted_ids += pairs
        experts += [e] * (len(pairs) // block_m)
    used = len(sorted_ids)
    return sorted_ids + [num_pairs] * (p_max - used), experts + [-1] * (p_max // block_m - len(experts)), used


def _random_ids(num_tokens: int, top_k: int, num_experts: int, seed: int, skip_fraction: float = 0.0) -> torch.Tensor:
    """Distinct experts per row (as a router gives), a fraction replaced by -1 or E (skipped)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k]
    skip = torch.rand(num_tokens, top_k, generator=gen) < skip_fraction
    off_rank = torch.where(torch.rand(num_tokens, top_k, generator=gen) < 0.5, -1, num_experts)
    return torch.where(skip, off_rank, ids)


def _assert_equal(got: AlignedPairs, want: AlignedPairs) -> None:
    for name in ("sorted_pair_ids", "block_experts", "num_padded"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.int32 and g.device == w.device, name
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: {g.cpu().tolist()} != {w.cpu().tolist()}"


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    want = moe_align_reference(topk_ids, num_experts, block_m)
    got = moe_align_block_size(topk_ids, num_experts, block_m)
    p_max = padded_capacity(topk_ids.numel(), num_experts, block_m)
    assert got.sorted_pair_ids.shape == (p_max,) and got.block_experts.shape == (p_max // block_m,)
    assert got.num_padded.shape == (1,)
    _assert_equal(got, want)


def test_worked_example() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    aligned = moe_align_reference(ids, num_experts=4, block_m=2)
    # expert 0: pairs 1, 4; expert 1: none; expert 2: 0, 2, 5 + pad; expert 3: 3 + pad.
    # P_max = round_up(6 + 4 * 1, 2) = 10.
    assert aligned.sorted_pair_ids.tolist() == [1, 4, 0, 2, 5, 6, 3, 6, 6, 6]
    assert aligned.block_experts.tolist() == [0, 2, 2, 3, -1]
    assert aligned.num_padded.tolist() == [8]


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m", "skip"),
    [
        (0, 2, 8, 16, 0.0),
        (1, 1, 1, 16, 0.0),
        (5, 3, 7, 4, 0.3),
        (20, 2, 8, 16, 0.0),
        (9, 8, 256, 64, 0.2),
        (33, 4, 12, 1, 0.1),
    ],
)
def test_reference_matches_spec(num_tokens: int, top_k: int, num_experts: int, block_m: int, skip: float) -> None:
    ids = _random_ids(num_tokens, top_k, num_experts, seed=num_tokens, skip_fraction=skip)
    sorted_ids, experts, used = _spec(ids, num_experts, block_m)
    aligned = moe_align_reference(ids, num_experts, block_m)
    assert aligned.sorted_pair_ids.tolist() == sorted_ids
    assert aligned.block_experts.tolist() == experts
    assert aligned.num_padded.tolist() == [used]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts"),
    [
        (0, 8, 256),  # nothing routed
        (1, 8, 256),  # decode, one token: most experts empty
        (1, 1, 1),
        (7, 2, 8),  # Mixtral
        (23, 8, 128),  # Qwen3, several chunks
        (40, 4, 60),  # E not a power of two
        (300, 8, 64),  # more chunks than one step of the prefix kernel
    ],
)
def test_kernel_matches_reference(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, device: torch.device
) -> None:
    _check(_random_ids(num_tokens, top_k, num_experts, seed=num_tokens).to(device), num_experts, block_m)


def test_chunk_shape_is_exercised() -> None:
    assert 300 * 8 > BLOCK_P * BLOCK_C, "the (300, 8, 64) case must span several prefix steps"


@pytest.mark.parametrize("block_m", [16, 64])
def test_all_pairs_to_one_expert(block_m: int, device: torch.device) -> None:
    ids = torch.full((150, 2), 5, dtype=torch.int64, device=device)  # 300 pairs over three chunks
    _check(ids, 8, block_m)
    aligned = moe_align_block_size(ids, 8, block_m)
    assert aligned.sorted_pair_ids[:300].cpu().tolist() == list(range(300))


@pytest.mark.parametrize("block_m", [16, 64])
def test_skipped_ids(block_m: int, device: torch.device) -> None:
    """Ids of experts on other ranks (-1, or beyond the local count) take no slot."""
    ids = _random_ids(64, 4, 16, seed=7, skip_fraction=0.4).to(device)
    _check(ids, 16, block_m)
    aligned = moe_align_block_size(ids, 16, block_m)
    kept = int(((ids >= 0) & (ids < 16)).sum())
    assert int((aligned.sorted_pair_ids < ids.numel()).sum()) == kept
    none_local = torch.full((10, 2), -1, dtype=torch.int64, device=device)
    _check(none_local, 16, block_m)
    assert moe_align_block_size(none_local, 16, block_m).num_padded.item() == 0


def test_int32_ids_and_top1(device: torch.device) -> None:
    """The expert-parallel path aligns `[N, 1]` rows that arrive grouped by local expert."""
    ids = torch.arange(4, dtype=torch.int32, device=device).repeat_interleave(
        torch.tensor([3, 0, 20, 1], device=device)
    )[:, None]
    _check(ids.contiguous(), 4, 16)


def test_validation(device: torch.device) -> None:
    ids = torch.zeros(4, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        moe_align_block_size(ids[0], 8, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        moe_align_block_size(ids.float(), 8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        moe_align_block_size(ids.t(), 8, 16)
    with pytest.raises(ValueError, match="num_experts"):
        moe_align_block_size(ids, 0, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_align_block_size(ids, 8, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize(("top_k", "num_experts"), [(8, 256), (8, 128), (2, 8)])
def test_kernel_matches_reference_gpu(
    top_k: int, num_experts: int, num_tokens: int, block_m: int, device: torch.device
) -> None:
    _check(_random_ids(num_tokens, top_k, num_experts, seed=num_tokens).to(device), num_experts, block_m)
    # Expert parallelism over 8 ranks: this rank holds E/8 experts, the others' ids are -1.
    local = num_experts // 8
    ids = _random_ids(num_tokens, top_k, num_experts, seed=num_tokens + 1).to(device)
    _check(torch.where(ids < local, ids, -1), local, block_m)


@pytest.mark.gpu
def test_cuda_graph_replay(device: torch.device) -> None:
    """Sized from shapes alone: a captured call replays on new ids written into the same buffer."""
    ids = _random_ids(64, 8, 256, seed=0).to(device)
    moe_align_block_size(ids, 256, 16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aligned = moe_align_block_size(ids, 256, 16)
    ids.copy_(_random_ids(64, 8, 256, seed=1).to(device))
    graph.replay()
    _assert_equal(aligned, moe_align_reference(ids, 256, 16))
