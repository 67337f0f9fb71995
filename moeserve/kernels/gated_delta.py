"""Gated DeltaNet on the GPU: the causal conv1d over a step's packed sequences with each one's
carried state, and the gated delta rule, for prompt chunks and decodes alike (varlen: each
sequence its own span of the packed tokens, its own state slot).

Against the torch reference (`ops/gated_delta.py`), each within float32 rounding:

- `_conv_out_kernel`: one program per (token, channel block). Token t of a sequence starting at
  packed row `start` reads inputs t-K+1..t: rows of this step where they are in the sequence, the
  slot's conv state (the K - 1 inputs before the step) for the positions before `start` (zeros
  for a sequence that starts afresh). Then silu. Every output is independent: one launch. With
  drafts (`DRAFTS`), a token of a verifying sequence also stores its last K - 1 inputs, the conv
  state after it, at its position of the slot's draft states.
- `_conv_state_kernel`: one program per (sequence, channel block), after the outputs: the last
  K - 1 inputs (old state and new rows mixed when the sequence brought fewer than K - 1) are
  loaded whole, then stored, so the slot is rewritten in place.
- `_delta_rule_kernel`: one program per (sequence, value head, Dv block) holds its `[Dk, BV]`
  slice of the float32 recurrent state in registers and walks the sequence's tokens: decay by
  exp(g), the delta update with beta, the output read with q (q and k l2-normalised, q scaled by
  Dk ** -0.5), then stores the state. The recurrent form: what a decode takes (and a span of a
  few tokens, and every verify span of drafts, keeping the state after each token under
  `DRAFTS`); longer prompt spans go to the chunked form in `chunk_delta`.

Drafts: a sequence verifying k drafts keeps the state after each of its 1 + k tokens in
`LinearState.draft_conv` / `draft_recurrent` (`[N, 1 + k, ...]`), where the torch path keeps
them, so the next step's restore (`LinearState.restore`) reads either backend's. `DRAFTS` is a
constexpr: steps without drafts run the kernels compiled as they were before drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.targets import require_launchable

CONV_BLOCK = 128  # channels per conv program


@triton.jit
def _inputs_at(x_ptr, state_row, pos, valid, cols, col_mask, start, resumes, stride_x, K: tl.constexpr):
    """The conv's inputs at packed rows `pos` `[P]` (where `valid`) for channels `cols`: `[BLOCK_C, P]`
    from this step's rows for positions from the sequence's `start` on, from its state (the K - 1
    inputs before the step, at `state_row`) for earlier ones, zeros for a fresh sequence's."""
    in_step = valid & (pos >= start)
    from_state = valid & (pos < start) & ((pos * 0 + resumes) != 0)  # vectors: the interpreter takes no scalar mask
    xs = tl.load(
        x_ptr + pos[None, :].to(tl.int64) * stride_x + cols[:, None],
        mask=col_mask[:, None] & in_step[None, :],
        other=0.0,
    )
    ss = tl.load(
        state_row + cols[:, None] * (K - 1) + (K - 1 + pos - start)[None, :],
        mask=col_mask[:, None] & from_state[None, :],
        other=0.0,
    )
    return tl.where(in_step[None, :], xs.to(ss.dtype), ss)


