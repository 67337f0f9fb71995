"""Scheduler limits: how many sequences and tokens one step may carry, the KV cache's size, and the
batching policy with its latency targets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from moeserve.spec_decode.config import SpeculativeConfig

Policy = Literal["fcfs", "slo"]
AdmissionMode = Literal["off", "reject", "degrade"]
ADMISSION_MODES: tuple[str, ...] = get_args(AdmissionMode)
DPRouting = Literal["tokens", "requests"]
DP_ROUTINGS: tuple[str, ...] = get_args(DPRouting)
POLICIES: tuple[str, ...] = get_args(Policy)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens of KV (ceiling division)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Static limits of the batching policy, validated once so `schedule()` never meets a request
    it can not eventually run.

    Keyword-only: most fields are ints, so a positional call would swap limits silently.
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
    enable_prefix_caching: bool = True
    """Keep computed KV blocks findable by their content, so a request whose prompt begins like an
    earlier one's (a shared system prompt, the previous chat turn) computes only the rest. Freed
    blocks stay cached until their space is needed, least recently used first."""
    max_waiting: int | None = None
    """Most requests queued for admission; `add_request` raises `QueueFullError` beyond it, so an
    overloaded server sheds load at once instead of queueing unboundedly. None: no bound."""
    policy: Policy = "fcfs"
    """Batching policy. "fcfs": admit in arrival order and fill every step up to the token budget,
    for the best throughput, though a long prompt's chunk delays every running stream's next
    token. "slo": size each step's prefill from measured step times so a step carrying decodes
    stays within slo_tbt_s, and admit by TTFT deadline (arrival + slo_ttft_s), streams preempted
    mid-output first and requests past their deadline last. Without chunked prefill there is no
    chunk to size, and slo only orders the queue."""
    slo_ttft_s: float = 5.0
    """Time-to-first-token target of the slo policy, in seconds. Requests that can still meet it
    are admitted before those that no longer can, so under overload one late request does not
    make every later one late too."""
    slo_tbt_s: float = 0.025
    """Time-between-tokens target of the slo policy, in seconds: how long one step carrying decodes
    may take, which caps its prefill chunk. A target below the decodes' own step time cannot be
    met; prefill then still advances one KV block per step so prompts are never starved."""
    slo_admission: AdmissionMode = "off"
    """When the step-time model predicts a new request's TTFT target will be missed: "reject"
    raises `SLORejectedError` (HTTP 429), "degrade" admits it as best effort, "off" admits it.
    A request's own targets (`SamplingParams.slo`) replace slo_ttft_s and slo_tbt_s for it."""
    dp_routing: DPRouting = "tokens"
    """How a new request picks its data-parallel group (with more than one): "tokens" sends it
    to the group whose backlog, priced by that group's own measured step times, clears soonest,
    so a long prompt counts for its length and a slow group gets less; "requests" to the group
    with the fewest requests (queued ones counting 4, running ones 1)."""
    has_state: bool = False
    """The model's layers keep a state per sequence beside the paged blocks (`CacheSpecs.has_state`:
    Gated DeltaNet): a prefix-cache hit then resumes only from a saved state."""
    num_saved_states: int = 0
    """With `has_state` and prefix caching: saved-state slots held for hits, in the memory budget
    beside the running sequences' states. 0: such a model never hits."""
    state_save_interval: int = 64
    """With saved states: a sequence's state is saved every this many blocks, and at the last
    block boundary before its prompt's last token (what a later turn of the conversation or a
    repeat of the prompt resumes from). A prompt chunk crossing such a boundary is cut there."""
    block_groups: tuple[tuple[tuple[int, int | None], int], ...] = ()
    """A model whose paged caches form several block-table groups (`CacheSpecs.groups`, DeepSeek-V4):
    each group's key and pool (`block_groups.group_block_counts`), each request holding a table per
    group. Empty: one group of `num_kv_blocks`, then a table per request (`Request.block_ids`),
    as every other model has. `num_kv_blocks` is then the context the cache holds, in blocks."""
    speculative: SpeculativeConfig | None = None
    """Draft tokens for decodes (`moeserve.spec_decode`): a decode step may feed, after its last
    token, up to `num_speculative_tokens` drafts, each costing a token of the step's budget and a
    KV slot until the target model has verified it. None: one token per decode."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_saved_states < 0 or self.state_save_interval < 1:
            raise ValueError(
                f"num_saved_states must be >= 0 and state_save_interval >= 1, got "
                f"{self.num_saved_states} and {self.state_save_interval}"
            )
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {self.max_waiting}")
        if self.slo_admission not in ADMISSION_MODES:
            raise ValueError(f"slo_admission must be one of {ADMISSION_MODES}, got {self.slo_admission!r}")
        if self.dp_routing not in DP_ROUTINGS:
            raise ValueError(f"dp_routing must be one of {DP_ROUTINGS}, got {self.dp_routing!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("slo_ttft_s", "slo_tbt_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
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
