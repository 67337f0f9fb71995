"""Serving on top of the step cost: continuous batching, chunked prefill, a prefill/decode split
and MTP, simulated step by step on one attention-DP group, then scaled to the deployment.

Every DP group of every instance is taken to see the same load (arrivals split evenly), so one
group's simulation stands for all of them; the step time comes from `cost.step_cost` for that
rank's batch. Arrivals are `loadtest.arrivals` (Poisson by default), the percentiles and SLO
verdicts those of `loadtest.metrics`, so a plan reads like a `bench serve` report.

Simplifications, stated: every request has the same input and output length; a decode token's
context is the mean one, isl + osl / 2; KV transfer between prefill and decode is not timed;
with MTP a step yields E = 1 + a + a^2 + ... + a^n tokens on average (n drafts, acceptance a
each) at the cost of verifying n + 1 tokens per request, and the TBT of a token is the step
time over E.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

from moeserve.loadtest.arrivals import arrival_offsets
from moeserve.loadtest.metrics import LatencyStats, summarize
from moeserve.plan.cost import Layout, StepCost, Work, max_tokens_in_cache, step_cost
from moeserve.plan.hardware import Hardware
from moeserve.plan.shapes import ModelShape


@dataclass(frozen=True)
class Workload:
    isl: int = 1024
    osl: int = 1024
    rate: float | None = None
    """Requests/s over the whole deployment; None: `load` times what it can sustain."""
    load: float = 0.9
    mtp_drafts: int = 0
    mtp_acceptance: float = 0.0
    requests: int = 200
    seed: int = 0

    @property
    def tokens_per_step(self) -> float:
        """E: tokens a decode step yields per request."""
        return sum(self.mtp_acceptance**i for i in range(self.mtp_drafts + 1))

    @property
    def draft_states(self) -> int:
        """States a state layer keeps per sequence to step back past rejected drafts: one after
        each token of a verify step (`EngineConfig.draft_states`), none without MTP."""
        return self.mtp_drafts + 1 if self.mtp_drafts else 0

    def prompts_in(self, tokens: int) -> float:
        """Prompts a prefill chunk of `tokens` spans on average: it starts anywhere in a queue of
        isl-token prompts and crosses a boundary every isl tokens."""
        return 1 + tokens / self.isl if tokens else 0.0


@dataclass(frozen=True)
class Deployment:
    """The whole cluster: decode instances (and prefill ones when split), one EP group each.

    prefill None: prefill runs on the decode ranks, `chunk` tokens of it per step (chunked
    prefill). max_batch and chunk are per attention-DP group (of `tp` GPUs), as its scheduler
    sees them: requests decoded at once, prompt tokens prefilled a step."""

    decode: Layout
    decode_instances: int
    max_batch: int
    chunk: int
    prefill: Layout | None = None
    prefill_instances: int = 0

    @property
    def gpus(self) -> int:
        return self.decode.ep * self.decode_instances + (
            self.prefill.ep * self.prefill_instances if self.prefill else 0
        )

    def describe(self) -> str:
        d = f"EP{self.decode.ep} TP{self.decode.tp} DP{self.decode.dp}{' TBO' if self.decode.tbo else ''}"
        if self.prefill is None:
            return f"{self.decode_instances}x[{d}] colocated"
        p = f"EP{self.prefill.ep} TP{self.prefill.tp}{' TBO' if self.prefill.tbo else ''}"
        return f"P {self.prefill_instances}x[{p}] : D {self.decode_instances}x[{d}]"


class StepTimes:
    """Step seconds of one layout by (decode requests, prefill tokens), cached: a simulation asks
    for the same few shapes thousands of times."""

    def __init__(self, shape: ModelShape, hw: Hardware, layout: Layout, workload: Workload) -> None:
        self.shape, self.hw, self.layout, self.workload = shape, hw, layout, workload
        self.seconds = functools.lru_cache(maxsize=None)(self._seconds)

    def cost(self, decode: int, prefill: int) -> StepCost:
        """One DP group's step: `decode` requests (verifying n + 1 tokens each with MTP) and
        `prefill` prompt tokens, computed by its TP ranks together."""
        w = self.workload
        work = Work(
            decode_tokens=decode * (w.mtp_drafts + 1),
            decode_ctx=w.isl + w.osl / 2,
            prefill_tokens=prefill,
            prefill_ctx=w.isl / 2,
            decode_queries=w.mtp_drafts + 1,
            decode_restores=1 - w.mtp_acceptance**w.mtp_drafts if w.mtp_drafts else 0.0,
            prefill_seqs=w.prompts_in(prefill),
        )
        return step_cost(self.shape, self.hw, self.layout, work)

    def _seconds(self, decode: int, prefill: int) -> float:
        return self.cost(decode, prefill).seconds


@functools.lru_cache(maxsize=4096)
def step_times(shape: ModelShape, hw: Hardware, layout: Layout, workload: Workload) -> StepTimes:
    """One StepTimes per layout and workload, shared by the screen and the simulations."""
    return StepTimes(shape, hw, layout, workload)


@dataclass
class _Request:
    arrival: float
    prompt_left: int
    output_left: float
    first_token: float | None = None
    worst_gap: float = 0.0


@dataclass(frozen=True)
class RankRun:
    """What one simulated DP rank saw: per request TTFT (s), worst TBT gap, every token's TBT."""

    ttft: list[float]
    worst_tbt: list[float]
    tbt: list[float]
    duration_s: float
    output_tokens: float


