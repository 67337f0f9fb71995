"""Layout of the `nvshmem` backend's symmetric buffers, and the index arithmetic its kernels do.

Pure torch, device-agnostic, no communication: everything here is what one rank computes from
its own inputs. The device kernels (not written yet) are to mirror these functions one to one;
the CPU tests check that a dispatch simulated with these indices hands every expert exactly the
rows, in exactly the order, that the `torch` backend does.

Symmetric buffers (same size on every rank; sizes from `buffer_sizes`). Let `T` be
`max_tokens_per_rank`, `K` top-k, `H` hidden, `L` the most local experts any rank holds
(`max_local_experts`, `ceil(E / ep)` for an even split) and `ep` the EP group size.

Dispatch receive buffer, a per-row metadata array parallel to it, and signal words:

* low_latency: expert-major `[L, ep * T, H]`. Local expert `e` owns `ep * T` rows, split into
  one region of `T` rows per source rank `s` (rows `s*T .. s*T+T-1`). A sender writes its pairs
  for (`e` on rank `d`) into its own region of `d`'s buffer, at slot = how many of its own
  earlier pairs (ascending `(token, k)`) go to the same expert. No information from any other
  rank is needed, so the puts can start at once (one round trip per step: the point of LL).
  `T` rows per region suffice because a token picks each expert at most once. Cost: the buffer
  is `L * ep * T = E * T` rows whatever the EP size, mostly empty.
* high_throughput: source-major `[ep * R, H]` with `R = T * min(K, L)` rows per source rank:
  a token sends at most `min(K, L)` rows to one rank (distinct experts, at most `L` there), so
  `ep * T * min(K, L)` rows are the exact worst case for a rank. A sender packs its rows for
  rank `d` into its region of `d`'s buffer, ordered by (local expert, `(token, k)`) -- the
  `torch` backend's send order -- at slot = exclusive prefix of its own counts to `d`'s earlier
  local experts + the LL slot. Still needs nothing from other ranks; smaller than LL by
  `L / min(K, L)` (4x for DeepSeek-V3 at EP 8) at the cost of rows not being expert-contiguous
  on arrival. A chunked (ring-buffer) variant can cut it further; that is a kernel decision.
* metadata: per receive row, 4 x 4 bytes: source rank (int32), source token (int32), k (int32),
  top-k weight (float32). combine() needs (rank, token, k) to put the expert output back.
* dispatch signal words: `[L, ep]` uint64 per rank (one per (local expert, source rank)); the
  sender writes `count + 1` after its rows (0 = not arrived), so the receiver learns the counts
  and completion from the same word.

Combine: each source rank receives one row per (token, k) pair it sent, at `[token, k]` of a
`[T, K, H]` buffer, plus `[ep, L]` signal words (one per (expert rank, local expert)). It then
reduces over k in `local`'s pair order (ascending global expert id) itself, with `local`'s
arithmetic -- no cross-rank summation order to worry about.

Send staging (symmetric because the IB transport can only put from registered memory): dispatch
packs each token once into `[T, H]` and puts it to up to K destinations; combine writes expert
outputs into a buffer shaped like the dispatch receive buffer before putting them home.

Figures for DeepSeek-V3 (E=256, H=7168, K=8, bfloat16 rows), per rank, in MiB (2**20 bytes),
computed by `buffer_sizes` (see `deepseek_v3_table`; a test checks these lines match it).
signal is both signal arrays in KiB; staging is both send buffers:

    mode             ep    T  dispatch_recv  meta  signal  combine_recv  staging    total
    low_latency       8  128          448.0   0.5       4          14.0    449.8    912.3
    low_latency      16  128          448.0   0.5       4          14.0    449.8    912.3
    low_latency      32  128          448.0   0.5       4          14.0    449.8    912.3
    high_throughput   8  128          112.0   0.1       4          14.0    113.8    239.9
    high_throughput  16  128          224.0   0.2       4          14.0    225.8    464.0
    high_throughput  32  128          448.0   0.5       4          14.0    449.8    912.3
    high_throughput   8 4096         3584.0   4.0       4         448.0   3640.0   7676.0
    high_throughput  16 4096         7168.0   8.0       4         448.0   7224.0  14848.0
    high_throughput  32 4096        14336.0  16.0       4         448.0  14392.0  29192.0

LL costs `E * T` rows whatever the EP size (~0.9 GiB at T=128 in bf16; DeepEP halves the
dispatch side with FP8 rows). HT grows with ep: the full-size layout is fine for decode-sized T
but far too large at prefill sizes (T=4096), where a chunked ring buffer must replace it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.dispatch.placement import ExpertPlacement

MODES = ("low_latency", "high_throughput")
META_BYTES_PER_ROW = 16  # source rank, source token, k (int32 each), top-k weight (float32)
SIGNAL_BYTES = 8  # one uint64 NVSHMEM signal word
ROW_ALIGN_BYTES = 16  # kernels copy rows in 16-byte vectors


@dataclass(frozen=True)
class NvshmemBufferConfig:
    """What sizes the symmetric buffers. max_local_experts: None = ceil(num_experts / ep_size);
    give the placement's own (see `for_placement`) when it is uneven or not contiguous."""

    ep_size: int
    num_experts: int
    hidden: int
    top_k: int
    max_tokens_per_rank: int
    dtype: torch.dtype = torch.bfloat16
    mode: str = "low_latency"
    max_local_experts: int | None = None

    def __post_init__(self) -> None:
        for field in ("ep_size", "num_experts", "hidden", "top_k", "max_tokens_per_rank"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts} (a token picks distinct experts)"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        row_bytes = self.hidden * self.element_size
        if row_bytes % ROW_ALIGN_BYTES:
            raise ValueError(
                f"a row of hidden={self.hidden} {self.dtype} is {row_bytes} bytes; the kernels need a multiple of "
                f"{ROW_ALIGN_BYTES}"
            )
        least = math.ceil(self.num_experts / self.ep_size)
        if self.max_local_experts is not None and not least <= self.max_local_experts <= self.num_experts:
            raise ValueError(
                f"max_local_experts={self.max_local_experts} outside [{least}, {self.num_experts}] for "
                f"{self.num_experts} experts on {self.ep_size} ranks"
            )

    @classmethod
    def for_placement(
        cls,
        placement: ExpertPlacement,
        hidden: int,
        top_k: int,
        max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
        mode: str = "low_latency",
    ) -> NvshmemBufferConfig:
        return cls(
            placement.ep_size,
            placement.num_experts,
            hidden,
            top_k,
            max_tokens_per_rank,
            dtype,
            mode,
            max_local_experts=max_local_experts(placement),
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def local_experts(self) -> int:
        """L: expert slots per rank in the buffers."""
        return self.max_local_experts or math.ceil(self.num_experts / self.ep_size)

    @property
    def region_rows(self) -> int:
        """Rows of one sender's region: per (local expert, source) in LL, per source in HT."""
        return region_rows(self.mode, self.max_tokens_per_rank, self.top_k, self.local_experts)

    @property
    def recv_rows(self) -> int:
        """Rows of the dispatch receive buffer."""
        if self.mode == "low_latency":
            return self.local_experts * self.ep_size * self.max_tokens_per_rank
        return self.ep_size * self.region_rows


@dataclass(frozen=True)
class BufferSizes:
    """Bytes of each symmetric buffer on one rank (every rank allocates the same)."""

    dispatch_recv: int  # recv_rows * H * elem
    dispatch_meta: int  # recv_rows * 16
    dispatch_signal: int  # L * ep * 8
    dispatch_send: int  # T * H * elem (each token packed once)
    combine_recv: int  # T * K * H * elem
    combine_signal: int  # ep * L * 8
    combine_send: int  # recv_rows * H * elem

    @property
    def total(self) -> int:
        return (
            self.dispatch_recv
            + self.dispatch_meta
            + self.dispatch_signal
            + self.dispatch_send
            + self.combine_recv
            + self.combine_signal
            + self.combine_send
        )


def buffer_sizes(config: NvshmemBufferConfig) -> BufferSizes:
    """Per-rank bytes of every symmetric buffer (formulas in the module docstring)."""
    row = config.hidden * config.element_size
    words = config.local_experts * config.ep_size * SIGNAL_BYTES
    return BufferSizes(
        dispatch_recv=config.recv_rows * row,
        dispatch_meta=config.recv_rows * META_BYTES_PER_ROW,
        dispatch_signal=words,
        dispatch_send=config.max_tokens_per_rank * row,
        combine_recv=config.max_tokens_per_rank * config.top_k * row,
        combine_signal=words,
        combine_send=config.recv_rows * row,
    )


def deepseek_v3_table() -> list[str]:
    """The docstring's DeepSeek-V3 lines, from `buffer_sizes`."""
    lines = []
    for mode, tokens in (("low_latency", 128), ("high_throughput", 128), ("high_throughput", 4096)):
        for ep in (8, 16, 32):
            s = buffer_sizes(NvshmemBufferConfig(ep, 256, 7168, 8, tokens, torch.bfloat16, mode))
            lines.append(
                f"    {mode:<15} {ep:>3} {tokens:>4} {_mib(s.dispatch_recv):>14} {_mib(s.dispatch_meta):>5} "
                f"{(s.dispatch_signal + s.combine_signal) / 2**10:>7.0f} {_mib(s.combine_recv):>13} "
                f"{_mib(s.dispatch_send + s.combine_send):>8} {_mib(s.total):>8}"
            )
    return lines


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f}"


