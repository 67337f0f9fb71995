"""What users set about the engine: process layout, KV cache, latency targets and the rest.

Each knob is a documented field of exactly one dataclass here, with its one default; the flags of
`moeserve launch` / `generate` and the keywords of `LLM(...)` are generated from these fields (see
`moeserve.options`). Scheduler limits take their defaults from `SchedulerConfig`, which documents
what they do to batching.

Imports no torch, so the command's parser can be built without it: dtypes are names here and
become torch dtypes in `moeserve.config.parse_dtype`. Device "auto" is resolved on construction,
and so is dtype "auto" on a CPU, where it depends on the CPU (see `auto_cpu_dtype`).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import re
from dataclasses import dataclass, field
from typing import Literal

from moeserve import cpu_features
from moeserve.kv_transfer.config import KvTransferConfig, disaggregation_problem
from moeserve.options import build, option
from moeserve.scheduler.config import POLICIES, SchedulerConfig
from moeserve.slo import DEFAULT_CLASS, RequestSLO, SLOCatalog, SLOClass, parse_slo_class
from moeserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from moeserve.straggler import SlowRank, parse_slow_rank

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
KERNEL_BACKENDS = ("auto", "torch", "triton")
INDEXER_KEY_DTYPES = ("auto", "fp8")
A2A_BACKENDS = ("auto", "torch", "nvshmem")
SCHEDULING_POLICIES = POLICIES

_BYTE_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_bytes(text: str) -> int:
    """'512MiB', '4GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 4GiB or a number of bytes)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def dtype_name(dtype: object) -> str:
    """'auto' or a canonical dtype name from a name, an alias or a torch dtype."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name != "auto" and name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {', '.join(DTYPE_NAMES)}")
    return name


def _scheduler_default(name: str) -> object:
    """A scheduler limit's default, from `SchedulerConfig`, its one home."""
    return SchedulerConfig.__dataclass_fields__[name].default


