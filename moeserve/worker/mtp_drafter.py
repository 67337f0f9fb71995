"""MTP drafts (speculative decoding method mtp): the checkpoint's multi-token prediction layers
propose the tokens a decode feeds after its last one, and the target verifies them in the same
forward (`verify_drafts`).

The scheduler grants a drafting decode its draft slots (blocks and budget) with placeholder ids;
the runner's `MTPDrafter` fills them in before the target runs, on every rank alike (the drafts
are argmaxes of the same gathered rows), so nothing flows back from a step to the scheduler.

An MTP layer at position p reads the target's hidden state at p and the token at p + 1, so a row's MTP
input is complete only once the token after it is known: the target rows of a step wait
(`_Pending`) until the next step says which of them were kept (its start position) and which
token follows the last kept one (its first fed token). Each step then runs:

1. catch-up: the first MTP layer over every kept row of the previous step, writing its KV at
   those positions of its own cache (rows past them were scratch, overwritten later); the last
   row of a drafting decode predicts its first draft;
2. draft j = 2..N: one row per drafting decode, at the position after the previous one, reading
   the MTP layer's own output and the previous draft (vLLM's way of reusing the last layer for
   more drafts than the checkpoint has layers). Its KV lands in blocks the step already holds for
   the drafts and is rewritten by the next catch-up.

Under lockstep (expert parallelism) every rank makes the same number of passes, empty or not,
because every pass's MoE joins the group's all-to-all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from moeserve.models import MoECausalLM
from moeserve.ops import attention_batch
from moeserve.ops.host_ints import int64_tensor
from moeserve.scheduler import ScheduledRequest


@dataclass
class _Pending:
    """A request's target rows whose MTP input still lacks the token after them."""

    start: int  # position of token_ids[0]
    token_ids: list[int]
    stream: torch.Tensor  # [len(token_ids), H], what the MTP layers read (`forward_with_stream`)


@dataclass(frozen=True)
class _Rows:
    """One MTP pass: per sequence (index into the step's scheduled list) its rows' positions."""

    seqs: list[int]
    starts: list[int]
    lens: list[int]


