"""MTP drafts for DeepSeek-V4 (speculative decoding method mtp): its MTP block (`models/v4/mtp.py`)
proposes the tokens a decode feeds after its last one, and the V4 verify path checks them (the
compressors step back past rejected ones), as `mtp_drafter` does for DeepSeek-V3's layers.

The block reads the target's hyper-connection streams of the kept positions, held until the next
step says which were kept and which token follows them (`MTPDrafter.keep` and its catch-up), then
chains itself for the later drafts on its own window cache. Its cache row for position p is row
p + 1 (`models/v4/mtp.py`), so every row a pass reads or writes lies in the window the scheduler
keeps for the step's own queries and in the blocks it granted for the drafts:

1. catch-up: the block over the kept positions of the previous step, at most the last `window`
   of them (no query reads rows further back, and their blocks may be given back): each writes its
   window key, the last one runs the whole block and proposes the first draft;
2. draft j = 2..N: one row per drafting decode at position start + j - 2 (row start + j - 1),
   reading the block's own output streams and the previous draft. Rows of rejected drafts are
   rewritten by the next catch-up before any query reads them.

Under lockstep (expert parallelism) every rank makes the same passes, empty or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from moeserve.models.v4.cache import SequenceView, V4Batch
from moeserve.ops.host_ints import int64_tensor
from moeserve.scheduler import ScheduledRequest
from moeserve.worker.mtp_drafter import MTPDrafter, fill_drafts


class V4MTPDrafter(MTPDrafter):
    """The catch-up and chaining of `MTPDrafter` over a V4 MTP block and its grouped cache."""

    def draft(self, scheduled: Sequence[ScheduledRequest], lockstep: bool) -> list[ScheduledRequest]:
        """`scheduled` with each drafting decode's placeholder drafts replaced by the block's."""
        window = self.model.cfg.compressed_attention.window
        catch_up = self._catch_up_rows(scheduled)
        seqs, firsts, streams, next_ids = [], [], [], []
        for i, start, n in zip(catch_up.seqs, catch_up.starts, catch_up.lens, strict=True):
            pending, kept = self._pending[scheduled[i].request_id], min(n, window)
            seqs.append(i)
            firsts.append(start + n - kept)
            streams.append(pending.stream[n - kept : n])
            next_ids.append((pending.token_ids[1:n] + [scheduled[i].token_ids[0]])[n - kept :])
        drafts: dict[int, list[int]] = {i: [] for i, s in enumerate(scheduled) if s.num_draft_tokens}
        cfg, model = self.model.cfg, self.model
        shape = (0, cfg.hyper_connections.mult, cfg.hidden_size)
        empty = torch.empty(shape, dtype=model.dtype, device=model.embed_tokens.device)
        out = empty
        if seqs or lockstep:
            out = self._pass(scheduled, seqs, firsts, torch.cat(streams) if streams else empty, next_ids, drafts)
        for j in range(1, self.num_drafts):
            alive = [i for i in seqs if scheduled[i].num_draft_tokens > j]
            if not alive and not lockstep:
                break
            inputs = out[int64_tensor([seqs.index(i) for i in alive]).to(out.device)]
            starts = [scheduled[i].start_position + j - 1 for i in alive]
            out = self._pass(scheduled, alive, starts, inputs, [[drafts[i][-1]] for i in alive], drafts)
            seqs = alive
        return [
            replace(s, token_ids=s.token_ids[: len(s.token_ids) - s.num_draft_tokens] + fill_drafts(drafts[i], s))
            if s.num_draft_tokens
            else s
            for i, s in enumerate(scheduled)
        ]

    def _pass(
        self,
        scheduled: Sequence[ScheduledRequest],
        seqs: list[int],
        firsts: list[int],
        hidden: torch.Tensor,
        next_ids: list[list[int]],
        drafts: dict[int, list[int]],
    ) -> torch.Tensor:
        """One pass of the block: sequence `seqs[k]`'s rows at positions `firsts[k] ..`, one per
        row of `hidden` `[R, N, H]` (each sequence's in turn) and next token. Each drafting
        sequence's argmax at its last row joins its drafts -> the block's output streams at each
        sequence's last row `[S, N, H]`."""
        model = self.model
        device = model.embed_tokens.device
        views = tuple(
            SequenceView(
                first + 1,  # the block's cache row of a position: that of the token it embeds
                {key: int64_tensor(table).to(device) for key, table in scheduled[i].group_tables.items()},
                -1,
                self.block_size,
            )
            for i, first in zip(seqs, firsts, strict=True)
        )
        ids = int64_tensor([t for row in next_ids for t in row]).to(device)
        rows = V4Batch(tuple(len(row) for row in next_ids), views)
        out, normed = model.mtp[0](ids, model.embed_tokens, hidden, rows, self.caches[0], None)
        for k, token in enumerate(model.compute_logits(normed).argmax(-1).tolist()):
            if seqs[k] in drafts:
                drafts[seqs[k]].append(token)
        return out
