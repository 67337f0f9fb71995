"""The Gated DeltaNet kernels against the torch reference (`ops/gated_delta.py`), under Triton's
interpreter on CPU: a step mixing a fresh prompt, a later chunk resuming from its slot (one
shorter than the conv's window among them) and decodes, in float32 and bfloat16 inputs."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen
from moeserve.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_step

QUERY_LENS = (7, 2, 1, 1, 20)
SLOTS = (3, 0, 5, 1, 2)
RESUMES = (False, True, True, True, True)


def reference_conv(x, weight, state):
    """Per sequence the reference conv from its slot's state (None when it starts afresh)."""
    state, outs, first = state.clone(), [], 0
    for qlen, slot, resumes in zip(QUERY_LENS, SLOTS, RESUMES):
        rows = x[first : first + qlen].t().unsqueeze(0)
        out, new = causal_conv1d(rows, weight, state[slot : slot + 1] if resumes else None)
        state[slot] = new[0]
        outs.append(out[0].t())
        first += qlen
    return torch.cat(outs), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    channels = 200  # two channel blocks, the second partial
    x = torch.randn(sum(QUERY_LENS), channels, generator=g).to(dtype)
    weight = torch.randn(channels, 4, generator=g).to(dtype)
    state = torch.randn(6, channels, 3, generator=g).to(dtype)
    want, want_state = reference_conv(x, weight, state)
    got = causal_conv1d_varlen(x, weight, state, QUERY_LENS, SLOTS, RESUMES)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for slot in SLOTS:  # slot 4 is nobody's: left alone
        torch.testing.assert_close(state[slot], want_state[slot], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    num_tokens, hk, hv, dk, dv = sum(QUERY_LENS), 2, 4, 16, 24
    q, k = (torch.randn(num_tokens, hk, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(num_tokens, hv, dv, generator=g).to(dtype)
    decay = -torch.rand(num_tokens, hv, generator=g) * 2
    beta = torch.rand(num_tokens, hv, generator=g).to(dtype)
    state = torch.randn(6, hv, dk, dv, generator=g)
    want_state, outs, first = state.clone(), [], 0
    for qlen, slot, resumes in zip(QUERY_LENS, SLOTS, RESUMES):
        rows = slice(first, first + qlen)
        if qlen == 1 and resumes:
            out, new = recurrent_gated_delta_step(
                q[rows], k[rows], v[rows], decay[rows], beta[rows], want_state[slot : slot + 1]
            )
            new = new[0]
        else:
            initial = want_state[slot] if resumes else None
            out, new = chunk_gated_delta_rule(q[rows], k[rows], v[rows], decay[rows], beta[rows], initial)
        want_state[slot] = new
        outs.append(out)
        first += qlen
    got = gated_delta_rule_varlen(q, k, v, decay, beta, state, QUERY_LENS, SLOTS, RESUMES)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, torch.cat(outs), rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)


def test_backends_agree_through_layer_ops():
    """`LayerOps.gated_delta_net`, as the layer calls it: the Triton backend's varlen launches (the
    20-token prompt chunk through the chunked kernel, the rest through the recurrent one) against
    the torch backend's per-sequence forms, outputs and both states."""
    from moeserve.ops import TORCH_OPS
    from moeserve.ops.state_batch import LinearState, StateBatch, StateStep
    from moeserve.ops.triton_ops import TritonOps

    g = torch.Generator().manual_seed(2)
    num_tokens, hk, hv, dk, dv = sum(QUERY_LENS), 2, 4, 16, 24
    channels = 2 * hk * dk + hv * dv
    mixed = torch.randn(num_tokens, channels, generator=g)
    decay, beta = -torch.rand(num_tokens, hv, generator=g), torch.rand(num_tokens, hv, generator=g)
    weight = torch.randn(channels, 4, generator=g)
    states = [LinearState(torch.randn(6, channels, 3, generator=g), torch.randn(6, hv, dk, dv, generator=g))]
    states.append(LinearState(states[0].conv.clone(), states[0].recurrent.clone()))
    batch = StateBatch(SLOTS, QUERY_LENS, RESUMES)
    want, got = (
        ops.gated_delta_net(mixed, decay, beta, weight, StateStep(state, batch), (dk, dv))
        for ops, state in zip((TORCH_OPS, TritonOps()), states)
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[1].conv, states[0].conv)
    torch.testing.assert_close(states[1].recurrent, states[0].recurrent, rtol=1e-4, atol=1e-4)


def test_backends_keep_the_same_draft_states_and_restore_from_them():
    """Two steps of verifying drafts through `LayerOps.gated_delta_net`: spans of 1 + 3 tokens
    beside a decode and prompt chunks that draft nothing (one of 20 tokens through the chunked
    kernel), then a step where one sequence steps back to the state after its first draft and
    verifies again. The Triton kernels leave what the torch path leaves: outputs, slot states and
    every draft state (those of the sequences without drafts untouched)."""
    from moeserve.ops import TORCH_OPS
    from moeserve.ops.state_batch import LinearState, StateBatch, StateStep
    from moeserve.ops.triton_ops import TritonOps

    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv, kept = 2, 4, 16, 24, 4
    channels = 2 * hk * dk + hv * dv
    weight = torch.randn(channels, 4, generator=g)
    shapes = ((6, channels, 3), (6, hv, dk, dv), (6, kept, channels, 3), (6, kept, hv, dk, dv))
    initial = [torch.randn(*shape, generator=g) for shape in shapes]  # conv, recurrent, their draft states
    torch_state, triton_state = LinearState(*initial), LinearState(*(t.clone() for t in initial))
    steps = [
        StateBatch((3, 0, 5, 2, 1), (4, 1, 4, 20, 2), (True, True, True, True, False), (3, 0, 3, 0, 0), (-1,) * 5),
        StateBatch((5, 3, 0), (1, 4, 1), (True,) * 3, (0, 3, 0), (-1, 1, 2)),
    ]
    for batch in steps:
        num_tokens = sum(batch.query_lens)
        mixed = torch.randn(num_tokens, channels, generator=g)
        decay, beta = -torch.rand(num_tokens, hv, generator=g), torch.rand(num_tokens, hv, generator=g)
        want, got = (
            ops.gated_delta_net(mixed, decay, beta, weight, StateStep(state, batch), (dk, dv))
            for ops, state in ((TORCH_OPS, torch_state), (TritonOps(), triton_state))
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for name in ("conv", "recurrent", "draft_conv", "draft_recurrent"):
            torch.testing.assert_close(getattr(triton_state, name), getattr(torch_state, name), rtol=1e-4, atol=1e-4)
