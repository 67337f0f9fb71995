"""`nvshmem` backend: dispatch and combine as device-initiated stores into peers' symmetric buffers.

Each rank's kernels (`moeserve.kernels.peer_copy`) store rows straight into the receive buffers
of the ranks holding their experts and raise a signal word there; the receiver waits on its own
signal words and copies the rows out. No collective library, no host in the loop: NVLink
all-to-all as DeepEP's intranode/low-latency paths and pplx's NVLink path do it, over whichever
`SymmetricHeap` transport makes the peers' buffers addressable (NVSHMEM on GPUs, shared memory
across rank processes on CPU, emulated PEs in one process for tests and one-GPU benchmarks).

Wire protocol (buffer layout in `nvshmem_layout`). The step's tokens go in chunks of at most
`chunk_tokens` per rank; chunk j of every rank moves in one sequence number `seq` through ring
slot `seq % S`:

1. send: per (destination rank d, local expert e) group, the sender's rows for e, in its (token,
   k) order, into its own `C`-row region of d's slot, and each row's pair (token in chunk * K + k)
   beside it; then `seq << 32 | rows` into d's signal word for (e, sender), with release
   semantics. Before storing into d's slot the sender waits for d's credit for the slot's
   previous use.
2. receive: wait (acquire) until every (e, source) word of the slot carries seq; copy each
   group's rows into the expert-major output at its offset (expert, then source rank, then the
   source's order: exactly the rows and order of the `torch` backend); the last group of a source
   to be copied sends that source a credit.
3. combine send: each output row goes home to its pair's `[token, k]` row of the source's
   combine slot, then a signal per (expert rank, local expert).
4. combine receive: wait for every expert rank's words, reduce over k with `weighted_sum` (the
   one function every backend uses, so results are bit-equal to `local` and `torch`), credit.

Two modes, as in the `torch` backend. Low-latency (the step's `max_tokens_per_rank` is at most
`chunk_tokens`): one chunk, no host sync, output padded to `EP * bound * min(K, L)` rows.
High-throughput (no bound, or a larger one): a notify round first exchanges each rank's counts
and token count, read back to the host once (the declared `syncs_host`), which sizes the output
exactly and fixes the number of chunks every rank runs; then the chunks stream through the slots.

The buffer is allocated when the dispatcher is built, for the model's `DispatchRows`: at startup,
where every rank builds its dispatcher collectively and in the same order, and the heap returns
only once every rank's copy is zeroed. No dispatch allocates (see `dispatch.rows` for the race
that allocating in the first dispatch allowed).

`dispatch_steps`/`combine_steps` yield after each send, before the matching wait, so a caller may
compute between them (two-batch overlap) and emulated PEs in one process can be run in lockstep.

Streams (`streams`): the kernels (and the small torch ops between them) run on comm streams of
the dispatcher's own, on `num_comm_sms` programs, so the caller's compute stream runs beside them
(another micro-batch's attention and experts) on the SMs left, which the experts' persistent
grids keep to (`launch_config.reserve_comm_sms`). The streams meet only at events: the first
send waits for the compute stream as it was when dispatch or combine was called (the rows
exist), and before dispatch or combine returns, and before the one host read, the compute stream
waits for the comm stream (the rows arrived). Every tensor the comm stream uses is referenced
by the generator until that last wait is enqueued, so none is freed to the caching allocator
while the comm stream may still read or write it.

Two comm streams, taken in turn by successive dispatches (a combine runs on its dispatch's):
a combine send waits for its experts, and on one stream every later comm kernel would wait
behind it, the other micro-batch's receive included, which would serialise two-batch overlap
again. Its micro-batches dispatch in turn, so each gets a comm stream of its own. Correctness
never rests on which stream a call gets: the events order whatever must be ordered.
FP8 (`dispatch_fp8`): the payload is the packed FP8 rows (`fp8.encode_rows`), so the layout's
`row_bytes` is `fp8.packed_row_bytes(H)` (0.52x a bf16 row at H = 7168) and the kernels move them
unchanged; the receiver unpacks its output rows (`fp8.decode_rows`), hands them to the experts as
they came (`DispatchOutput.fp8_rows`) and dequantised. Combine rows stay in the activation dtype.

Two kinds of peer (`nvlink_domain_size`): the ranks of our NVLink domain (`rank // domain` equal)
are reached by stores through the address table; every other rank by puts (`peer_copy`'s put
variants: the group's rows gathered into a staging region of our own buffer, then one NVSHMEM
put-with-signal, or per-row puts, a fence and a signal, into the peer's slot at the same offset).
Each send runs as one launch per kind of peer, the same kernel source with its `KIND` constexpr,
so a put variant's code holds no store to a peer. On CPU the put is emulated (`PUT_EMULATED`),
so a group of emulated nodes runs the whole protocol; on GPUs it is NVSHMEM's (IBGDA between
nodes), which needs the kernels linked with NVSHMEM's device library.

`nvlink_domain_size=0` (`ALL_PUTS`): no peer is reached by load/store, this rank included, so
every send is one put launch. It exists to test the network path where there is no network:
one GPU puts to itself through NVSHMEM, and the GPUs of one node put to each other (with
`NVSHMEM_DISABLE_P2P=1`, through the NIC where there is one); the results are the same rows.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.dispatch.base import DispatchHandle, DispatchLayout, DispatchOutput, SteppedDispatcher, Steps
from moeserve.dispatch.combine import weighted_sum
from moeserve.dispatch.counts import count_per_expert
from moeserve.dispatch.fp8 import decode_rows, encode_rows
from moeserve.dispatch.nvshmem_layout import SymmetricLayout
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.dispatch.rows import DispatchRows
from moeserve.dispatch.streams import Streams, streams_for
from moeserve.dispatch.symmetric import SymmetricHeap
from moeserve.dispatch.symmetric.nvshmem4py_heap import NvshmemHostChoice, choose_nvshmem_host

CHUNK_TOKENS = 128  # tokens per rank per chunk: the low-latency bound, as the torch backend's
GPU_COMM_SMS = 20  # programs of every communication kernel on a GPU; the rest compute
CPU_COMM_PROGRAMS = 3  # under the interpreter programs run one after another: a few exercise the striding
WAIT_TIMEOUT_S = 100.0  # a peer silent this long is dead or mismatched (DeepEP's bound is of this order)
# Overrides WAIT_TIMEOUT_S where a dispatcher is built with no timeout_s: the GPU runbook sets it
# below its stages' watchdogs, so that a hang is the kernels' PeerTimeout naming phase and peer.
TIMEOUT_VAR = "MOESERVE_PEER_TIMEOUT_S"


def default_timeout_s() -> float:
    """The wait bound of a dispatcher built without one: TIMEOUT_VAR's seconds, else WAIT_TIMEOUT_S."""
    return float(os.environ.get(TIMEOUT_VAR) or WAIT_TIMEOUT_S)


