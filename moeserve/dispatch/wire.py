"""What an MoE layer's all-to-all moves: rows and bytes per (source rank, destination rank).

Counted from the routing itself, on the device, before the send: each (token, k) pair is one
row dispatched to the rank owning its physical slot and one row combined back. A row whose
slot is on the source rank never crosses a link; it is counted apart (`local`). The payload is
counted, not the wire format: the `torch` backend's low-latency mode also sends zero padding up
to its fixed region, and FP8 rows carry their scales (`row_bytes` includes those).

Links: ranks of one NVLink domain (`domain` consecutive ranks, `--nvlink-domain-size`) exchange
rows by load/store, the others through the NIC (the `nvshmem` backend's puts); `LINKS` names the
two, and the bytes of each direction split between them, since the NIC's are the scarce ones.

The analytic side (the seeds' comparison, per token and MoE layer, per rank):

* EP: a token's K rows go out and come back; under uniform routing a share (N - 1) / N of them
  crosses ranks, whatever N: `2 * K * (N - 1) / N` rows.
* TP (experts sharded by tensor parallelism): the layer's output is all-reduced. A ring
  all-reduce (reduce-scatter then all-gather) sends `2 * (N - 1) / N` rows per token from each
  rank, and every rank holds every token, so per token of the batch the group sends
  `2 * (N - 1)` rows: it grows with N while EP's does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.dispatch.counts import count_per_expert
from moeserve.dispatch.fp8 import packed_row_bytes

LINKS = ("intra_domain", "inter_domain")


def rows_per_destination(
    slots: torch.Tensor, owner: torch.Tensor, ep_size: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 `[ep]`: the pairs of `slots` (int64 `[T, K]` physical slots) each rank receives;
    owner: int64 `[P]`, each slot's rank; weights: int64 `[T, K]`, what each pair counts (None: 1)."""
    return count_per_expert(owner[slots.reshape(-1)], ep_size, weights)


def dispatch_row_bytes(hidden_size: int, dtype: torch.dtype, fp8: bool) -> int:
    """Bytes of one dispatched row: the activation row, or the packed FP8 row with its scales."""
    return packed_row_bytes(hidden_size) if fp8 else hidden_size * dtype.itemsize


@dataclass(frozen=True)
class WireVolume:
    """rows[src][dst]: rows dispatched from src to dst (all MoE layers; combine sends as many back).
    dispatch_row_bytes / combine_row_bytes: bytes of one row each way. domain: ranks per NVLink
    domain (None: every rank in one; 0: none, every row between ranks takes the NIC, as the
    `nvshmem` backend's puts do at `nvlink_domain_size=0`)."""

    rows: list[list[int]]
    dispatch_row_bytes: int
    combine_row_bytes: int
    domain: int | None = None

    def link(self, src: int, dst: int) -> str:
        """Which of `LINKS` rows between src and dst take."""
        same = self.domain is None or (self.domain > 0 and src // self.domain == dst // self.domain)
        return LINKS[0] if same else LINKS[1]

    def sent(self, src: int) -> int:
        """Rows src dispatched to other ranks."""
        return sum(n for dst, n in enumerate(self.rows[src]) if dst != src)

    def local(self, src: int) -> int:
        """Rows src dispatched to its own slots (no link crossed)."""
        return self.rows[src][src]

    def dispatch_bytes(self, src: int, link: str | None = None) -> int:
        """Bytes src dispatched to other ranks (over `link` only, if given)."""
        rows = sum(n for dst, n in enumerate(self.rows[src]) if dst != src and link in (None, self.link(src, dst)))
        return rows * self.dispatch_row_bytes

    def combine_bytes(self, dst: int, link: str | None = None) -> int:
        """Bytes rank dst sends back in combine: the rows other ranks dispatched to it (over `link` only)."""
        rows = sum(row[dst] for src, row in enumerate(self.rows) if src != dst and link in (None, self.link(src, dst)))
        return rows * self.combine_row_bytes


def ep_rows_per_token(top_k: int, ep_size: int) -> float:
    """Rows crossing ranks per token and MoE layer, out and back, under uniform routing."""
    return 2 * top_k * (ep_size - 1) / ep_size


def tp_rows_per_token(tp_size: int) -> float:
    """Rows a ring all-reduce sends per token and layer, over the whole TP group."""
    return 2 * (tp_size - 1)
