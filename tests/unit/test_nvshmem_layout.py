"""`nvshmem_layout`: buffer sizing, per-pair slots and the receive order, against brute force."""

from __future__ import annotations

import pytest
import torch
from helpers.routing import ROUTING_KINDS, routing

import moeserve.dispatch.nvshmem_layout as layout
from moeserve.dispatch import ExpertPlacement
from moeserve.dispatch.nvshmem import KERNELS_MISSING, NvshmemDispatcher
from moeserve.dispatch.nvshmem_layout import (
    NvshmemBufferConfig,
    buffer_sizes,
    deepseek_v3_table,
    dispatch_slots,
    local_index_of_experts,
    receive_order,
)

# ---------------------------------------------------------------- sizing


def test_small_case_by_hand() -> None:
    # E=8 on ep=2 -> L=4; T=5, K=2, H=8 float32 (32-byte rows).
    ll = buffer_sizes(NvshmemBufferConfig(2, 8, 8, 2, 5, torch.float32, "low_latency"))
    assert ll.dispatch_recv == 4 * (2 * 5) * 32  # [L, ep*T, H]
    assert ll.dispatch_meta == 4 * 2 * 5 * 16
    assert ll.dispatch_signal == ll.combine_signal == 4 * 2 * 8
    assert ll.dispatch_send == 5 * 32
    assert ll.combine_recv == 5 * 2 * 32  # [T, K, H]
    assert ll.combine_send == ll.dispatch_recv
    assert ll.total == 1280 + 640 + 64 + 160 + 320 + 64 + 1280
    ht = buffer_sizes(NvshmemBufferConfig(2, 8, 8, 2, 5, torch.float32, "high_throughput"))
    assert ht.dispatch_recv == 2 * 5 * min(2, 4) * 32  # [ep * T * min(K, L), H]
    assert ht.dispatch_meta == 2 * 5 * 2 * 16
    # K > L: a token sends at most L rows to one rank
    ht = buffer_sizes(NvshmemBufferConfig(4, 8, 8, 6, 5, torch.float32, "high_throughput"))
    assert ht.dispatch_recv == 4 * 5 * 2 * 32


def test_uneven_placement_sizes_by_its_largest_rank() -> None:
    placement = ExpertPlacement((0, 0, 0, 1, 2), ep_size=3, rank=1)
    config = NvshmemBufferConfig.for_placement(placement, hidden=8, top_k=2, max_tokens_per_rank=4, dtype=torch.float32)
    assert config.local_experts == 3
    assert buffer_sizes(config).dispatch_recv == 3 * 3 * 4 * 32


