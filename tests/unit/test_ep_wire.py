"""The all-to-all volume counters against the analytic formula, on a synthetic uniform routing."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch import ExpertMap
from moeserve.dispatch.wire import (
    LINKS,
    WireVolume,
    dispatch_row_bytes,
    ep_rows_per_token,
    rows_per_destination,
    tp_rows_per_token,
)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_counters_equal_the_formula_for_uniform_routing(ep):
    """Token g's k-th expert is (g * K + k) mod E: every expert gets the same number of pairs, so
    a rank keeps exactly 1/N of its rows and sends (N - 1)/N, out in dispatch and back in combine."""
    num_experts, top_k, tokens, hidden = 16, 4, 32, 64
    owner = ExpertMap.default(num_experts, 0, ep, 1).slot_placement().owner
    rows = []
    for rank in range(ep):
        g = torch.arange(rank * tokens, (rank + 1) * tokens)[:, None]
        slots = (g * top_k + torch.arange(top_k)) % num_experts  # [T, K]
        rows.append(rows_per_destination(slots, owner, ep).tolist())
    wire = WireVolume(rows, dispatch_row_bytes(hidden, torch.bfloat16, False), hidden * 2)
    for rank in range(ep):
        assert wire.local(rank) == tokens * top_k // ep
        crossing = tokens * ep_rows_per_token(top_k, ep) / 2  # out only
        assert wire.sent(rank) == crossing
        assert wire.dispatch_bytes(rank) == crossing * hidden * 2
        assert wire.combine_bytes(rank) == crossing * hidden * 2
    assert tp_rows_per_token(ep) == 2 * (ep - 1)


def test_fp8_rows_carry_their_scales():
    assert dispatch_row_bytes(7168, torch.bfloat16, True) == 7392
    assert dispatch_row_bytes(7168, torch.bfloat16, False) == 14336


def test_bytes_split_between_and_inside_nvlink_domains():
    """Four ranks in two domains of two: rows between 0 and 1 (or 2 and 3) stay inside a domain,
    the rest cross the NIC; the two parts add up to the totals, each way."""
    rows = [[5, 1, 2, 3], [4, 6, 0, 7], [1, 1, 9, 2], [0, 3, 8, 4]]
    wire = WireVolume(rows, 10, 100, domain=2)
    assert [wire.dispatch_bytes(0, link) for link in LINKS] == [1 * 10, (2 + 3) * 10]
    assert [wire.combine_bytes(0, link) for link in LINKS] == [4 * 100, (1 + 0) * 100]
    for rank in range(4):
        assert sum(wire.dispatch_bytes(rank, link) for link in LINKS) == wire.dispatch_bytes(rank)
        assert sum(wire.combine_bytes(rank, link) for link in LINKS) == wire.combine_bytes(rank)
    one_domain = WireVolume(rows, 10, 100)
    assert one_domain.dispatch_bytes(0, LINKS[1]) == 0 and one_domain.dispatch_bytes(0, LINKS[0]) == 60
    all_puts = WireVolume(rows, 10, 100, domain=0)  # nvlink_domain_size=0: no load/store peer at all
    assert all_puts.dispatch_bytes(0, LINKS[0]) == 0 and all_puts.dispatch_bytes(0, LINKS[1]) == 60