class PeerTimeout(RuntimeError):
    """A wait for a peer ran out: the peer is dead, stalled, or running a different step."""


# What a timed-out wait was waiting for, by the phase code the kernels record, and which peer
# its first late word belongs to (words are numbered from the slot's first word).
PHASES = {
    1: ("dispatch send (waiting for the destination's credit)", None),
    2: ("dispatch receive (waiting for the source's rows)", lambda word, ep, lmax: word % ep),
    3: ("combine send (waiting for the source's credit)", None),
    4: ("combine receive (waiting for the expert rank's rows)", lambda word, ep, lmax: word // lmax % ep),
    5: ("notify (waiting for the peer's counts)", lambda word, ep, lmax: word % ep),
}
COMM_STREAMS = 2  # one per micro-batch of two-batch overlap (module docstring)
ALL_PUTS = 0  # the nvlink_domain_size of no load/store peer: every peer, this rank too, by puts (module docstring)


@dataclass(frozen=True)
class NvshmemHandle(DispatchHandle):
    """What combine() needs: per chunk, each (local expert, source) group's rows and first row in
    the output (`[chunks, L * EP]` int64), each output row's pair in its source's chunk, and the
    router's ids and weights for `weighted_sum`."""

    chunk_counts: torch.Tensor
    chunk_offsets: torch.Tensor
    row_meta: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    out_dtype: torch.dtype
    comm_lane: int  # which of the dispatcher's comm streams the dispatch ran on; combine runs there too


def _programs(device: torch.device, override: int | None) -> int:
    if override is not None:
        if override < 1:
            raise ValueError(f"num_comm_sms must be at least 1, got {override}")
        return override
    return GPU_COMM_SMS if device.type == "cuda" else CPU_COMM_PROGRAMS


class NvshmemDispatcher(SteppedDispatcher):
    """Expert-parallel dispatch by stores into peers' symmetric buffers (see the module docstring)."""

    name = "nvshmem"

    def __init__(
        self,
        placement: ExpertPlacement,
        rows: DispatchRows,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        heap: SymmetricHeap | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        num_comm_sms: int | None = None,
        dispatch_fp8: bool = False,
        timeout_s: float | None = None,
        streams: Streams | None = None,
        comm_stream: bool = True,
        nvlink_domain_size: int | None = None,
        nvshmem_host: NvshmemHostChoice = "auto",
    ) -> None:
        """rows: what every dispatch moves; the buffer is laid out and allocated for them here.
        Collective: every rank of the group builds its dispatcher with the same rows, in the same
        order as its other symmetric allocations.
        heap: the transport (None: shared memory over `group` on CPU, NVSHMEM on CUDA).
        chunk_tokens: tokens per rank per chunk, and the largest low-latency bound.
        num_comm_sms: programs of each communication kernel (None: 20 on GPUs, 3 on CPU).
        dispatch_fp8: send FP8 rows with per-128-channel scales (see the module docstring).
        timeout_s: how long any wait for a peer may take before it raises `PeerTimeout` (None:
            `default_timeout_s()`).
        streams: the device's streams and events (None: `streams_for(device)`).
        comm_stream: launch on a comm stream of our own beside the caller's (module docstring);
            False: on the caller's stream, after its work, as emulated PEs that one host thread
            times on one stream need.
        nvlink_domain_size: consecutive ranks that reach each other by load/store (None: all of
            them); the others are reached by puts (module docstring). 0 (`ALL_PUTS`): none,
            every peer and this rank too by puts, to test the network path on one node or GPU.
        nvshmem_host: who starts NVSHMEM for the default heap on a GPU (`choose_nvshmem_host`):
            nvshmem4py where importable (auto), or PyTorch's symmetric memory (torch)."""
        super().__init__(placement, dispatch_fp8)
        self.device = torch.device(device)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.rows, self.chunk_tokens = rows, chunk_tokens
        self.domain = check_domain(nvlink_domain_size, placement.ep_size)
        staged = self.domain < placement.ep_size  # some peers are reached by puts (every one at ALL_PUTS)
        self._layout = SymmetricLayout.for_rows(placement, rows, chunk_tokens, dispatch_fp8, staged)
        if heap is None:
            heap = _default_heap(group, self.device, self._layout.nbytes, self.domain, nvshmem_host)
        self.heap = heap
        if (self.heap.world_size, self.heap.rank) != (placement.ep_size, placement.rank):
            raise ValueError(
                f"the placement is rank {placement.rank} of ep_size={placement.ep_size} but the heap is PE "
                f"{self.heap.rank} of {self.heap.world_size}"
            )
        # NVSHMEM's puts on its own heap; on any other transport (emulated PEs on one GPU included)
        # the emulated put, compiled or interpreted alike. 0: no peer is reached by puts.
        self._put_kind = 0 if not staged else 2 if self.heap.name == "nvshmem" else 1
        self.num_programs = _programs(self.device, num_comm_sms)
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._timeout_ns = int(timeout_s * 1e9)
        # The kernels' clock, fixed by the device: the GPU's global timer when compiled, the
        # host's when interpreted (every launch of a wait passes it).
        cuda = self.device.type == "cuda"
        self._clock = {"GLOBALTIMER": cuda, "HOST_CLOCK": None if cuda else time.monotonic_ns}
        # (phase, peer or word, seq, 0) of the first wait that ran out; the kernels write it, the
        # host reads it (`_check_peers`) where it can without stalling the GPU.
        self._error = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._error_seen = _ErrorMirror(self._error)
        self.streams = streams if streams is not None else streams_for(self.device)
        self.comm_streams = tuple(
            self.streams.new_stream(f"comm {i}") for i in range(COMM_STREAMS if comm_stream else 0)
        )
        self._dispatches = 0
        if comm_stream and self.device.type == "cuda":
            from moeserve.kernels.launch_config import reserve_comm_sms

            reserve_comm_sms(self.device, self.num_programs)
        self._expert_slot = placement.expert_slot.to(self.device)
        # Imported here, not with the module: it decorates the kernels (compiled or interpreted)
        # and pulls in triton, which no process that never builds this backend needs.
        from moeserve.kernels import peer_copy

        self._kernels = peer_copy
        # NVSHMEM's put variants are linked with its device library (peer_copy's externs).
        self._put_libs = {}
        if self._put_kind == 2:
            from moeserve.kernels.nvshmem_device import extern_libs, init_linked_modules

            self._put_libs = {"extern_libs": extern_libs(torch.cuda.get_device_capability(self.device)[0] * 10)}
            init_linked_modules(self.heap.init_module)
        self._buffer = self.heap.allocate(self._layout.nbytes)
        self._seq = {"dispatch": 0, "combine": 0, "notify": 0}

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the kernels are Triton kernels and triton is not installed"
        if device.type == "cuda":
            from moeserve.dispatch.symmetric.nvshmem_heap import nvshmem_heap_unavailable

            return nvshmem_heap_unavailable(device)
        if device.type != "cpu":
            return f"no symmetric-memory transport for {device.type} devices"
        if placement.ep_size > 1 and not (dist.is_available() and dist.is_initialized()):
            return "the shared-memory transport needs an initialised torch.distributed group of the ranks"
        return None

    def syncs_host(self, max_tokens_per_rank: int | None) -> bool:
        """True in the high-throughput mode: no bound, or one above `chunk_tokens`."""
        return max_tokens_per_rank is None or max_tokens_per_rank > self.chunk_tokens

    def graph_capture_refusal(self, max_tokens_per_rank: int) -> str | None:
        """Always refused: each call takes the next sequence number on the host, which a replay
        would repeat."""
        return "the nvshmem backend numbers every dispatch and combine on the host (sequence numbers)"

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch_steps(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> Steps[DispatchOutput]:
        num_tokens, top_k = topk_ids.shape
        if max_tokens_per_rank is not None and num_tokens > max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceed this step's max_tokens_per_rank={max_tokens_per_rank}")
        layout = self._layout_for(hidden, top_k)
        payload = self._words(encode_rows(hidden) if self.dispatch_fp8 else hidden)  # int32 [T, W]
        ep, lmax, groups = layout.ep, layout.local_experts, layout.groups
        lane = self._dispatches % COMM_STREAMS
        self._dispatches += 1
        comm = self._comm(lane)

        if self.syncs_host(max_tokens_per_rank):
            received = yield from self._notify(topk_ids, layout, comm)  # [EP, L + 1] per source: counts, tokens
            num_chunks = -(-max(row[-1] for row in received) // self.chunk_tokens)
            per_group = torch.tensor([row[:lmax] for row in received], dtype=torch.int64).t().reshape(-1)  # (e, s)
            num_rows = int(per_group.sum())
            base = (torch.cumsum(per_group, 0) - per_group).to(self.device)
            host_counts = tuple(per_group.view(lmax, ep).sum(1).tolist())[: self.placement.num_local_experts]
        else:
            num_chunks = 1
            num_rows = ep * max_tokens_per_rank * min(top_k, lmax)
            base, host_counts = None, None

        order, send_counts, send_starts = self._send_plan(topk_ids, num_chunks, layout)
        out = payload.new_zeros(num_rows, payload.shape[1])
        row_meta = torch.empty(num_rows, dtype=torch.int32, device=self.device)
        chunk_counts = torch.zeros(num_chunks, groups, dtype=torch.int64, device=self.device)
        chunk_offsets = torch.zeros_like(chunk_counts)
        running = torch.zeros(groups, dtype=torch.int64, device=self.device)
        self._comm_after_compute(comm)  # the payload and the send plan exist
        for chunk in range(num_chunks):
            seq = self._launch_send(payload, order, send_counts[chunk], send_starts[chunk], chunk, layout, top_k, comm)
            yield
            counts = self._wait(
                "dispatch_signal", (seq % layout.slots) * groups, groups, seq, self._kernels.DISPATCH_SIGNAL, comm
            )
            with self._on_comm(comm, "dispatch_recv"):
                offsets = torch.cumsum(counts, 0) - counts if base is None else base + running
                self._launch_recv(counts, offsets, out, row_meta, seq, layout)
                running += counts
                chunk_counts[chunk], chunk_offsets[chunk] = counts, offsets
        self._compute_after_comm(comm)  # the rows arrived: the experts may read them

        handle = NvshmemHandle(
            num_tokens=num_tokens,
            chunk_counts=chunk_counts,
            chunk_offsets=chunk_offsets,
            row_meta=row_meta,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            out_dtype=hidden.dtype,
            comm_lane=lane,
        )
        fp8_rows = decode_rows(out, hidden.shape[1]) if self.dispatch_fp8 else None
        return DispatchOutput(
            hidden=out.view(hidden.dtype) if fp8_rows is None else fp8_rows.dequantize(hidden.dtype),
            fp8_rows=fp8_rows,
            num_tokens_per_expert=running.view(lmax, ep).sum(1)[: self.placement.num_local_experts],
            num_tokens_per_expert_host=host_counts,
            layout=DispatchLayout.EXPERT_MAJOR,
            handle=handle,
        )

    def _notify(self, topk_ids: torch.Tensor, layout: SymmetricLayout, comm: object) -> Steps[list[list[int]]]:
        """Every rank's pairs per (our local expert) and its token count, read to the host."""
        ep, lmax = layout.ep, layout.local_experts
        counts = count_per_expert(self._expert_slot[topk_ids.reshape(-1)], ep * lmax).view(ep, lmax)
        rows = torch.cat([counts, counts.new_full((ep, 1), topk_ids.shape[0])], 1).contiguous()
        seq = self._next("notify")
        slot = seq % layout.slots
        offsets = layout.offsets
        self._comm_after_compute(comm)  # the counts exist
        with self._on_comm(comm, "notify_send"):
            for kind, libs in self._send_kinds:
                self._kernels.notify_send[(min(self.num_programs, ep),)](
                    self._buffer.addresses, rows, self.heap.rank, self._kernels.epoch(seq), slot, offsets["notify"],
                    offsets["notify_signal"], offsets["notify_stage"], EP=ep, WIDTH=lmax + 1,
                    BLOCK=self._kernels.block_for(lmax + 1), KIND=kind, DOMAIN=self.domain, **libs,
                )  # fmt: skip
        yield
        self._wait("notify_signal", slot * ep, ep, seq, self._kernels.NOTIFY_SIGNAL, comm)
        self._compute_after_comm(comm)  # the read below is enqueued on the compute stream
        notify = self._buffer.view(offsets["notify"], (layout.slots, ep, lmax + 1), torch.int64)
        received = notify[slot].tolist()  # the one host read of the high-throughput mode
        self._check_peers(synced=True)
        return received

    def _send_plan(
        self, topk_ids: torch.Tensor, num_chunks: int, layout: SymmetricLayout
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pairs sorted by (chunk, destination, local expert), stable, with each group's count and
        start: `[chunks, EP * L]` each."""
        top_k = topk_ids.shape[1]
        key = self._expert_slot[topk_ids.reshape(-1)]
        if num_chunks > 1:
            chunk = torch.arange(key.numel(), device=key.device) // (top_k * self.chunk_tokens)
            key = key + chunk * layout.groups
        order = torch.argsort(key, stable=True)
        counts = count_per_expert(key, num_chunks * layout.groups)
        starts = torch.cumsum(counts, 0) - counts
        return order, counts.view(num_chunks, layout.groups), starts.view(num_chunks, layout.groups)

    def _launch_send(self, payload, order, counts, starts, chunk, layout, top_k, comm) -> int:
        seq = self._next("dispatch")
        offsets = layout.offsets
        block_m, block_w = self._blocks(payload.shape[1])
        with self._on_comm(comm, "dispatch_send"):
            for kind, libs in self._send_kinds:
                self._kernels.dispatch_send[(self.num_programs,)](
                    self._buffer.addresses, payload, order, counts, starts, self._error, self.heap.rank, seq,
                    self._kernels.epoch(seq), seq % layout.slots, chunk * self.chunk_tokens, offsets["dispatch_rows"],
                    offsets["dispatch_meta"], offsets["dispatch_signal"], offsets["dispatch_credit"],
                    offsets["dispatch_stage"], offsets["dispatch_stage_meta"], self._timeout_ns,
                    EP=layout.ep, L=layout.local_experts, C=self.chunk_tokens, K=top_k, SLOTS=layout.slots,
                    WORDS=payload.shape[1], BLOCK_M=block_m, BLOCK_W=block_w, KIND=kind, DOMAIN=self.domain,
                    **self._clock, **libs,
                )  # fmt: skip
        return seq

    def _launch_recv(self, counts, offsets, out, row_meta, seq, layout) -> None:
        regions = layout.offsets
        block_m, block_w = self._blocks(out.shape[1])
        self._kernels.dispatch_recv[(self.num_programs,)](
            self._buffer.addresses, counts, offsets, out, row_meta, self.heap.rank, seq, seq % layout.slots,
            regions["dispatch_rows"], regions["dispatch_meta"], regions["dispatch_done"],
            regions["dispatch_credit"],
            EP=layout.ep, L=layout.local_experts, C=self.chunk_tokens, WORDS=out.shape[1],
            BLOCK_M=block_m, BLOCK_W=block_w, PUT=self._put_kind, DOMAIN=self.domain, **self._put_libs,
        )  # fmt: skip

    # -- combine ----------------------------------------------------------------------------

    def combine_steps(self, expert_output: torch.Tensor, handle: DispatchHandle) -> Steps[torch.Tensor]:
        assert isinstance(handle, NvshmemHandle), f"nvshmem combine got a {type(handle).__name__}"
        if expert_output.shape[0] != handle.row_meta.numel():
            raise ValueError(
                f"combine got {expert_output.shape[0]} rows; dispatch handed out {handle.row_meta.numel()}"
            )
        if expert_output.dtype != handle.out_dtype:
            raise ValueError(f"combine got {expert_output.dtype} rows for a {handle.out_dtype} dispatch")
        layout, offsets = self._layout, self._layout.offsets
        num_tokens, top_k = handle.topk_ids.shape
        hidden_size = expert_output.shape[1]
        words = self._words(expert_output)
        block_m, block_w = self._blocks(words.shape[1])
        out = expert_output.new_empty(num_tokens, hidden_size)
        comm = self._comm(handle.comm_lane)
        self._comm_after_compute(comm)  # the experts' rows exist
        for chunk in range(handle.chunk_counts.shape[0]):
            seq = self._next("combine")
            slot = seq % layout.slots
            with self._on_comm(comm, "combine_send"):
                for kind, libs in self._send_kinds:
                    self._kernels.combine_send[(self.num_programs,)](
                        self._buffer.addresses, words, handle.row_meta, handle.chunk_counts[chunk],
                        handle.chunk_offsets[chunk], self._error, self.heap.rank, seq, self._kernels.epoch(seq), slot,
                        offsets["combine_rows"], offsets["combine_signal"], offsets["combine_credit"],
                        offsets["combine_stage"], self._timeout_ns,
                        EP=layout.ep, L=layout.local_experts, C=self.chunk_tokens, K=top_k, SLOTS=layout.slots,
                        WORDS=words.shape[1], BLOCK_M=block_m, BLOCK_W=block_w, KIND=kind, DOMAIN=self.domain,
                        **self._clock, **libs,
                    )  # fmt: skip
            yield
            self._wait("combine_signal", slot * layout.groups, layout.groups, seq, self._kernels.COMBINE_SIGNAL, comm)
            first = chunk * self.chunk_tokens
            tokens = max(0, min(num_tokens - first, self.chunk_tokens))
            slot_rows = self.chunk_tokens * top_k
            # On the comm stream, so the credit below follows the read of the slot.
            with self._on_comm(comm, "combine_reduce"):
                rows = self._buffer.view(
                    offsets["combine_rows"] + slot * slot_rows * layout.out_row_bytes,
                    (tokens * top_k, hidden_size),
                    expert_output.dtype,
                )
                span = slice(first, first + tokens)
                order = None if handle.sum_order is None else handle.sum_order[span]
                out[span] = weighted_sum(rows, handle.topk_ids[span], handle.topk_weights[span], order)
            with self._on_comm(comm, "give_credit"):
                self._kernels.give_credit[(min(self.num_programs, layout.ep),)](
                    self._buffer.addresses,
                    self.heap.rank,
                    seq,
                    slot,
                    offsets["combine_credit"],
                    EP=layout.ep,
                    PUT=self._put_kind,
                    DOMAIN=self.domain,
                    **self._put_libs,
                )
        self._compute_after_comm(comm)  # the reduced rows are home
        return out

    # -- helpers ----------------------------------------------------------------------------

    def _wait(self, region: str, first_word: int, num_words: int, seq: int, phase, comm: object) -> torch.Tensor:
        """int64 `[num_words]`: the counts in words [first_word, +num_words) of `region`, once all carry seq."""
        with self._on_comm(comm, "wait_signals"):
            counts = torch.empty(num_words, dtype=torch.int64, device=self.device)
            self._kernels.wait_signals[(1,)](
                self._buffer.addresses, self._error, self.heap.rank, self._layout.offsets[region], first_word,
                counts, seq, self._kernels.epoch(seq), self._timeout_ns, phase.value,
                NUM_WORDS=num_words, BLOCK=self._kernels.block_for(num_words, 1024), **self._clock,
            )  # fmt: skip
        self._check_peers(synced=self.device.type != "cuda")
        return counts

    def _comm(self, lane: int) -> object | None:
        """Comm stream `lane`, or None without comm streams (the caller's stream is used)."""
        return self.comm_streams[lane] if self.comm_streams else None

    def _on_comm(self, comm: object | None, what: str) -> contextlib.AbstractContextManager[None]:
        """A context enqueuing `what` on the comm stream `comm` (None: on the caller's stream)."""
        return self.streams.on(comm if comm is not None else self.streams.current(), what)

    def _comm_after_compute(self, comm: object | None) -> None:
        """The comm stream's next work waits for the compute stream's work so far."""
        if comm is not None:
            self.streams.follow(comm, self.streams.current())

    def _compute_after_comm(self, comm: object | None) -> None:
        """The compute stream's next work waits for the comm stream's work so far."""
        if comm is not None:
            self.streams.follow(self.streams.current(), comm)

    @property
    def _send_kinds(self) -> list[tuple[int, dict]]:
        """(KIND, launch keywords) of each send's launches: the stores to our domain (none at
        `ALL_PUTS`), then the puts to the other domains where there are any."""
        kinds = [(0, {})] if self.domain != ALL_PUTS else []
        if self._put_kind:
            kinds.append((self._put_kind, self._put_libs))
        return kinds

    def check_step(self) -> None:
        """The error words read now, not an earlier copy: on a GPU a low-latency wait that ran out
        hands out zero counts and the step goes on without a host sync (`_check_peers` looks only
        at a copy already made), so its tokens would leave without the dead peer's rows. One
        small read, where the runner reads the tokens anyway."""
        self._raise_for(self._error.tolist())

    def _check_peers(self, synced: bool) -> None:
        """Raise `PeerTimeout` if a wait of this dispatcher ran out. `synced`: the kernels so far
        have finished (a CPU transport, or right after a host read); on a GPU otherwise only
        what an earlier, completed copy of the error words shows is looked at, never waited for."""
        self._raise_for(self._error_seen.read(synced))

    def _raise_for(self, error: list[int] | None) -> None:
        """Raise `PeerTimeout` naming the phase and peer if `error` (the error words) holds a record."""
        if error is None or error[0] == 0:
            return
        phase, where, seq = error[0], error[1], error[2]
        what, peer_of_word = PHASES.get(phase, (f"phase {phase}", None))
        layout = self._layout
        peer = where if peer_of_word is None else peer_of_word(where % layout.groups, layout.ep, layout.local_experts)
        raise PeerTimeout(
            f"rank {self.heap.rank}: no word from rank {peer} for {self.timeout_s:g} s in {what}, "
            f"sequence {seq}: that rank is dead, stalled, or running a different step"
        )

    def _layout_for(self, hidden: torch.Tensor, top_k: int) -> SymmetricLayout:
        """The buffer's layout, once this dispatch's rows are shown to be those it was allocated for."""
        if (hidden.shape[1], top_k, hidden.dtype) != (self.rows.hidden_size, self.rows.top_k, self.rows.dtype):
            raise ValueError(
                f"this dispatcher's buffer was allocated for {self.rows}; this dispatch brings hidden size "
                f"{hidden.shape[1]}, top-k {top_k}, {hidden.dtype} (they are fixed when the dispatcher is built)"
            )
        return self._layout

    def _words(self, rows: torch.Tensor) -> torch.Tensor:
        """rows `[N, H]` as int32 words `[N, W]`: the kernels copy bits, whatever the dtype."""
        if rows.device != self.device:
            raise ValueError(f"rows on {rows.device}; this dispatcher runs on {self.device}")
        row_bytes = rows.shape[1] * rows.element_size()
        if row_bytes % 4:
            raise ValueError(f"a row of {rows.shape[1]} {rows.dtype} is {row_bytes} bytes; need a multiple of 4")
        return rows.contiguous().view(torch.int32).view(rows.shape[0], row_bytes // 4)

    def _blocks(self, words: int) -> tuple[int, int]:
        return self._kernels.copy_tiles(words, self.device.type)

    def _next(self, counter: str) -> int:
        self._seq[counter] += 1
        return self._seq[counter]


def check_domain(nvlink_domain_size: int | None, ep: int) -> int:
    """The NVLink domain's size in ranks (None: the whole group), once shown to tile the group;
    `ALL_PUTS` (0) stands for itself."""
    if nvlink_domain_size is None:
        return ep
    if nvlink_domain_size == ALL_PUTS:
        return ALL_PUTS
    if nvlink_domain_size < 1 or ep % min(nvlink_domain_size, ep):
        raise ValueError(
            f"nvlink_domain_size={nvlink_domain_size} must divide ep_size={ep}, or be {ALL_PUTS} (every peer by puts)"
        )
    return min(nvlink_domain_size, ep)


def _default_heap(
    group: dist.ProcessGroup | None, device: torch.device, nbytes: int, domain: int, nvshmem_host: NvshmemHostChoice
) -> SymmetricHeap:
    """nbytes: the dispatcher's one buffer, which NVSHMEM's heap is sized for. A process builds one
    dispatcher for all its MoE layers (they take turns in one buffer), so that is all it allocates."""
    if choose_nvshmem_host(nvshmem_host, device) == "nvshmem4py":
        from moeserve.dispatch.symmetric.nvshmem4py_heap import Nvshmem4pyHeap

        return Nvshmem4pyHeap(group, device, planned_bytes=(nbytes,), nvlink_domain_size=domain)
    if device.type == "cuda":
        from moeserve.dispatch.symmetric.nvshmem_heap import NvshmemHeap

        return NvshmemHeap(group, device, planned_bytes=(nbytes,), nvlink_domain_size=domain)
    if not dist.is_initialized():
        from moeserve.dispatch.symmetric import EmulatedWorld

        return EmulatedWorld(1, device).heaps[0]  # one rank, no process group: nothing to share
    from moeserve.dispatch.symmetric.shm import SharedMemoryHeap

    return SharedMemoryHeap(group)


class _ErrorMirror:
    """A host copy of a dispatcher's error words, read without stalling a GPU: each look starts
    a non-blocking copy and reads only a copy that has already completed."""

    def __init__(self, error: torch.Tensor) -> None:
        self._error = error
        self._cuda = error.device.type == "cuda"
        self._host = torch.zeros(4, dtype=torch.int64, pin_memory=self._cuda)
        self._copied = torch.cuda.Event() if self._cuda else None
        self._pending = False

    def read(self, synced: bool) -> list[int] | None:
        if not self._cuda or synced:
            return self._error.tolist()
        seen = None
        if self._pending and self._copied.query():
            seen, self._pending = self._host.tolist(), False
        if not self._pending:
            self._host.copy_(self._error, non_blocking=True)
            self._copied.record()
            self._pending = True
        return seen
