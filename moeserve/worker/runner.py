"""The model runner: one scheduler step in, one sampled token per sampling request out (after the
draft tokens it verified and kept, for a request that drafted: `verify_drafts`).

`execute()` turns the step plan into packed inputs (all sequences concatenated, no padding),
plans attention once for every layer, runs the model, and samples only the rows whose chunk
reached the end of their known tokens. What sampling needs of each request (its parameters,
what it has sampled and its seeded generator) the runner keeps in a persistent `InputBatch`,
learnt from the plans alone: a request's data comes with the plan that first schedules it, and
its id with the first plan after it finished.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.models import MoECausalLM
from moeserve.models.decoder import LayerCache
from moeserve.models.v4.cache import LayerCache as GroupedLayerCache
from moeserve.models.v4.cache import SequenceView, V4Batch
from moeserve.ops import attention_batch
from moeserve.ops.attention import AttentionPlan
from moeserve.ops.host_ints import int64_tensor
from moeserve.ops.state_batch import LinearState, StateStep
from moeserve.scheduler import ScheduledRequest, SchedulerOutput
from moeserve.worker.decode_graphs import DecodeGraphs, is_decode
from moeserve.worker.host_memory import retain_freed_host_memory
from moeserve.worker.input_batch import InputBatch
from moeserve.worker.mtp_drafter import MTPDrafter
from moeserve.worker.prompt_logprobs import PromptLogprobs, PromptLogprobsTracker
from moeserve.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_allowed_tokens,
    make_generator,
    mask_tokens,
    penalize,
    random_probs,
)
from moeserve.worker.sampling_metadata import PendingBitmask
from moeserve.worker.state_slots import StateSlots
from moeserve.worker.two_batch import interleave, split_point
from moeserve.worker.v4_mtp_drafter import V4MTPDrafter
from moeserve.worker.verify_drafts import TokenLogprobs, accept_greedy, rejection_sample, verified_logprobs


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    accepted_draft_ids: tuple[int, ...] = ()
    """Draft tokens the step verified, which come before `token_id` (speculative decoding)."""
    accepted_draft_logprobs: tuple[TokenLogprobs, ...] = ()
    """Each accepted draft's (logprob, top logprobs), for a request asking for logprobs."""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token this step added to the sequence, in order."""
        return (*self.accepted_draft_ids, self.token_id)


