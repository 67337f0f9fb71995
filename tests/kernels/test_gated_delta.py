"""Gated DeltaNet's torch reference against transformers' own (Qwen3-Next's module functions):
the chunked form over a whole prompt, the same prompt fed in chunks carrying the state, the
recurrent decode step, and the causal conv1d with its state."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_step

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def inputs(num_tokens: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(num_tokens, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(num_tokens, hv, dv, generator=g)
    decay = -torch.rand(num_tokens, hv, generator=g) * 2  # log decays in (-2, 0]
    beta = torch.rand(num_tokens, hv, generator=g)
    return q, k, v, decay, beta


def hf_chunk(q, k, v, decay, beta, state=None, chunk_size=64):
    out, final = hf.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=decay[None],
        beta=beta[None],
        chunk_size=chunk_size,
        initial_state=None if state is None else state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 150])
def test_chunked_matches_transformers(num_tokens):
    q, k, v, decay, beta = inputs(num_tokens)
    state = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(9))
    for initial in (None, state):
        out, final = chunk_gated_delta_rule(q, k, v, decay, beta, initial)
        ref_out, ref_final = hf_chunk(q, k, v, decay, beta, initial)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunks_carry_the_state(chunk):
    """A prompt fed `chunk` tokens at a time, each piece starting from the last one's state, gives
    one pass's outputs and final state."""
    q, k, v, decay, beta = inputs(45, seed=1)
    ref_out, ref_final = hf_chunk(q, k, v, decay, beta)
    state, outs = None, []
    for start in range(0, 45, chunk):
        piece = slice(start, start + chunk)
        out, state = chunk_gated_delta_rule(q[piece], k[piece], v[piece], decay[piece], beta[piece], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_final, rtol=1e-5, atol=1e-5)


def test_recurrent_step_matches_transformers():
    """Three sequences decoding one token each, batched, against transformers' recurrent form
    sequence by sequence."""
    q, k, v, decay, beta = inputs(3, seed=2)
    state = torch.randn(3, 4, 8, 6, generator=torch.Generator().manual_seed(3))
    out, new_state = recurrent_gated_delta_step(q, k, v, decay, beta, state)
    for b in range(3):
        ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
            q[None, b : b + 1],
            k[None, b : b + 1],
            v[None, b : b + 1],
            g=decay[None, b : b + 1],
            beta=beta[None, b : b + 1],
            initial_state=state[b : b + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[b], ref_out[0, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(new_state[b], ref_state[0], rtol=1e-6, atol=1e-6)


def test_causal_conv1d_with_state():
    """A whole sequence through transformers' conv equals it fed in pieces with the state carried
    (pieces shorter than the kernel included), and the state is the last K - 1 inputs."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 10, 13, generator=g)
    weight = torch.randn(10, 4, generator=g)
    ref = hf.causal_conv1d_fn(x, weight, None, activation="silu")
    state, outs = None, []
    for start, end in ((0, 2), (2, 3), (3, 9), (9, 13)):
        out, state = causal_conv1d(x[:, :, start:end], weight, state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, x[:, :, -3:])
    hf_state = torch.zeros(1, 10, 3)
    hf_step = hf.causal_conv1d_update(x[:, :, :1], hf_state, weight, None, "silu")
    ours, ours_state = causal_conv1d(x[:, :, :1], weight, None)
    torch.testing.assert_close(ours, hf_step)
    torch.testing.assert_close(ours_state, hf_state)
