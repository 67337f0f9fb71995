"""Device-initiated all-to-all kernels: rows stored straight into peers' symmetric buffers.

The protocol of `moeserve.dispatch.symmetric_all_to_all` (read its docstring first), one kernel per
phase, so compute can run between a phase's send and its receive and no kernel ever waits on a
program of its own launch:

* `dispatch_send`:  per (destination rank, local expert) group, the sender's rows and their
  pair metadata into its own region of the destination's receive slot, then one signal word
  there, `seq << 32 | rows`, with release semantics;
* `wait_signals`:   spin (acquire) until a run of signal words carries `seq`, hand out the counts;
* `dispatch_recv`:  per (local expert, source) group, the received rows into the caller's
  expert-major output, then a credit to the source once all of its groups are copied out;
* `combine_send`:   per group, each expert-output row home to its pair's `[token, k]` row of the
  source's combine slot, then a signal;
* `notify_send`:    one row of counts to every peer (the high-throughput mode's size exchange);
* `give_credit`:    tell every peer a slot of ours may be written again.

Peers are reached through an int64 table of their buffers' addresses (`SymmetricBuffer.addresses`),
never through tensor arguments, so the same kernels serve every transport: in-process emulated PEs,
shared-memory rank processes on CPU (Triton's interpreter) and NVLink peers on GPUs. Rows move as
int32 words, so the kernels are blind to the payload's dtype (bf16, fp32, FP8 plus scales).
Every kernel runs on a fixed number of programs (`num_programs`, the communication SMs) that
stride over the groups, leaving the rest of the GPU to the experts' GEMM.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SEQ: tl.constexpr = tl.constexpr(1 << 32)  # a signal word is seq * SEQ + count: newer sequence numbers compare larger

# Pointers are rebuilt inline from the address table (`(address + offset).to(pointer_type)`) rather
# than in helper functions: under the interpreter every call of a nested jit function costs
# milliseconds, per group, which the CPU tests would pay thousands of times.


def block_for(count: int, cap: int | None = None) -> int:
    """The power-of-two block that covers `count` elements in one tile, at most `cap`."""
    block = triton.next_power_of_2(count)
    return block if cap is None else min(block, cap)


def _jit(fn):
    """Compiled for CUDA; Triton's interpreter on machines without it, where the CPU transports
    run these same kernels (chosen here, per kernel, so no environment variable must be set first)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return triton.jit(fn)
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@_jit
def _add(a, b):
    # tl.sum would do, but the standard library's functions are compiled-only unless the
    # interpreter was chosen before triton was imported; tl.reduce with our own combiner is not.
    return a + b


