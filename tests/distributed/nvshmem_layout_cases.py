"""Per-rank body of `test_nvshmem_layout_vs_torch`: the NVSHMEM dispatch simulated with torch.

Each rank computes its slots with `dispatch_slots`, writes every pair's hidden row where the
device put would land -- into a full-size copy of each destination's receive buffer, with a
written-flag per row -- and one `all_to_all_single` stands in for the puts (a second one for the
signal words, i.e. the counts). The receiver overlays the sources' writes (no row written
twice), applies `receive_order`, and returns what it would hand its experts, next to the `torch`
backend's DispatchOutput for the same inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dispatch_cases import Case, placement_for, rank_inputs

from moeserve.dispatch import create_dispatcher
from moeserve.dispatch.nvshmem_layout import MODES, NvshmemBufferConfig, dispatch_slots, receive_order


def simulate(hidden: torch.Tensor, ids: torch.Tensor, case: Case, placement, max_tokens: int, mode: str) -> dict:
    ep, width = placement.ep_size, hidden.shape[-1]
    config = NvshmemBufferConfig.for_placement(placement, width, case.top_k, max_tokens, torch.float32, mode)
    rows = config.recv_rows
    slots = dispatch_slots(ids, placement, max_tokens, mode)
    assert slots.max_local_experts == config.local_experts and slots.region_rows == config.region_rows

    # What this rank puts into every destination's buffer (+ a written flag per row).
    send = hidden.new_zeros(ep, rows, width)
    written = torch.zeros(ep, rows, dtype=torch.int64)
    token = torch.arange(ids.shape[0]).repeat_interleave(case.top_k)
    dest, row = slots.dest_rank.reshape(-1), slots.buffer_row.reshape(-1)
    send[dest, row] = hidden[token]
    written.index_put_((dest, row), torch.ones_like(row), accumulate=True)
    recv = torch.empty_like(send)
    recv_written = torch.empty_like(written)
    dist.all_to_all_single(recv, send)
    dist.all_to_all_single(recv_written, written)
    recv_counts = torch.empty_like(slots.counts)
    dist.all_to_all_single(recv_counts, slots.counts)  # the signal words

    times_written = recv_written.sum(0)
    buffer = hidden.new_zeros(rows, width)
    for s in range(ep):  # no row is written by two sources (checked below), so overlay order is moot
        buffer = torch.where(recv_written[s, :, None].bool(), recv[s], buffer)
    n_local = placement.num_local_experts
    counts = recv_counts[:, :n_local]
    order = receive_order(counts, max_tokens, mode, top_k=case.top_k, max_local_experts=config.local_experts)
    return {
        "hidden": buffer.index_select(0, order),
        "counts": tuple(counts.sum(0).tolist()),
        "max_writes": int(times_written.max()) if rows else 0,
        "read_rows_written": bool((times_written[order] == 1).all()),
        "rows_written": int(times_written.sum()),
        "padded_counts_zero": bool((recv_counts[:, n_local:] == 0).all()),
    }


def run_cases(rank: int, world_size: int, cases: list[Case], slack: int) -> list[dict]:
    results = []
    for case in cases:
        placement = placement_for(case, world_size, rank)
        hidden, ids, weights = rank_inputs(case, rank)
        received = create_dispatcher("torch", placement).dispatch(hidden, ids, weights)
        max_tokens = max(max(case.tokens_per_rank), 1) + slack
        results.append(
            {
                "torch_hidden": received.hidden,
                "torch_counts": tuple(received.num_tokens_per_expert.tolist()),
                **{mode: simulate(hidden, ids, case, placement, max_tokens, mode) for mode in MODES},
            }
        )
    return results
