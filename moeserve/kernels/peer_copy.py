"""Device-initiated all-to-all kernels: rows stored straight into peers' symmetric buffers.

The protocol of `moeserve.dispatch.symmetric_all_to_all` (read its docstring first), one kernel per
phase, so compute can run between a phase's send and its receive and no kernel ever waits on a
program of its own launch:

* `dispatch_send`:  per (destination rank, local expert) group, the sender's rows and their
  pair metadata into its own region of the destination's receive slot, then one signal word
  there, `epoch << 32 | rows`, with release semantics;
* `wait_signals`:   spin (acquire) until a run of signal words carries the epoch, hand out the counts;
* `dispatch_recv`:  per (local expert, source) group, the received rows into the caller's
  expert-major output, then a credit to the source once all of its groups are copied out;
* `combine_send`:   per group, each expert-output row home to its pair's `[token, k]` row of the
  source's combine slot, then a signal;
* `notify_send`:    one row of counts to every peer (the high-throughput mode's size exchange);
* `give_credit`:    tell every peer a slot of ours may be written again.

Peers are reached through an int64 table of their buffers' addresses (`SymmetricBuffer.addresses`),
never through tensor arguments, so the same kernels serve every transport: in-process emulated PEs,
shared-memory rank processes on CPU (Triton's interpreter) and NVLink peers on GPUs. Rows move as
int32 words, so the kernels are blind to the payload's dtype (bf16, fp32, FP8 plus scales); a row
of a multiple of 16 bytes (every real model's) moves in 16-byte vector loads and stores, because
every region and row is 16-byte aligned and the kernels tell the compiler so (`tl.multiple_of`).
Every kernel runs on a fixed number of programs (`num_programs`, the communication SMs) that
stride over the groups, leaving the rest of the GPU to the experts' GEMM.

Two kinds of peer. Peers of the rank's NVLink domain (`rank // DOMAIN` equal) are stored into as
above. The others have no address and are reached by NVSHMEM puts (`nvshmem_device`): the group's
rows are gathered into a staging region of our own symmetric buffer, then one put-with-signal
moves them to the same offset of the peer's buffer, the signal word riding on it (combine's rows
go to scattered `[token, k]` rows: a put per row, a fence, then the signal; credits are signal
operations). NVSHMEM delivers a put-with-signal's data before its signal and fenced puts before
what follows them; nothing else is relied on. Each send kernel is launched once per kind of
peer, its constexpr `KIND` choosing the path, so the put variant's code holds no store into a
peer (the compile check's PTX rules hold it to that). The receive side is the same for both.
`DOMAIN` 0 means no peer is reached by load/store, the rank itself included: every send is a
put, so one GPU exercises NVSHMEM's puts to itself (`nvlink_domain_size=0`); the credit kernels'
store branch is then a constant False, compiled out of their put variants.
The puts are non-blocking: a send returns once they are posted, and the receive step's wait on
the signal is where they are known to have landed. Without NVSHMEM (the interpreter, emulated
PEs on one GPU) `PUT_EMULATED` keeps the put's shape and promise: the same staging, then a copy
into the peer's slot and the signal released after it.

What a GPU run needs that the interpreter never shows:

* Sequence numbers, ranks, slots and offsets change from call to call. Compiled Triton would turn
  an int argument equal to 1 into a constant (and recompile for multiples of 16), so all of them
  are `do_not_specialize`: one compile per shape, and the first call (`seq == 1`) compiles too.
* Every wait is bounded (`timeout` nanoseconds: of the GPU's `%globaltimer` when compiled,
  of `HOST_CLOCK`, the host's monotonic clock, when interpreted; the interpreter runs the
  kernel's Python, so it may call one). A wait that runs out records `(phase, word, seq)` in the caller's `error`
  words, hands out zero counts and stops; every wait re-reads the record (a volatile load: the
  compiler may not keep it in a register) each time round its loop, so one already spinning ends
  too, and every later one returns at once: a dead or mismatched peer turns into a host-side error
  naming it instead of a hung GPU. The step whose wait ran out produces no token (the model
  runner's `check_step` reads the record before its sampled tokens leave the device).
* Signal words carry `epoch(seq)` (1 .. 2**31 - 1, wrapping), compared for equality: a slot's word
  holds either its previous use's epoch or the current one, never a later one (credits forbid
  it), so equality is exact where `seq << 32` would overflow int64 after 2**31 sequences.
* Completion is counted per ring slot, and credits are words per ring slot and peer, raised with
  `atomic_max` on the store path (set in sequence order by NVSHMEM signal ops on the put path,
  which can only set a word): two streams that finish sequences out of order can neither miss the
  last group of a sequence nor move a credit back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels import nvshmem_device as nvshmem
from moeserve.kernels.targets import DeviceKernel

EPOCHS = 2**31 - 1  # signal epochs run 1 .. EPOCHS; 0 is a word never written
SEQ: tl.constexpr = tl.constexpr(1 << 32)  # a signal word is epoch * SEQ + count

# Phases a timed-out wait records in `error[0]` (the host names them, `nvshmem.PHASES`).
DISPATCH_CREDIT: tl.constexpr = tl.constexpr(1)
DISPATCH_SIGNAL: tl.constexpr = tl.constexpr(2)
COMBINE_CREDIT: tl.constexpr = tl.constexpr(3)
COMBINE_SIGNAL: tl.constexpr = tl.constexpr(4)
NOTIFY_SIGNAL: tl.constexpr = tl.constexpr(5)

# How a launch reaches its peers (`KIND` of the send kernels, `PUT` of the others; see "Two kinds of
# peer" in the module docstring).
STORE: tl.constexpr = tl.constexpr(0)  # load/store: the address table (NVLink, shared memory, emulated PEs)
PUT_EMULATED: tl.constexpr = tl.constexpr(1)  # puts emulated by stores in NVSHMEM's order (no NVSHMEM heap)
PUT_NVSHMEM: tl.constexpr = tl.constexpr(2)  # puts by NVSHMEM's device API (IBGDA between nodes)

# Arguments that change per call: never value-specialized (see the module docstring).
_PER_CALL = ["rank", "seq", "epoch", "slot", "first_token", "first_word", "timeout", "phase"]

# Pointers are rebuilt inline from the address table (`(address + offset).to(pointer_type)`) and the
# bounded waits are written out in each kernel rather than in helper functions: under the
# interpreter every call of a nested jit function costs milliseconds, per group, which the CPU
# tests would pay thousands of times, and a kernel launched interpreted by `DeviceKernel` can
# call no nested jit function outside `tl.reduce`.


# WIDENING: Triton's interpreter types an int in [2**31, 2**32) as uint32 and its `.to(tl.int64)`
# keeps the numpy uint32, which its atomics refuse; adding it to an int64 zero widens it in both
# the interpreter and compiled code (where such a seq is an i64 argument anyway).

# CALLS: NVSHMEM's transfer routines stay real calls in the put variants, and a call keeps only
# the few registers its callee saves: every other value live across it is stored to local memory
# before the call and loaded after (the spills the compile check reported: 70-90 B a thread in
# the send kernels). The compiler would hold many there. What it computes from kernel arguments
# alone (a sign-extended offset, `own`'s address, `seq - SLOTS`) it hoists out of the group loop,
# so each is live across every call of every group; and a group's offsets computed before its
# first call are kept for the later ones. So the put variants take the arguments a group reads
# through `nvshmem.anew` (the same values, as ones the compiler must take as computed there) at
# the top of each group and again after each call, and compute from those copies alone: nothing
# but the loop's own counters is live across a call, and the arguments themselves cost nothing
# there (they stay in the constant bank). The other variants use the arguments as they are.


def epoch(seq: int) -> int:
    """The signal epoch of sequence number `seq` (>= 1)."""
    return (seq - 1) % EPOCHS + 1


def block_for(count: int, cap: int | None = None) -> int:
    """The power-of-two block that covers `count` elements in one tile, at most `cap`."""
    block = triton.next_power_of_2(count)
    return block if cap is None else min(block, cap)


def copy_tiles(words: int, device_type: str) -> tuple[int, int]:
    """(rows, words) per copy tile: 16 x up to 256 words on GPUs (16 KiB a tile: 32 words of
    payload per thread at 4 warps, eight 128-bit loads and stores, leaving the waits' and address
    arithmetic's registers room: 512 words spilled on sm_90); larger under the interpreter, where
    each tile is one numpy operation. The compile check asks for the GPU's with `device_type="cuda"`."""
    if device_type == "cuda":
        return 16, block_for(words, 256)
    return 64, block_for(words, 4096)


@triton.jit
def _add(a, b):
    # tl.sum would do, but the standard library's functions are compiled-only unless the
    # interpreter was chosen before triton was imported; tl.reduce with our own combiner is not.
    return a + b


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit(do_not_specialize=_PER_CALL)
def dispatch_send_kernel(
    addresses,
    payload,  # int32 [T, WORDS]: this rank's token rows
    pair_order,  # int64: pair ids (t * K + k) sorted by (chunk, dest rank, local expert), stable
    group_counts,  # int64 [EP * L]: this chunk's pairs per (dest rank, local expert)
    group_starts,  # int64 [EP * L]: where each group begins in pair_order
    error,  # int64 [4]: (phase, peer, seq, 0) of the first wait that ran out, else zeros
    rank,
    seq,
    epoch,
    slot,
    first_token,
    rows_offset,
    meta_offset,
    signal_offset,
    credit_offset,
    stage_rows_offset,
    stage_meta_offset,
    timeout,
    EP: tl.constexpr,
    L: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    GLOBALTIMER: tl.constexpr,
    HOST_CLOCK: tl.constexpr,
    KIND: tl.constexpr,
    DOMAIN: tl.constexpr,
):
    w = tl.arange(0, BLOCK_W)
    for g in range(tl.program_id(0), EP * L, tl.num_programs(0)):
        rank_g, slot_g, seq_g, epoch_g, first_token_g, error_g = rank, slot, seq, epoch, first_token, error
        rows_offset_g, meta_offset_g, signal_offset_g = rows_offset, meta_offset, signal_offset
        credit_offset_g, stage_rows_offset_g, stage_meta_offset_g = credit_offset, stage_rows_offset, stage_meta_offset
        if KIND == PUT_NVSHMEM:  # the arguments anew per group: see CALLS
            rank_g, slot_g, seq_g, epoch_g, first_token_g, error_g = nvshmem.anew(
                rank, slot, seq, epoch, first_token, error
            )
            rows_offset_g, meta_offset_g, signal_offset_g = nvshmem.anew(rows_offset, meta_offset, signal_offset)
            credit_offset_g, stage_rows_offset_g, stage_meta_offset_g = nvshmem.anew(
                credit_offset, stage_rows_offset, stage_meta_offset
            )
        seq64 = tl.full((), 0, tl.int64) + seq_g  # not seq.to(tl.int64): see WIDENING
        own = tl.load(addresses + rank_g)
        credits = (own + credit_offset_g).to(tl.pointer_type(tl.int64)) + slot_g * EP
        dest = g // L
        expert = g % L
        count = tl.load(group_counts + g)
        start = tl.load(group_starts + g)
        # Groups of the other kind of peer are the other launch's (see "Two kinds of peer").
        remote = (dest // DOMAIN != rank_g // DOMAIN) if DOMAIN else dest >= 0
        ready = remote == (KIND != STORE)
        if ready & (seq64 > SLOTS):  # the slot was used SLOTS sequences ago: wait until dest has copied it out
            credit = tl.atomic_add(credits + dest, 0, sem="acquire", scope="sys")
            failed = tl.load(error_g, volatile=True) != 0
            spent = tl.cast(0, tl.int64)
            if GLOBALTIMER:
                start_ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], tl.int64, False, 1)
            else:
                start_ns = HOST_CLOCK()
            while (credit < seq64 - SLOTS) & (spent < timeout) & (not failed):
                credit = tl.atomic_add(credits + dest, 0, sem="acquire", scope="sys")
                failed = tl.load(error_g, volatile=True) != 0  # another program's timeout ends this wait too
                if GLOBALTIMER:
                    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], tl.int64, False, 1)
                    spent = now - start_ns
                else:
                    spent = HOST_CLOCK() - start_ns
            ready = credit >= seq64 - SLOTS
            if not ready:
                if tl.atomic_cas(error_g, tl.cast(0, tl.int64), tl.cast(DISPATCH_CREDIT, tl.int64)) == 0:
                    tl.store(error_g + 1, dest.to(tl.int64))
                    tl.store(error_g + 2, seq64)
        if ready:
            region = (((slot_g * L + expert) * EP + rank_g) * C).to(tl.int64)  # ours, in dest's slot
            sent = epoch_g.to(tl.int64) * SEQ + count
            signal_word = ((slot_g * L + expert) * EP + rank_g).to(tl.int64)
            if KIND == STORE:  # straight into dest's slot
                target = tl.load(addresses + dest)
                rows = tl.multiple_of((target + rows_offset_g).to(tl.pointer_type(tl.int32)), 16)
                meta = (target + meta_offset_g).to(tl.pointer_type(tl.int32))
                at = region
            else:  # into our staging region for dest, from which the put takes them
                rows = tl.multiple_of((own + stage_rows_offset_g).to(tl.pointer_type(tl.int32)), 16)
                meta = (own + stage_meta_offset_g).to(tl.pointer_type(tl.int32))
                at = (((slot_g * L + expert) * EP + dest) * C).to(tl.int64)
            for m0 in range(0, count, BLOCK_M):
                i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
                mask = i < count
                pair = tl.load(pair_order + start + i, mask=mask, other=0)
                token = pair // K
                tl.store(meta + at + i, ((token - first_token_g) * K + pair % K).to(tl.int32), mask=mask)
                for w0 in range(0, WORDS, BLOCK_W):
                    m = mask[:, None] & (w0 + w < WORDS)[None, :]
                    row = tl.load(payload + token[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                    tl.store(rows + (at + i)[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
            tl.debug_barrier()  # every thread's stores before the release (or the put) below
            if KIND == STORE:
                signal = (target + signal_offset_g).to(tl.pointer_type(tl.int64)) + signal_word
                tl.atomic_xchg(signal, sent, sem="release", scope="sys")
            elif KIND == PUT_EMULATED:  # NVSHMEM's promise, by hand: the rows, then the signal
                target = tl.load(addresses + dest)
                peer_rows = tl.multiple_of((target + rows_offset_g).to(tl.pointer_type(tl.int32)), 16)
                peer_meta = (target + meta_offset_g).to(tl.pointer_type(tl.int32))
                for m0 in range(0, count, BLOCK_M):
                    i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
                    mask = i < count
                    tl.store(peer_meta + region + i, tl.load(meta + at + i, mask=mask), mask=mask)
                    for w0 in range(0, WORDS, BLOCK_W):
                        m = mask[:, None] & (w0 + w < WORDS)[None, :]
                        row = tl.load(rows + (at + i)[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                        tl.store(peer_rows + (region + i)[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
                tl.debug_barrier()  # every thread's peer-row stores before the release below
                signal = (target + signal_offset_g).to(tl.pointer_type(tl.int64)) + signal_word
                tl.atomic_xchg(signal, sent, sem="release", scope="sys")
            else:  # the metadata, a fence, then the rows carrying the signal
                nvshmem.putmem_nbi_block(
                    own + meta_offset_g + region * 4, own + stage_meta_offset_g + at * 4, count * 4, dest.to(tl.int32)
                )
                tl.debug_barrier()  # the block's put is posted before its one thread fences it
                if nvshmem.thread_index() == 0:
                    nvshmem.fence()
                tl.debug_barrier()
                # The group anew after the calls rather than held across them (see CALLS).
                h, me, ring, era = nvshmem.anew(g, rank, slot, epoch)
                rows_at, stage_at, signal_at = nvshmem.anew(rows_offset, stage_rows_offset, signal_offset)
                base = tl.load(addresses + me)
                rows = tl.load(group_counts + h)
                word = ((ring * L + h % L) * EP + me).to(tl.int64)
                staged = (((ring * L + h % L) * EP + h // L) * C).to(tl.int64)
                nvshmem.putmem_signal_nbi_block(
                    base + rows_at + word * (C * WORDS * 4), base + stage_at + staged * (WORDS * 4),
                    rows * (WORDS * 4), base + signal_at + word * 8, era.to(tl.int64) * SEQ + rows,
                    (h // L).to(tl.int32),
                )  # fmt: skip


@triton.jit(do_not_specialize=_PER_CALL)
def wait_signals_kernel(
    addresses,
    error,
    rank,
    signal_offset,
    first_word,
    counts_out,
    seq,
    epoch,
    timeout,
    phase,
    NUM_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    GLOBALTIMER: tl.constexpr,
    HOST_CLOCK: tl.constexpr,
):
    """One program: wait for words [first_word, first_word + NUM_WORDS) to carry `epoch`;
    counts_out gets their counts (zeros for words that never did, once the wait ran out)."""
    seq64 = tl.full((), 0, tl.int64) + seq  # not seq.to(tl.int64): see WIDENING
    words = (tl.load(addresses + rank) + signal_offset).to(tl.pointer_type(tl.int64)) + first_word
    target = epoch.to(tl.int64)
    failed = tl.load(error, volatile=True) != 0
    spent = tl.cast(0, tl.int64)
    if GLOBALTIMER:
        start_ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], tl.int64, False, 1)
    else:
        start_ns = HOST_CLOCK()
    for w0 in range(0, NUM_WORDS, BLOCK):
        i = w0 + tl.arange(0, BLOCK)
        mask = i < NUM_WORDS
        value = tl.atomic_add(words + i, 0, mask=mask, sem="acquire", scope="sys")
        late = mask & ((value >> 32) != target)
        pending = tl.reduce(late.to(tl.int32), 0, _add)
        while (pending > 0) & (spent < timeout) & (not failed):
            value = tl.atomic_add(words + i, 0, mask=mask, sem="acquire", scope="sys")
            late = mask & ((value >> 32) != target)
            pending = tl.reduce(late.to(tl.int32), 0, _add)
            failed = tl.load(error, volatile=True) != 0  # another program's timeout ends this wait too
            if GLOBALTIMER:
                now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], tl.int64, False, 1)
                spent = now - start_ns
            else:
                spent = HOST_CLOCK() - start_ns
        if (pending > 0) & (not failed):
            if tl.atomic_cas(error, tl.cast(0, tl.int64), phase.to(tl.int64)) == 0:
                tl.store(error + 1, (first_word + tl.reduce(tl.where(late, i, NUM_WORDS), 0, _min)).to(tl.int64))
                tl.store(error + 2, seq64)
        failed = failed | (pending > 0)
        tl.store(counts_out + i, tl.where(late, 0, value & 0xFFFFFFFF), mask=mask)


@triton.jit(do_not_specialize=_PER_CALL)
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
    PUT: tl.constexpr,
    DOMAIN: tl.constexpr,
):
    seq64 = tl.full((), 0, tl.int64) + seq  # not seq.to(tl.int64): see WIDENING
    own = tl.load(addresses + rank)
    rows = tl.multiple_of((own + rows_offset).to(tl.pointer_type(tl.int32)), 16)
    meta = (own + meta_offset).to(tl.pointer_type(tl.int32))
    done = (own + done_offset).to(tl.pointer_type(tl.int64)) + slot * EP
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
        # The last of the source's L groups in this slot to be copied out hands the slot back. The
        # count is per slot, and a slot holds one sequence at a time, so every L-th group is the last.
        tl.debug_barrier()
        finished = tl.atomic_add(done + source, 1, sem="acq_rel", scope="gpu") + 1
        if finished % L == 0:
            word = slot * EP + rank
            # A store, or the emulated put of the one word; NVSHMEM's puts only compiled where they
            # are linked (a constexpr branch, as every extern call here).
            by_store = True
            if PUT == PUT_NVSHMEM:
                by_store = (source // DOMAIN == rank // DOMAIN) if DOMAIN else False
                if (not by_store) & (nvshmem.thread_index() == 0):  # one signal, not one per thread
                    nvshmem.signal_op(own + credit_offset + word * 8, seq64, source.to(tl.int32))
            if by_store:
                credit = (tl.load(addresses + source) + credit_offset).to(tl.pointer_type(tl.int64)) + word
                tl.atomic_max(credit, seq64, sem="release", scope="sys")


@triton.jit(do_not_specialize=_PER_CALL)
def combine_send_kernel(
    addresses,
    expert_out,  # int32 [N, WORDS]: the experts' rows, in dispatch_recv's order
    row_meta,  # int32 [N]: each row's pair in its source's chunk
    counts,  # int64 [L * EP]: this chunk's rows per (local expert, source)
    offsets,  # int64 [L * EP]: each group's first row in expert_out
    error,
    rank,
    seq,
    epoch,
    slot,
    rows_offset,
    signal_offset,
    credit_offset,
    stage_offset,
    timeout,
    EP: tl.constexpr,
    L: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    GLOBALTIMER: tl.constexpr,
    HOST_CLOCK: tl.constexpr,
    KIND: tl.constexpr,
    DOMAIN: tl.constexpr,
):
    w = tl.arange(0, BLOCK_W)
    for g in range(tl.program_id(0), L * EP, tl.num_programs(0)):
        group, rank_g, slot_g, seq_g, epoch_g, error_g = g, rank, slot, seq, epoch, error
        rows_offset_g, signal_offset_g, credit_offset_g, stage_offset_g = (
            rows_offset,
            signal_offset,
            credit_offset,
            stage_offset,
        )
        if KIND == PUT_NVSHMEM:  # the arguments anew per group: see CALLS
            group, rank_g, slot_g, seq_g, epoch_g, error_g = nvshmem.anew(g, rank, slot, seq, epoch, error)
            rows_offset_g, signal_offset_g, credit_offset_g, stage_offset_g = nvshmem.anew(
                rows_offset, signal_offset, credit_offset, stage_offset
            )
        seq64 = tl.full((), 0, tl.int64) + seq_g  # not seq.to(tl.int64): see WIDENING
        own = tl.load(addresses + rank_g)
        credits = (own + credit_offset_g).to(tl.pointer_type(tl.int64)) + slot_g * EP
        expert = group // EP
        source = group % EP
        count = tl.load(counts + group)
        offset = tl.load(offsets + group)
        remote = (source // DOMAIN != rank_g // DOMAIN) if DOMAIN else source >= 0
        ready = remote == (KIND != STORE)  # else the other launch's
        if ready & (seq64 > SLOTS):  # the slot was used SLOTS sequences ago: wait until source has reduced it
            credit = tl.atomic_add(credits + source, 0, sem="acquire", scope="sys")
            failed = tl.load(error_g, volatile=True) != 0
            spent = tl.cast(0, tl.int64)
            if GLOBALTIMER:
                start_ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], tl.int64, False, 1)
            else:
                start_ns = HOST_CLOCK()
            while (credit < seq64 - SLOTS) & (spent < timeout) & (not failed):
                credit = tl.atomic_add(credits + source, 0, sem="acquire", scope="sys")
                failed = tl.load(error_g, volatile=True) != 0  # another program's timeout ends this wait too
                if GLOBALTIMER:
                    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], tl.int64, False, 1)
                    spent = now - start_ns
                else:
                    spent = HOST_CLOCK() - start_ns
            ready = credit >= seq64 - SLOTS
            if not ready:
                if tl.atomic_cas(error_g, tl.cast(0, tl.int64), tl.cast(COMBINE_CREDIT, tl.int64)) == 0:
                    tl.store(error_g + 1, source.to(tl.int64))
                    tl.store(error_g + 2, seq64)
        if ready:
            sent = epoch_g.to(tl.int64) * SEQ + count
            signal_word = ((slot_g * EP + rank_g) * L + expert).to(tl.int64)
            if KIND == STORE:  # each row straight home to its [token, k] row of source's slot
                target = tl.load(addresses + source)
                rows = tl.multiple_of((target + rows_offset_g).to(tl.pointer_type(tl.int32)), 16)
                for m0 in range(0, count, BLOCK_M):
                    i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
                    mask = i < count
                    dest_row = slot_g * C * K + tl.load(row_meta + offset + i, mask=mask, other=0).to(tl.int64)
                    for w0 in range(0, WORDS, BLOCK_W):
                        m = mask[:, None] & (w0 + w < WORDS)[None, :]
                        row = tl.load(expert_out + (offset + i)[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                        tl.store(rows + dest_row[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
                tl.debug_barrier()
                signal = (target + signal_offset_g).to(tl.pointer_type(tl.int64)) + signal_word
                tl.atomic_xchg(signal, sent, sem="release", scope="sys")
            else:  # staged in the group's region of ours, then one put per row home
                stage = tl.multiple_of((own + stage_offset_g).to(tl.pointer_type(tl.int32)), 16)
                at = ((slot_g * L * EP + group) * C).to(tl.int64)
                # Half-height tiles in the put variant: with NVSHMEM's calls in the kernel ptxas
                # allots it fewer registers (64 under Triton 3.6), which a full tile overran by 8 B.
                STAGE_M: tl.constexpr = BLOCK_M // 2 if KIND == PUT_NVSHMEM else BLOCK_M
                for m0 in range(0, count, STAGE_M):
                    i = m0 + tl.arange(0, STAGE_M).to(tl.int64)
                    mask = i < count
                    for w0 in range(0, WORDS, BLOCK_W):
                        m = mask[:, None] & (w0 + w < WORDS)[None, :]
                        row = tl.load(expert_out + (offset + i)[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                        tl.store(stage + (at + i)[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
                tl.debug_barrier()
                if KIND == PUT_EMULATED:  # NVSHMEM's promise, by hand: every row, then the signal
                    target = tl.load(addresses + source)
                    rows = tl.multiple_of((target + rows_offset_g).to(tl.pointer_type(tl.int32)), 16)
                    for m0 in range(0, count, BLOCK_M):
                        i = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
                        mask = i < count
                        dest_row = slot_g * C * K + tl.load(row_meta + offset + i, mask=mask, other=0).to(tl.int64)
                        for w0 in range(0, WORDS, BLOCK_W):
                            m = mask[:, None] & (w0 + w < WORDS)[None, :]
                            row = tl.load(stage + (at + i)[:, None] * WORDS + (w0 + w)[None, :], mask=m)
                            tl.store(rows + dest_row[:, None] * WORDS + (w0 + w)[None, :], row, mask=m)
                    tl.debug_barrier()  # every thread's peer-row stores before the release below
                    signal = (target + signal_offset_g).to(tl.pointer_type(tl.int64)) + signal_word
                    tl.atomic_xchg(signal, sent, sem="release", scope="sys")
                else:  # the rows' puts, a fence, then the signal: NVSHMEM delivers it after them
                    # Each row's put from the arguments anew, and up to the region's C rows rather than
                    # `count`, so that only the two loops' counters are live across the calls (see CALLS).
                    for i in range(0, C):
                        h, row, me, ring, rows_at, stage_at = nvshmem.anew(g, i, rank, slot, rows_offset, stage_offset)
                        if row < tl.load(counts + h):
                            base = tl.load(addresses + me)
                            home = ring * C * K + tl.load(row_meta + tl.load(offsets + h) + row).to(tl.int64)
                            staged = ((ring * L * EP + h) * C + row).to(tl.int64)
                            nvshmem.putmem_nbi_block(
                                base + rows_at + home * (WORDS * 4), base + stage_at + staged * (WORDS * 4),
                                tl.full((), WORDS * 4, tl.int64), (h % EP).to(tl.int32),
                            )  # fmt: skip
                    tl.debug_barrier()  # every row's put posted before the one thread's fence and signal
                    if nvshmem.thread_index() == 0:
                        h, me, ring, era, signal_at = nvshmem.anew(g, rank, slot, epoch, signal_offset)
                        word = ((ring * EP + me) * L + h // EP).to(tl.int64)
                        nvshmem.fence()
                        nvshmem.signal_op(
                            tl.load(addresses + me) + signal_at + word * 8,
                            era.to(tl.int64) * SEQ + tl.load(counts + h), (h % EP).to(tl.int32),
                        )  # fmt: skip


@triton.jit(do_not_specialize=_PER_CALL)
def notify_send_kernel(
    addresses,
    counts,  # int64 [EP, WIDTH]: row d goes to rank d's notify slot, at row `rank`
    rank,
    epoch,
    slot,
    notify_offset,
    signal_offset,
    stage_offset,
    EP: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    DOMAIN: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    mask = i < WIDTH
    own = tl.load(addresses + rank)
    at = ((slot * EP + rank) * WIDTH).to(tl.int64)  # our row of dest's slot
    signal_word = (slot * EP + rank).to(tl.int64)
    for dest in range(tl.program_id(0), EP, tl.num_programs(0)):
        remote = (dest // DOMAIN != rank // DOMAIN) if DOMAIN else dest >= 0
        if remote == (KIND != STORE):  # else the other launch's
            row = tl.load(counts + dest * WIDTH + i, mask=mask)
            if KIND == PUT_NVSHMEM:  # staged (row dest of our own slot), then put with the signal
                staged = ((slot * EP + dest) * WIDTH).to(tl.int64)
                tl.store((own + stage_offset).to(tl.pointer_type(tl.int64)) + staged + i, row, mask=mask)
                tl.debug_barrier()
                nvshmem.putmem_signal_nbi_block(
                    own + notify_offset + at * 8, own + stage_offset + staged * 8, tl.full((), WIDTH * 8, tl.int64),
                    own + signal_offset + signal_word * 8, epoch.to(tl.int64) * SEQ, dest.to(tl.int32),
                )  # fmt: skip
            else:  # stored, or the emulated put: the row, then the signal
                peer = tl.load(addresses + dest)
                notify = (peer + notify_offset).to(tl.pointer_type(tl.int64)) + at
                tl.store(notify + i, row, mask=mask)
                tl.debug_barrier()
                signal = (peer + signal_offset).to(tl.pointer_type(tl.int64)) + signal_word
                tl.atomic_xchg(signal, epoch.to(tl.int64) * SEQ, sem="release", scope="sys")


@triton.jit(do_not_specialize=_PER_CALL)
def give_credit_kernel(
    addresses, rank, seq, slot, credit_offset, EP: tl.constexpr, PUT: tl.constexpr, DOMAIN: tl.constexpr
):
    """Every peer's credit word for us and this slot rises to seq: what it sent into the slot has been read."""
    seq64 = tl.full((), 0, tl.int64) + seq  # not seq.to(tl.int64): see WIDENING
    word = slot * EP + rank
    for dest in range(tl.program_id(0), EP, tl.num_programs(0)):
        by_store = True  # or the emulated put of the one word
        if PUT == PUT_NVSHMEM:
            by_store = (dest // DOMAIN == rank // DOMAIN) if DOMAIN else False
            if (not by_store) & (nvshmem.thread_index() == 0):  # one signal, not one per thread
                nvshmem.signal_op(tl.load(addresses + rank) + credit_offset + word * 8, seq64, dest.to(tl.int32))
        if by_store:
            credit = (tl.load(addresses + dest) + credit_offset).to(tl.pointer_type(tl.int64)) + word
            tl.atomic_max(credit, seq64, sem="release", scope="sys")


dispatch_send = DeviceKernel(dispatch_send_kernel)
wait_signals = DeviceKernel(wait_signals_kernel)
dispatch_recv = DeviceKernel(dispatch_recv_kernel)
combine_send = DeviceKernel(combine_send_kernel)
notify_send = DeviceKernel(notify_send_kernel)
give_credit = DeviceKernel(give_credit_kernel)
KERNELS = (dispatch_send, wait_signals, dispatch_recv, combine_send, notify_send, give_credit)