def region_rows(mode: str, max_tokens_per_rank: int, top_k: int, max_local_experts: int) -> int:
    """Rows one sender may fill: per (local expert, source rank) in LL, per source rank in HT."""
    if mode == "low_latency":
        return max_tokens_per_rank
    if mode == "high_throughput":
        return max_tokens_per_rank * min(top_k, max_local_experts)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def max_local_experts(placement: ExpertPlacement) -> int:
    """L: the most experts any rank of the placement holds."""
    return placement.max_local_experts


def local_index_of_experts(placement: ExpertPlacement) -> torch.Tensor:
    """`[E]` int64: each global expert's index among its owner's local experts (ascending ids)."""
    return torch.tensor(placement.local_index, dtype=torch.int64)


@dataclass(frozen=True)
class DispatchSlots:
    """Where each of this rank's (token, k) pairs goes. All `[T, K]` int64 unless noted.

    dest_rank, dest_local_expert:  the rank holding the pair's expert, and its local index there.
    slot:        row within this rank's region of the destination buffer (see module docstring).
    buffer_row:  the flat row of the destination's dispatch receive buffer the pair's hidden row
                 is written to (`[L, ep*T]` flattened in LL, `[ep*R]` in HT).
    counts:      `[ep, L]` pairs this rank sends to each (dest rank, local expert): the values of
                 the signal words it writes (plus one).
    """

    dest_rank: torch.Tensor
    dest_local_expert: torch.Tensor
    slot: torch.Tensor
    buffer_row: torch.Tensor
    counts: torch.Tensor
    mode: str
    region_rows: int
    max_local_experts: int


