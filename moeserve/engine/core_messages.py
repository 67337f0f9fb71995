"""What the API process and the engine core process say to each other, as msgpack frames.

One frame each way per turn of the core's loop, not one per request: the frontend sends every
command it gathered since its last frame (`CoreInputs`), the core answers with everything one
step made and what became of those commands (`CoreOutputs`). msgpack, not pickle: these frames
cross the process boundary hundreds of times a second, and plain lists and numbers are all they
hold. Only the start-up config, sent once, is pickled (`core_process.py`).

Commands are applied in the order sent, so an abort and a new request reusing its id never swap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.dispatch.wire import WireVolume
from moeserve.engine.core import CoreRequest, CoreStep, FinishedSequence, SchedulerStats
from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.executor.healing import HealReport, RejoinReport
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import QueueFullError, SLORejectedError
from moeserve.scheduler.block_groups import GroupBlocks
from moeserve.spec_decode.stats import SpecDecodeStats
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_STRUCTURED = _PARAM_FIELDS.index("structured_outputs")
_SLO = _PARAM_FIELDS.index("slo")
_KV_TRANSFER = _PARAM_FIELDS.index("kv_transfer")

# Command tags in a `CoreInputs` frame.
_ADD, _ABORT, _FINISH, _SHUTDOWN = "add", "abort", "finish", "shutdown"
# Exceptions an add may be refused with, by name: the client re-raises the same type.
_REFUSALS: dict[str, type[Exception]] = {
    "QueueFullError": QueueFullError,
    "SLORejectedError": SLORejectedError,
    "ValueError": ValueError,
}


@dataclass(frozen=True)
class Add:
    """Queue the samples of one client request, all or none; answered in `accepted` or `refused`."""

    key: str
    samples: list[CoreRequest]


@dataclass(frozen=True)
class Abort:
    sequence_ids: list[str]


@dataclass(frozen=True)
class Finish:
    stops: dict[str, str]
    """Sequence id -> the stop string its text matched in the frontend."""


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, stop the executor and exit 0."""


Command = Add | Abort | Finish | Shutdown


@dataclass
class CoreInputs:
    commands: list[Command] = field(default_factory=list)


@dataclass
class CoreOutputs:
    """One turn of the core's loop: answers to the commands it read, the step it ran (if any),
    the scheduler's gauges after both, and why it stops, if it does."""

    gauges: SchedulerStats
    accepted: list[str] = field(default_factory=list)
    refused: list[tuple[str, str, str]] = field(default_factory=list)
    """(add key, exception type name, message)."""
    step: CoreStep | None = None
    dead: str | None = None
    """Set on the last frame of a core that failed: the reason, for the server's log and clients."""
    stopped: bool = False
    """Set on the last frame after a `Shutdown`."""
    retry_after_s: dict[str, int] = field(default_factory=dict)
    """Add key -> seconds to wait, for refusals that say (`SLORejectedError`)."""
    best_effort: dict[str, float] = field(default_factory=dict)
    """Accepted add key -> its predicted TTFT, where SLO admission took it as best effort."""


def refusal(kind: str, message: str, retry_after_s: int | None = None) -> Exception:
    """The exception a refused add raises in the client: the core's own type where it is known."""
    if kind == "SLORejectedError" and retry_after_s is not None:
        return SLORejectedError(message, retry_after_s)
    return _REFUSALS.get(kind, RuntimeError)(message)


# ---- encoding ------------------------------------------------------------------------------


def _params(p: SamplingParams) -> list[Any]:
    values = [getattr(p, name) for name in _PARAM_FIELDS]
    if p.structured_outputs is not None:  # a (kind, spec) pair on the wire; SamplingParams takes it back
        values[_STRUCTURED] = dataclasses.astuple(p.structured_outputs)
    if p.slo is not None:  # a (ttft_s, tbt_s, label) triple on the wire
        values[_SLO] = dataclasses.astuple(p.slo)
    if p.kv_transfer is not None:  # a (transfer_id, remote) pair on the wire
        values[_KV_TRANSFER] = dataclasses.astuple(p.kv_transfer)
    return values


def encode_inputs(inputs: CoreInputs) -> bytes:
    frame = []
    for c in inputs.commands:
        if isinstance(c, Add):
            samples = [[s.request_id, s.prompt_token_ids, _params(s.params), s.arrival_time] for s in c.samples]
            frame.append([_ADD, c.key, samples])
        elif isinstance(c, Abort):
            frame.append([_ABORT, c.sequence_ids])
        elif isinstance(c, Finish):
            frame.append([_FINISH, c.stops])
        else:
            frame.append([_SHUTDOWN])
    return msgpack.packb(frame)


def decode_inputs(data: bytes) -> CoreInputs:
    commands: list[Command] = []
    for entry in msgpack.unpackb(data, strict_map_key=False):
        tag = entry[0]
        if tag == _ADD:
            samples = [
                CoreRequest(rid, ids, SamplingParams(**dict(zip(_PARAM_FIELDS, params))), arrival)
                for rid, ids, params, arrival in entry[2]
            ]
            commands.append(Add(entry[1], samples))
        elif tag == _ABORT:
            commands.append(Abort(entry[1]))
        elif tag == _FINISH:
            commands.append(Finish(entry[1]))
        elif tag == _SHUTDOWN:
            commands.append(Shutdown())
        else:
            raise ValueError(f"unknown engine core command {tag!r}")
    return CoreInputs(commands)


