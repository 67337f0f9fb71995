"""The model runner: one scheduler step in, one sampled token per sampling request out.

`execute()` turns the step plan into packed inputs (all sequences concatenated, no padding),
plans attention once for every layer, runs the model, and samples only the rows whose chunk
reached the end of their known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch

from moeserve.worker.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from moeserve.models import MoECausalLM
from moeserve.ops import attention_batch
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import SchedulerOutput


class SamplingRequest(Protocol):
    """What sampling needs of a request: the scheduler's `Request`, or a worker's copy of it."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


class ModelRunner:
    """`lockstep`: run the model even for an empty plan, because other ranks wait for this one
    in every MoE layer's all-to-all. `samples`: this rank samples (the first rank of a tensor-
    parallel group; the others only help compute the hidden states)."""

    def __init__(
        self,
        model: MoECausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
        lockstep: bool = False,
        samples: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.lockstep = lockstep
        self.samples = samples
        self.sampler = Sampler()
        # Per-request generators live as long as the request, so a seeded request draws the
        # same numbers whatever else shares its batches.
        self._generators: dict[str, torch.Generator | None] = {}

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _generator(self, request: SamplingRequest) -> torch.Generator | None:
        if request.request_id not in self._generators:
            self._generators[request.request_id] = make_generator(request.sampling_params.seed, self.device)
        return self._generators[request.request_id]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, requests: Mapping[str, SamplingRequest]) -> dict[str, SampledToken]:
        scheduled = plan.scheduled
        if not scheduled and not self.lockstep:
            return {}
        input_ids = [t for s in scheduled for t in s.token_ids]
        positions = [s.start_position + i for s in scheduled for i in range(len(s.token_ids))]
        batch = attention_batch(
            [s.block_ids for s in scheduled],
            [s.start_position for s in scheduled],
            [len(s.token_ids) for s in scheduled],
            self.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.model.ops.plan_attention(batch),
            self.kv_caches,
        )  # [T, H]
        ends = torch.tensor([len(s.token_ids) for s in scheduled]).cumsum(0) - 1
        sampling = [i for i, s in enumerate(scheduled) if s.sample]
        if not sampling or not self.samples:
            return {}
        logits = self.model.compute_logits(hidden[ends[sampling].to(self.device)])  # [S, V]
        sampled_requests = [requests[scheduled[i].request_id] for i in sampling]
        rows = [
            SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, self._generator(r))
            for r in sampled_requests
        ]
        out = self.sampler(logits, rows, self.eos_token_ids)
        return self._unpack(out, sampled_requests)

    @staticmethod
    def _unpack(out: SamplerOutput, sampled_requests: list[SamplingRequest]) -> dict[str, SampledToken]:
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
