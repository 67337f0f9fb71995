"""DeepSeek-V4's compressors: every `ratio` tokens of a layer pooled into one attention entry.

Each token projects to a value `kv` and a gate; a window's entry is the softmax-gated sum (over
the window's tokens, per channel, with a learnt bias per position in the window) of its values,
RMS-normalised and rotated at position `entry * ratio`. HCA (`overlap` off) pools each window
alone. CSA (`overlap` on) projects two series per token, Ca and Cb, and its entry w pools window
w's Cb with window w - 1's Ca, so it spans 2 x ratio tokens with stride ratio: what carries from
one window to the next is the previous window's Ca values and gates (`Overlap`).

The lightning indexer of a CSA layer is such a compressor at its own small head size, whose
entries score each query (`sum_h w_h * relu(q_h . k)`) to keep the `index_topk` best entries the
query may see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moeserve.models.layers.linear import Linear
from moeserve.models.v4.cache import write_rows
from moeserve.models.v4.norm import Float32RMSNorm
from moeserve.models.v4.rotary import TailRotary, rotate_tail
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.compressed_attention import PagedRows, top_entries


@dataclass(frozen=True)
class Overlap:
    """A CSA compressor's carry: the last closed window's Ca values and biased gates `[ratio, D]`."""

    kv: torch.Tensor
    gate: torch.Tensor


@dataclass(frozen=True)
class Drafts:
    """A sequence's drafts as its compressors see them: `kept` (`LayerCache.kept`, the
    compressor's part), whether this step verifies drafts (its inputs are kept), and `restore`:
    -1, or how many drafts the previous step accepted, fewer than it fed (the open window steps
    back)."""

    kept: tuple[torch.Tensor, ...] = ()
    verifies: bool = False
    restore: int = -1


class Compressor(nn.Module):
    def __init__(
        self,
        hidden: int,
        head_dim: int,
        ratio: int,
        overlap: bool,
        eps: float,
        rotary: TailRotary,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap, self.ops = head_dim, ratio, overlap, ops
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = Linear(hidden, width, False, dtype, device, ops)
        self.gate_proj = Linear(hidden, width, False, dtype, device, ops)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, device=device), requires_grad=False)
        self.kv_norm = Float32RMSNorm(head_dim, eps, device)
        self.rotary = rotary

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[S, H]` -> each token's values and gates `[S, width]`."""
        return self.kv_proj(x), self.gate_proj(x)

    def pool(
        self, kv: torch.Tensor, gate: torch.Tensor, first_entry: int, carry: Overlap | None
    ) -> tuple[torch.Tensor, Overlap | None]:
        """The entries of n closed windows: kv, gate `[n * ratio, width]`, the window of entry
        `first_entry` first; `carry`: the window before's (None at the sequence's first) ->
        (entries `[n, head_dim]`, the carry after them; None without overlap)."""
        n, r, d = kv.shape[0] // self.ratio, self.ratio, self.head_dim
        kv = kv.view(n, r, -1)
        gate = gate.view(n, r, -1) + self.position_bias
        next_carry = None
        if self.overlap:
            pooled_kv = kv.new_zeros((n, 2 * r, d))
            pooled_gate = gate.new_full((n, 2 * r, d), float("-inf"))
            pooled_kv[:, r:], pooled_gate[:, r:] = kv[..., d:], gate[..., d:]
            pooled_kv[1:, :r], pooled_gate[1:, :r] = kv[:-1, :, :d], gate[:-1, :, :d]
            if carry is not None:
                pooled_kv[0, :r], pooled_gate[0, :r] = carry.kv.to(kv.dtype), carry.gate.to(gate.dtype)
            next_carry = Overlap(kv[-1, :, :d].clone(), gate[-1, :, :d].clone())
            kv, gate = pooled_kv, pooled_gate
        entries = self.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        positions = (torch.arange(n, device=kv.device) + first_entry) * r
        cos, sin = self.rotary.cos_sin(positions, entries.dtype)
        return rotate_tail(entries, cos, sin), next_carry

    def extend(
        self,
        x: torch.Tensor,
        start: int,
        rows: PagedRows,
        state: tuple[torch.Tensor, ...],
        slot: int,
        drafts: Drafts = Drafts(),
    ) -> None:
        """A sequence's next rows x `[n, H]` from position `start`: the windows they close pooled
        (with the pending positions the state holds) and written to the sequence's entries
        `rows`, the rest left pending in `state`'s slot. With `drafts`: first the open window
        stepped back past the previous step's rejected drafts, and a verify step's inputs kept."""
        if drafts.restore >= 0:
            self.step_back(start, drafts.restore, state, drafts.kept, slot)
        kv, gate = self.project(x)
        pending, first_entry = start % self.ratio, start // self.ratio
        kv = torch.cat([state[0][slot, :pending], kv])
        gate = torch.cat([state[1][slot, :pending], gate])
        if drafts.verifies:
            kept = drafts.kept
            kept[0][slot, : kv.shape[0]], kept[1][slot, : kv.shape[0]] = kv, gate
            if self.overlap:
                kept[2][slot], kept[3][slot] = state[2][slot], state[3][slot]
        usable = kv.shape[0] // self.ratio * self.ratio
        if usable:
            carry = Overlap(state[2][slot], state[3][slot]) if self.overlap and first_entry else None
            entries, carry = self.pool(kv[:usable], gate[:usable], first_entry, carry)
            write_rows(rows.cache, rows.table, first_entry, entries, rows.block_size)
            if carry is not None:
                state[2][slot], state[3][slot] = carry.kv, carry.gate
        left = kv.shape[0] - usable
        state[0][slot, :left], state[1][slot, :left] = kv[usable:], gate[usable:]

    def step_back(
        self, start: int, accepted: int, state: tuple[torch.Tensor, ...], kept: tuple[torch.Tensor, ...], slot: int
    ) -> None:
        """The open window (and carry) of `state`'s slot set to what it was after position
        `start - 1`, from what the previous step kept: it verified drafts from `start - 1 -
        accepted`, and `accepted` of them were. The windows its kept positions close before
        `start` pooled accepted tokens only, so their entries stand; the last of them is the carry."""
        r, d = self.ratio, self.head_dim
        first = start - 1 - accepted
        held = start - (first - first % r)  # kept rows up to `start`, from the open window's first
        closed = held // r * r
        if self.overlap and closed:
            state[2][slot] = kept[0][slot, closed - r : closed, :d]
            state[3][slot] = kept[1][slot, closed - r : closed, :d] + self.position_bias[:, :d]
        elif self.overlap:
            state[2][slot], state[3][slot] = kept[2][slot], kept[3][slot]
        state[0][slot, : held - closed], state[1][slot, : held - closed] = (
            kept[0][slot, closed:held],
            kept[1][slot, closed:held],
        )

    def sequence_entries(self, x: torch.Tensor) -> torch.Tensor:
        """The entries of a whole sequence `[S, H]` from position 0: one per closed window."""
        usable = x.shape[0] // self.ratio * self.ratio
        kv, gate = self.project(x[:usable])
        if not usable:
            return kv.new_zeros((0, self.head_dim))
        return self.pool(kv, gate, 0, None)[0]