def simulate_rank(
    times: StepTimes, offsets: list[float], max_batch: int, chunk: int, prompt: int, output: int, tokens_per_step: float
) -> RankRun:
    """Run one DP rank over its arrivals: each step decodes every running request (at most
    `max_batch`) and prefills up to `chunk` prompt tokens, first come first served, of requests
    that will fit the batch. A request's first token comes when its prompt is done; output=0
    runs prefill only (a prefill instance: the request leaves with its first token)."""
    pending = deque(_Request(t, prompt, output) for t in offsets)
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    done: list[_Request] = []
    tbt: list[float] = []
    now = 0.0
    while pending or waiting or running:
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        if not waiting and not running:
            now = pending[0].arrival
            continue
        budget, filling = chunk, []
        for r in waiting:
            take = min(budget, r.prompt_left)
            if (r.prompt_left and not take) or len(running) + len(filling) >= max_batch:
                break
            filling.append((r, take))
            budget -= take
        dt = times.seconds(len(running), chunk - budget)
        now += dt
        for r in running:
            gap = dt / tokens_per_step
            tbt.extend([gap] * max(1, round(min(tokens_per_step, r.output_left))))
            r.worst_gap = max(r.worst_gap, gap)
            r.output_left -= tokens_per_step
        finished = [r for r in running if r.output_left <= 0]
        running = [r for r in running if r.output_left > 0]
        for r, take in filling:
            r.prompt_left -= take
            if r.prompt_left == 0:
                waiting.remove(r)
                r.first_token = now
                r.output_left -= 1
                (running if r.output_left > 0 else finished).append(r)
        done.extend(finished)
    start = offsets[0] if offsets else 0.0
    return RankRun(
        [r.first_token - r.arrival for r in done],
        [r.worst_gap for r in done],
        tbt,
        now - start,
        len(done) * output,
    )


@dataclass(frozen=True)
class ServingResult:
    deployment: Deployment
    rate: float
    """Requests/s offered to the deployment."""
    tok_s_per_gpu: float
    ttft_s: LatencyStats
    tbt_s: LatencyStats
    goodput_tok_s_per_gpu: float
    """Output tokens/s per GPU of the requests that met both SLOs (TTFT, and every TBT gap)."""
    attainment: float
    dominant: str
    """The largest term of a full decode step."""