@dataclass(frozen=True)
class EplbConfig:
    """Expert load balancing: redundant expert slots, where each logical expert lives, and
    rebalancing them by measured load while serving (DeepSeek's EPLB)."""

    num_redundant_experts: int = 0
    """Extra physical expert slots over the EP group (E + R in all); each holds a replica of a
    logical expert, so a hot expert's tokens split over several ranks."""
    expert_placement: str | None = None
    """JSON file of the logical expert in each rank's slots per MoE layer (`moeserve eplb plan`
    writes one from recorded loads); None: slot p holds expert p mod E."""
    enabled: bool = option(False, name="enable_eplb")
    """Rebalance while serving: every eplb_interval_steps steps the ranks recompute the placement
    from the last eplb_window_steps steps' loads and move expert weights between themselves."""
    window_steps: int = option(1000, name="eplb_window_steps")
    """Steps of routing statistics the rebalancer looks at (a sliding window)."""
    interval_steps: int = option(3000, name="eplb_interval_steps")
    """Steps between two rebalances."""
    record_expert_load: str | None = None
    """Write the logical experts' routed rows per MoE layer to this JSON file at shutdown, the
    input of `moeserve eplb plan`."""

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0 (got {self.num_redundant_experts})")
        if self.window_steps < 1 or self.interval_steps < 1:
            raise ValueError("eplb_window_steps and eplb_interval_steps must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout: `ep` ranks hold the experts (E/ep each); attention runs data-parallel
    over `ep / tp` groups of `tp` tensor-parallel ranks. ep = tp = 1 runs in one process."""

    ep: int = 1
    """Expert-parallel ranks, one process each; each holds 1/ep of the experts."""
    tp: int = 1
    """Tensor-parallel size of attention inside each of the ep/tp data-parallel groups."""
    nnodes: int = option(1, env=("NNODES", "SLURM_NNODES"))
    """Machines the ranks span; each runs `ep / nnodes` of them."""
    node_rank: int = option(0, env=("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"))
    """This machine's index; node 0 runs the scheduler and the API, the others only run ranks."""
    master_addr: str = option("127.0.0.1", env=("MASTER_ADDR",))
    """Where node 0 listens for the others to rendezvous (its TCP store), as they reach it."""
    master_port: int | None = option(None, env=("MASTER_PORT",))
    """Port of that store, the same on every node. None: a free one on a single node, 29500 across
    nodes (0 always picks a free one, which only a single node can use)."""
    node_ip: str | None = option(None, env=("MOESERVE_NODE_IP",))
    """This node's address as the other nodes reach it, across nodes: its interface carries gloo,
    NCCL, NVSHMEM's bootstrap and the control channel. None: the address of the route to
    master_addr (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, where set, win over it)."""
    backend: Literal["auto", "gloo", "nccl"] = option("auto", name="distributed_backend")
    """Collectives between ranks: gloo, nccl, or auto (nccl on CUDA devices, gloo on CPU)."""
    a2a_backend: Literal["auto", "torch", "nvshmem"] = "auto"
    """MoE all-to-all between ranks: torch (torch.distributed collectives), nvshmem (Triton kernels
    storing rows straight into peers' symmetric buffers: NVSHMEM/NVLink on GPUs, shared memory
    between rank processes on CPU), or auto (torch, until the nvshmem kernels have run on a GPU)."""
    dispatch_fp8: bool = False
    """MoE dispatch sends tokens as FP8 (e4m3) with a scale per 128 channels, about half the bytes
    of bf16, as DeepEP's low-latency mode does; experts and combine stay in the activation dtype.
    Applied at ep=1 too, so every layout computes the same tokens (which differ slightly from
    unquantised dispatch)."""
    num_comm_sms: int | None = None
    """SMs the nvshmem all-to-all's kernels run on, from comm streams of their own beside the
    compute stream; the experts' GEMMs keep to the GPU's other SMs, so the two share the GPU
    rather than take turns (two-batch overlap's gain). None: 20 on GPUs, 3 programs under the
    CPU interpreter. At least 1, and fewer than the GPU's SMs."""
    nvlink_domain_size: int | None = None
    """Ranks that reach each other's memory by load/store (an NVLink domain), consecutive from rank
    0: the nvshmem all-to-all stores into their buffers and reaches every other rank by NVSHMEM
    puts (IBGDA over the NIC between nodes; emulated on CPU, where it makes one machine's ranks
    behave as several nodes). None: the ranks of one node, `ep / nnodes`. Must divide ep, or be
    0: no load/store peers, every peer and the rank itself by puts, to test the network path on
    one node or one GPU (with NVSHMEM_DISABLE_P2P=1 the puts between a node's GPUs take the NIC)."""
    nvshmem_host: Literal["auto", "nvshmem4py", "torch"] = "auto"
    """Who starts NVSHMEM for the nvshmem all-to-all on GPUs: nvshmem4py (a unique id from rank 0
    over torch.distributed, NVSHMEM's own bindings for its heap, teams and kernel modules), torch
    (PyTorch's symmetric memory), or auto (nvshmem4py where it is installed, else torch)."""
    collective_timeout_s: float = option(120.0, name="collective_timeout", aliases=("collective_timeout_s",))
    """Seconds any collective may wait before the rank gives up (a stalled peer)."""
    heartbeat_timeout_s: float = option(5.0, name="heartbeat_timeout", aliases=("heartbeat_timeout_s",))
    """Seconds of silence after which a rank is declared lost (see on_rank_failure)."""
    startup_timeout_s: float = option(600.0, name="startup_timeout")
    """Seconds node 0 waits for every rank to join and load its weights."""
    two_batch_overlap: bool = False
    """Two-batch overlap: split each step's sequences into two micro-batches of about half the
    tokens and interleave their passes, so one's MoE dispatch/combine is in flight while the
    other computes. The same tokens as without; it pays off when the all-to-all is slow (EP)."""
    eplb: EplbConfig = field(default_factory=EplbConfig)
    on_rank_failure: Literal["auto", "exit", "heal"] = "auto"
    """What a lost rank (killed, failing, or silent for heartbeat_timeout) does to the engine:
    exit (every open request fails, the server exits 1) or heal (the survivors form a new group
    without it, take over its experts and its requests, and serving goes on; one node, tp 1,
    CPU and gloo, the torch all-to-all); auto: heal where the layout allows it, else exit."""
    min_ranks: int = 1
    """With on_rank_failure heal: the fewest ranks worth serving with; a loss below it exits as
    on_rank_failure exit does."""
    rank_restarts: int = 3
    """With on_rank_failure heal: how often node 0 restarts each lost rank (a fresh process, the
    same flags) after healing over it; once loaded it rejoins the group at the engine's next step
    and takes expert slots back. 0: serve on without it."""

    def __post_init__(self) -> None:
        if self.master_port is None:
            object.__setattr__(self, "master_port", 29500 if self.nnodes > 1 else 0)
        if self.ep < 1 or self.tp < 1:
            raise ValueError(f"ep and tp must be >= 1 (got ep={self.ep}, tp={self.tp})")
        if self.ep % self.tp:
            raise ValueError(f"ep={self.ep} must be a multiple of tp={self.tp}")
        if self.nnodes < 1 or self.ep % self.nnodes:
            raise ValueError(f"ep={self.ep} ranks cannot be spread evenly over nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} outside [0, {self.nnodes})")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a multi-node launch needs a fixed --master-port that every node uses")
        if self.node_ip is not None:
            ipaddress.ip_address(self.node_ip)  # a ValueError that names the text
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend {self.backend!r} is not one of auto, gloo, nccl")
        if self.a2a_backend not in A2A_BACKENDS:
            raise ValueError(f"a2a_backend {self.a2a_backend!r} is not one of {', '.join(A2A_BACKENDS)}")
        domain = self.nvlink_domain_size
        if domain is not None and (domain < 0 or (domain and self.ep % domain)):
            raise ValueError(f"nvlink_domain_size must be a positive divisor of ep={self.ep}, or 0 (got {domain})")
        if self.nvshmem_host not in ("auto", "nvshmem4py", "torch"):
            raise ValueError(f"nvshmem_host {self.nvshmem_host!r} is not one of auto, nvshmem4py, torch")
        if self.num_comm_sms is not None and self.num_comm_sms < 1:
            raise ValueError(f"num_comm_sms must be at least 1 (got {self.num_comm_sms})")
        if min(self.collective_timeout_s, self.heartbeat_timeout_s, self.startup_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.eplb.enabled and self.ep < 2:
            raise ValueError("--enable-eplb moves experts between ranks: it needs ep >= 2")
        self._check_healing()

    def _check_healing(self) -> None:
        if self.on_rank_failure not in ("auto", "exit", "heal"):
            raise ValueError(f"on_rank_failure {self.on_rank_failure!r} is not one of auto, exit, heal")
        if not 1 <= self.min_ranks <= self.ep:
            raise ValueError(f"min_ranks must be in [1, ep={self.ep}] (got {self.min_ranks})")
        if self.rank_restarts < 0:
            raise ValueError(f"rank_restarts must be >= 0 (got {self.rank_restarts})")
        if self.on_rank_failure == "heal":
            problem = self.heal_problem()
            if problem is not None:
                raise ValueError(f"--on-rank-failure heal: {problem}")

    def heal_problem(self, device: str = "cpu") -> str | None:
        """Why this layout on `device` cannot heal over a lost rank, or None if it can."""
        # Why each: a TP group that lost a member has lost its attention heads (nothing replicates
        # them); a rank on another node cannot be fenced from node 0; NCCL has no way out of a
        # collective with a dead peer but an abort this engine does not drive yet; the symmetric
        # heap of the nvshmem all-to-all is sized for the world it was made for.
        problem = None
        if self.ep < 2:
            problem = "it needs ep >= 2"
        elif self.tp != 1:
            problem = "it needs tp 1 (every rank its own data-parallel group)"
        elif self.nnodes != 1:
            problem = "it needs all ranks on one node"
        elif self.backend == "nccl":
            problem = "it needs the gloo collectives"
        elif self.a2a_backend == "nvshmem":
            problem = "it needs the torch all-to-all"
        elif not device.startswith("cpu"):
            problem = "it needs the gloo collectives, so the CPU device for now"
        return problem

    def resolved(self, device: str) -> ParallelConfig:
        """This layout with on_rank_failure auto decided for `device`: heal where it can."""
        if self.on_rank_failure != "auto":
            return self
        policy = "heal" if self.heal_problem(device) is None else "exit"
        return dataclasses.replace(self, on_rank_failure=policy)

    @property
    def is_distributed(self) -> bool:
        return self.ep > 1 or self.tp > 1

    @property
    def num_dp_groups(self) -> int:
        return self.ep // self.tp

    @property
    def ranks_per_node(self) -> int:
        return self.ep // self.nnodes

    @property
    def load_store_ranks(self) -> int:
        """The NVLink domain's size in ranks: the option, or one node's ranks."""
        return self.nvlink_domain_size if self.nvlink_domain_size is not None else self.ranks_per_node


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = _scheduler_default("block_size")  # type: ignore[assignment]
    """Tokens per paged KV block: small enough to waste little, large enough to gather fast."""
    num_blocks: int | None = option(None, name="kv_cache_blocks")
    """KV cache size in blocks; None: as many as kv_cache_memory holds."""
    memory_bytes: int = option(512 * 1024**2, name="kv_cache_memory", parse=parse_bytes)
    """KV cache size in bytes when kv_cache_blocks is not given, e.g. 512MiB or 4GiB."""
    enable_prefix_caching: bool = _scheduler_default("enable_prefix_caching")  # type: ignore[assignment]
    """Reuse the KV of full blocks computed for earlier requests whose tokens begin the same way (a
    shared system prompt, a previous chat turn), so only the rest of a prompt is computed; cached
    blocks are evicted least recently used first when space is needed. With ep/tp > 1 a request
    goes to the data-parallel group holding the longest prefix of its prompt, unless much busier."""
    saved_states: int | None = None
    """For a model whose layers keep a state per sequence (Gated DeltaNet), with prefix caching:
    how many saved states a hit can resume from, taken from the cache budget before the blocks;
    None: max_num_seqs."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.saved_states is not None and self.saved_states < 0:
            raise ValueError("saved_states must be >= 0")


MAX_DEFAULT_GRAPH_SIZE = 512
"""The default capture sizes stop here (vLLM's cap too): beyond it a decode step is long enough
that launch overhead, what a graph saves, is a small part of it."""


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' (or spaces between) -> (1, 2, 4, 8)."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a list of batch sizes: {text!r} (use e.g. 1,2,4,8)")
    return tuple(int(p) for p in parts)


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (itself included) and at most 512."""
    top = min(max_num_seqs, MAX_DEFAULT_GRAPH_SIZE)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top}))


