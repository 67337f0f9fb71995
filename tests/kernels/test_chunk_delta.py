"""The chunked gated delta rule kernel against the torch reference (`ops/gated_delta.py`), under
Triton's interpreter on CPU, at a chunk of 16: one step packing sequences of 1, C - 1, C, C + 3
and 2.5 C tokens, each length once from a stored state and once afresh, outputs and final states compared
within float32 rounding (1e-4: a prompt of 40 tokens runs ~40 dependent float32 updates)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.chunk_delta import chunk_gated_delta_rule_varlen
from moeserve.ops.gated_delta import chunk_gated_delta_rule

CHUNK = 16
QUERY_LENS = (1, CHUNK - 1, CHUNK, CHUNK + 3, 5 * CHUNK // 2)
SLOTS = (4, 0, 2, 5, 1)


@pytest.mark.parametrize("resumes", [(True, False, True, False, True), (False, True, False, True, False)])
def test_chunked_matches_reference(resumes):
    g = torch.Generator().manual_seed(3)
    num_tokens, hk, hv, dk, dv = sum(QUERY_LENS), 2, 4, 16, 24  # Dv a partial block of 32
    q, k = (torch.randn(num_tokens, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(num_tokens, hv, dv, generator=g)
    decay = -torch.rand(num_tokens, hv, generator=g)
    beta = torch.rand(num_tokens, hv, generator=g)
    state = torch.randn(6, hv, dk, dv, generator=g)
    want_state, outs, first = state.clone(), [], 0
    for qlen, slot, resume in zip(QUERY_LENS, SLOTS, resumes):
        rows = slice(first, first + qlen)
        initial = want_state[slot] if resume else None
        out, want_state[slot] = chunk_gated_delta_rule(q[rows], k[rows], v[rows], decay[rows], beta[rows], initial)
        outs.append(out)
        first += qlen
    got = chunk_gated_delta_rule_varlen(q, k, v, decay, beta, state, QUERY_LENS, SLOTS, resumes, chunk=CHUNK)
    torch.testing.assert_close(got, torch.cat(outs), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)  # slot 3 is nobody's: left alone


def test_chosen_sequences_only():
    """A step split between the kernels: the unchosen sequences' rows of `out` and their slots are
    left as they were."""
    g = torch.Generator().manual_seed(4)
    query_lens, slots = (3, CHUNK + 3), (1, 0)
    num_tokens, hk, hv, dk, dv = sum(query_lens), 1, 2, 16, 16
    q, k = (torch.randn(num_tokens, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(num_tokens, hv, dv, generator=g)
    decay, beta = -torch.rand(num_tokens, hv, generator=g), torch.rand(num_tokens, hv, generator=g)
    state = torch.randn(2, hv, dk, dv, generator=g)
    before = state.clone()
    out = torch.full((num_tokens, hv, dv), 7.0)
    chunk_gated_delta_rule_varlen(
        q, k, v, decay, beta, state, query_lens, slots, (True, True), chosen=(1,), out=out, chunk=CHUNK
    )
    want, want_state = chunk_gated_delta_rule(q[3:], k[3:], v[3:], decay[3:], beta[3:], before[0])
    torch.testing.assert_close(out[3:], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[0], want_state, rtol=1e-4, atol=1e-4)
    assert (out[:3] == 7.0).all()
    assert torch.equal(state[1], before[1])