def capacity(shape: ModelShape, hw: Hardware, dep: Deployment, workload: Workload) -> float:
    """Requests/s the deployment sustains with full batches: decode ranks produce
    max_batch * E tokens a step; a prefill rank finishes chunk / isl prompts a step. A colocated
    rank finishing r requests a step prefills r * isl tokens and decodes r * osl / E requests in
    it, r = min(max_batch E / osl, chunk / isl): whichever runs out first."""
    e = workload.tokens_per_step
    dec = step_times(shape, hw, dep.decode, workload)
    ranks = dep.decode.dp * dep.decode_instances
    if dep.prefill is None:
        per_step = min(dep.max_batch * e / workload.osl, dep.chunk / workload.isl)
        decoding = max(1, round(per_step * workload.osl / e))
        return ranks * per_step / dec.seconds(decoding, max(1, round(per_step * workload.isl)))
    decode_rate = ranks * dep.max_batch * e / workload.osl / dec.seconds(dep.max_batch, 0)
    pre = step_times(shape, hw, dep.prefill, workload)
    prefill_ranks = dep.prefill.dp * dep.prefill_instances
    prefill_rate = prefill_ranks * dep.chunk / workload.isl / pre.seconds(0, dep.chunk)
    return min(decode_rate, prefill_rate)


def fits(shape: ModelShape, hw: Hardware, dep: Deployment, workload: Workload) -> bool:
    """The weights fit, and the decode ranks' KV cache holds max_batch full-length requests
    beside their states (a hybrid's: max_batch slots, their MTP draft states and as many saved
    states, `cost.state_bytes_per_gpu`); a prefill rank's holds a chunk and a prompt beside the
    states of the prompts a chunk spans (its engine's `max_num_seqs` taken as just that)."""
    need = dep.max_batch * (workload.isl + workload.osl)
    if max_tokens_in_cache(shape, hw, dep.decode, sequences=dep.max_batch, draft_states=workload.draft_states) < need:
        return False
    if dep.prefill is None:
        return True
    prompts = math.ceil(workload.prompts_in(dep.chunk))
    return max_tokens_in_cache(shape, hw, dep.prefill, sequences=prompts) >= dep.chunk + workload.isl


def serve(
    shape: ModelShape, hw: Hardware, dep: Deployment, workload: Workload, slo_ttft_s: float, slo_tbt_s: float
) -> ServingResult:
    """Simulate the deployment at the workload's rate (or `load` of its capacity) and judge it."""
    rate = workload.rate if workload.rate is not None else workload.load * capacity(shape, hw, dep, workload)
    e = workload.tokens_per_step
    dec = step_times(shape, hw, dep.decode, workload)
    dec_ranks = dep.decode.dp * dep.decode_instances
    n = workload.requests
    if dep.prefill is None:
        offsets = arrival_offsets(n, rate / dec_ranks, 1.0, workload.seed)
        run = simulate_rank(dec, offsets, dep.max_batch, dep.chunk, workload.isl, workload.osl, e)
        ttft, worst = run.ttft, run.worst_tbt
        decode_run = run
    else:
        pre = step_times(shape, hw, dep.prefill, workload)
        pre_ranks = dep.prefill.dp * dep.prefill_instances
        offsets = arrival_offsets(n, rate / pre_ranks, 1.0, workload.seed)
        prefill_run = simulate_rank(pre, offsets, 1 << 30, dep.chunk, workload.isl, 1, e)
        offsets = arrival_offsets(n, rate / dec_ranks, 1.0, workload.seed + 1)
        decode_run = simulate_rank(dec, offsets, dep.max_batch, 0, 0, workload.osl, e)
        ttft, worst = prefill_run.ttft, decode_run.worst_tbt
    met = [t <= slo_ttft_s and g <= slo_tbt_s for t, g in zip(ttft, worst)]
    attainment = sum(met) / len(met) if met else 0.0
    served = decode_run.output_tokens / decode_run.duration_s * dec_ranks if decode_run.duration_s > 0 else 0.0
    served = min(served, rate * workload.osl)
    tok_s_per_gpu = served / dep.gpus
    return ServingResult(
        dep,
        rate,
        tok_s_per_gpu,
        summarize(ttft),
        summarize(decode_run.tbt),
        tok_s_per_gpu * attainment,
        attainment,
        dec.cost(dep.max_batch, 0 if dep.prefill else dep.chunk).dominant,
    )
