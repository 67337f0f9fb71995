"""The `nvshmem` backend's symmetric buffer: which bytes of the one allocation hold what.

Let `EP` be the EP group's size, `L` the most local experts any rank holds, `K` top-k, `C` the
tokens per rank in one chunk, `S` the ring slots (2), and a row `row_bytes` of payload (one token's
hidden state, or its FP8 bytes and scales). Every rank allocates the same, in this order:

    dispatch_rows    [S, L, EP, C] rows   slot s, local expert e, source rank r: r's rows for e
    dispatch_meta    [S, L, EP, C] int32  each row's pair in its source's chunk, token * K + k
    dispatch_signal  [S, L, EP] int64     epoch << 32 | rows, written by the source after its rows
    dispatch_credit  [S, EP] int64        (as a sender) the last seq rank d has copied out of a slot of us
    dispatch_done    [S, EP] int64        (as a receiver) groups copied out of a slot per source, ever
    notify           [S, EP, L + 1] int64 a source's row counts per local expert, and its tokens
    notify_signal    [S, EP] int64
    combine_rows     [S, C * K] rows      one row per (token, k) of our chunk, back from its expert
    combine_signal   [S, EP, L] int64     epoch << 32 | rows, per (expert rank, local expert)
    combine_credit   [S, EP] int64        (as an expert rank) the last seq source s has reduced from a slot

and, where some peers are reached by puts (`staged`), the local sources of those puts:

    dispatch_stage       [S, L, EP, C] rows   our rows for (expert e of) rank d, gathered for the put
    dispatch_stage_meta  [S, L, EP, C] int32  their pairs
    notify_stage         [S, EP, L + 1] int64 the counts row for rank d
    combine_stage        [S, L, EP, C] rows   the experts' rows for (e, source s), in dispatch order

A put's source must be symmetric (registered) memory and must not change until the put is
delivered; the staging regions are both, and a staging slot is rewritten only after the peer's
credit for its previous use, which follows the delivery.

A sender's region of a receive slot is `C` rows per (expert, source) because a token picks an
expert at most once, so no count from any other rank is needed before storing: one round trip
per chunk. The cost is `E * C` rows per slot whatever EP is, most of them empty (DeepEP's
low-latency layout makes the same trade). Slots are reused every `S` sequences, guarded by the
credit words (one per slot and peer: a put can only set a word, never raise it to a maximum, and
per slot a word is set in sequence order whatever order two streams finish in); a signal word
holds its slot's previous epoch or the current one (`peer_copy.epoch`, compared for equality),
so a signal from an earlier use of a slot is never mistaken for the current one and nothing
needs cleaning between steps.

Per rank for DeepSeek-V3 (E=256, H=7168, K=8, bf16 rows, C=128, S=2), from `deepseek_v3_line` (a
test checks this line): dispatch rows 896.0 MiB, combine rows 28.0 MiB, total 924.3 MiB. The same
at any EP size and for prefill too, since long steps stream through the slots in chunks (the
step-sized layout of issue 7 needed 7.5-28.5 GiB per rank at 4096 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from moeserve.dispatch.fp8 import packed_row_bytes
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.dispatch.rows import DispatchRows

SLOTS = 2
SIGNAL_BYTES = 8
ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class SymmetricLayout:
    """Byte offsets of every region of the symmetric buffer (see the module docstring). The
    derived tables are cached: the kernels' launches read them on every dispatch."""

    ep: int
    local_experts: int
    top_k: int
    chunk_tokens: int
    row_bytes: int  # dispatch payload per token, a multiple of 4 (rows move as int32 words)
    out_row_bytes: int  # combine payload per (token, k): the experts' output row
    slots: int = SLOTS
    staged: bool = False  # some peers are reached by puts: the staging regions exist

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "staged":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive int, got {value!r}")
        if self.row_bytes % 4 or self.out_row_bytes % 4:
            raise ValueError(f"rows of {self.row_bytes} and {self.out_row_bytes} bytes: the kernels move 4-byte words")

    @classmethod
    def for_rows(
        cls, placement: ExpertPlacement, rows: DispatchRows, chunk_tokens: int, dispatch_fp8: bool, staged: bool = False
    ) -> SymmetricLayout:
        """The layout a dispatcher of `placement` needs for a model's `rows`: everything it depends
        on is known at startup, so the buffer can be allocated before any dispatch."""
        out_row_bytes = rows.hidden_size * rows.dtype.itemsize
        return cls(
            ep=placement.ep_size,
            local_experts=placement.max_local_experts,
            top_k=rows.top_k,
            chunk_tokens=chunk_tokens,
            row_bytes=packed_row_bytes(rows.hidden_size) if dispatch_fp8 else out_row_bytes,
            out_row_bytes=out_row_bytes,
            staged=staged,
        )

    @property
    def groups(self) -> int:
        """(local expert, rank) pairs: signal words per slot."""
        return self.local_experts * self.ep

    @cached_property
    def region_sizes(self) -> dict[str, int]:
        s, g, c = self.slots, self.groups, self.chunk_tokens
        staged = int(self.staged)
        return {
            "dispatch_rows": s * g * c * self.row_bytes,
            "dispatch_meta": s * g * c * 4,
            "dispatch_signal": s * g * SIGNAL_BYTES,
            "dispatch_credit": s * self.ep * SIGNAL_BYTES,
            "dispatch_done": s * self.ep * SIGNAL_BYTES,
            "notify": s * self.ep * (self.local_experts + 1) * 8,
            "notify_signal": s * self.ep * SIGNAL_BYTES,
            "combine_rows": s * c * self.top_k * self.out_row_bytes,
            "combine_signal": s * g * SIGNAL_BYTES,
            "combine_credit": s * self.ep * SIGNAL_BYTES,
            "dispatch_stage": staged * s * g * c * self.row_bytes,
            "dispatch_stage_meta": staged * s * g * c * 4,
            "notify_stage": staged * s * self.ep * (self.local_experts + 1) * 8,
            "combine_stage": staged * s * g * c * self.out_row_bytes,
        }

    @cached_property
    def offsets(self) -> dict[str, int]:
        offsets, at = {}, 0
        for name, size in self.region_sizes.items():
            offsets[name] = at
            at += _aligned(size)
        return offsets

    @cached_property
    def nbytes(self) -> int:
        return sum(_aligned(size) for size in self.region_sizes.values())


def deepseek_v3_line() -> str:
    """The docstring's DeepSeek-V3 figures, from the layout itself."""
    layout = SymmetricLayout(
        ep=8, local_experts=32, top_k=8, chunk_tokens=128, row_bytes=7168 * 2, out_row_bytes=7168 * 2
    )
    sizes, mib = layout.region_sizes, 2**20
    return (
        f"dispatch rows {sizes['dispatch_rows'] / mib:.1f} MiB, combine rows {sizes['combine_rows'] / mib:.1f} MiB, "
        f"total {layout.nbytes / mib:.1f} MiB"
    )
