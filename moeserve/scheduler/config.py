"""Scheduler limits: how many sequences and tokens one step may carry, and the KV cache's size."""

from __future__ import annotations

from dataclasses import dataclass


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens of KV (ceiling division)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Static limits of the batching policy, validated once so `schedule()` never meets a request
    it can not eventually run.

    Keyword-only: every field is an int, so a positional call would swap limits silently.
    """

    max_num_seqs: int = 256
    """Most requests running at once; bounds the decode batch (and a CUDA graph's batch size)."""
    max_num_batched_tokens: int = 8192
    """Per-step token budget shared by prefill chunks and decodes (1 token each). Large enough to
    keep the GPU busy on prefill, small enough that one step's latency does not stall decodes."""
    max_model_len: int
    """Most tokens (prompt + output) in one sequence; a request that could exceed it is rejected."""
    block_size: int = 16
    """Tokens per KV block: small enough to waste little at a sequence's tail, large enough that
    the attention kernel gathers long runs."""
    num_kv_blocks: int
    """KV blocks in the cache, as sized by the engine from free device memory."""
    enable_chunked_prefill: bool = True
    """Split a prompt larger than the step's remaining budget across steps, so long prompts do not
    block running decodes (and their time between tokens) for a whole step."""
    max_waiting: int | None = None
    """Most requests queued for admission; `add_request` raises `QueueFullError` beyond it, so an
    overloaded server sheds load at once instead of queueing unboundedly. None: no bound."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {self.max_waiting}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in every step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )
        if self.num_kv_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) can not hold one sequence of max_model_len "
                f"({self.max_model_len}) tokens, which needs {self.max_blocks_per_seq} blocks of "
                f"{self.block_size}; lower max_model_len or give the KV cache more memory"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one sequence of `max_model_len` tokens needs (the width of a block table)."""
        return blocks_for_tokens(self.max_model_len, self.block_size)
