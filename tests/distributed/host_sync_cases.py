"""Per-rank body of `test_host_syncs_ep`: one prefill and one decode step of a real checkpoint on
an EP rank (`torch` dispatcher, tp = 1), counting host syncs in each step's model forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from helpers.host_syncs import HostSyncCounter

from moeserve.dispatch import ExpertPlacement, create_dispatcher
from moeserve.models import load_model, model_config
from moeserve.models.layers.moe import MoEBlock
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from moeserve.worker.kv_cache import allocate_kv_caches
from moeserve.worker.runner import ModelRunner

BLOCK_SIZE = 8
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@dataclass
class Sequence:
    """What the runner's sampler needs of a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=lambda: GREEDY)
    output_token_ids: list[int] = field(default_factory=list)


def step(sequences: list[Sequence], decode: bool) -> SchedulerOutput:
    scheduled = []
    for i, seq in enumerate(sequences):
        tokens = seq.output_token_ids[-1:] if decode else seq.prompt_token_ids
        start = len(seq.prompt_token_ids) if decode else 0
        scheduled.append(ScheduledRequest(seq.request_id, tokens, start, [2 * i, 2 * i + 1], sample=True))
    return SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled), [], [])


def run_rank(rank: int, world_size: int, folder: str, decode_bound: int) -> dict:
    """Rank r holds r + 1 sequences (so ranks dispatch different token counts). The prefill runs
    without a step bound (the uneven all-to-all, with its declared host read), the decode step
    with `decode_bound`. Returns the syncs seen inside and outside the MoE layers per step."""
    torch.set_num_threads(1)
    placement = ExpertPlacement.contiguous(model_config(folder).num_experts, world_size, rank)
    dispatcher = create_dispatcher("torch", placement)
    model = load_model(folder, torch.float32, "cpu", dispatcher)
    caches = allocate_kv_caches(model.cfg, 2 * world_size, BLOCK_SIZE, torch.float32, "cpu")
    runner = ModelRunner(model, caches, BLOCK_SIZE, eos_token_ids=(), lockstep=True)
    sequences = [Sequence(f"r{rank}-{i}", [3 + rank + i, 7, 11 + i]) for i in range(rank + 1)]
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    result = {"syncs_host": {"prefill": dispatcher.syncs_host(None), "decode": dispatcher.syncs_host(decode_bound)}}
    for name, decode, bound in (("prefill", False, None), ("decode", True, decode_bound)):
        requests = {seq.request_id: seq for seq in sequences}
        with HostSyncCounter(blocks) as syncs:
            sampled = runner.execute(step(sequences, decode), requests, max_tokens_per_rank=bound)
        for seq in sequences:
            seq.output_token_ids.append(sampled[seq.request_id].token_id)
        result[name] = {"inside_moe": syncs.inside_moe, "outside_moe": syncs.outside_moe}
    result["num_moe_layers"] = len(blocks)
    return result
