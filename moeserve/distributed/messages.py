"""What node 0 and the rank processes say to each other over the control channel.

Node 0 (scheduler + API) publishes one `StepInput` per lockstep step to every rank; each rank
answers with a `StepOutput`. Everything is pickled: the channel runs inside the cluster, between
processes of one deployment, never facing clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.config import ParallelConfig
from moeserve.engine_config import CudaGraphConfig
from moeserve.eplb import RebalanceReport
from moeserve.kv_transfer.agent import KvRegistration
from moeserve.scheduler import SchedulerOutput
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken
from moeserve.worker.sampling_metadata import TokenBitmask


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build its share of the model; node 0 decides it once."""

    model: str
    dtype: torch.dtype
    device: str
    parallel: ParallelConfig
    block_size: int
    num_kv_blocks: int
    """Per data-parallel group: what that group's scheduler plans with."""
    eos_token_ids: tuple[int, ...]
    seed: int
    kernels: str = "auto"
    indexer_key_dtype: str = "auto"
    """`EngineConfig.indexer_key_dtype`: every rank caches the indexer's keys alike."""
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    max_num_seqs: int = 1
    """Per data-parallel group, as its scheduler has it: the largest decode batch."""
    max_num_batched_tokens: int = 1
    """Per data-parallel group: the most tokens one step carries (a window group's pool is sized for it)."""
    max_model_len: int = 1
    """The longest context a sequence reaches (the captured decode steps are shaped for it)."""
    mtp_drafts: int = 0
    """Speculative decoding with method mtp: drafts per decode, made by the MTP layers each rank
    loads (0: none loaded)."""
    draft_states: int = 0
    """States kept per sequence to step back past rejected drafts (`EngineConfig.draft_states`)."""
    saved_states: int = 0
    """Saved states prefix caching holds for a model with state layers (`EngineConfig.num_saved_states`)."""
    kv_transfer: bool = False
    """Register the KV cache with a NIXL agent, for a prefill instance to write into (`--role decode`)."""
    kv_write_host: str = ""
    """`--role prefill`: where the rank serves writes of its KV blocks to decode instances
    (`kv_transfer.rank_writer`); empty: it serves none."""


@dataclass(frozen=True)
class LoadReport:
    """A rank's answer once its weights and KV cache are in memory (or why they are not)."""

    rank: int
    node_rank: int
    pid: int
    host: str
    num_local_experts: int = 0
    expert_bytes: int = 0
    other_bytes: int = 0
    kv_bytes: int = 0
    """The rank's cache: its blocks and, for a model with Gated DeltaNets, its sequences' states."""
    dispatcher: str = ""
    """The MoE all-to-all backend the rank built (`--a2a-backend` resolved)."""
    decode_graph_sizes: tuple[int, ...] = ()
    """Decode batch sizes the rank captured (none: every step runs eagerly)."""
    kv_registration: KvRegistration | None = None
    """With `WorkerSpec.kv_transfer`: the rank's KV cache as a peer writes into it."""
    kv_writer: str | None = None
    """With `WorkerSpec.kv_write_host`: host:port of the rank's side channel that writes its blocks."""
    error: str | None = None


@dataclass(frozen=True)
class Sync:
    """Repeated until every rank has answered: a subscriber only receives what is published
    after its connection is up, so the first step must wait for all of them."""


@dataclass(frozen=True)
class SyncAck:
    rank: int
    member: int
    """The rank as launched (`rank` is its place in the current group)."""


@dataclass(frozen=True)
class StepInput:
    step: int
    plans: tuple[SchedulerOutput, ...]
    """One per data-parallel group; a rank runs its group's plan (maybe empty: it still steps).
    The plans carry what the ranks learn of requests: new ones' data, finished ones' ids."""
    want_routed_tokens: bool = False
    bitmask_follows: bool = False
    """A `StepBitmask` for this step comes next: the engine sends the plan first, so the ranks
    start the forward while it fills the grammar bitmask."""
    profile: bool = False
    """A start-up profile step (`Executor.execute`): the ranks drop the load it routed and do not
    count it as an EPLB step."""


@dataclass(frozen=True)
class StepBitmask:
    """The grammar's allowed tokens of every group's constrained requests that sample this step
    (a few KiB per request: one bit per token); each sampling rank takes its own rows."""

    step: int
    token_bitmask: TokenBitmask


@dataclass(frozen=True)
class StepOutput:
    step: int
    rank: int
    sampled: dict[str, SampledToken]
    """Filled by the first rank of each tensor-parallel group, the one that samples."""
    routed_tokens: list[list[int]] | None = None
    """Per MoE layer and logical expert, rows this rank's expert slots received since last asked."""
    dispatch_rows: list[int] | None = None
    """With routed_tokens: rows this rank dispatched to each rank since last asked (`dispatch.wire`)."""
    rebalance: RebalanceReport | None = None
    """From rank 0, when the experts were rebalanced after this step (`eplb.Rebalancer`)."""
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    """From the sampling rank, for the requests of its group that asked (`worker.prompt_logprobs`)."""


@dataclass(frozen=True)
class StepFailed:
    """A rank's step raised (`--on-rank-failure heal`): most likely a peer is gone and the
    collective broke. The rank has left its process group and waits for a `Regroup` (or to be
    stopped); node 0 heals if it finds a rank lost, else stops with `error`."""

    step: int
    rank: int
    error: str


@dataclass(frozen=True)
class Regroup:
    """Node 0 to the ranks: form process group `generation` of `members`, after a loss (without
    the lost ranks) or a return (with the returned ranks after the others).

    members:  launch ranks (the names heartbeats and errors go by) in the order of their new
              group ranks.
    previous: for each of them, its group rank before (None: a returned rank, holding nothing
              yet); from these each rank computes the new expert map (`eplb.survivors.survivor_map`)
              from the current one, which group rank 0 shares (node 0 does not hold it).
    forget_requests: the step in flight was lost: the runners drop every request, which the
              scheduler announces again. A return happens between steps and keeps them.
    """

    generation: int
    members: tuple[int, ...]
    previous: tuple[int | None, ...]
    forget_requests: bool


@dataclass(frozen=True)
class RegroupDone:
    """A rank's answer to `Regroup`: it serves as group rank `rank` (or why it cannot)."""

    generation: int
    member: int
    rank: int
    regroup_s: float = 0.0
    """Leaving the old group and forming the new one (the rendezvous of `generation`)."""
    experts_s: float = 0.0
    """Filling its new expert slots: its own copies, other ranks' replicas, the checkpoint."""
    peer_slots: int = 0
    checkpoint_slots: int = 0
    peer_bytes: int = 0
    checkpoint_bytes: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class NodeZeroBeat:
    """Node 0's pulse to the other nodes' launch processes (`node_watch`), about twice a second."""

    seq: int
    serving: bool
    """The ranks have all loaded and answered (before that node 0 still waits for them)."""


@dataclass(frozen=True)
class NodeZeroLeaving:
    """Node 0 is stopping: `clean` after a SIGTERM or a normal end (the other nodes leave with
    exit 0), else after a failure, `reason`, which they leave non-zero with."""

    clean: bool
    reason: str