class MTPDrafter:
    """`num_drafts`: the configured num_speculative_tokens, the passes a lockstep step makes."""

    def __init__(self, model: MoECausalLM, kv_caches: list[torch.Tensor], block_size: int, num_drafts: int) -> None:
        if not model.mtp:
            raise ValueError("MTP drafts need a model loaded with its MTP layers")
        self.model = model
        self.caches = kv_caches[model.cfg.num_layers :]
        self.block_size = block_size
        self.num_drafts = num_drafts
        self._pending: dict[str, _Pending] = {}

    @property
    def request_ids(self) -> list[str]:
        """Requests with rows waiting for their next step."""
        return list(self._pending)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Finished or preempted requests: their rows will never be continued."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)

    def draft(self, scheduled: Sequence[ScheduledRequest], lockstep: bool) -> list[ScheduledRequest]:
        """`scheduled` with each drafting decode's placeholder drafts replaced by MTP's."""
        device = self.model.embed_tokens.device
        catch_up = self._catch_up_rows(scheduled)
        hidden = [self._pending[scheduled[i].request_id] for i in catch_up.seqs]
        streams = [p.stream[:n] for p, n in zip(hidden, catch_up.lens)]
        next_ids = [
            p.token_ids[1:n] + [scheduled[i].token_ids[0]] for p, n, i in zip(hidden, catch_up.lens, catch_up.seqs)
        ]
        drafting = [i for i, s in enumerate(scheduled) if s.num_draft_tokens]
        drafts: dict[int, list[int]] = {i: [] for i in drafting}
        if catch_up.seqs or lockstep:
            stream, normed = self._run(0, scheduled, catch_up, streams, next_ids, device)
            ends = list(itertools.accumulate(catch_up.lens))
            last = {i: end - 1 for i, end in zip(catch_up.seqs, ends)}
            have = [i for i in drafting if i in last]
            state = self._propose(0, have, [last[i] for i in have], stream, normed, drafts)
        else:
            state = ([], None)
        for j in range(1, self.num_drafts):
            alive = [i for i in state[0] if scheduled[i].num_draft_tokens > j]
            if not alive and not lockstep:
                break
            rows = _Rows(alive, [scheduled[i].start_position + j - 1 for i in alive], [1] * len(alive))
            kept = [state[0].index(i) for i in alive]
            prev = state[1][int64_tensor(kept).to(device)] if state[1] is not None and kept else None
            inputs = [prev] if prev is not None else []
            layer = min(j, len(self.model.mtp) - 1)
            stream, normed = self._run(layer, scheduled, rows, inputs, [[drafts[i][-1]] for i in alive], device)
            state = self._propose(layer, alive, list(range(len(alive))), stream, normed, drafts)
        return [
            replace(s, token_ids=s.token_ids[: len(s.token_ids) - s.num_draft_tokens] + fill_drafts(drafts[i], s))
            if s.num_draft_tokens
            else s
            for i, s in enumerate(scheduled)
        ]

    def keep(self, scheduled: Sequence[ScheduledRequest], stream: torch.Tensor) -> None:
        """The target's stream of this step `[T, H]` (rows in `scheduled` order): each request's rows
        wait for the next step, which says which were kept and what follows them."""
        first = 0
        for s in scheduled:
            n = len(s.token_ids)
            self._pending[s.request_id] = _Pending(s.start_position, list(s.token_ids), stream[first : first + n])
            first += n

    def _catch_up_rows(self, scheduled: Sequence[ScheduledRequest]) -> _Rows:
        """Per scheduled request with rows waiting: those before its start position (the kept ones).
        Rows that do not lead up to the start (a request recomputing after preemption) are dropped."""
        rows = _Rows([], [], [])
        for i, s in enumerate(scheduled):
            pending = self._pending.get(s.request_id)
            if pending is None:
                continue
            n = s.start_position - pending.start
            if not 0 < n <= len(pending.token_ids):
                del self._pending[s.request_id]
                continue
            rows.seqs.append(i)
            rows.starts.append(pending.start)
            rows.lens.append(n)
        return rows

    def _run(
        self,
        layer: int,
        scheduled: Sequence[ScheduledRequest],
        rows: _Rows,
        streams: list[torch.Tensor],
        next_ids: list[list[int]],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of MTP layer `layer` over `rows` -> (its stream, its normed output), `[R, H]` each."""
        model = self.model
        batch = attention_batch(
            [scheduled[i].block_ids for i in rows.seqs], rows.starts, rows.lens, self.block_size, device
        )
        plan = model.ops.plan_attention(batch)
        positions = int64_tensor(p for start, n in zip(rows.starts, rows.lens) for p in range(start, start + n))
        cos, sin = model.rotary.cos_sin(positions.to(device), model.dtype)
        ids = int64_tensor(itertools.chain.from_iterable(next_ids)).to(device)
        empty = torch.empty(0, model.cfg.hidden_size, dtype=model.dtype, device=device)
        hidden = torch.cat(streams) if streams else empty
        return model.mtp[layer](hidden, ids, cos, sin, self.caches[layer], plan)

    def _propose(
        self,
        layer: int,
        seqs: list[int],
        rows: list[int],
        stream: torch.Tensor,
        normed: torch.Tensor,
        drafts: dict[int, list[int]],
    ) -> tuple[list[int], torch.Tensor | None]:
        """Append each sequence's argmax of MTP layer `layer` at its row to its drafts -> (the
        sequences, their stream rows)."""
        if not seqs:
            return [], None
        index = int64_tensor(rows).to(stream.device)
        for i, token in zip(seqs, self.model.mtp[layer].logits(normed[index]).argmax(-1).tolist()):
            drafts[i].append(token)
        return seqs, stream[index]


def fill_drafts(drafts: list[int], s: ScheduledRequest) -> list[int]:
    """A decode without an MTP row to draft from (its first step after a recompute) still feeds
    its granted slots: copies of its last token, which verification keeps only if right."""
    return (drafts + [s.token_ids[0]] * s.num_draft_tokens)[: s.num_draft_tokens]
