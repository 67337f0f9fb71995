"""The engine's executor over rank processes: one process per expert-parallel rank.

Node 0 runs the engine (schedulers, detokenizer, API) and no model. It hosts the rendezvous
store, starts its node's ranks, waits until every rank (its own and other nodes') has loaded
its share, then drives them in lockstep: each step it publishes every group's plan, as the
schedulers made it, and collects one answer per rank. The plan is all the ranks learn of
requests: a request's sampling data comes with its first plan, its id with the plan after it
finished; in between the sampling rank appends its own tokens, exactly as the scheduler does.

A lost rank (exited, killed, stalled, unreachable) ends the executor: `failure` is set, the
listeners are told, node 0's ranks are stopped, and a step in flight raises `WorkerLostError`
within `POLL_S`, so nothing waits for a collective to time out.

With `--on-rank-failure heal` (and at least `--min-ranks` left) a loss raises `RanksLostError`
instead, and the engine core calls `heal`: the lost ranks are fenced (SIGKILL: a frozen rank
must never come back into a group that went on without it, and its closed sockets break the
survivors out of any collective it was part of), the survivors form process group generation
g + 1 over the same store, each computes the new expert map and fills its new slots, and the
executor steps on with fewer groups. Each stage is bounded and logged. Node 0 then restarts
each lost rank (`--rank-restarts`, `executor.returning`); once one has loaded, `rejoin` takes it
back at the engine's next step: generation g + 2 with it appended, its expert slots back from
the others (`eplb.survivors`), and one more data-parallel group.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence

import torch

from moeserve.config import EngineConfig, ModelConfig
from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.dispatch.wire import WireVolume, dispatch_row_bytes
from moeserve.distributed.channel import ControlServer
from moeserve.distributed.launcher import start_rank, start_ranks, stop_ranks
from moeserve.distributed.messages import (
    LoadReport,
    Regroup,
    RegroupDone,
    Shutdown,
    StepBitmask,
    StepFailed,
    StepInput,
    StepOutput,
    Sync,
    SyncAck,
    WorkerSpec,
)
from moeserve.distributed.monitor import Loss, RankMonitor
from moeserve.distributed.node_network import use_node_network
from moeserve.distributed.node_watch import Beacon
from moeserve.distributed.processes import ChildProcess
from moeserve.distributed.rendezvous import BEACON_KEY, CONTROL_KEY, GENERATION_KEY, SPEC_KEY, host_store, put
from moeserve.eplb import RebalanceReport
from moeserve.eplb.record import LoadRecord
from moeserve.executor.base import Executor
from moeserve.executor.healing import HealReport, RanksLostError, RejoinReport
from moeserve.executor.returning import ReturningRanks
from moeserve.kv_transfer.agent import KvRegistration
from moeserve.kv_transfer.rank_writer import KvWriter, RankWriter
from moeserve.scheduler import StepPlan
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken
from moeserve.worker.sampling_metadata import PendingBitmask

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiting node 0 checks whether a rank was lost
FENCE_S = 5.0  # a SIGKILLed rank is reaped within this, or the heal fails
HEAL_S = 60.0  # the ranks regroup and recover their experts within this, or the heal (or rejoin) fails
SUBSCRIBE_S = 10.0  # a returned rank answers on the control channel within this, or it is restarted again


class WorkerLostError(RuntimeError):
    """A rank is gone; the engine cannot run another step."""


class MultiprocessExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        num_kv_blocks: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        p = config.parallel
        self.parallel = p
        self.num_groups = p.num_dp_groups
        self.num_kv_blocks = num_kv_blocks
        self.failure: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # orders a loss against listener registration
        self._moe_layers = model_config.moe_layer_indices
        self._step = 0
        self._routed: dict[int, list[list[int]]] = {}  # rank -> its `logical_rows` since last taken
        self._wire: dict[int, list[int]] = {}  # rank -> rows it dispatched to each rank since last taken
        self._row_bytes = (
            dispatch_row_bytes(model_config.hidden_size, dtype, p.dispatch_fp8),
            model_config.hidden_size * dtype.itemsize,
            p.load_store_ranks,  # which rows cross the NIC (`WireVolume.link`)
        )
        self._routing_wanted = False  # ask the ranks for their expert load with the next step
        self._load_record = None
        if p.eplb.record_expert_load is not None:
            self._load_record = LoadRecord(p.eplb.record_expert_load, model_config.num_experts, self._moe_layers)
        self.rebalances: list[RebalanceReport] = []  # every live rebalance so far, as rank 0 reported it
        self._untaken_rebalances: list[RebalanceReport] = []  # the tail of `rebalances` not yet taken
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}  # from the sampling ranks, not yet taken
        self._closed = False
        self._monitor: RankMonitor | None = None
        self.members = list(range(p.ep))
        """The live ranks as launched, in the order of their ranks in the current process group."""
        self._generation = 0  # of the ranks' process group: one more with each heal and each rejoin
        self._loss: RanksLostError | None = None  # a loss to heal, raised by the next step
        self._step_failed: tuple[float, StepFailed] | None = None  # the first rank that said its step failed
        self._kv_registrations: dict[int, KvRegistration] = {}  # rank -> its KV cache, with --kv-transfer
        self._kv_writers: dict[int, str] = {}  # rank -> its write side channel, with --role prefill

        network = use_node_network(p)  # first: a node that cannot work refuses before it starts anything
        self._store = host_store(p.master_port, p.ep, p.startup_timeout_s)
        node0_addr = "127.0.0.1" if p.nnodes == 1 else p.master_addr  # how the ranks reach this store
        # Across nodes the channel and the beacon listen on the address the other nodes reach this
        # one by (`node_network`), the one gloo/NCCL use too.
        channel_host = "127.0.0.1" if network is None else network.address
        self._channel = ControlServer(channel_host, channel_host)
        self._beacon = None if network is None else Beacon(channel_host, channel_host)
        put(
            self._store,
            SPEC_KEY,
            WorkerSpec(
                model=config.model,
                dtype=dtype,
                device=config.device,
                parallel=p,
                block_size=config.cache.block_size,
                num_kv_blocks=num_kv_blocks,
                eos_token_ids=tuple(eos_token_ids),
                seed=config.seed,
                kernels=config.kernels,
                indexer_key_dtype=config.indexer_key_dtype,
                cuda_graphs=config.cuda_graphs,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len or model_config.max_position_embeddings,
                mtp_drafts=config.mtp_drafts,
                draft_states=config.draft_states,
                saved_states=config.num_saved_states,
                kv_transfer=config.kv_transfer.enabled,
                kv_write_host=config.kv_transfer.host if config.kv_transfer.role == "prefill" else "",
            ),
        )
        put(self._store, CONTROL_KEY, self._channel.addresses)
        put(self._store, GENERATION_KEY, 0)
        if self._beacon is not None:
            put(self._store, BEACON_KEY, self._beacon.address)
        logger.info(
            "rendezvous at %s:%d: %d ranks on %d node(s), %d data-parallel group(s) of tp=%d",
            node0_addr,
            self._store.port,
            p.ep,
            p.nnodes,
            p.num_dp_groups,
            p.tp,
        )
        self._procs = start_ranks(p, node0_addr, self._store.port, node_rank=0, watch_parent=True)
        self._returning = ReturningRanks(p.rank_restarts, p.startup_timeout_s, self._store, self._restart_rank)
        atexit.register(self.shutdown)
        self._monitor = RankMonitor(self._store, p, self._procs, self._lost)
        try:
            self._wait_loaded()
            self._synchronize()
            if self._beacon is not None:
                self._beacon.serving()
        except BaseException:
            self.shutdown()
            raise

    # ---- failure ---------------------------------------------------------------------------

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` is called once, from the monitor's thread, if a rank is lost (at
        once if one already was)."""
        with self._lock:
            if self.failure is None:
                self._listeners.append(listener)
                return
        listener(self.failure)

    def rank_pids(self) -> dict[int, int]:
        """This node's live ranks (as launched) -> their process ids."""
        return {m: p.pid for m, p in self._procs.items() if m in self.members}

    @property
    def world(self) -> int:
        """Ranks in the current process group (`ep` until a heal)."""
        return len(self.members)

    def _lost(self, loss: Loss) -> None:
        """From the monitor's thread: heal at the next step if the policy allows, else stop."""
        left = [m for m in self.members if m not in loss.ranks]
        p = self.parallel
        if p.on_rank_failure == "heal" and loss.ranks and len(left) >= p.min_ranks:
            logger.error("lost rank(s) %s: %s; healing", ", ".join(map(str, loss.ranks)), loss.reason)
            self._loss = RanksLostError(loss.reason, loss.ranks, time.monotonic())
            return
        if p.on_rank_failure == "heal" and loss.ranks:
            loss = Loss(f"{loss.reason}; {len(left)} rank(s) left, fewer than --min-ranks {p.min_ranks}", loss.ranks)
        self._fail(loss.reason)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            listeners = list(self._listeners)
        logger.error("lost a rank: %s; the engine cannot continue", reason)
        if self._monitor is not None:
            self._monitor.stop()
        stop_ranks(self._procs, grace_s=2.0)
        for listener in listeners:
            try:
                listener(reason)
            except Exception:
                logger.exception("failure listener failed")

    def _check(self) -> None:
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        if self._loss is not None:
            raise self._loss
        if self._step_failed is not None:
            since, failed = self._step_failed
            # A peer's loss shows in the monitor within a poll and its settling time; a step that
            # failed with every rank still alive is a failure of its own, and the end.
            if time.monotonic() - since > self.parallel.heartbeat_timeout_s + 1.0:
                self._fail(f"rank {failed.rank} failed step {failed.step}: {failed.error}")
                raise WorkerLostError(self.failure)

    # ---- start-up --------------------------------------------------------------------------

    def _wait_loaded(self) -> None:
        """Every rank's load report; the first failure ends the start-up with its reason."""
        reports: dict[int, LoadReport] = {}
        started = last_note = time.monotonic()
        while len(reports) < self.parallel.ep:
            self._check()
            message = self._channel.receive(POLL_S)
            if isinstance(message, LoadReport):
                if message.error is not None:
                    raise RuntimeError(
                        f"rank {message.rank} (node {message.node_rank}) could not load the model: {message.error}"
                    )
                reports[message.rank] = message
                if message.kv_registration is not None:
                    self._kv_registrations[message.rank] = message.kv_registration
                if message.kv_writer is not None:
                    self._kv_writers[message.rank] = message.kv_writer
            now = time.monotonic()
            if now - last_note > 10.0:
                logger.info(
                    "waiting for ranks to load: %d/%d ready after %.0f s", len(reports), self.parallel.ep, now - started
                )
                last_note = now
        total_experts = sum(r.expert_bytes for r in reports.values())
        for rank in sorted(reports):
            r = reports[rank]
            logger.info(
                "rank %d (node %d, %s pid %d): %d experts, %.1f MiB of expert weights (%.0f%% of all %.1f MiB), "
                "%.1f MiB of other weights, %.1f MiB of KV cache, %s all-to-all, decode graphs %s",
                rank,
                r.node_rank,
                r.host,
                r.pid,
                r.num_local_experts,
                r.expert_bytes / 2**20,
                100.0 * r.expert_bytes / max(total_experts, 1),
                total_experts / 2**20,
                r.other_bytes / 2**20,
                r.kv_bytes / 2**20,
                r.dispatcher,
                list(r.decode_graph_sizes) or "off",
            )

    def _synchronize(self) -> None:
        """Publish until every rank has answered: then every subscription is live."""
        acked: set[int] = set()
        deadline = time.monotonic() + self.parallel.startup_timeout_s
        while len(acked) < self.parallel.ep:
            self._check()
            if time.monotonic() > deadline:
                raise WorkerLostError(
                    f"ranks {sorted(set(range(self.parallel.ep)) - acked)} never answered on the control channel"
                )
            self._channel.publish(Sync())
            message = self._channel.receive(POLL_S)
            while message is not None:
                if isinstance(message, SyncAck):
                    acked.add(message.rank)
                message = self._channel.receive(0.0)

    # ---- steps -----------------------------------------------------------------------------

    def execute(
        self, plan: StepPlan, token_bitmask: PendingBitmask | None = None, *, profile: bool = False
    ) -> dict[str, SampledToken]:
        """Publish the plan, then the grammar bitmask once filled (the ranks run the forward
        meanwhile); an idle plan (nothing to run, no finished ids) is not worth a step."""
        self._check()
        if plan.is_idle:
            return {}
        self._step += 1
        follows = token_bitmask is not None
        wanted = self._routing_wanted and not profile  # a profile step reports no load: the next does
        self._channel.publish(StepInput(self._step, plan.groups, wanted, follows, profile))
        if wanted:
            self._routing_wanted = False
        if token_bitmask is not None:
            self._channel.publish(StepBitmask(self._step, token_bitmask.get()))
        return self._collect(self._step)

    def _collect(self, step: int) -> dict[str, SampledToken]:
        sampled: dict[str, SampledToken] = {}
        pending = set(range(self.world))
        deadline = time.monotonic() + self.parallel.collective_timeout_s
        while pending:
            message = self._receive(POLL_S)
            self._check()
            if message is None:
                if time.monotonic() > deadline:
                    raise WorkerLostError(
                        f"ranks {sorted(pending)} did not finish step {step} within "
                        f"{self.parallel.collective_timeout_s:.0f} s"
                    )
                continue
            if isinstance(message, StepFailed) and message.step == step and self._step_failed is None:
                logger.warning("rank %d: step %d failed: %s", message.rank, message.step, message.error)
                self._step_failed = (time.monotonic(), message)
                continue
            if not isinstance(message, StepOutput) or message.step != step:
                continue  # a late Sync answer
            pending.discard(message.rank)
            sampled.update(message.sampled)
            for request_id, chunk in message.prompt_logprobs.items():
                earlier = self._prompt_logprobs.get(request_id)
                self._prompt_logprobs[request_id] = chunk if earlier is None else earlier.followed_by(chunk)
            if message.routed_tokens is not None:
                self._add_routed(message.rank, message.routed_tokens)
            if message.dispatch_rows is not None:
                known = self._wire.setdefault(message.rank, [0] * self.world)
                self._wire[message.rank] = [a + b for a, b in zip(known, message.dispatch_rows)]
            if message.rebalance is not None:
                self.rebalances.append(message.rebalance)
                self._untaken_rebalances.append(message.rebalance)
                logger.info("%s", message.rebalance.describe())
        return sampled

    def _add_routed(self, rank: int, per_layer: list[list[int]]) -> None:
        """per_layer `[i][e]`: rows the rank's slots received per logical expert (the rank maps
        its slots itself, under the expert map they held when the rows were counted)."""
        known = self._routed.get(rank)
        if known is None:
            self._routed[rank] = per_layer
            return
        for total, counts in zip(known, per_layer):
            for e, rows in enumerate(counts):
                total[e] += rows

    def ask_routed_tokens(self) -> None:
        self._routing_wanted = True

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        taken, self._prompt_logprobs = self._prompt_logprobs, {}
        return taken

    def take_rebalances(self) -> list[RebalanceReport]:
        taken, self._untaken_rebalances = self._untaken_rebalances, []
        return taken

    def take_routed_tokens(self) -> RoutedTokens | None:
        """What the ranks reported since the last call: every step up to the last one that asked
        (`ask_routed_tokens`) or rebalanced; None until every rank has reported."""
        routed, self._routed = self._routed, {}
        wire_rows, self._wire = self._wire, {}
        if len(routed) < self.world:
            return None
        wire = None
        if len(wire_rows) == self.world:
            wire = WireVolume([wire_rows[r] for r in range(self.world)], *self._row_bytes)
        tokens = RoutedTokens.from_ranks([routed[r] for r in range(self.world)], self._moe_layers, wire)
        if self._load_record is not None:
            self._load_record.add(tokens.counts)
        return tokens

    # ---- healing (`--on-rank-failure heal`) -------------------------------------------------

    def heal(self, lost: RanksLostError) -> HealReport:
        """Fence the lost ranks, regroup the survivors, have them recover the experts; the engine
        core requeues the requests. Raises `WorkerLostError` (the engine stops) if any stage fails
        or overruns its bound."""
        aborted = time.monotonic()
        lost_groups = tuple(self.members.index(m) for m in lost.lost if m in self.members)
        survivors = tuple(g for g, m in enumerate(self.members) if m not in lost.lost)
        members = tuple(self.members[g] for g in survivors)
        try:
            self._fence(lost.lost)
            fenced = time.monotonic()
            answers = self._regroup(Regroup(self._generation + 1, members, survivors, forget_requests=True))
        except WorkerLostError as exc:
            self._fail(f"{lost.reason}; the heal failed: {exc}")
            raise WorkerLostError(self.failure) from exc
        self.members = list(members)
        self.num_groups = len(members)
        self._loss = self._step_failed = None
        self._routed, self._wire = {}, {}  # counted under the old group; the ranks dropped theirs too
        slowest_regroup = max(a.regroup_s for a in answers)
        report = HealReport(
            lost_ranks=tuple(lost.lost),
            reason=lost.reason,
            ranks_left=len(members),
            generation=self._generation,
            lost_groups=lost_groups,
            detected_at=lost.detected_at,
            abort_s=aborted - lost.detected_at,
            fence_s=fenced - aborted + slowest_regroup,
            experts_s=max(a.experts_s for a in answers),
            peer_slots=sum(a.peer_slots for a in answers),
            checkpoint_slots=sum(a.checkpoint_slots for a in answers),
            recovered_bytes=sum(a.peer_bytes + a.checkpoint_bytes for a in answers),
        )
        logger.info(
            "process group generation %d: %d ranks (%s); slowest regroup %.3f s, slowest expert recovery %.3f s",
            self._generation,
            len(members),
            ", ".join(map(str, members)),
            slowest_regroup,
            report.experts_s,
        )
        self._monitor = self._watch(members)
        for member in lost.lost:
            self._returning.restart(member)
        return report

    def _watch(self, members: tuple[int, ...]) -> RankMonitor:
        return RankMonitor(
            self._store, self.parallel, {m: p for m, p in self._procs.items() if m in members}, self._lost, members
        )

    def _regroup(self, message: Regroup) -> list[RegroupDone]:
        """Publish `message` (the store's generation first: a rank restarted from now on knows
        it comes back) and collect every member's answer."""
        self._generation = message.generation
        put(self._store, GENERATION_KEY, message.generation)
        self._channel.publish(message)
        return self._await_regroup(message.members)

    def _restart_rank(self, member: int) -> ChildProcess:
        """A lost rank's process again, with its launch flags (one node: its local rank is its rank)."""
        proc = start_rank(member, member, "127.0.0.1", self._store.port, 0, watch_parent=True)
        self._procs[member] = proc
        return proc

    def _receive(self, timeout_s: float) -> object | None:
        """The next control message, a restarted rank's load report noted on the way."""
        message = self._channel.receive(timeout_s)
        if isinstance(message, LoadReport):
            self._returning.note(message)
        return message

    def rejoin(self) -> RejoinReport | None:
        """Between two steps: take the restarted ranks that have loaded back into the group (None
        if none is ready). They are appended to the members, so the others keep their group
        ranks, requests and KV caches; the new map gives them their share of the expert slots
        back, copied from the others. Raises `WorkerLostError` (the engine stops) if the group
        fails midway."""
        if not self._returning.pending or self.failure is not None or self._loss is not None:
            return None
        while self._receive(0.0) is not None:
            pass
        ready = self._returning.ready()
        if not ready:
            return None
        started = time.monotonic()
        subscribed = self._await_subscribed(tuple(r.member for r in ready))
        if not subscribed:
            return None
        newcomers = tuple(r.member for r in ready if r.member in subscribed)
        members = (*self.members, *newcomers)
        previous = (*range(len(self.members)), *(None for _ in newcomers))
        self._monitor.stop()
        try:
            answers = self._regroup(Regroup(self._generation + 1, members, previous, forget_requests=False))
        except WorkerLostError as exc:
            self._fail(f"restarted rank(s) {', '.join(map(str, newcomers))} could not rejoin: {exc}")
            raise WorkerLostError(self.failure) from exc
        done = time.monotonic()
        self._returning.taken(newcomers)
        self.members, self.num_groups = list(members), len(members)
        self._routed, self._wire = {}, {}  # counted under the old group; the ranks dropped theirs too
        restarted_at = min(r.started_at for r in ready if r.member in newcomers)
        loaded_at = max(r.loaded_at or started for r in ready if r.member in newcomers)
        report = RejoinReport(
            ranks=newcomers,
            ranks_now=len(members),
            generation=self._generation,
            restarted_at=restarted_at,
            load_s=loaded_at - restarted_at,
            wait_s=started - loaded_at,
            regroup_s=max(a.regroup_s for a in answers),
            experts_s=max(a.experts_s for a in answers),
            peer_slots=sum(a.peer_slots for a in answers),
            checkpoint_slots=sum(a.checkpoint_slots for a in answers),
            moved_bytes=sum(a.peer_bytes + a.checkpoint_bytes for a in answers),
            pause_s=done - started,
            total_s=done - restarted_at,
        )
        logger.info("%s", report.describe())
        self._monitor = self._watch(members)
        return report

    def _await_subscribed(self, members: tuple[int, ...]) -> set[int]:
        """Publish `Sync` until the restarted `members` answer it (a subscriber hears only what
        is published after it connected); one that does not within `SUBSCRIBE_S` is restarted."""
        acked: set[int] = set()
        deadline = time.monotonic() + SUBSCRIBE_S
        while len(acked) < len(members) and time.monotonic() < deadline:
            self._channel.publish(Sync())
            message = self._receive(POLL_S)
            while message is not None:
                if isinstance(message, SyncAck) and message.member in members:
                    acked.add(message.member)
                message = self._receive(0.0)
        for member in set(members) - acked:
            self._returning.retry(member, f"did not answer on the control channel within {SUBSCRIBE_S:.0f} s")
        return acked

    def _fence(self, lost: tuple[int, ...]) -> None:
        """SIGKILL and reap the lost ranks of this node (a frozen one included)."""
        started = time.monotonic()
        for member in lost:
            proc = self._procs.get(member)
            if proc is None:
                raise WorkerLostError(f"rank {member} runs on another node, which cannot be fenced from here")
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for member in lost:
            try:
                self._procs[member].wait(FENCE_S)
            except Exception as exc:  # noqa: BLE001 - a process that outlives SIGKILL is the kernel's problem
                raise WorkerLostError(f"rank {member} did not die within {FENCE_S:.0f} s of SIGKILL") from exc
        logger.info("fenced rank(s) %s in %.3f s", ", ".join(map(str, lost)), time.monotonic() - started)

    def _await_regroup(self, members: tuple[int, ...]) -> list[RegroupDone]:
        answers: dict[int, RegroupDone] = {}
        deadline = time.monotonic() + HEAL_S
        while len(answers) < len(members):
            for member in members:
                proc = self._procs.get(member)
                if proc is not None and proc.poll() is not None:
                    raise WorkerLostError(f"rank {member} died while regrouping")
            if time.monotonic() > deadline:
                missing = sorted(set(members) - set(answers))
                raise WorkerLostError(f"rank(s) {missing} did not regroup within {HEAL_S:.0f} s")
            message = self._receive(POLL_S)
            if not isinstance(message, RegroupDone) or message.generation != self._generation:
                continue  # what the lost step left in flight
            if message.error is not None:
                raise WorkerLostError(f"rank {message.member} could not regroup: {message.error}")
            answers[message.member] = message
        return [answers[m] for m in members]

    # ---- shutdown --------------------------------------------------------------------------

    def kv_registrations(self) -> list[KvRegistration]:
        """Group g's cache is its first rank's (tp > 1 is refused with --kv-transfer)."""
        if len(self._kv_registrations) < self.parallel.ep:
            raise ValueError("the ranks' KV caches were not registered for transfers (no --kv-transfer)")
        return [self._kv_registrations[g * self.parallel.tp] for g in range(self.num_groups)]

    def kv_writers(self) -> list[KvWriter]:
        """Group g's pushes are written by its first rank, which holds its cache (`--role prefill`)."""
        if len(self._kv_writers) < self.num_groups:
            raise ValueError("the ranks serve no KV writes (not --role prefill)")
        return [RankWriter(self._kv_writers[g * self.parallel.tp]) for g in range(self.num_groups)]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._load_record is not None:
            self._load_record.save()
        if self._monitor is not None:
            self._monitor.stop()
        if self._beacon is not None:
            self._beacon.leave(self.failure is None, self.failure or "node 0 stopped")
        if self.failure is None:
            self._channel.publish(Shutdown())
            deadline = time.monotonic() + 10.0
            while any(p.poll() is None for p in self._procs.values()) and time.monotonic() < deadline:
                time.sleep(0.05)
        stop_ranks(self._procs, grace_s=2.0)
        self._channel.close()
        logger.info("stopped %d rank process(es) on this node", len(self._procs))
