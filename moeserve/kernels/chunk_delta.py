"""The gated delta rule in chunked form for prompt spans (Gated DeltaNet, Qwen3-Next and Qwen3.5):
varlen over a step's packed sequences, each from its state slot (or zeros when it starts afresh),
its final state written back, so a later prompt chunk or a prefix-cache resume carries it.

The recurrent kernel (`gated_delta._delta_rule_kernel`) walks a prompt token by token: T
dependent steps of `[Dk, BV]` vector work. Here a sequence goes C tokens at a time, as
`ops/gated_delta.chunk_gated_delta_rule` does and flash-linear-attention's chunked form: within a
chunk, with d the cumulative log decay and L the strictly lower `beta_i (k_i . k_j) exp(d_i - d_j)`,

    T = (I + L)^-1                        forward substitution, one row at a time
    w = T (beta k exp(d)),  u = T (beta v) the WY / UT representation
    v' = u - w S = T (beta (v - exp(d) k S))  the chunk's values against the state it starts from
    o = (q exp(d)) S + causal(q k^T exp(d_i - d_j)) v'
    S = exp(d_last) S + (k exp(d_last - d))^T v'

Two launches, so that the only serial part of a chunk that is not a matmul stays off the
sequence's path through its chunks:

- `_chunk_inverse_kernel`: one program per (chunk of any sequence, value head) solves its T by
  forward substitution (a row per step, for the chunk's real rows only: a padding row of T is
  the identity's) and stores it, float32 `[chunks, Hv, C, C]`. Every chunk at once.
- `_chunk_state_kernel`: one program per (sequence, value head, Dv block) keeps its `[Dk, BV]`
  float32 state slice in registers and walks the sequence's chunks: v' (by its second form, so
  that the `[C, Dk]` w is never held beside q and k), o and the state update, all matmuls on
  tensor cores.

Every product accumulates in float32; its float32 inputs go to the tensor cores as tf32 (10
mantissa bits, above the bf16 that q, k and v arrive in; the state itself stays float32 in
registers). tf32x3, which would keep float32's mantissa, triples the operands and spills the
state kernel at every tile tried (compile check, sm_90a and sm_100a). q and k are l2-normalised
(eps 1e-6) and q scaled by Dk ** -0.5 in both kernels, as the reference does. Rows past a
sequence's end load as zeros with g = 0: no decay, no key, no effect on the state.

The launch is sized by the compile check's registers at Qwen3-Next's and Qwen3.5's 128-dim heads:
chunks of 32 (at 64, `[64, 128]` q and k tiles spill at any warp count), 32 value dims per program
(4 per head, so that a single prompt still fills a GPU's SMs), 4 warps, one stage (software
pipelining buffers a chunk's loads twice over in shared memory for a loop that is not load-bound).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from moeserve.kernels.gated_delta import load_state_slice, store_state_slice, varlen_spans
from moeserve.kernels.targets import require_launchable

CHUNK = 32  # tokens per chunk
BLOCK_V = 32  # value dims per program
INVERSE_WARPS = 4
STATE_WARPS = 4
STATE_STAGES = 1
PRECISION = "tf32"


@triton.jit
def _unit_rows(ptr, rows64, row_mask, stride, col0, cols, col_mask, scale):
    """`[C, D]` rows of one head, in float32, l2-normalised (eps 1e-6, as the reference) and scaled."""
    x = tl.load(
        ptr + rows64[:, None] * stride + col0 + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _chunk_decay(g_ptr, beta_ptr, rows64, live, hv, stride_g, stride_beta, idx, C: tl.constexpr):
    """A chunk's beta `[C]`, cumulative log decay d `[C]`, causal `[C, C]` (j <= i) and
    exp(d_i - d_j) there, 0 elsewhere."""
    g = tl.load(g_ptr + rows64 * stride_g + hv, mask=live, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows64 * stride_beta + hv, mask=live, other=0.0).to(tl.float32)
    decay = tl.cumsum(g, axis=0)
    causal = idx[None, :] <= idx[:, None]
    pairwise = tl.where(causal, tl.exp(tl.where(causal, decay[:, None] - decay[None, :], 0.0)), 0.0)
    return beta, decay, causal, pairwise


@triton.jit
def _chunk_inverse_kernel(
    k_ptr,  # [T, Hk, Dk]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv]
    inverse_ptr,  # [chunks, Hv, C, C] float32
    chunk_first_ptr,  # [chunks] int32: the chunk's first packed row
    chunk_end_ptr,  # [chunks] int32: its sequence's past-last row
    stride_k,
    stride_g,
    stride_beta,
    HV: tl.constexpr,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    ks = tl.arange(0, BK)
    idx = tl.arange(0, C)
    first = tl.load(chunk_first_ptr + chunk)
    real = tl.minimum(tl.load(chunk_end_ptr + chunk) - first, C)
    rows64 = (first + idx).to(tl.int64)
    live = idx < real
    beta, decay, causal, pairwise = _chunk_decay(g_ptr, beta_ptr, rows64, live, hv, stride_g, stride_beta, idx, C)
    k = _unit_rows(k_ptr, rows64, live, stride_k, (hv // RATIO) * DK, ks, ks < DK, 1.0)
    lower = tl.dot(k, tl.trans(k), input_precision=PRECISION) * pairwise * beta[:, None]
    lower = tl.where(idx[None, :] < idx[:, None], lower, 0.0)
    # T = (I + L)^-1: row i is e_i - L[i, :] T, its earlier rows already final.
    t = tl.where(idx[None, :] == idx[:, None], 1.0, 0.0)
    for i in range(1, real):
        l_row = tl.sum(tl.where(idx[:, None] == i, lower, 0.0), axis=0)  # [C] over j
        row = tl.where(idx == i, 1.0, 0.0) - tl.sum(l_row[:, None] * t, axis=0)
        t = tl.where(idx[:, None] == i, row[None, :], t)
    base = inverse_ptr + (chunk.to(tl.int64) * HV + hv) * C * C
    tl.store(base + idx[:, None] * C + idx[None, :], t)


@triton.jit
def _chunk_state_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv]
    inverse_ptr,  # [chunks, Hv, C, C] float32
    state_ptr,  # [N, Hv, Dk, Dv] float32
    out_ptr,  # [T, Hv, Dv]
    starts_ptr,
    ends_ptr,
    first_chunk_ptr,  # [B] int32: the sequence's first chunk in `inverse`
    slots_ptr,
    resumes_ptr,
    stride_q,
    stride_k,
    stride_v,
    stride_g,
    stride_beta,
    stride_out,
    stride_state_slot,
    scale,
    HV: tl.constexpr,
    RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    ks = tl.arange(0, BK)
    idx = tl.arange(0, C)
    k_mask, v_mask = ks < DK, vs < DV
    col0 = (hv // RATIO) * DK
    start = tl.load(starts_ptr + seq)
    end = tl.load(ends_ptr + seq)
    s = load_state_slice(state_ptr, slots_ptr, resumes_ptr, seq, hv, ks, vs, stride_state_slot, DK, DV)
    inverse = inverse_ptr + (tl.load(first_chunk_ptr + seq).to(tl.int64) * HV + hv) * C * C
    for first in range(start, end, C):
        rows64 = (first + idx).to(tl.int64)
        live = first + idx < end
        beta, decay, causal, pairwise = _chunk_decay(g_ptr, beta_ptr, rows64, live, hv, stride_g, stride_beta, idx, C)
        last = tl.sum(tl.where(idx == C - 1, decay, 0.0), axis=0)  # padding has g = 0: the last real d
        # Each [C, Dk] tile lives only as long as it must: q to its two products, k to the
        # products with q and with the state, then read again (from L2) for the state's update.
        k = _unit_rows(k_ptr, rows64, live, stride_k, col0, ks, k_mask, 1.0)
        q = _unit_rows(q_ptr, rows64, live, stride_q, col0, ks, k_mask, scale)
        attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * pairwise, 0.0)
        o = tl.dot(q * tl.exp(decay)[:, None], s, input_precision=PRECISION)  # [C, BV]
        ks_state = tl.dot(k, s, input_precision=PRECISION)  # [C, BV]
        v = tl.load(
            v_ptr + rows64[:, None] * stride_v + hv * DV + vs[None, :],
            mask=live[:, None] & v_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        # v' = u - w S = T (beta (v - exp(d) k S)): w itself is never formed.
        v = beta[:, None] * (v - tl.exp(decay)[:, None] * ks_state)
        t = tl.load(inverse + idx[:, None] * C + idx[None, :])
        new_v = tl.dot(t, v, input_precision=PRECISION)  # [C, BV]
        o += tl.dot(attn, new_v, input_precision=PRECISION)
        tl.store(
            out_ptr + rows64[:, None] * stride_out + hv * DV + vs[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=live[:, None] & v_mask[None, :],
        )
        k = _unit_rows(k_ptr, rows64, live, stride_k, col0, ks, k_mask, 1.0) * tl.exp(last - decay)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k), new_v, input_precision=PRECISION)
        inverse += HV * C * C
    store_state_slice(state_ptr, slots_ptr, seq, hv, ks, vs, stride_state_slot, s, DK, DV)


def _chunk_table(
    query_lens: tuple[int, ...], chosen: tuple[int, ...], chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the host's lengths (no device sync): per chunk of the chosen sequences its first row
    and its sequence's end; per chosen sequence the index of its first chunk."""
    ends = list(itertools.accumulate(query_lens))
    firsts, chunk_ends, first_chunk = [], [], []
    for i in chosen:
        first_chunk.append(len(firsts))
        firsts += range(ends[i] - query_lens[i], ends[i], chunk)
        chunk_ends += [ends[i]] * (len(firsts) - first_chunk[-1])
    return tuple(torch.tensor(x, dtype=torch.int32).to(device) for x in (firsts, chunk_ends, first_chunk))