@_jit
def dispatch_send_kernel(
    addresses,
    payload,  # int32 [T, WORDS]: this rank's token rows
    pair_order,  # int64: pair ids (t * K + k) sorted by (chunk, dest rank, local expert), stable
    group_counts,  # int64 [EP * L]: this chunk's pairs per (dest rank, local expert)
    group_starts,  # int64 [EP * L]: where each group begins in pair_order
    rank,
    seq,
    slot,
    first_token,
    rows_offset,
    meta_offset,
    signal_offset,
    credit_offset,
    EP: tl.constexpr,
    L: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    credits = (tl.load(addresses + rank) + credit_offset).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, BLOCK_W).to(tl.int64)
    for g in range(tl.program_id(0), EP * L, tl.num_programs(0)):
        dest = g // L
        expert = g % L
        count = tl.load(group_counts + g)
        start = tl.load(group_starts + g)
        if seq > SLOTS:  # the slot was used SLOTS sequences ago: wait until dest has copied it out
            credit = tl.atomic_add(credits + dest, 0, sem="acquire", scope="sys")
            while credit < seq - SLOTS:
                credit = tl.atomic_add(credits + dest, 0, sem="acquire", scope="sys")
        peer = tl.load(addresses + dest)
        rows = (peer + rows_offset).to(tl.pointer_type(tl.int32))
        meta = (peer + meta_offset).to(tl.pointer_type(tl.int32))
        region = (((slot * L + expert) * EP + rank) * C).to(tl.int64)
        for m0 in range(0, count, BLOCK_M):
            i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
            mask = i < count
            pair = tl.load(pair_order + start + i, mask=mask, other=0)
            token = pair // K
            tl.store(meta + region + i, ((token - first_token) * K + pair % K).to(tl.int32), mask=mask)
            for w0 in range(0, WORDS, BLOCK_W):
                m = mask[:, None] & (w0 + w < WORDS)[None, :]
                row = tl.load(payload + token[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                tl.store(rows + (region + i)[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
        tl.debug_barrier()  # every thread's stores before the release below
        signal = (peer + signal_offset).to(tl.pointer_type(tl.int64)) + (slot * L + expert) * EP + rank
        tl.atomic_xchg(signal, seq.to(tl.int64) * SEQ + count, sem="release", scope="sys")


@_jit
def wait_signals_kernel(
    addresses, rank, signal_offset, first_word, counts_out, seq, NUM_WORDS: tl.constexpr, BLOCK: tl.constexpr
):
    """One program: wait for words [first_word, first_word + NUM_WORDS) to reach seq; counts_out gets their counts."""
    words = (tl.load(addresses + rank) + signal_offset).to(tl.pointer_type(tl.int64)) + first_word
    target = seq.to(tl.int64) * SEQ
    for w0 in range(0, NUM_WORDS, BLOCK):
        i = w0 + tl.arange(0, BLOCK)
        mask = i < NUM_WORDS
        value = tl.where(mask, tl.atomic_add(words + i, 0, mask=mask, sem="acquire", scope="sys"), target)
        pending = tl.reduce((value < target).to(tl.int32), 0, _add)
        while pending > 0:
            value = tl.where(mask, tl.atomic_add(words + i, 0, mask=mask, sem="acquire", scope="sys"), target)
            pending = tl.reduce((value < target).to(tl.int32), 0, _add)
        tl.store(counts_out + i, value - target, mask=mask)


@_jit
def dispatch_recv_kernel(
    addresses,
    counts,  # int64 [L * EP]: rows per (local expert, source) this chunk, from wait_signals
    out_offsets,  # int64 [L * EP]: each group's first row in out
    out,  # int32 [N, WORDS]
    out_meta,  # int32 [N]: each row's pair in its source's chunk (token * K + k)
    rank,
    seq,
    slot,
    rows_offset,
    meta_offset,
    done_offset,
    credit_offset,
    EP: tl.constexpr,
    L: tl.constexpr,
    C: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    own = tl.load(addresses + rank)
    rows = (own + rows_offset).to(tl.pointer_type(tl.int32))
    meta = (own + meta_offset).to(tl.pointer_type(tl.int32))
    done = (own + done_offset).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, BLOCK_W).to(tl.int64)
    for g in range(tl.program_id(0), L * EP, tl.num_programs(0)):
        source = g % EP
        count = tl.load(counts + g)
        offset = tl.load(out_offsets + g)
        region = ((slot * L * EP + g) * C).to(tl.int64)
        for m0 in range(0, count, BLOCK_M):
            i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
            mask = i < count
            tl.store(out_meta + offset + i, tl.load(meta + region + i, mask=mask), mask=mask)
            for w0 in range(0, WORDS, BLOCK_W):
                m = mask[:, None] & (w0 + w < WORDS)[None, :]
                row = tl.load(rows + (region + i)[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                tl.store(out + (offset + i)[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
        # The last of the source's L groups to be copied out hands the slot back to it.
        tl.debug_barrier()
        finished = tl.atomic_add(done + source, 1, sem="acq_rel", scope="gpu") + 1
        if finished == seq.to(tl.int64) * L:
            credit = (tl.load(addresses + source) + credit_offset).to(tl.pointer_type(tl.int64)) + rank
            tl.atomic_xchg(credit, seq.to(tl.int64), sem="release", scope="sys")


@_jit
def combine_send_kernel(
    addresses,
    expert_out,  # int32 [N, WORDS]: the experts' rows, in dispatch_recv's order
    row_meta,  # int32 [N]: each row's pair in its source's chunk
    counts,  # int64 [L * EP]: this chunk's rows per (local expert, source)
    offsets,  # int64 [L * EP]: each group's first row in expert_out
    rank,
    seq,
    slot,
    rows_offset,
    signal_offset,
    credit_offset,
    EP: tl.constexpr,
    L: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    credits = (tl.load(addresses + rank) + credit_offset).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, BLOCK_W).to(tl.int64)
    for g in range(tl.program_id(0), L * EP, tl.num_programs(0)):
        expert = g // EP
        source = g % EP
        count = tl.load(counts + g)
        offset = tl.load(offsets + g)
        if seq > SLOTS:  # the slot was used SLOTS sequences ago: wait until source has reduced it
            credit = tl.atomic_add(credits + source, 0, sem="acquire", scope="sys")
            while credit < seq - SLOTS:
                credit = tl.atomic_add(credits + source, 0, sem="acquire", scope="sys")
        peer = tl.load(addresses + source)
        rows = (peer + rows_offset).to(tl.pointer_type(tl.int32))
        for m0 in range(0, count, BLOCK_M):
            i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
            mask = i < count
            dest_row = slot * C * K + tl.load(row_meta + offset + i, mask=mask, other=0).to(tl.int64)
            for w0 in range(0, WORDS, BLOCK_W):
                m = mask[:, None] & (w0 + w < WORDS)[None, :]
                row = tl.load(expert_out + (offset + i)[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                tl.store(rows + dest_row[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
        tl.debug_barrier()
        signal = (peer + signal_offset).to(tl.pointer_type(tl.int64)) + (slot * EP + rank) * L + expert
        tl.atomic_xchg(signal, seq.to(tl.int64) * SEQ + count, sem="release", scope="sys")


@_jit
def notify_send_kernel(
    addresses,
    counts,  # int64 [EP, WIDTH]: row d goes to rank d's notify slot, at row `rank`
    rank,
    seq,
    slot,
    notify_offset,
    signal_offset,
    EP: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    mask = i < WIDTH
    for dest in range(tl.program_id(0), EP, tl.num_programs(0)):
        peer = tl.load(addresses + dest)
        notify = (peer + notify_offset).to(tl.pointer_type(tl.int64)) + (slot * EP + rank) * WIDTH
        tl.store(notify + i, tl.load(counts + dest * WIDTH + i, mask=mask), mask=mask)
        tl.debug_barrier()
        signal = (peer + signal_offset).to(tl.pointer_type(tl.int64)) + slot * EP + rank
        tl.atomic_xchg(signal, seq.to(tl.int64) * SEQ, sem="release", scope="sys")


@_jit
def give_credit_kernel(addresses, rank, seq, credit_offset, EP: tl.constexpr):
    """Every peer's credit word for us becomes seq: what it stored into our slot has been read."""
    for dest in range(tl.program_id(0), EP, tl.num_programs(0)):
        credit = (tl.load(addresses + dest) + credit_offset).to(tl.pointer_type(tl.int64)) + rank
        tl.atomic_xchg(credit, seq.to(tl.int64), sem="release", scope="sys")