def test_deepseek_v3_figures_in_the_docstring_are_the_functions() -> None:
    for line in deepseek_v3_table():
        assert line in layout.__doc__, line
    ll8 = buffer_sizes(NvshmemBufferConfig(8, 256, 7168, 8, 128, torch.bfloat16, "low_latency"))
    ll32 = buffer_sizes(NvshmemBufferConfig(32, 256, 7168, 8, 128, torch.bfloat16, "low_latency"))
    assert ll8.dispatch_recv == ll32.dispatch_recv == 256 * 128 * 7168 * 2  # E*T rows whatever ep
    ht8 = buffer_sizes(NvshmemBufferConfig(8, 256, 7168, 8, 128, torch.bfloat16, "high_throughput"))
    assert ll8.dispatch_recv == 4 * ht8.dispatch_recv  # L=32 vs min(K, L)=8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ep_size=0), "ep_size must be a positive int"),
        (dict(hidden=2.0), "hidden must be a positive int"),
        (dict(top_k=9), "top_k=9 exceeds"),
        (dict(mode="fast"), "mode must be one of"),
        (dict(dtype=torch.int32), "floating"),
        (dict(hidden=7), "multiple of 16"),
        (dict(max_local_experts=3), r"max_local_experts=3 outside \[4, 8\]"),
        (dict(max_local_experts=9), "max_local_experts=9 outside"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    base = dict(ep_size=2, num_experts=8, hidden=8, top_k=2, max_tokens_per_rank=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        NvshmemBufferConfig(**{**base, **kwargs})


# ---------------------------------------------------------------- slots


def placements() -> list[ExpertPlacement]:
    return [
        ExpertPlacement.contiguous(8, 2, 1),
        ExpertPlacement.contiguous(7, 3, 0),  # uneven
        ExpertPlacement(tuple(e % 4 for e in range(10)), 4, 2),  # round robin, uneven
        ExpertPlacement((0, 0, 0, 1, 2), 3, 2),
    ]


def routings(num_experts: int, top_k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    cases = {kind: routing(kind, 23, num_experts, top_k, g) for kind in ROUTING_KINDS}
    return {**cases, "no_tokens": torch.empty(0, top_k, dtype=torch.int64)}


def brute_force(ids: torch.Tensor, placement: ExpertPlacement, max_tokens: int, mode: str):
    """Python loops over pairs in (token, k) order: dest, local, slot per pair, and counts."""
    ep = placement.ep_size
    per_rank = [placement.experts_of(r) for r in range(ep)]
    lmax = max(len(x) for x in per_rank)
    counts = [[0] * lmax for _ in range(ep)]
    seen: dict[int, int] = {}
    dest, local, within = [], [], []
    for e in ids.reshape(-1).tolist():
        d = placement.expert_to_rank[e]
        i = per_rank[d].index(e)
        dest.append(d)
        local.append(i)
        within.append(seen.get(e, 0))
        seen[e] = seen.get(e, 0) + 1
        counts[d][i] += 1
    if mode == "low_latency":
        slot = within
    else:
        slot = [sum(counts[d][:i]) + w for d, i, w in zip(dest, local, within)]
    return dest, local, slot, counts


@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
def test_slots_against_brute_force(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    for placement in placements():
        for top_k in (1, 2, 3):
            for name, ids in routings(placement.num_experts, top_k, g).items():
                max_tokens = 30
                where = f"{placement}, k={top_k}, {name}"
                got = dispatch_slots(ids, placement, max_tokens, mode)
                dest, local, slot, counts = brute_force(ids, placement, max_tokens, mode)
                assert got.dest_rank.reshape(-1).tolist() == dest, where
                assert got.dest_local_expert.reshape(-1).tolist() == local, where
                assert got.slot.reshape(-1).tolist() == slot, where
                assert got.counts.tolist() == counts, where
                assert got.slot.shape == ids.shape and got.buffer_row.shape == ids.shape
                ep, lmax, rows = placement.ep_size, got.max_local_experts, got.region_rows
                # within bounds; ascending (token, k) within each (dest, local expert) group;
                # packed: a region's slots are exactly 0..n-1
                assert bool((got.slot >= 0).all() and (got.slot < rows).all()), where
                group = got.dest_rank * lmax + got.dest_local_expert
                for gid in group.unique().tolist():
                    slots = got.slot[group == gid]  # boolean mask keeps (token, k) order
                    assert bool((slots[1:] > slots[:-1]).all()), f"{where}: group {gid}"
                region = group if mode == "low_latency" else got.dest_rank
                for r in region.unique().tolist():
                    slots = got.slot[region == r]
                    assert sorted(slots.tolist()) == list(range(slots.numel())), f"{where}: region {r}"
                # counts are bincounts of (dest, local)
                flat = (got.dest_rank * lmax + got.dest_local_expert).reshape(-1)
                assert torch.equal(got.counts.reshape(-1), torch.bincount(flat, minlength=ep * lmax)), where
                # buffer rows: distinct, inside the buffer, inside this rank's region
                recv_rows = lmax * ep * max_tokens if mode == "low_latency" else ep * rows
                in_dest = got.dest_rank * recv_rows + got.buffer_row  # rows of different ranks' buffers
                assert in_dest.reshape(-1).unique().numel() == ids.numel(), where
                assert bool((got.buffer_row >= 0).all() and (got.buffer_row < recv_rows).all()), where
                if mode == "low_latency":
                    src_of_row = (got.buffer_row % (ep * max_tokens)) // max_tokens
                else:
                    src_of_row = got.buffer_row // rows
                assert bool((src_of_row == placement.rank).all()), where


def test_slots_use_local_index_of_owner() -> None:
    placement = ExpertPlacement((1, 0, 1, 0, 1), 2, 0)
    assert local_index_of_experts(placement).tolist() == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
def test_overflow_is_refused(mode: str) -> None:
    placement = ExpertPlacement.contiguous(8, 2, 0)
    ids = torch.tensor([[0, 1]] * 5)
    with pytest.raises(ValueError, match="5 tokens on rank 0 exceed max_tokens_per_rank=4"):
        dispatch_slots(ids, placement, 4, mode)
    with pytest.raises(ValueError, match="token 1 names expert 3 twice"):
        dispatch_slots(torch.tensor([[0, 1], [3, 3]]), placement, 4, mode)


def test_bad_ids_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        dispatch_slots(torch.tensor([[8]]), ExpertPlacement.contiguous(8, 2, 0), 4)
    with pytest.raises(ValueError, match="must be one of"):
        dispatch_slots(torch.tensor([[1]]), ExpertPlacement.contiguous(8, 2, 0), 4, "fast")


# ---------------------------------------------------------------- receive order


def test_receive_order_low_latency_by_hand() -> None:
    # ep=2, 2 local experts, T=3: buffer rows e*6 + s*3 + j
    counts = torch.tensor([[2, 0], [1, 3]])  # [source, expert]
    assert receive_order(counts, 3).tolist() == [0, 1, 3, 9, 10, 11]


def test_receive_order_high_throughput_by_hand() -> None:
    # ep=2, L=2, K=2, T=3: regions of R=6 rows per source, packed by expert within
    counts = torch.tensor([[2, 1], [1, 3]])
    order = receive_order(counts, 3, "high_throughput", top_k=2, max_local_experts=2)
    assert order.tolist() == [0, 1, 6, 2, 7, 8, 9]
    with pytest.raises(ValueError, match="needs top_k"):
        receive_order(counts, 3, "high_throughput")


def test_receive_order_empty_and_overflow() -> None:
    assert receive_order(torch.zeros(3, 2, dtype=torch.int64), 4).numel() == 0
    assert receive_order(torch.zeros(3, 0, dtype=torch.int64), 4).numel() == 0
    with pytest.raises(ValueError, match="exceed"):
        receive_order(torch.tensor([[5]]), 4)


# ---------------------------------------------------------------- the dispatcher stub


def test_nvshmem_dispatcher_refuses_honestly() -> None:
    placement = ExpertPlacement.contiguous(8, 2, 0)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        reason = NvshmemDispatcher.supports(placement, device)
        assert reason is not None and KERNELS_MISSING in reason
        if not torch.cuda.is_available():
            assert "CUDA device" in reason
    with pytest.raises(ValueError, match=KERNELS_MISSING) as raised:
        NvshmemDispatcher(placement)
    assert NvshmemDispatcher.supports(placement, torch.device("cpu")) in str(raised.value)
    assert NvshmemDispatcher.name == "nvshmem"
