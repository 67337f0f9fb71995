"""The step-time models fitted before serving: a short profile of prefill and decode steps.

SLO admission, the slo policy's chunk sizing and token-aware data-parallel routing price steps
with `StepTimeModel`s, which learn from measured steps and predict only once they have seen
`min_samples` of them. Fitted from traffic alone, a fresh server promised nothing for its first
16 steps: it admitted a burst it could not serve, and refused the rest only once it could
predict, a second or more later. So, as engines profile memory at start-up, the engine runs a few
requests of its own before it reports ready: staggered prompts of a few lengths up to the
longest chunk one step carries, each then decoding, so that the steps range over a prefill alone,
prefills beside decodes, and decode batches of one to four sequences. Every data-parallel group
runs the same requests in the same steps, so that each group's models (its scheduler's and the
token router's) are ready whichever group a first request reaches.

The requests are planned by a scheduler of their own (fcfs, no prefix cache): the engine's
scheduler, its prefix cache, queue and admission tally never see them, only its models learn
from their steps. Their KV goes to blocks nobody holds yet, and the runners drop their state
with the profile's last plan, which carries only their finished ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig, StepPlan, StepShape, StepTimeModel
from moeserve.scheduler.config import blocks_for_tokens

logger = logging.getLogger(__name__)

PROFILE_SEQS = 4
"""Sequences profiled together: batches of one to four tell the per-sequence cost from the
per-token one, which a lone stream cannot."""
PROFILE_OUTPUT_TOKENS = 20
"""Tokens the first profiled sequence generates (each later one two fewer): the first alone spans
more steps than a model needs (`StepTimeModel.min_samples`, 16), whichever group it runs in."""
PROFILE_MAX_PROMPT_TOKENS = 256
"""The longest profiled prompt (less where the step budget or `max_model_len` is shorter): long
enough to fit a prefill's per-token cost, short enough to profile in well under a second on a
CPU. Longer chunks are extrapolated, and the models go on learning from every served step."""
PROFILE_ROUNDS = 3
"""At most this many passes over the requests: speculative decoding may finish them in fewer
steps than a model needs, and then they run again."""

RunStep = Callable[[StepPlan], tuple[Mapping[str, Sequence[int]], float, Sequence[float] | None]]
"""Runs a plan: (tokens per sequence, the step's duration, each group's own or None), timed as the
engine times a served step."""


@dataclass(frozen=True)
class ProfiledRequest:
    """One request of the profile: it joins before step `arrives_at_step` is planned."""

    prompt_tokens: int
    output_tokens: int
    arrives_at_step: int


@dataclass(frozen=True)
class StepProfile:
    """What the start-up profile did."""

    num_steps: int
    seconds: float
    ready: bool
    """Every model can predict (else they learn on from served steps, as before)."""


def profiled_requests(config: SchedulerConfig) -> list[ProfiledRequest]:
    """One request per step, prompts doubling up to the longest profiled chunk (the last one),
    outputs shrinking by two, so that the decode batch also shrinks one by one at the end. All of
    them fit the KV cache together at full length (halving the prompts, then dropping requests,
    where it is small): preempted, they would run one after another, twice as many steps."""
    longest = min(
        PROFILE_MAX_PROMPT_TOKENS, config.max_num_batched_tokens, config.max_model_len - PROFILE_OUTPUT_TOKENS
    )
    count = min(PROFILE_SEQS, config.max_num_seqs)
    while True:
        requests = _requests(count, max(1, longest), config.max_model_len)
        blocks = sum(blocks_for_tokens(r.prompt_tokens + r.output_tokens, config.block_size) for r in requests)
        if blocks <= config.num_kv_blocks or count == 1:
            return requests
        if longest > 1:
            longest //= 2
        else:
            count -= 1


def _requests(count: int, longest: int, max_model_len: int) -> list[ProfiledRequest]:
    requests = []
    for i in range(count):
        outputs = max(1, min(PROFILE_OUTPUT_TOKENS - 2 * i, max_model_len - 1))
        prompt = max(1, min(longest >> (count - 1 - i), max_model_len - outputs))
        requests.append(ProfiledRequest(prompt, outputs, i))
    return requests


def profile_step_times(scheduler: DataParallelScheduler, run_step: RunStep, vocab_size: int) -> StepProfile:
    """Fit `scheduler`'s step-time models from steps run by `run_step` (see the module)."""
    config = scheduler.config
    own = dict(policy="fcfs", slo_admission="off", enable_prefix_caching=False, max_waiting=None, dp_routing="requests")
    planner = DataParallelScheduler(replace(config, **own), num_groups=len(scheduler.groups))
    requests = profiled_requests(config)
    started = time.monotonic()
    num_steps = 0
    for round_ in range(PROFILE_ROUNDS):
        num_steps += _run_round(planner, scheduler, run_step, requests, vocab_size, round_)
        if _ready(scheduler):
            break
    flush = planner.schedule()  # nothing scheduled: the finished ids, for the runners to forget them
    run_step(flush)
    planner.update(flush, {})
    profile = StepProfile(num_steps, time.monotonic() - started, _ready(scheduler))
    _log(profile, scheduler.step_time_models[0], requests[-1].prompt_tokens)
    return profile


def _run_round(
    planner: DataParallelScheduler,
    scheduler: DataParallelScheduler,
    run_step: RunStep,
    requests: Sequence[ProfiledRequest],
    vocab_size: int,
    round_: int,
) -> int:
    """Run `requests` to their end in every group, teaching `scheduler`'s models; the steps run."""
    step = 0
    while step < len(requests) or planner.has_unfinished_requests():
        for i, profiled in enumerate(requests):
            if profiled.arrives_at_step == step:
                for group in range(len(planner.groups)):
                    request = _request(f"step-profile-{round_}-{group}-{i}", profiled, vocab_size)
                    planner.add_request(request, group=group)
        plan = planner.schedule()
        tokens, duration_s, group_durations_s = run_step(plan)
        planner.update(plan, tokens)
        scheduler.observe(plan, duration_s, group_durations_s)
        step += 1
    return step


def _request(request_id: str, profiled: ProfiledRequest, vocab_size: int) -> Request:
    """Greedy, to its length whatever it samples; a prompt of varied tokens, as text has."""
    params = SamplingParams(max_tokens=profiled.output_tokens, temperature=0.0, ignore_eos=True)
    prompt = [(31 * j + 7) % vocab_size for j in range(profiled.prompt_tokens)]
    return Request(request_id, prompt, params, (), time.monotonic())


def _ready(scheduler: DataParallelScheduler) -> bool:
    return all(model.ready for model in scheduler.step_time_models)


def _log(profile: StepProfile, model: StepTimeModel, longest_prompt: int) -> None:
    """One line: how long it took, and what the fit predicts for a few steps a user would know."""
    if not profile.ready:
        logger.warning(
            "step-time profile: %d steps in %.2f s left a model unfitted; it predicts once served steps teach it",
            profile.num_steps,
            profile.seconds,
        )
        return
    decode = StepShape.of([(1, longest_prompt)])
    batch = StepShape.of([(1, longest_prompt)] * PROFILE_SEQS)
    prefill = StepShape.of([(longest_prompt, 0)])
    logger.info(
        "step-time profile: %d steps in %.2f s; predicted step: one decode %.1f ms, %d decodes %.1f ms, "
        "a %d-token prefill %.1f ms",
        profile.num_steps,
        profile.seconds,
        model.predict(decode) * 1000,
        PROFILE_SEQS,
        model.predict(batch) * 1000,
        longest_prompt,
        model.predict(prefill) * 1000,
    )
