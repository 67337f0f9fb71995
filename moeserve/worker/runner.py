"""The model runner: one scheduler step in, one sampled token per sampling request out.

`execute()` turns the step plan into packed inputs (all sequences concatenated, no padding),
plans attention once for every layer, runs the model, and samples only the rows whose chunk
reached the end of their known tokens. What sampling needs of each request (its parameters,
tokens and seeded generator) the runner learns from the plans alone: a request's data comes with
the plan that first schedules it, and its id with the first plan after it finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moeserve.models import MoECausalLM
from moeserve.ops import attention_batch
from moeserve.ops.attention import AttentionPlan
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import NewRequest, ScheduledRequest, SchedulerOutput
from moeserve.worker.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from moeserve.worker.two_batch import interleave, split_point


@dataclass
class _RequestState:
    """The runner's copy of a request, from its first plan until it finished. The sampling rank
    appends the tokens it samples, exactly as the scheduler does, so the copy stays in step."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    generator: torch.Generator | None
    """Lives as long as the request (preemption included), so a seeded request draws the same
    numbers whatever else shares its batches."""
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


class ModelRunner:
    """`lockstep`: run the model even for an empty plan, because other ranks wait for this one
    in every MoE layer's all-to-all. `samples`: this rank samples (the first rank of a tensor-
    parallel group; the others only help compute the hidden states).

    `seed` seeds the process's global generator, from which requests without a seed of their
    own draw: seeded here, after the model is loaded, it is in the same state at the first
    sampling step whatever the layout, so ep=1 and ep>1 sample the same tokens.

    `two_batch_overlap`: run each step as two micro-batches whose MoE communication and compute
    take turns (see `two_batch`); the same tokens either way.
    """

    def __init__(
        self,
        model: MoECausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
        *,
        seed: int,
        lockstep: bool = False,
        samples: bool = True,
        two_batch_overlap: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.lockstep = lockstep
        self.samples = samples
        self.two_batch_overlap = two_batch_overlap
        self.sampler = Sampler()
        self._requests: dict[str, _RequestState] = {}
        torch.manual_seed(seed)

    @property
    def request_ids(self) -> list[str]:
        """The requests whose state this runner holds."""
        return list(self._requests)

    def _track(self, plan: SchedulerOutput) -> None:
        """Forget the finished requests first: a new request may reuse a finished one's id."""
        for request_id in plan.finished_request_ids:
            self._requests.pop(request_id, None)
        for new in plan.new_requests:
            self._requests[new.request_id] = self._state(new)

    def _state(self, new: NewRequest) -> _RequestState:
        generator = make_generator(new.sampling_params.seed, self.device)
        return _RequestState(new.request_id, new.sampling_params, new.prompt_token_ids, generator)

    @torch.inference_mode()
    def execute(
        self,
        plan: SchedulerOutput,
        max_tokens_per_rank: int | None = None,
        micro_batch_bounds: tuple[int, int] | None = None,
    ) -> dict[str, SampledToken]:
        """max_tokens_per_rank: the most tokens any rank's MoE layers dispatch this step, the same
        on every rank of the EP group (see `MoECausalLM.forward`); None where it is not known.
        micro_batch_bounds: with two-batch overlap, the same bound for each micro-batch
        (`two_batch.micro_batch_bounds`); None: max_tokens_per_rank for both."""
        self._track(plan)
        scheduled = plan.scheduled
        if not scheduled and not self.lockstep:
            return {}
        if self._overlaps(scheduled):
            cut = split_point([len(s.token_ids) for s in scheduled])
            parts = [scheduled[:cut], scheduled[cut:]]
            bounds = micro_batch_bounds or (max_tokens_per_rank, max_tokens_per_rank)
            passes = [
                self.model.forward_steps(*self._inputs(part), self.kv_caches, bound)
                for part, bound in zip(parts, bounds)
            ]
            hiddens = interleave(passes)
        else:
            parts = [scheduled]
            hiddens = [self.model(*self._inputs(scheduled), self.kv_caches, max_tokens_per_rank)]  # [T, H]
        sampling = [i for i, s in enumerate(scheduled) if s.sample]
        if not sampling or not self.samples:
            return {}
        last = [self._sampled_rows(hidden, part) for hidden, part in zip(hiddens, parts)]  # in scheduled order
        logits = self.model.compute_logits(last[0] if len(last) == 1 else torch.cat(last))  # [S, V]
        sampled_requests = [self._requests[scheduled[i].request_id] for i in sampling]
        rows = [
            SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator)
            for r in sampled_requests
        ]
        result = self._unpack(self.sampler(logits, rows, self.eos_token_ids), sampled_requests)
        for request in sampled_requests:
            request.output_token_ids.append(result[request.request_id].token_id)
        return result

    def _overlaps(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether this step runs as two micro-batches. Under lockstep always (with the flag): the
        decision must be the same on every rank, and only the flag is (a micro-batch may be
        empty). Alone in its process a runner needs two sequences to split."""
        return self.two_batch_overlap and (self.lockstep or len(scheduled) > 1)

    def _inputs(self, scheduled: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan]:
        """The model's packed inputs for these sequences: token ids `[T]`, positions `[T]` and the
        attention plan."""
        input_ids = [t for s in scheduled for t in s.token_ids]
        positions = [s.start_position + i for s in scheduled for i in range(len(s.token_ids))]
        batch = attention_batch(
            [s.block_ids for s in scheduled],
            [s.start_position for s in scheduled],
            [len(s.token_ids) for s in scheduled],
            self.block_size,
            self.device,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.model.ops.plan_attention(batch),
        )

    def _sampled_rows(self, hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """The rows of `hidden [T, H]` that sample: the last token of each sampling sequence."""
        ends = itertools.accumulate(len(s.token_ids) for s in scheduled)
        rows = [end - 1 for end, s in zip(ends, scheduled) if s.sample]
        return hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)]

    @staticmethod
    def _unpack(out: SamplerOutput, sampled_requests: list[_RequestState]) -> dict[str, SampledToken]:
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top = None
        if out.top_logprobs is not None:
            top = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist())
        result = {}
        for i, request in enumerate(sampled_requests):
            wanted = request.sampling_params.logprobs
            sampled = SampledToken(token_ids[i])
            if wanted is not None and logprobs is not None:
                alternatives = tuple(zip(top[0][i][:wanted], top[1][i][:wanted])) if top and wanted else ()
                sampled = SampledToken(token_ids[i], logprobs[i], alternatives)
            result[request.request_id] = sampled
        return result
