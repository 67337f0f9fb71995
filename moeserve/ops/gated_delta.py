"""Gated DeltaNet's torch reference (Qwen3-Next, Qwen3.5): the causal depthwise conv1d with its
carried state, the gated delta rule in chunked form (prefill) and as one recurrent step (decode).

A sequence's cache is two fixed-size tensors whatever its length: the conv state (the last K - 1
inputs of the convolution, `[C, K - 1]`) and the recurrent state (`[Hv, Dk, Dv]` per value
head). A chunk of a prompt starts from the state the previous chunk left, so chunked prefill
gives the result of one pass. The arithmetic follows transformers' reference (float32, q and k
l2-normalised with eps 1e-6, q scaled by Dk ** -0.5, chunks of 64 solved by a unit lower
triangular system), so that greedy tokens match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.state_batch import LinearState, StateStep

CHUNK = 64


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[B, C, T]` (B sequences of T new inputs each), weight `[C, K]`, state `[B, C, K - 1]` or
    None (a fresh sequence: zeros) -> (silu(conv) `[B, C, T]` in x's dtype, the new state
    `[B, C, K - 1]`: the last K - 1 inputs, earlier state included when T < K - 1)."""
    width = weight.shape[1]
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1).to(weight.dtype)  # [B, C, K - 1 + T]
    out = F.conv1d(full, weight.unsqueeze(1), groups=x.shape[1])  # [B, C, T]
    return F.silu(out).to(x.dtype), full[:, :, full.shape[-1] - (width - 1) :]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k `[..., Hk, Dk]`, v `[..., Hv, Dv]` -> float32, q and k repeated to Hv heads (each
    key head serves Hv / Hk consecutive value heads), l2-normalised, q scaled."""
    repeats = v.shape[-2] // k.shape[-2]
    q, k = (t.float().repeat_interleave(repeats, dim=-2) for t in (q, k))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v.float()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens: q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g (log decay, <= 0) and beta
    `[T, Hv]`, state `[Hv, Dk, Dv]` or None -> (out `[T, Hv, Dv]` in q's dtype, final state float32)."""
    num_tokens, dtype = q.shape[0], q.dtype
    q, k, v = _prepare(q, k, v)
    # [Hv, T, D] and [Hv, T], padded to whole chunks (padding has beta 0 and decay 0: no effect).
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    beta, g = beta.float().t(), g.float().t()
    pad = (chunk_size - num_tokens % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    heads, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    q, k, v = (t.reshape(heads, -1, chunk_size, t.shape[-1]) for t in (q, k, v))  # [Hv, N, C, D]
    k_beta = k * beta.reshape(heads, -1, chunk_size, 1)
    v_beta = v * beta.reshape(heads, -1, chunk_size, 1)
    decay = g.reshape(heads, -1, chunk_size).cumsum(-1)  # [Hv, N, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower triangular once the diagonal is 1
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]
    s = torch.zeros(heads, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty_like(new_v)
    for i in range(q.shape[1]):
        v_i = new_v[:, i] - k_decay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_i
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    out = out.reshape(heads, -1, dv)[:, :num_tokens].transpose(0, 1)
    return out.to(dtype), s


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k `[B, Hk, Dk]`, v `[B, Hv, Dv]`, g and beta `[B, Hv]`,
    state `[B, Hv, Dk, Dv]` -> (out `[B, Hv, Dv]` in q's dtype, new state float32)."""
    dtype = q.dtype
    q, k, v = _prepare(q, k, v)
    s = state.float() * g.float().exp()[..., None, None]
    delta = (v - (s * k.unsqueeze(-1)).sum(-2)) * beta.float().unsqueeze(-1)  # [B, Hv, Dv]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(-2).to(dtype), s


def split_heads(
    mixed: torch.Tensor, head_dims: tuple[int, int], num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output `[n, C]` -> q, k `[n, Hk, Dk]`, v `[n, Hv, Dv]`."""
    dk, dv = head_dims
    key_dim = (mixed.shape[1] - num_v_heads * dv) // 2
    q, k, v = mixed.split([key_dim, key_dim, num_v_heads * dv], dim=-1)
    n = mixed.shape[0]
    return q.reshape(n, key_dim // dk, dk), k.reshape(n, key_dim // dk, dk), v.reshape(n, num_v_heads, dv)


def gated_delta_net(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    step: StateStep,
    head_dims: tuple[int, int],
) -> torch.Tensor:
    """`LayerOps.gated_delta_net` in torch, with transformers' choice of form: the decodes (one
    token from a state) batched through one recurrent step, every other sequence (a prompt or a
    chunk of one) through the conv and the chunked rule on its own."""
    state, batch = step.state, step.batch
    num_v_heads = g.shape[1]
    state.restore(batch.slots, batch.restores)
    core = mixed.new_empty(mixed.shape[0], num_v_heads, head_dims[1])
    first = 0
    decodes: list[tuple[int, int]] = []  # (row, slot) of sequences stepping one token from a state
    drafts = batch.drafts or (0,) * len(batch.slots)
    for slot, qlen, resumes, num_drafts in zip(batch.slots, batch.query_lens, batch.resumes, drafts):
        if num_drafts:
            _verify(mixed[first : first + qlen], g, beta, conv_weight, state, slot, first, head_dims, core)
        elif qlen == 1 and resumes:
            decodes.append((first, slot))
        elif qlen:
            rows = slice(first, first + qlen)
            conv = state.conv[slot : slot + 1] if resumes else None
            out, new_conv = causal_conv1d(mixed[rows].t().unsqueeze(0), conv_weight, conv)  # [1, C, n]
            state.conv[slot] = new_conv[0]
            q, k, v = split_heads(out[0].t(), head_dims, num_v_heads)
            initial = state.recurrent[slot] if resumes else None
            core[rows], state.recurrent[slot] = chunk_gated_delta_rule(q, k, v, g[rows], beta[rows], initial)
        first += qlen
    if decodes:
        rows, slots = (torch.tensor(column, device=mixed.device) for column in zip(*decodes))
        out, state.conv[slots] = causal_conv1d(mixed[rows].unsqueeze(-1), conv_weight, state.conv[slots])
        q, k, v = split_heads(out.squeeze(-1), head_dims, num_v_heads)
        core[rows], state.recurrent[slots] = recurrent_gated_delta_step(
            q, k, v, g[rows], beta[rows], state.recurrent[slots]
        )
    return core


def _verify(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    state: LinearState,
    slot: int,
    first: int,
    head_dims: tuple[int, int],
    core: torch.Tensor,
) -> None:
    """A drafting sequence's 1 + k tokens (`mixed` rows from packed row `first`), one recurrent step
    each, as decoding them one at a time would, keeping the state after each."""
    num_v_heads = g.shape[1]
    for j in range(mixed.shape[0]):
        row = first + j
        out, state.conv[slot : slot + 1] = causal_conv1d(
            mixed[j : j + 1].unsqueeze(-1), conv_weight, state.conv[slot : slot + 1]
        )
        q, k, v = split_heads(out.squeeze(-1), head_dims, num_v_heads)
        core[row : row + 1], state.recurrent[slot : slot + 1] = recurrent_gated_delta_step(
            q, k, v, g[row : row + 1], beta[row : row + 1], state.recurrent[slot : slot + 1]
        )
        state.draft_conv[slot, j] = state.conv[slot]
        state.draft_recurrent[slot, j] = state.recurrent[slot]