@dataclass(frozen=True)
class CudaGraphConfig:
    """CUDA graphs for decode steps: on CUDA devices each listed batch size is captured once at
    start-up and a decode step (every sequence one token) is padded up to the next one and
    replayed; larger batches and steps with prefill run eagerly. Never on a CPU."""

    sizes: tuple[int, ...] | None = option(None, name="cuda_graph_sizes", parse=parse_sizes)
    """Decode batch sizes to capture, e.g. 1,2,4,8,16; None: 1, 2, 4 and every multiple of 8 up
    to max_num_seqs (at most 512). Sizes above max_num_seqs are dropped."""
    enforce_eager: bool = False
    """Run every step eagerly: capture no CUDA graphs."""
    emulate: bool = option(False, name="emulate_cuda_graphs", hidden=True)
    """Test-only: on a CPU, run decode steps through the graph runner with an emulating capture
    (the step re-run over the same persistent buffers), to check its logic without a GPU."""

    def __post_init__(self) -> None:
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            if not sizes or not all(isinstance(s, int) and s >= 1 for s in sizes):
                raise ValueError(f"cuda_graph_sizes must be positive integers, got {self.sizes!r}")
            object.__setattr__(self, "sizes", tuple(sorted(set(sizes))))

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The sizes to capture, ascending, none above max_num_seqs (no decode step has more)."""
        sizes = default_graph_sizes(max_num_seqs) if self.sizes is None else self.sizes
        return tuple(s for s in sizes if s <= max_num_seqs)

    def wanted(self, device: str) -> bool:
        """Whether this config asks for graphs on `device` (a runner may still find it cannot)."""
        return not self.enforce_eager and (device.split(":")[0] == "cuda" or self.emulate)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """What one request's output constraint may cost. A grammar's compile time and size grow
    with its spec (a 20,000-value enum compiles for seconds into a 26 MB grammar), and the step
    loop must not pay for it: specs over these limits are refused with a 400 before any work, the
    rest compile in worker processes on the frontend's CPUs, killed at the timeout."""

    max_spec_bytes: int = option(128 * 1024, name="structured_outputs_max_spec", parse=parse_bytes)
    """Largest JSON schema, regex, EBNF grammar or choice list (bytes of its text), e.g. 128KiB."""
    max_enum_values: int = option(1000, name="structured_outputs_max_enum_values")
    """Most enum and const values in one JSON schema, and choices in one choice list (OpenAI
    allows 1000): each is a branch of the grammar, and compile time grows with their number."""
    max_depth: int = option(32, name="structured_outputs_max_depth")
    """Deepest nesting of a JSON schema's objects and lists, or of a regex's groups."""
    compile_timeout_s: float = option(5.0, name="structured_outputs_compile_timeout")
    """Seconds one grammar may compile; then its worker is killed and the request refused."""
    compile_workers: int = option(2, name="structured_outputs_compile_workers")
    """Worker processes compiling grammars (each client may use all but one of them at once)."""
    compile_queue_per_client: int = option(4, name="structured_outputs_queue_per_client")
    """Most compiles one client (its API key, else its connection) may have queued or running;
    beyond it a 429."""
    max_compiled_bytes: int = option(8 * 1024**2, name="structured_outputs_max_compiled", parse=parse_bytes)
    """Largest compiled grammar (serialized), e.g. 8MiB: the engine core loads each one it has not
    cached, about 20 ms per MB of its step loop's time."""
    cache_bytes: int = option(256 * 1024**2, name="structured_outputs_cache", parse=parse_bytes)
    """Memory for compiled grammars, each process's (the server's and the engine core's), e.g.
    256MiB; identical specs share one and the least recently used go first."""
    max_tools: int = option(128, name="max_tools")
    """Most tools in one chat request (OpenAI's limit): each is a branch of the grammar when
    tool_choice is "required", and a part of the prompt."""

    def __post_init__(self) -> None:
        counts = ("max_spec_bytes", "max_enum_values", "max_depth", "compile_workers", "compile_queue_per_client")
        for name in (*counts, "max_compiled_bytes", "cache_bytes", "max_tools"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")


@dataclass(frozen=True)
class SLOConfig:
    """Latency targets: what the `slo` scheduling policy aims for and what /metrics judges
    every finished request against (attainment counters), whichever policy runs."""

    ttft_s: float = option(_scheduler_default("slo_ttft_s"), name="slo_ttft_ms", scale=0.001)
    """Time-to-first-token target (ms), from arrival to the first generated token."""
    tbt_s: float = option(_scheduler_default("slo_tbt_s"), name="slo_tbt_ms", scale=0.001)
    """Time-between-tokens target (ms): every gap between consecutive tokens of a stream."""
    classes: tuple[SLOClass, ...] = option((), name="slo_class", parse=parse_slo_class, repeatable=True)
    """A named pair of targets, NAME=ttft:MS,tbt:MS (repeatable): requests may ask for it with
    `slo: {"class": NAME}`, and /metrics labels attainment by class."""
    admission: Literal["off", "reject", "degrade"] = option(_scheduler_default("slo_admission"), name="slo_admission")
    """What to do with a request whose TTFT target the step-time model predicts will be missed:
    reject it at once (HTTP 429 with Retry-After), admit it as best effort and say so in its usage
    (degrade), or admit it regardless (off)."""

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLO targets must be > 0 (got ttft_s={self.ttft_s}, tbt_s={self.tbt_s})")
        object.__setattr__(self, "classes", tuple(self.classes or ()))
        self.catalog  # noqa: B018 - validates the class names

    @property
    def catalog(self) -> SLOCatalog:
        """The default targets and the classes, as requests' `slo` fields resolve against them."""
        return SLOCatalog(RequestSLO(self.ttft_s, self.tbt_s, DEFAULT_CLASS), self.classes)


def _auto_device() -> str:
    import torch  # only when a device is chosen: building the command's parser needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def visible_cuda_devices() -> int:
    import torch  # only for a CUDA layout of several ranks

    return torch.cuda.device_count()


def rank_devices_problem(device: str, parallel: ParallelConfig, visible: int) -> str | None:
    """Why this node cannot give each of its ranks a CUDA device of its own (`visible` are), or None.

    Every rank is a process on one device, the node's `local_rank`-th. Two cannot share one: NCCL
    refuses two ranks on a device, the `torch` all-to-all rides on NCCL, and the `nvshmem`
    backend's transports either need a GPU per process (NVSHMEM, CUDA IPC peers) or run on CPU
    (`shm`); its `emulated` transport, N PEs on one GPU, lives in a single process (tests,
    bench/dispatch.py), not in rank processes. So such a layout is refused before anything starts.
    """
    if not parallel.is_distributed or device.split(":")[0] != "cuda" or parallel.ranks_per_node <= visible:
        return None
    per_node = parallel.ranks_per_node
    fits = f"--ep {visible}" if visible > 1 else "--ep 1 (one process, no expert parallelism)"
    return (
        f"--ep {parallel.ep} runs {per_node} rank processes on this node, each on a CUDA device of its own, but "
        f"{visible} {'is' if visible == 1 else 'are'} visible: two ranks cannot share a GPU (NCCL refuses it, and "
        "neither --a2a-backend torch nor nvshmem has a transport between processes on one device). Use "
        f"{fits} here (--tp at most that too), a machine with {per_node} GPUs or more nodes (--nnodes) with at "
        "most that many ranks each, or --device cpu to run the same expert-parallel layout on CPU rank processes"
    )


def check_rank_devices(device: str, parallel: ParallelConfig) -> None:
    """Raise ValueError at once where this node's ranks would not each get a GPU (see `rank_devices_problem`)."""
    if device == "auto":
        device = _auto_device()
    if parallel.is_distributed and device.split(":")[0] == "cuda":
        problem = rank_devices_problem(device, parallel, visible_cuda_devices())
        if problem is not None:
            raise ValueError(problem)


def auto_cpu_dtype() -> str:
    """What dtype "auto" means on a CPU: "float32" when the CPU has no bf16 instructions, where a
    bf16 or fp16 checkpoint would run several times slower than in float32; else "auto" (the
    checkpoint's own). The choice is logged once per process."""
    if cpu_features.cpu_has_native_bf16():
        _log_once("dtype auto: the checkpoint's own (this CPU computes bfloat16 natively)")
        return "auto"
    _log_once("dtype auto: float32, whatever the checkpoint's dtype (this CPU has no avx512_bf16 or amx_bf16)")
    return "float32"


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the checkpoint's own config."""

    model: str | None = None
    """Hugging Face checkpoint folder; None: the built-in demo model (trained on Python's stdlib)."""
    dtype: str = "auto"
    """Weights and activations: float32, bfloat16, float16 or auto: the checkpoint's own, except
    float32 on a CPU without bf16 instructions (no AVX512_BF16 or AMX), where it is much faster."""
    device: str = "auto"
    """cuda, cpu, or auto: cuda when a GPU is visible, else cpu."""
    kernels: Literal["auto", "torch", "triton"] = "auto"
    """Layer operations backend: torch, triton, or auto (see `ops.create_ops`)."""
    indexer_key_dtype: Literal["auto", "fp8"] = "auto"
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): how the lightning indexer's keys are
    cached. auto: in the compute dtype, as transformers keeps them; fp8: e4m3 with one float32
    scale per token (index_head_dim + 4 bytes, 132 at 128), as DeepSeek-V3.2's release caches
    them, about half of bf16's bytes and close to (not exactly) the same top-k; kernels=torch only."""
    max_model_len: int | None = None
    """Longest prompt + completion; None: the checkpoint's max_position_embeddings."""
    max_num_seqs: int = _scheduler_default("max_num_seqs")  # type: ignore[assignment]
    """Most sequences in the running batch."""
    max_num_batched_tokens: int | None = None
    """Per-step token budget shared by prefill chunks and decodes; None: 8192, or max_num_seqs if
    larger (every running sequence must be able to decode in every step)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    seed: int = 0
    """Seed of the engine's random state (sampling of requests that give no seed)."""
    scheduling_policy: Literal["fcfs", "slo"] = _scheduler_default("policy")  # type: ignore[assignment]
    """fcfs: arrival order, full prefill chunks; slo: prefill chunks sized so decodes keep the TBT
    target, TTFT-deadline order."""
    slo: SLOConfig = field(default_factory=SLOConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    """Prefill/decode disaggregation: this instance's role and how KV moves (`moeserve.kv_transfer`)."""
    dp_routing: Literal["tokens", "requests"] = _scheduler_default("dp_routing")  # type: ignore[assignment]
    """With several data-parallel groups (--ep N): tokens sends a new request to the group whose
    backlog clears soonest at that group's measured step times (a long prompt counts for its
    length, a slow group gets less); requests to the group with the fewest requests."""
    max_waiting: int | None = option(None, launch_default=1024)
    """Most queued requests; beyond it the server answers 429 with Retry-After (add_request raises
    QueueFullError). None: no bound, as offline `LLM.generate` queues all its prompts at once."""
    speculative_config: SpeculativeConfig | None = option(None, parse=parse_speculative_config)
    """Speculative decoding, as a JSON object with vLLM's keys, e.g. {"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 4} or {"method": "mtp", "num_speculative_tokens":
    1} (the checkpoint's multi-token prediction layers draft): each decode step also feeds up to that
    many draft tokens, which one forward verifies. Greedy outputs are the same as without it; every
    request drafts but one under a grammar with mtp or ignore_eos. None: no drafts."""
    min_step_time_s: float = option(
        0.0, name="min_step_time_ms", scale=0.001, aliases=("debug_min_step_time_ms",), hidden=True
    )
    """Test-only: pad every non-empty step to at least this long (ms), so load tests can build a
    server with a known capacity (the SLO harness checks its knee search against it)."""
    debug_slow_rank: SlowRank | None = option(None, parse=parse_slow_rank, hidden=True)
    """Test-only: RANK:MS, rank RANK takes MS ms longer per token its data-parallel group computes
    in a step (the engine core waits it out), a straggler for the routing to steer around."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.device == "auto":
            object.__setattr__(self, "device", _auto_device())
        if self.dtype == "auto" and self.device.split(":")[0] == "cpu":
            object.__setattr__(self, "dtype", auto_cpu_dtype())
        check_rank_devices(self.device, self.parallel)
        if self.parallel.on_rank_failure == "heal":
            problem = self.parallel.heal_problem(self.device)
            if problem is not None:
                raise ValueError(f"--on-rank-failure heal: {problem}")
        object.__setattr__(self, "parallel", self.parallel.resolved(self.device))
        if self.max_num_batched_tokens is None:
            default = _scheduler_default("max_num_batched_tokens")
            object.__setattr__(self, "max_num_batched_tokens", max(default, self.max_num_seqs))  # type: ignore[call-overload]
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        if isinstance(self.debug_slow_rank, str):
            object.__setattr__(self, "debug_slow_rank", parse_slow_rank(self.debug_slow_rank))
        if self.debug_slow_rank is not None and self.debug_slow_rank.rank >= self.parallel.ep:
            raise ValueError(
                f"--debug-slow-rank names rank {self.debug_slow_rank.rank}, but --ep is {self.parallel.ep}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy {self.scheduling_policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels {self.kernels!r} is not one of {', '.join(KERNEL_BACKENDS)}")
        if self.indexer_key_dtype not in INDEXER_KEY_DTYPES:
            raise ValueError(
                f"indexer key dtype {self.indexer_key_dtype!r} is not one of {', '.join(INDEXER_KEY_DTYPES)}"
            )
        parallel, caching = self.parallel, self.cache.enable_prefix_caching
        problem = disaggregation_problem(self.kv_transfer, parallel.tp, caching)
        if problem is not None:
            raise ValueError(problem)

    @property
    def mtp_drafts(self) -> int:
        """Drafts per decode the model runners' MTP layers make (0: they load none)."""
        return 0 if self.speculative_config is None else self.speculative_config.mtp_drafts

    @property
    def draft_states(self) -> int:
        """States a state layer keeps per sequence beside its own to step back past rejected drafts:
        one after each token of a verify step (0 without speculative decoding)."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens + 1

    @property
    def num_saved_states(self) -> int:
        """Saved states prefix caching holds for a model with state layers (allocated only for such
        a model's state layers; 0 without prefix caching)."""
        if not self.cache.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.cache.saved_states is None else self.cache.saved_states

    @classmethod
    def from_options(cls, **values: object) -> EngineConfig:
        """From option names as `LLM(...)` and the command's flags take them (`slo_ttft_ms`,
        `kv_cache_memory`, ...)."""
        return build(cls, values)

    def with_model_folder(self) -> EngineConfig:
        """This config with model=None replaced by the built-in demo model's folder, which ships
        with the package."""
        if self.model is not None:
            return self
        from moeserve.checkpoints import demo_model_path

        return dataclasses.replace(self, model=str(demo_model_path()))