@triton.jit
def _conv_out_kernel(
    x_ptr,  # [T, C]
    w_ptr,  # [C, K]
    state_ptr,  # [N, C, K - 1]
    out_ptr,  # [T, C]
    token_seq_ptr,  # [T] int32: the sequence of each packed token
    starts_ptr,  # [B] int32: the sequence's first packed row
    slots_ptr,  # [B] int64
    resumes_ptr,  # [B] int32
    draft_ptr,  # [N, 1 + k, C, K - 1] (DRAFTS)
    drafts_ptr,  # [B] int32: the drafts each sequence verifies (DRAFTS)
    C,
    stride_x,
    stride_out,
    stride_state_slot,
    stride_draft_slot,
    stride_draft_pos,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DRAFTS: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    seq = tl.load(token_seq_ptr + t)
    start = tl.load(starts_ptr + seq)
    slot = tl.load(slots_ptr + seq)
    state_row = state_ptr + slot * stride_state_slot
    taps = tl.arange(0, K_POW2)
    tap_mask = taps < K
    pos = t - (K - 1) + taps  # [K_POW2] packed rows read
    window = _inputs_at(x_ptr, state_row, pos, tap_mask, cols, col_mask, start, tl.load(resumes_ptr + seq), stride_x, K)
    if DRAFTS:  # the state after token t: its last K - 1 inputs, taps 1..K-1 of its window
        kept = tap_mask & (taps >= 1) & ((taps * 0 + tl.load(drafts_ptr + seq)) != 0)
        draft_row = draft_ptr + slot * stride_draft_slot + (t - start) * stride_draft_pos
        tl.store(
            draft_row + cols[:, None] * (K - 1) + (taps - 1)[None, :],
            window.to(draft_ptr.dtype.element_ty),
            mask=col_mask[:, None] & kept[None, :],
        )
    inputs = window.to(tl.float32)
    w = tl.load(w_ptr + cols[:, None] * K + taps[None, :], mask=col_mask[:, None] & tap_mask[None, :], other=0.0)
    acc = tl.sum(inputs * w.to(tl.float32), axis=1)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    starts_ptr,
    ends_ptr,
    slots_ptr,
    resumes_ptr,
    C,
    stride_x,
    stride_state_slot,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    start = tl.load(starts_ptr + seq)
    state_row = state_ptr + tl.load(slots_ptr + seq) * stride_state_slot
    j = tl.arange(0, K_POW2)
    keep = j < K - 1
    pos = tl.load(ends_ptr + seq) - (K - 1) + j  # the last K - 1 positions
    new = _inputs_at(x_ptr, state_row, pos, keep, cols, col_mask, start, tl.load(resumes_ptr + seq), stride_x, K)
    tl.debug_barrier()  # every read of the old state before the first store
    tl.store(state_row + cols[:, None] * (K - 1) + j[None, :], new, mask=col_mask[:, None] & keep[None, :])


@triton.jit
def _slice_ptrs(state_ptr, slots_ptr, seq, hv, ks, vs, stride_state_slot, DK: tl.constexpr, DV: tl.constexpr):
    """A program's `[BK, BV]` slice of its sequence's state for value head `hv`: pointers, mask."""
    ptrs = state_ptr + tl.load(slots_ptr + seq) * stride_state_slot + hv * DK * DV + ks[:, None] * DV + vs[None, :]
    return ptrs, (ks < DK)[:, None] & (vs < DV)[None, :]


@triton.jit
def load_state_slice(
    state_ptr, slots_ptr, resumes_ptr, seq, hv, ks, vs, stride_state_slot, DK: tl.constexpr, DV: tl.constexpr
):
    """The slice in float32, zeros for a sequence that starts afresh."""
    ptrs, mask = _slice_ptrs(state_ptr, slots_ptr, seq, hv, ks, vs, stride_state_slot, DK, DV)
    resumes = tl.load(resumes_ptr + seq)
    return tl.load(ptrs, mask=mask & ((ks * 0 + resumes) != 0)[:, None], other=0.0)


@triton.jit
def store_state_slice(state_ptr, slots_ptr, seq, hv, ks, vs, stride_state_slot, s, DK: tl.constexpr, DV: tl.constexpr):
    """Back to the slot, its pointers made again here: a `[BK, BV]` tile of 64-bit pointers held
    across a program's loop would cost as many registers as the state itself."""
    ptrs, mask = _slice_ptrs(state_ptr, slots_ptr, seq, hv, ks, vs, stride_state_slot, DK, DV)
    tl.store(ptrs, s, mask=mask)


@triton.jit
def _delta_rule_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv]
    state_ptr,  # [N, Hv, Dk, Dv] float32
    out_ptr,  # [T, Hv, Dv]
    starts_ptr,
    ends_ptr,
    slots_ptr,
    resumes_ptr,
    draft_ptr,  # [N, 1 + k, Hv, Dk, Dv] float32 (DRAFTS)
    drafts_ptr,  # [B] int32 (DRAFTS)
    stride_q,
    stride_k,
    stride_v,
    stride_g,
    stride_beta,
    stride_out,
    stride_state_slot,
    stride_draft_slot,
    stride_draft_pos,
    scale,
    HV: tl.constexpr,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DRAFTS: tl.constexpr,
):
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    ks = tl.arange(0, BK)
    k_mask, v_mask = ks < DK, vs < DV
    hk = hv // RATIO
    start = tl.load(starts_ptr + seq)
    end = tl.load(ends_ptr + seq)
    s = load_state_slice(state_ptr, slots_ptr, resumes_ptr, seq, hv, ks, vs, stride_state_slot, DK, DV)
    verifies = False
    if DRAFTS:
        verifies = tl.load(drafts_ptr + seq) > 0
    for i in range(0, end - start):
        row = (start + i).to(tl.int64)
        q = tl.load(q_ptr + row * stride_q + hk * DK + ks, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k + hk * DK + ks, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_v + hv * DV + vs, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + hv).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_beta + hv).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BV]
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + row * stride_out + hv * DV + vs, o.to(out_ptr.dtype.element_ty), mask=v_mask)
        if verifies:  # the state after token i, at position i of the slot's draft states
            draft_pos = draft_ptr + i * stride_draft_pos
            store_state_slice(draft_pos, slots_ptr, seq, hv, ks, vs, stride_draft_slot, s, DK, DV)
    store_state_slice(state_ptr, slots_ptr, seq, hv, ks, vs, stride_state_slot, s, DK, DV)