class IndexerScorer(nn.Module):
    def __init__(
        self, hidden: int, num_heads: int, dtype: torch.dtype, device: torch.device | str, ops: LayerOps
    ) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, num_heads, False, dtype, device, ops)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at `index_head_dim`,
    queries from the attention's low-rank q (`q_residual`), rotated by the compressed rotary."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        ratio: int,
        top_k: int,
        eps: float,
        rotary: TailRotary,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__(hidden, head_dim, ratio, True, eps, rotary, dtype, device, ops)
        self.num_heads, self.top_k = num_heads, top_k
        self.q_b_proj = Linear(q_lora_rank, num_heads * head_dim, False, dtype, device, ops)
        self.scorer = IndexerScorer(hidden, num_heads, dtype, device, ops)

    def scoring_inputs(
        self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries' rows x `[S, H]` and q_residual `[S, q_lora]` at `positions [S]` -> (the
        rotated index queries `[S, Hi, Di]`, their head weights `[S, Hi]` float32 by Hi ** -0.5)."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q = rotate_tail(self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)
        return q, self.scorer.weights_proj(x).float() * self.num_heads**-0.5

    def select(
        self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """The indexer's entries `keys [E, Di]` -> bool `[S, E]`: the entries each query attends
        (its top_k best scoring among those it may see)."""
        q, weights = self.scoring_inputs(x, q_residual, positions)
        return top_entries(q, weights, keys, positions, self.ratio, self.top_k)

    def select_cached(self, x: torch.Tensor, q_residual: torch.Tensor, start: int, keys: PagedRows) -> Any:
        """`select` for a sequence's rows from position `start` over its key cache (extended
        already), in the ops backend's form of a choice (`LayerOps.compressed_select`)."""
        q, weights = self.scoring_inputs(x, q_residual, torch.arange(start, start + x.shape[0], device=x.device))
        return self.ops.compressed_select(q, weights, keys, start, self.ratio, self.top_k)
