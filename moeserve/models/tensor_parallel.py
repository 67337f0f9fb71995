"""Tensor parallelism inside one data-parallel attention group.

Layout of a decoder layer over the `size` ranks of a group (sequence-parallel style):

    x [T, H], the same on every rank of the group
      -> attention on this rank's heads; o_proj holds this rank's input columns  -> partial [T, H]
      -> reduce-scatter over tokens: rank t gets the summed rows of its slice    -> [T_t, H]
      -> residual, norm, FFN (MoE dispatches only this slice: no duplicated traffic)
      -> residual and the next layer's input norm, still on the slice
      -> all-gather of the normed rows over tokens                                -> [T, H]

One reduce-scatter plus one all-gather per layer moves what one all-reduce would, and the
FFN, the MoE all-to-all above all, runs on 1/size of the tokens on each rank. With size 1
every operation is the identity, so a single process runs exactly the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor forms; the GPU machines run older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group; `group` is None when size is 1."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError("tensor parallelism over several ranks needs a process group")

    def split(self, total: int, what: str) -> int:
        """This rank's equal share of `total` heads (or columns); they must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def largest_slice(self, num_tokens: int) -> int:
        """The most rows `token_slice` gives any rank of the group for `num_tokens` (the first rank's)."""
        return -(-num_tokens // self.size)

    def token_slice(self, num_tokens: int) -> slice:
        """The contiguous rows of a step's tokens this rank's FFN processes (ceil-sized chunks,
        so the last ranks may get fewer or none)."""
        chunk = self.largest_slice(num_tokens)
        start = min(self.rank * chunk, num_tokens)
        return slice(start, min(start + chunk, num_tokens))

    def reduce_scatter_tokens(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum `partial [T, H]` over the group and keep this rank's token slice."""
        num_tokens = partial.shape[0]
        if self.size == 1 or num_tokens == 0:  # a group's ranks share their step's token count
            return partial
        chunk = -(-num_tokens // self.size)
        padded = partial.new_zeros(chunk * self.size, *partial.shape[1:])
        padded[:num_tokens] = partial
        out = partial.new_empty(chunk, *partial.shape[1:])
        _reduce_scatter(out, padded, group=self.group)
        mine = self.token_slice(num_tokens)
        return out[: mine.stop - mine.start]

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of `partial` over the group (in place; the identity for one rank)."""
        if self.size > 1 and partial.numel():
            dist.all_reduce(partial, group=self.group)
        return partial

    def all_gather_tokens(self, mine: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's slice `[T_t, H]` -> the full `[T, H]` on every rank."""
        if self.size == 1 or num_tokens == 0:
            return mine
        chunk = -(-num_tokens // self.size)
        padded = mine.new_zeros(chunk, *mine.shape[1:])
        padded[: mine.shape[0]] = mine
        full = mine.new_empty(chunk * self.size, *mine.shape[1:])
        _all_gather(full, padded, group=self.group)
        return full[:num_tokens]


SINGLE = TensorParallel()


@dataclass(frozen=True)
class Shard:
    """Which part of a checkpoint tensor a sharded parameter holds: `length` entries of dim
    `dim` from `start`, out of `full`. `zeros`: the rank holds zeros instead (a row-parallel
    layer's bias is added by one rank only, so the group's sum counts it once)."""

    dim: int
    start: int
    length: int
    full: int
    zeros: bool = False

    def full_shape(self, shape: torch.Size) -> tuple[int, ...]:
        return tuple(self.full if d == self.dim else n for d, n in enumerate(shape))

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.zeros:
            return torch.zeros_like(tensor.narrow(self.dim, self.start, self.length))
        return tensor.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True)
class Rows:
    """Which dim-0 rows of which checkpoint tensor (named from its decoder layer's prefix, e.g.
    `linear_attn.in_proj_qkv.weight`, of `full` rows) a parameter holds, in order: for parts of
    tensors that interleave what a rank holds with what it does not (Gated DeltaNet's fused
    projections and conv, grouped by key head in Qwen3-Next), which one `Shard` cannot name."""

    tensor: str
    rows: tuple[int, ...]
    full: int


def mark_rows(param: torch.Tensor, rows: Rows) -> None:
    """Tag a parameter with the checkpoint rows it holds (see `Rows`; the loader reads the tag)."""
    param.checkpoint_rows = rows  # type: ignore[attr-defined]


def rows_of(param: torch.Tensor) -> Rows | None:
    return getattr(param, "checkpoint_rows", None)


def mark_shard(param: torch.Tensor, shard: Shard) -> None:
    """Tag a parameter with the part of its checkpoint tensor it holds (the loader reads the tag).
    The module that splits the work declares the split, so the loader needs no per-layer rules."""
    param.tp_shard = shard  # type: ignore[attr-defined]


def shard_of(param: torch.Tensor) -> Shard | None:
    return getattr(param, "tp_shard", None)


def column_parallel(layer: torch.nn.Linear, start: int, full: int, tp: TensorParallel) -> torch.nn.Linear:
    """`layer` computes output features [start, start + out) of `full`: its weight rows and bias."""
    if tp.size > 1:
        rows = layer.weight.shape[0]
        mark_shard(layer.weight, Shard(0, start, rows, full))
        if layer.bias is not None:
            mark_shard(layer.bias, Shard(0, start, rows, full))
    return layer


def row_parallel(layer: torch.nn.Linear, start: int, full: int, tp: TensorParallel) -> torch.nn.Linear:
    """`layer` takes input features [start, start + in) of `full`; its output is a partial sum
    the group reduces, so only rank 0 keeps the bias."""
    if tp.size > 1:
        cols = layer.weight.shape[1]
        mark_shard(layer.weight, Shard(1, start, cols, full))
        if layer.bias is not None:
            n = layer.bias.shape[0]
            mark_shard(layer.bias, Shard(0, 0, n, n, zeros=tp.rank != 0))
    return layer


def kv_heads_of(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first, count) of the KV heads the query heads of `tp_rank` read. With fewer KV heads
    than ranks each rank holds the one KV head its query heads share (KV heads are replicated)."""
    if num_kv_heads % tp_size == 0:
        count = num_kv_heads // tp_size
        return tp_rank * count, count
    if tp_size % num_kv_heads == 0:
        return tp_rank // (tp_size // num_kv_heads), 1
    raise ValueError(
        f"{num_kv_heads} KV heads cannot be spread over {tp_size} tensor-parallel ranks (neither divides the other)"
    )