class ModelRunner:
    """`lockstep`: run the model even for an empty plan, because other ranks wait for this one
    in every MoE layer's all-to-all. `samples`: this rank samples (the first rank of a tensor-
    parallel group; the others only help compute the hidden states).

    `seed` seeds the process's global generator, from which requests without a seed of their
    own draw: seeded here, after the model is loaded, it is in the same state at the first
    sampling step whatever the layout, so ep=1 and ep>1 sample the same tokens.

    `two_batch_overlap`: run each step as two micro-batches whose MoE communication and compute
    take turns (see `two_batch`); the same tokens either way.

    `graphs`: captured decode steps (`decode_graphs`); a decode step that fits one is replayed
    instead of run, with the same tokens.

    `mtp_drafts`: speculative decoding's num_speculative_tokens with method mtp (0: none); the
    model's MTP layers fill the drafts the scheduler granted (`mtp_drafter`). Such steps run
    eagerly in one batch (no graphs, no two-batch overlap): the drafts need the target's stream.
    """

    def __init__(
        self,
        model: MoECausalLM,
        kv_caches: list[torch.Tensor | LinearState],
        block_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
        *,
        seed: int,
        lockstep: bool = False,
        samples: bool = True,
        two_batch_overlap: bool = False,
        graphs: DecodeGraphs | None = None,
        mtp_drafts: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.grouped = any(isinstance(c, GroupedLayerCache) for c in kv_caches)
        """DeepSeek-V4: caches in several block-table groups, fed through `_grouped_inputs`."""
        drafter = V4MTPDrafter if self.grouped else MTPDrafter
        self.drafter = drafter(model, kv_caches, block_size, mtp_drafts) if mtp_drafts else None
        slots = [c.conv.shape[0] for c in kv_caches if isinstance(c, LinearState)]
        slots += [c.state[0].shape[0] for c in kv_caches if isinstance(c, GroupedLayerCache) and c.state]
        self.states = StateSlots(slots[0]) if slots else None
        """Each running sequence's slot in the state layers' caches (Gated DeltaNets, V4's open windows)."""
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            retain_freed_host_memory()  # steps reuse their freed buffers instead of faulting fresh pages in
        self.lockstep = lockstep
        self.samples = samples
        self.two_batch_overlap = two_batch_overlap
        self.graphs = graphs
        self.sampler = Sampler()
        self.batch = InputBatch(model.cfg.vocab_size, self.eos_token_ids, self.device)
        """Every live request's sampling state; a seeded request's generator lives there as long
        as the request (preemption included), so it draws the same numbers whatever else shares
        its batches."""
        self.prompt_logprobs = PromptLogprobsTracker()
        """Requests that asked for prompt logprobs (the sampling rank computes them)."""
        self._prompt_logprobs_out: dict[str, PromptLogprobs] = {}
        torch.manual_seed(seed)

    @property
    def request_ids(self) -> list[str]:
        """The requests whose state this runner holds."""
        return self.batch.request_ids

    def forget_requests(self) -> None:
        """Drop every request's state: after a lost rank the step in flight may have left it
        half-updated, and the scheduler announces each live request again (`Scheduler.lose_step`)."""
        for request_id in self.batch.request_ids:
            self.batch.remove(request_id)
            self.prompt_logprobs.remove(request_id)
        self._prompt_logprobs_out.clear()
        if self.drafter is not None:
            self.drafter.forget(self.drafter.request_ids)
        if self.states is not None:  # every sequence recomputes from position 0
            self.states.release(self.states.request_ids)

    def _track(self, plan: SchedulerOutput) -> None:
        """Forget the finished requests first: a new request may reuse a finished one's id."""
        for request_id in plan.finished_request_ids:
            self.batch.remove(request_id)
            self.prompt_logprobs.remove(request_id)
        if self.states is not None:
            self.states.release([*plan.finished_request_ids, *plan.preempted_request_ids])
        new = plan.new_requests
        if self.samples:
            for r in new:
                if not r.output_token_ids:  # one announced again has had its prompt's logprobs
                    self.prompt_logprobs.add(r.request_id, r.sampling_params.prompt_logprobs, r.prompt_token_ids)
        rows = [
            SamplingRow(
                r.sampling_params,
                r.prompt_token_ids,
                r.output_token_ids,
                make_generator(r.sampling_params.seed, self.device),
            )
            for r in new
        ]
        self.batch.add([r.request_id for r in new], rows)

    @torch.inference_mode()
    def execute(
        self,
        plan: SchedulerOutput,
        max_tokens_per_rank: int | None = None,
        micro_batch_bounds: tuple[int, int] | None = None,
        decode_only: bool | None = None,
        token_bitmask: PendingBitmask | None = None,
    ) -> dict[str, SampledToken]:
        """max_tokens_per_rank: the most tokens any rank's MoE layers dispatch this step, the same
        on every rank of the EP group (see `MoECausalLM.forward`); None where it is not known.
        micro_batch_bounds: with two-batch overlap, the same bound for each micro-batch
        (`two_batch.micro_batch_bounds`); None: max_tokens_per_rank for both.
        decode_only: whether every rank's step is decodes only, which decides, alike on every
        rank, whether captured graphs run; None: this plan's own.
        token_bitmask: the grammar's allowed tokens for requests under structured outputs, taken
        (waited for, if still filling) only once the logits exist."""
        self._track(plan)
        scheduled = plan.scheduled
        if not scheduled and not self.lockstep:
            return {}
        graph_size = self._graph_size(scheduled, max_tokens_per_rank, decode_only)
        if self.drafter is not None:
            self.drafter.forget([*plan.finished_request_ids, *plan.preempted_request_ids])
            scheduled = self.drafter.draft(scheduled, self.lockstep)
            parts = [scheduled]
            hidden, stream = self.model.forward_with_stream(
                *self._inputs(scheduled), max_tokens_per_rank
            )  # [T, H] each
            hiddens = [hidden]
            self.drafter.keep(scheduled, stream)
        elif graph_size is not None:
            parts = [scheduled]
            hiddens = [self.graphs.run(scheduled, graph_size)]  # [n, H]
        elif self._overlaps(scheduled):
            cut = split_point([len(s.token_ids) for s in scheduled])
            parts = [scheduled[:cut], scheduled[cut:]]
            bounds = micro_batch_bounds or (max_tokens_per_rank, max_tokens_per_rank)
            passes = [self.model.forward_steps(*self._inputs(part), bound) for part, bound in zip(parts, bounds)]
            hiddens = interleave(passes)
        else:
            parts = [scheduled]
            hiddens = [self.model(*self._inputs(scheduled), max_tokens_per_rank)]  # [T, H]
        if self.states is not None:
            self._save_states(scheduled)
        if self.prompt_logprobs:
            computed = self.prompt_logprobs.compute(parts, hiddens, self.model.compute_logits)
            for request_id, chunk in computed.items():
                earlier = self._prompt_logprobs_out.get(request_id)
                self._prompt_logprobs_out[request_id] = chunk if earlier is None else earlier.followed_by(chunk)
        sampling = [i for i, s in enumerate(scheduled) if s.sample]
        if not sampling or not self.samples:
            return {}
        last = [self._sampled_rows(hidden, part) for hidden, part in zip(hiddens, parts)]  # in scheduled order
        logits = self.model.compute_logits(last[0] if len(last) == 1 else torch.cat(last))  # [S + drafts, V]
        request_ids = [scheduled[i].request_id for i in sampling]
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens :] for s in scheduled if s.sample]
        accepted, resampled = None, {}
        if any(drafts):
            if token_bitmask is not None:  # every row under its own grammar mask, before anything reads it
                num_rows = [len(d) + 1 for d in drafts]
                apply_allowed_tokens(logits, token_bitmask.get().for_rows(request_ids, self.device, num_rows))
                token_bitmask = None
            judged = self._at_draft_positions(logits, request_ids, drafts)  # [R, V]
            resampled = self._verify_sampled(judged, request_ids, drafts)
            rows, accepted = accept_greedy(judged, drafts)
            verified = judged if self.sampler.logprobs_mode == "penalized" else logits
            logits = logits[int64_tensor(rows).to(self.device)]  # [S, V]: the row after each one's kept drafts
            kept_drafts = {
                request_id: tuple(draft[: resampled.get(request_id, (kept,))[0]])
                for request_id, draft, kept in zip(request_ids, drafts, accepted)
            }
            for request_id, kept in kept_drafts.items():  # the next token's penalties and min_tokens count them
                self.batch.record_drafts(self.batch.slot(request_id), kept)
        metadata = self.batch.sampling_metadata(self.batch.slots(request_ids))
        allowed = None if token_bitmask is None else token_bitmask.get().for_rows(request_ids, self.device)
        out = self.sampler.sample(logits, metadata, allowed)
        for dispatcher in {id(b.dispatcher): b.dispatcher for b in self.model.moe_blocks()}.values():
            dispatcher.check_step()  # a step whose exchange failed produces no token
        if resampled:  # the sampler's pick at the greedy row is not theirs: rejection sampling drew it
            for i, request_id in enumerate(request_ids):
                if request_id in resampled:
                    out.token_ids[i] = resampled[request_id][1]
        self.batch.record(metadata, out.token_ids)
        sampled = self._unpack(out, request_ids, metadata.num_logprobs)
        if accepted is not None:
            for request_id in resampled:
                sampled[request_id] = SampledToken(sampled[request_id].token_id)  # its logprobs come next
            self._add_kept_drafts(sampled, kept_drafts, set(resampled), verified, drafts, metadata.num_logprobs)
        return sampled

    def _at_draft_positions(
        self, logits: torch.Tensor, request_ids: Sequence[str], drafts: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """`logits [R, V]` (each sequence's rows in turn) as the sampler would see them at each
        row's position: min_tokens masks and penalties counting the drafts before the row as
        output tokens (float32). The logits themselves where no sequence has either. Drafts are
        judged on these; the row a sequence samples from is taken from `logits`, which the
        sampler processes itself once the kept drafts are recorded."""
        slots, drafts_before = [], []
        for request_id, draft in zip(request_ids, drafts):
            slot = self.batch.slot(request_id)
            for i in range(len(draft) + 1):
                slots.append(slot)
                drafts_before.append(draft[:i])
        metadata = self.batch.verify_metadata(slots, drafts_before)
        if metadata.penalties is None and metadata.min_tokens is None:
            return logits
        judged = logits.to(torch.float32, copy=True)
        mask_tokens(judged, metadata.min_tokens)
        penalize(judged, metadata.penalties)
        return judged

    @staticmethod
    def _add_kept_drafts(
        sampled: dict[str, SampledToken],
        kept_drafts: dict[str, tuple[int, ...]],
        resampled: set[str],
        verified: torch.Tensor,
        drafts: Sequence[Sequence[int]],
        num_logprobs: Sequence[int | None],
    ) -> None:
        """Put each sequence's kept drafts before its sampled token, with their logprobs where the
        request asked (and the next token's, for one whose next token rejection sampling drew):
        from the verify forward's rows (`verified [R, V]`, sequence j's `len(drafts[j]) + 1` rows
        in turn), the numbers decoding one token at a time gives."""
        firsts = itertools.accumulate((len(d) + 1 for d in drafts), initial=0)
        rows, token_ids, num_top, counts = [], [], [], {}
        for (request_id, kept), first, wanted in zip(kept_drafts.items(), firsts, num_logprobs):
            if wanted is None:
                continue
            tokens = [*kept, sampled[request_id].token_id] if request_id in resampled else list(kept)
            rows += range(first, first + len(tokens))
            token_ids += tokens
            num_top += [wanted] * len(tokens)
            counts[request_id] = len(tokens)
        logprobs = iter(verified_logprobs(verified, rows, token_ids, num_top))
        for request_id, kept in kept_drafts.items():
            found = tuple(itertools.islice(logprobs, counts.get(request_id, 0)))
            token = sampled[request_id]
            if request_id in resampled and found:
                (logprob, top), found = found[-1], found[:-1]
                token = dataclasses.replace(token, logprob=logprob, top_logprobs=top)
            if kept:
                token = dataclasses.replace(token, accepted_draft_ids=kept, accepted_draft_logprobs=found)
            sampled[request_id] = token

    def _verify_sampled(
        self, logits: torch.Tensor, request_ids: Sequence[str], drafts: Sequence[Sequence[int]]
    ) -> dict[str, tuple[int, int]]:
        """Rejection sampling for the drafting sequences that sample at random (logits `[R, V]`,
        each sequence's rows in turn): per such sequence, (drafts kept, next token). Each row is
        judged against the distribution the sampler would draw from there, with the request's
        parameters: one metadata row per logits row (grammar masks, min_tokens and penalties
        are already on the logits: `_at_draft_positions`)."""
        firsts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        chosen = [j for j, (rid, d) in enumerate(zip(request_ids, drafts)) if d and not self.batch.is_greedy(rid)]
        if not chosen:
            return {}
        rows = [row for j in chosen for row in range(firsts[j], firsts[j + 1])]
        slots = [self.batch.slot(request_ids[j]) for j in chosen for _ in range(len(drafts[j]) + 1)]
        random = self.batch.sampling_metadata(slots).random
        probs = random_probs(logits[int64_tensor(rows).to(self.device)].float(), random)  # [len(rows), V]
        result, first = {}, 0
        for j in chosen:
            k = len(drafts[j])
            result[request_ids[j]] = rejection_sample(probs[first : first + k + 1], drafts[j], random.generators[first])
            first += k + 1
        return result

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        """The prompt logprobs computed since the previous call, per request (its chunks joined)."""
        taken, self._prompt_logprobs_out = self._prompt_logprobs_out, {}
        return taken

    def _graph_size(
        self, scheduled: Sequence[ScheduledRequest], max_tokens_per_rank: int | None, decode_only: bool | None
    ) -> int | None:
        """The captured size this step replays, or None: it runs eagerly."""
        if self.graphs is None or self.drafter is not None:
            return None
        if not (is_decode(scheduled) if decode_only is None else decode_only):
            return None
        return self.graphs.size_for(len(scheduled), max_tokens_per_rank)

    def _overlaps(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether this step runs as two micro-batches. Under lockstep always (with the flag): the
        decision must be the same on every rank, and only the flag is (a micro-batch may be
        empty). Alone in its process a runner needs two sequences to split."""
        return self.two_batch_overlap and (self.lockstep or len(scheduled) > 1)

    def _inputs(
        self, scheduled: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan, list[LayerCache]]:
        """The model's packed inputs for these sequences: token ids `[T]`, positions `[T]`, the
        attention plan and the layers' caches (state layers' bound to these sequences' slots)."""
        if self.grouped:
            return self._grouped_inputs(scheduled)
        query_lens = [len(s.token_ids) for s in scheduled]
        start_positions = [s.start_position for s in scheduled]
        input_ids = int64_tensor(itertools.chain.from_iterable(s.token_ids for s in scheduled))
        batch = attention_batch(
            [s.block_ids for s in scheduled], start_positions, query_lens, self.block_size, self.device
        )
        caches: list[LayerCache] = self.kv_caches
        if self.states is not None:
            states = self.states.batch(scheduled)
            loads = [(slot, s.load_state) for slot, s in zip(states.slots, scheduled) if s.load_state >= 0]
            if loads:
                for cache in self.kv_caches:
                    if isinstance(cache, LinearState):
                        cache.load_saved(*zip(*loads))
            caches = [StateStep(c, states) if isinstance(c, LinearState) else c for c in self.kv_caches]
        return (
            input_ids.to(self.device),
            packed_positions(start_positions, query_lens).to(self.device),
            self.model.ops.plan_attention(batch),
            caches,
        )

    def _grouped_inputs(self, scheduled: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, V4Batch, list]:
        """A model with several block-table groups: token ids `[T]`, each sequence's view (its
        first position, its table per group, its state slot) and the layers' caches."""
        slots = restores = (-1,) * len(scheduled)  # a model of window layers only keeps no state
        if self.states is not None:
            states = self.states.batch(scheduled)
            slots, restores = states.slots, states.restores
        loads = [(slot, s.load_state) for slot, s in zip(slots, scheduled) if s.load_state >= 0]
        if loads:
            for cache in self.kv_caches:
                if cache.saved:
                    cache.load_saved(*zip(*loads))
        views = tuple(
            SequenceView(
                s.start_position,
                {key: int64_tensor(table).to(self.device) for key, table in s.group_tables.items()},
                slot,
                self.block_size,
                s.num_draft_tokens,
                restore,
            )
            for s, slot, restore in zip(scheduled, slots, restores, strict=True)
        )
        input_ids = int64_tensor(itertools.chain.from_iterable(s.token_ids for s in scheduled))
        return input_ids.to(self.device), V4Batch(tuple(len(s.token_ids) for s in scheduled), views), self.kv_caches

    def _save_states(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Copy the states of the sequences the plan marked into their saved-state slots, once
        the step's forward has run (prefix caching of a model with state layers)."""
        saves = [(self.states.slot(s.request_id), s.save_state) for s in scheduled if s.save_state >= 0]
        if saves:
            for cache in self.kv_caches:
                if isinstance(cache, LinearState) or isinstance(cache, GroupedLayerCache) and cache.saved:
                    cache.save(*zip(*saves))

    def _sampled_rows(self, hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """The rows of `hidden [T, H]` that sample: the last token of each sampling sequence, and
        for one that drafts, its last real token and every draft (each row verifies the next)."""
        ends = itertools.accumulate(len(s.token_ids) for s in scheduled)
        rows = [row for end, s in zip(ends, scheduled) if s.sample for row in range(end - 1 - s.num_draft_tokens, end)]
        if len(rows) == hidden.shape[0]:  # every row samples (decodes only): all of them, in order
            return hidden
        return hidden[int64_tensor(rows).to(self.device)]

    @staticmethod
    def _unpack(
        out: SamplerOutput, request_ids: list[str], num_logprobs: Sequence[int | None]
    ) -> dict[str, SampledToken]:
        """One `SampledToken` per row; a row's logprobs only if it asked, its top ones cut to its ask."""
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return {request_id: SampledToken(token) for request_id, token in zip(request_ids, token_ids)}
        logprobs = out.logprobs.tolist()
        top_ids, top_values = out.top_logprobs if out.top_logprobs is not None else (None, None)
        top = list(zip(top_ids.tolist(), top_values.tolist())) if top_ids is not None else None
        result = {}
        for i, (request_id, wanted) in enumerate(zip(request_ids, num_logprobs)):
            sampled = SampledToken(token_ids[i])
            if wanted is not None:
                alternatives = tuple(zip(top[i][0][:wanted], top[i][1][:wanted])) if top and wanted else ()
                sampled = SampledToken(token_ids[i], logprobs[i], alternatives)
            result[request_id] = sampled
        return result


def packed_positions(start_positions: Sequence[int], query_lens: Sequence[int]) -> torch.Tensor:
    """The position of every packed token, `[T]` int64 on the host: sequence i's tokens sit at
    start_positions[i], start_positions[i] + 1, ... (one arange and one repeat, no Python loop)."""
    starts = int64_tensor(start_positions)  # [S]
    if len(query_lens) == sum(query_lens):  # decodes only: one token per sequence, at its start
        return starts
    lens = int64_tensor(query_lens)  # [S]
    first_index = torch.cumsum(lens, 0) - lens  # [S] where each sequence begins in the packed batch
    return torch.arange(sum(query_lens), dtype=torch.int64) + torch.repeat_interleave(starts - first_index, lens)