@dataclass(frozen=True)
class VarlenSpans:
    """Device tensors, per sequence run: its first and past-last packed row, its slot, resume
    flag and drafts verified (None when no sequence of the step verifies any); per packed token
    its sequence (for the conv, which runs every sequence)."""

    starts: torch.Tensor  # int32
    ends: torch.Tensor  # int32
    slots: torch.Tensor  # int64
    resumes: torch.Tensor  # int32
    token_seq: torch.Tensor  # int32
    drafts: torch.Tensor | None  # int32


def varlen_spans(
    query_lens: tuple[int, ...],
    slots: tuple[int, ...],
    resumes: tuple[bool, ...],
    device: torch.device,
    chosen: tuple[int, ...] | None = None,
    drafts: tuple[int, ...] = (),
) -> VarlenSpans:
    """The spans of the sequences in `chosen` (default all), rows counted over all of them, so
    that two kernels can each take a share of one step's packed tokens; `drafts` per sequence
    (default none)."""
    lens = torch.tensor(query_lens, dtype=torch.int32)
    ends = torch.cumsum(lens, 0, dtype=torch.int32)
    starts = ends - lens
    token_seq = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32), lens)
    picked = slice(None) if chosen is None else torch.tensor(chosen, dtype=torch.int64)
    return VarlenSpans(
        starts[picked].to(device),
        ends[picked].to(device),
        torch.tensor(slots, dtype=torch.int64)[picked].to(device),
        torch.tensor(resumes, dtype=torch.int32)[picked].to(device),
        token_seq.to(device),
        torch.tensor(drafts, dtype=torch.int32)[picked].to(device) if any(drafts) else None,
    )


