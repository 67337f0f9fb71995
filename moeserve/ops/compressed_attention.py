"""DeepSeek-V4's attention over a sliding window plus compressed entries, and its lightning
indexer's choice of entries, in plain torch: the reference the Triton kernels
(`kernels.compressed_attention`) are held to, and the CPU path.

A query at position p sees the window's keys at positions p - window + 1 .. p and the entries of
the compression windows closed at p (entry e pools positions e * ratio .. (e + 1) * ratio - 1, so
e < (p + 1) // ratio): all of them on an HCA layer, the `top_k` its indexer scores best on a CSA
layer. Each key is also its value (shared-KV MQA); a learnt sink logit per head joins the softmax.

The caches are read through one sequence's block table (`PagedRows`): row i of a group lies in
block `table[i // block_size]` at `i % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PagedRows:
    """One sequence's rows of one cache group: the group's tensor `[N, B, D]`, the sequence's
    block table `[blocks]` and the block size."""

    cache: torch.Tensor
    table: torch.Tensor
    block_size: int

    def read(self, first: int, end: int) -> torch.Tensor:
        """Rows `first .. end - 1` `[end - first, D]`."""
        index = torch.arange(first, end)
        return self.cache[self.table[index // self.block_size], index % self.block_size]


@dataclass(frozen=True)
class SequenceKeys:
    """What one sequence's queries at positions `start ..` attend on a V4 layer: the last
    `window_len` keys of its window cache and, on a compressed layer, its `entries` (one per
    `ratio` positions; None on a window-only layer). Both hold this step's rows already."""

    start: int
    window: PagedRows
    window_len: int
    entries: PagedRows | None = None
    ratio: int = 0


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q `[S, Hq, D]`, keys (also the values) `[L, D]`, visible bool `[S, L]`, sinks `[Hq]` ->
    `[S, Hq, D]`: softmax over the visible keys and the head's sink, the sink's share dropped."""
    logits = torch.einsum("shd,ld->shl", q, keys) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.to(logits.dtype)[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("shl,ld->shd", probs.to(keys.dtype), keys)


def window_visible(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool `[S, L]`: keys at most `window - 1` tokens before the query, none after."""
    distance = query_positions[:, None] - key_positions[None, :]
    return (distance >= 0) & (distance < window)


def visible_entries(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """bool `[S, E]`: which entries each query may see, those of windows closed at its position."""
    return torch.arange(num_entries, device=positions.device)[None, :] < ((positions + 1) // ratio)[:, None]


def top_entries(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int, top_k: int
) -> torch.Tensor:
    """The indexer's rotated queries `[S, Hi, Di]` at `positions [S]`, their head weights `[S, Hi]`
    float32 (scaled by Hi ** -0.5) and its entries `keys [E, Di]` -> bool `[S, E]`: each query's
    `top_k` best scoring entries (`sum_h w_h * relu(q_h . k) / sqrt(Di)`) among those it may see."""
    num_entries = keys.shape[0]
    scores = F.relu(torch.einsum("shd,ed->she", q.float(), keys.float())) * q.shape[-1] ** -0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [S, E]
    visible = visible_entries(positions, num_entries, ratio)
    chosen = torch.zeros_like(visible)
    if num_entries:
        top = scores.masked_fill(~visible, float("-inf")).topk(min(top_k, num_entries), dim=-1).indices
        chosen.scatter_(1, top, True)
    return chosen & visible


def compressed_select(
    q: torch.Tensor, weights: torch.Tensor, keys: PagedRows, start: int, ratio: int, top_k: int
) -> torch.Tensor:
    """`top_entries` for one sequence's queries at positions `start ..`, over the indexer's
    entries closed by the last of them (its key cache, already extended) -> bool `[S, E]`."""
    positions = torch.arange(start, start + q.shape[0], device=q.device)
    return top_entries(q, weights, keys.read(0, (start + q.shape[0]) // ratio), positions, ratio, top_k)


def compressed_attention(
    q: torch.Tensor, sinks: torch.Tensor, scale: float, keys: SequenceKeys, selection: torch.Tensor | None
) -> torch.Tensor:
    """One sequence's queries `[S, Hq, D]` over its `keys`: the window's and the entries closed at
    each query, all of them (`selection` None) or those `compressed_select` chose -> `[S, Hq, D]`."""
    n, start = q.shape[0], keys.start
    positions = torch.arange(start, start + n, device=q.device)
    first = max(0, start - keys.window_len + 1)
    rows = keys.window.read(first, start + n)
    visible = window_visible(positions, torch.arange(first, start + n, device=q.device), keys.window_len)
    if keys.entries is not None:
        closed = keys.entries.read(0, (start + n) // keys.ratio)
        chosen = visible_entries(positions, closed.shape[0], keys.ratio) if selection is None else selection
        rows, visible = torch.cat([rows, closed]), torch.cat([visible, chosen], dim=1)
    return sink_attention(q, rows, visible, sinks, scale)