def _token(t: SampledToken) -> list[Any]:
    """[id], or [id, logprob, top, accepted drafts, their logprobs] (the plain token, by far the
    commonest, short)."""
    if t.logprob is None and not t.accepted_draft_ids:
        return [t.token_id]
    drafts_logprobs = [[lp, [list(pair) for pair in top]] for lp, top in t.accepted_draft_logprobs]
    top = [list(pair) for pair in t.top_logprobs]
    return [t.token_id, t.logprob, top, list(t.accepted_draft_ids), drafts_logprobs]


def _untoken(entry: list[Any]) -> SampledToken:
    if len(entry) == 1:
        return SampledToken(entry[0])
    token_id, logprob, top, drafts, drafts_logprobs = entry
    return SampledToken(
        token_id,
        logprob,
        _pairs(top),
        tuple(drafts),
        tuple((lp, _pairs(draft_top)) for lp, draft_top in drafts_logprobs),
    )


def _pairs(entry: list[list[Any]]) -> tuple[tuple[int, float], ...]:
    return tuple((a, b) for a, b in entry)


def _rebalance(r: RebalanceReport) -> list[Any]:
    return [
        r.step,
        list(r.imbalance_before),
        list(r.imbalance_after),
        r.experts_moved,
        r.bytes_moved,
        r.balance_s,
        r.transfer_s,
    ]


def _unrebalance(entry: list[Any]) -> RebalanceReport:
    step, before, after, experts, moved_bytes, balance_s, transfer_s = entry
    return RebalanceReport(step, tuple(before), tuple(after), experts, moved_bytes, balance_s, transfer_s)


def _heal(h: HealReport) -> list[Any]:
    values = dataclasses.astuple(h)
    return [list(v) if isinstance(v, tuple) else v for v in values]


def _unheal(entry: list[Any]) -> HealReport:
    return HealReport(*(tuple(v) if isinstance(v, list) else v for v in entry))


def _rejoin(r: RejoinReport) -> list[Any]:
    return [list(r.ranks), *dataclasses.astuple(r)[1:]]


def _unrejoin(entry: list[Any]) -> RejoinReport:
    return RejoinReport(tuple(entry[0]), *entry[1:])


def _gauges(values: list[Any]) -> SchedulerStats:
    """`SchedulerStats` from its msgpack array (its last field, the groups' usage, as arrays)."""
    *counts, groups = values
    return SchedulerStats(*counts, tuple(GroupBlocks(*g) for g in groups))


def _step(s: CoreStep) -> list[Any]:
    routed = None
    if s.routed_tokens is not None:
        r = s.routed_tokens
        wire = None if r.wire is None else list(dataclasses.astuple(r.wire))
        routed = [r.counts, r.rank_rows, list(r.layers), wire]
    return [
        {rid: _token(t) for rid, t in s.sampled.items()},
        [[f.request_id, f.finish_reason, f.stop_reason] for f in s.finished],
        s.first_scheduled,
        s.time,
        s.step_duration_s,
        s.num_preemptions,
        dataclasses.astuple(s.scheduler),
        routed,
        [_rebalance(r) for r in s.rebalances],
        s.prefix_cache_queries,
        s.prefix_cache_hits,
        {rid: [p.start, p.logprobs, p.ranks, p.top] for rid, p in s.prompt_logprobs.items()},
        [_heal(h) for h in s.heals],
        [_rejoin(r) for r in s.rejoins],
        None if s.spec_decode is None else s.spec_decode.to_list(),
    ]


def _unstep(entry: list[Any]) -> CoreStep:
    (
        sampled,
        finished,
        first_scheduled,
        time,
        duration,
        preemptions,
        gauges,
        routed,
        rebalances,
        queries,
        hits,
        prompt,
        heals,
        rejoins,
        spec_decode,
    ) = entry
    routed_tokens = None
    if routed is not None:
        counts, rank_rows, layers, wire = routed
        routed_tokens = RoutedTokens(counts, rank_rows, tuple(layers), None if wire is None else WireVolume(*wire))
    return CoreStep(
        sampled={rid: _untoken(t) for rid, t in sampled.items()},
        finished=[FinishedSequence(*f) for f in finished],
        first_scheduled=first_scheduled,
        time=time,
        step_duration_s=duration,
        num_preemptions=preemptions,
        scheduler=_gauges(gauges),
        routed_tokens=routed_tokens,
        rebalances=[_unrebalance(r) for r in rebalances],
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prompt_logprobs={
            rid: PromptLogprobs(start, logprobs, ranks, [[(a, b) for a, b in row] for row in top])
            for rid, (start, logprobs, ranks, top) in prompt.items()
        },
        heals=[_unheal(h) for h in heals],
        rejoins=[_unrejoin(r) for r in rejoins],
        spec_decode=None if spec_decode is None else SpecDecodeStats.from_list(spec_decode),
    )


def encode_outputs(out: CoreOutputs) -> bytes:
    step = None if out.step is None else _step(out.step)
    frame = [
        dataclasses.astuple(out.gauges),
        out.accepted,
        out.refused,
        step,
        out.dead,
        out.stopped,
        out.retry_after_s,
        out.best_effort,
    ]
    return msgpack.packb(frame)


def decode_outputs(data: bytes) -> CoreOutputs:
    frame = msgpack.unpackb(data, strict_map_key=False)
    gauges, accepted, refused, step, dead, stopped, retry_after_s, best_effort = frame
    return CoreOutputs(
        gauges=_gauges(gauges),
        accepted=accepted,
        refused=[tuple(r) for r in refused],
        step=None if step is None else _unstep(step),
        dead=dead,
        stopped=stopped,
        retry_after_s=retry_after_s,
        best_effort=best_effort,
    )