def chunk_gated_delta_rule_varlen(
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
    chunk: int = CHUNK,
) -> torch.Tensor:
    """q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g (float32) and beta `[T, Hv]`, state `[N, Hv, Dk, Dv]`
    float32 (each sequence's slot read unless it starts afresh, and rewritten) -> `[T, Hv, Dv]`.
    chosen: the sequences to run (default all), the rest of `out` left as it is, so that one step
    can send its decodes to the recurrent kernel and its prompt spans here. chunk: tokens per
    chunk, a power of two of at least 16 (the tensor-core tile)."""
    require_launchable(q, "chunk_gated_delta_rule_varlen")
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    if out is None:
        out = torch.empty(num_tokens, num_v_heads, dv, dtype=q.dtype, device=q.device)
    chosen = tuple(range(len(query_lens))) if chosen is None else chosen
    if not chosen:
        return out
    spans = varlen_spans(query_lens, slots, resumes, q.device, chosen)
    chunk_first, chunk_end, first_chunk = _chunk_table(query_lens, chosen, chunk, q.device)
    q, k, v = (t.contiguous() for t in (q, k, v))
    inverse = torch.empty(len(chunk_first), num_v_heads, chunk, chunk, dtype=torch.float32, device=q.device)
    shape = dict(HV=num_v_heads, RATIO=num_v_heads // num_k_heads, DK=dk, BK=max(triton.next_power_of_2(dk), 16))
    if len(chunk_first):
        _chunk_inverse_kernel[(len(chunk_first), num_v_heads)](
            k, g, beta, inverse, chunk_first, chunk_end, k.stride(0), g.stride(0), beta.stride(0),
            **shape, C=chunk, PRECISION=PRECISION, num_warps=INVERSE_WARPS,
        )  # fmt: skip
    bv = min(max(triton.next_power_of_2(dv), 16), BLOCK_V)
    _chunk_state_kernel[(len(chosen), num_v_heads, triton.cdiv(dv, bv))](
        q, k, v, g, beta, inverse, state, out,
        spans.starts, spans.ends, first_chunk, spans.slots, spans.resumes,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), out.stride(0), state.stride(0),
        dk**-0.5,
        **shape, DV=dv, BV=bv, C=chunk, PRECISION=PRECISION, num_warps=STATE_WARPS, num_stages=STATE_STAGES,
    )  # fmt: skip
    return out