def dispatch_slots(
    topk_ids: torch.Tensor, placement: ExpertPlacement, max_tokens_per_rank: int, mode: str = "low_latency"
) -> DispatchSlots:
    """Destination rank, local expert and receive-buffer slot of every (token, k) pair of this rank.

    Uses only this rank's `topk_ids` `[T, K]` (global expert ids, distinct per token) and the
    placement; `placement.rank` is the sending rank. A kernel computes `within` (how many earlier
    pairs, ascending (token, k), go to the same expert) with an ordered per-expert scan, not with
    atomics: atomic slot claims would be correct but would not reproduce the `torch` row order.
    Raises ValueError for T > max_tokens_per_rank, ids outside [0, E), or a token naming an
    expert twice: with those excluded, every slot provably fits its region.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    num_tokens, top_k = topk_ids.shape
    if num_tokens > max_tokens_per_rank:
        raise ValueError(
            f"{num_tokens} tokens on rank {placement.rank} exceed max_tokens_per_rank={max_tokens_per_rank}; "
            "the buffers were sized for fewer"
        )
    ep, num_experts = placement.ep_size, placement.num_experts
    lmax = max_local_experts(placement)
    rows = region_rows(mode, max_tokens_per_rank, top_k, lmax)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts})")
    if top_k > 1 and num_tokens:
        ranked = topk_ids.sort(dim=1).values
        repeated = (ranked[:, 1:] == ranked[:, :-1]).any(dim=1).nonzero()
        if repeated.numel():
            token = int(repeated[0, 0])
            row = ranked[token]
            expert = int(row[1:][row[1:] == row[:-1]][0])
            raise ValueError(f"token {token} names expert {expert} twice; a token's top-k experts must be distinct")

    owner = placement.owner.to(device)
    local_index = local_index_of_experts(placement).to(device)
    dest_rank = owner[flat]
    dest_local = local_index[flat]

    # within[p] = #{q < p : expert[q] == expert[p]}: position in a stable sort by expert minus the group start.
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=num_experts)
    group_start = torch.cumsum(per_expert, 0) - per_expert
    within = torch.empty_like(flat)
    within[order] = torch.arange(flat.numel(), device=device) - group_start[flat[order]]

    counts = torch.zeros(ep, lmax, dtype=torch.int64, device=device)
    counts.index_put_((dest_rank, dest_local), torch.ones_like(flat), accumulate=True)

    src = placement.rank
    if mode == "low_latency":
        slot = within
        buffer_row = dest_local * (ep * max_tokens_per_rank) + src * max_tokens_per_rank + slot
    else:  # region_rows() has validated the mode
        prefix = torch.cumsum(counts, 1) - counts  # [ep, L]: rows before each local expert in a dest's region
        slot = prefix[dest_rank, dest_local] + within
        buffer_row = src * rows + slot
    if slot.numel() and int(slot.max()) >= rows:
        raise AssertionError(f"slot {int(slot.max())} outside a {rows}-row {mode} region (a bug in this layout)")
    shape = topk_ids.shape
    return DispatchSlots(
        dest_rank.view(shape),
        dest_local.view(shape),
        slot.view(shape),
        buffer_row.view(shape),
        counts,
        mode,
        rows,
        lmax,
    )


def receive_order(
    counts_from_each_source: torch.Tensor,
    max_tokens_per_rank: int,
    mode: str = "low_latency",
    top_k: int | None = None,
    max_local_experts: int | None = None,
) -> torch.Tensor:
    """`[N_recv]` int64: for each row of the `torch` backend's DispatchOutput.hidden, its flat row
    in this rank's dispatch receive buffer.

    counts_from_each_source: `[ep, n]` rows each source rank sent to each of this rank's local
    experts (the signal words minus one); `n` may be this rank's own count of local experts or
    the padded L. Output order: local expert, then source rank, then the sender's (token, k)
    order -- the `torch` backend's. HT needs `top_k` and `max_local_experts` (L) to know the
    region size; LL needs neither.
    """
    counts = counts_from_each_source.to(torch.int64)
    ep, n_local = counts.shape
    device = counts.device
    if mode == "high_throughput":
        if top_k is None or max_local_experts is None:
            raise ValueError("high_throughput receive_order needs top_k and max_local_experts")
        if n_local > max_local_experts:
            raise ValueError(f"counts name {n_local} local experts, more than max_local_experts={max_local_experts}")
    rows = region_rows(mode, max_tokens_per_rank, top_k or 1, max_local_experts or n_local)
    if counts.numel() and (
        int(counts.min()) < 0 or int(counts.sum(1).max() if mode == "high_throughput" else counts.max()) > rows
    ):
        raise ValueError(f"counts exceed the {rows}-row {mode} regions")

    # Output groups g = (expert e, source s) in order e-major; each group's start in the buffer.
    per_group = counts.t().reshape(-1)  # [n * ep]
    e = torch.arange(n_local, device=device).repeat_interleave(ep)
    s = torch.arange(ep, device=device).repeat(n_local)
    if mode == "low_latency":
        base = e * (ep * max_tokens_per_rank) + s * max_tokens_per_rank
    else:
        prefix = torch.cumsum(counts, 1) - counts  # [ep, n]
        base = s * rows + prefix[s, e]
    total = int(per_group.sum())
    group = torch.repeat_interleave(torch.arange(per_group.numel(), device=device), per_group, output_size=total)
    group_out_start = torch.cumsum(per_group, 0) - per_group
    return base[group] + torch.arange(total, device=device) - group_out_start[group]