def draft_launch(spans: VarlenSpans, draft_states: torch.Tensor | None, state: torch.Tensor) -> tuple:
    """A kernel's draft arguments: the draft states and the drafts per sequence, the states' slot
    and position strides, and `DRAFTS` (whether any sequence verifies drafts). Without, the slot
    states and slots stand in: the kernels compiled without drafts never read them."""
    if spans.drafts is None:
        return state, spans.slots, 0, 0, False
    if draft_states is None:
        raise ValueError("sequences verify drafts but the layer keeps no draft states (no speculative config)")
    return draft_states, spans.drafts, draft_states.stride(0), draft_states.stride(1), True


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_lens: tuple[int, ...],
    slots: tuple[int, ...],
    resumes: tuple[bool, ...],
    drafts: tuple[int, ...] = (),
    draft_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """x `[T, C]` (the step's sequences packed), weight `[C, K]`, conv_state `[N, C, K - 1]`
    (updated in place for each sequence's slot) -> silu(conv) `[T, C]` in x's dtype. A sequence
    verifying drafts (`drafts`, per sequence) also leaves the state after each of its tokens in
    `draft_states` `[N, 1 + k, C, K - 1]`."""
    require_launchable(x, "causal_conv1d_varlen")
    num_tokens, channels = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    spans = varlen_spans(query_lens, slots, resumes, x.device, drafts=drafts)
    draft_ptr, drafts_ptr, stride_draft_slot, stride_draft_pos, with_drafts = draft_launch(
        spans, draft_states, conv_state
    )
    weight = weight.contiguous()
    blocks = triton.cdiv(channels, CONV_BLOCK)
    k_pow2 = triton.next_power_of_2(width)
    _conv_out_kernel[(num_tokens, blocks)](
        x, weight, conv_state, out, spans.token_seq, spans.starts, spans.slots, spans.resumes,
        draft_ptr, drafts_ptr,
        channels, x.stride(0), out.stride(0), conv_state.stride(0), stride_draft_slot, stride_draft_pos,
        K=width, K_POW2=k_pow2, BLOCK_C=CONV_BLOCK, DRAFTS=with_drafts,
    )  # fmt: skip
    _conv_state_kernel[(len(query_lens), blocks)](
        x, conv_state, spans.starts, spans.ends, spans.slots, spans.resumes,
        channels, x.stride(0), conv_state.stride(0),
        K=width, K_POW2=k_pow2, BLOCK_C=CONV_BLOCK,
    )  # fmt: skip
    return out


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_lens: tuple[int, ...],
    slots: tuple[int, ...],
    resumes: tuple[bool, ...],
    chosen: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
    drafts: tuple[int, ...] = (),
    draft_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g (float32) and beta `[T, Hv]`, state `[N, Hv, Dk, Dv]`
    float32 (each sequence's slot read unless it starts afresh, and rewritten) -> `[T, Hv, Dv]`.
    chosen: the sequences to run (default all), the rest of `out` left as it is (see
    `chunk_delta.chunk_gated_delta_rule_varlen`, which takes the prompt spans). A sequence
    verifying drafts (`drafts`, per sequence of the step) also leaves the state after each of its
    tokens in `draft_states` `[N, 1 + k, Hv, Dk, Dv]`."""
    require_launchable(q, "gated_delta_rule_varlen")
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    if out is None:
        out = torch.empty(num_tokens, num_v_heads, dv, dtype=q.dtype, device=q.device)
    spans = varlen_spans(query_lens, slots, resumes, q.device, chosen, drafts)
    if not len(spans.starts):
        return out
    draft_ptr, drafts_ptr, stride_draft_slot, stride_draft_pos, with_drafts = draft_launch(spans, draft_states, state)
    q, k, v = (t.contiguous() for t in (q, k, v))
    bv = min(triton.next_power_of_2(dv), 64)
    grid = (len(spans.starts), num_v_heads, triton.cdiv(dv, bv))
    _delta_rule_kernel[grid](
        q, k, v, g, beta, state, out, spans.starts, spans.ends, spans.slots, spans.resumes, draft_ptr, drafts_ptr,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), out.stride(0), state.stride(0),
        stride_draft_slot, stride_draft_pos, dk**-0.5,
        HV=num_v_heads, RATIO=num_v_heads // num_k_heads, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=bv, DRAFTS=with_drafts,
    )  # fmt: skip
    return out
