"""The policy comparison of bench/request_slos.py on a simulated clock: the scheduler alone.

On a machine shared with other jobs, a wall-clock run measures the neighbours as much as the
scheduling (steps padded to 200 ms took 400-800 ms on average there, with multi-second stalls).
Here the real `Scheduler` plans every step and a synthetic cost says how long it took:
`STEP_FLOOR_S` plus `PER_TOKEN_S` per token, the padded tiny model without the noise. The
clock moves only by those steps, so a run is exact and repeatable, and the admission promise
("of requests predicted to meet their TTFT, >= 95% did") is checked against the same load the
wall-clock runs got.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, Scheduler, SchedulerConfig, SLORejectedError, StepShape
from moeserve.slo import RequestSLO

STEP_FLOOR_S = 0.2
PER_TOKEN_S = 0.4e-3
"""A full 128-token step: 251 ms; eight decodes: 203 ms."""


def step_cost(shape: StepShape) -> float:
    return STEP_FLOOR_S + PER_TOKEN_S * shape.num_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimRequest:
    cls_name: str
    at_s: float
    """Arrival, from the start of the load."""
    ttft_s: float
    tbt_s: float
    token_times: list[float] = field(default_factory=list)
    rejected: bool = False


def simulate(arrivals: list, policy: str, admission: str, budget: int) -> tuple[dict[str, list[SimRequest]], dict]:
    """Offer `arrivals` (bench/request_slos.Arrival) to one scheduler; each request's token times,
    by class, and the admission tally. A warm-up load first teaches the step-time model."""
    clock = Clock()
    config = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        max_model_len=2048,
        num_kv_blocks=4096,
        policy=policy,
        slo_admission=admission,
    )
    scheduler = Scheduler(config, clock)
    warm = [(f"warm{i}", [5 + i] * 48, 24) for i in range(8)] + [("warm-long", [7] * 900, 4)]
    for request_id, prompt, max_tokens in warm:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request(request_id, prompt, params, (), arrival_time=0.0), slo_admission=False)
    while scheduler.has_unfinished_requests():
        _step(scheduler, clock, {})
    start = clock.now
    tally_before = (scheduler.admission.predicted_on_time, scheduler.admission.on_time)
    by_id: dict[str, SimRequest] = {}
    by_class: dict[str, list[SimRequest]] = {}
    pending = list(arrivals)
    while pending or scheduler.has_unfinished_requests():
        while pending and start + pending[0].at_s <= clock.now:
            a = pending.pop(0)
            record = SimRequest(a.cls.name, a.at_s, a.cls.ttft_s, a.cls.tbt_s)
            by_class.setdefault(a.cls.name, []).append(record)
            slo = RequestSLO(a.cls.ttft_s, a.cls.tbt_s, a.cls.name)
            params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, slo=slo)
            request_id = f"r{len(by_id)}"
            try:
                scheduler.add_request(Request(request_id, a.prompt, params, (), arrival_time=start + a.at_s))
            except SLORejectedError:
                record.rejected = True
            by_id[request_id] = record
        if scheduler.has_unfinished_requests():
            _step(scheduler, clock, by_id)
        elif pending:
            clock.now = start + pending[0].at_s
    tally = {
        "predicted_on_time": scheduler.admission.predicted_on_time - tally_before[0],
        "on_time": scheduler.admission.on_time - tally_before[1],
        "rejected": scheduler.admission.rejected,
    }
    for records in by_class.values():
        for r in records:
            r.token_times = [t - start for t in r.token_times]
    return by_class, tally


def _step(scheduler: Scheduler, clock: Clock, by_id: dict[str, SimRequest]) -> None:
    output = scheduler.schedule()
    duration = step_cost(StepShape.of((len(s.token_ids), s.start_position) for s in output.scheduled))
    clock.now += duration
    sampled = {s.request_id: 7 for s in output.scheduled if s.sample}
    scheduler.update(output, sampled, duration)
    for request_id in sampled:
        if request_id in by_id:
            by_id[request_id].token_times.append(clock.now)


def summarize(by_class: dict[str, list[SimRequest]], seconds: float) -> dict:
    """Per class, as the wall-clock part reports it: refusals, attainment over sent and admitted,
    goodput; TTFT counts from each request's arrival."""
    summary: dict = {}
    met_total = sent_total = 0
    for cls_name, records in by_class.items():
        ttft_met = tbt_met = both = 0
        for r in records:
            if r.rejected:
                continue
            on_time = r.token_times[0] - r.at_s <= r.ttft_s
            gaps_ok = all(b - a <= r.tbt_s for a, b in zip(r.token_times, r.token_times[1:]))
            ttft_met, tbt_met, both = ttft_met + on_time, tbt_met + gaps_ok, both + (on_time and gaps_ok)
        sent, rejected = len(records), sum(r.rejected for r in records)
        summary[cls_name] = {
            "sent": sent,
            "rejected": rejected,
            "attainment": {"ttft": ttft_met / sent, "tbt": tbt_met / sent, "both": both / sent},
            "admitted_attainment_both": both / (sent - rejected) if sent > rejected else None,
            "goodput_per_s": both / seconds,
        }
        met_total, sent_total = met_total + both, sent_total + sent
    summary["all_both_attained"] = met_total / sent_total
    return summary
