"""The all-to-all volume counters against the analytic formula, on a synthetic uniform routing."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch import ExpertMap
from moeserve.dispatch.wire import (
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
