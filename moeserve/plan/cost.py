"""The time of one step of this runtime, per layer and per rank, from first principles.

A step is what every rank of one EP group does in lockstep: `ep` ranks hold E/ep experts each;
attention runs over `ep / tp` data-parallel groups of `tp` tensor-parallel ranks (the layout of
`ParallelConfig`). Each term below is a roofline: the larger of its FLOPs over the effective FLOP
rate and its bytes over the effective bandwidth (`hardware.Hardware`: peak times an assumed
efficiency, or measured). Terms are per layer and per rank; `step_cost` sums them over the
layers (a hybrid's attention terms over its attention layers, its Gated DeltaNet terms over
the others), then applies what overlap hides. The slowest rank sets the step, so expert load
imbalance (max/mean rows per rank) scales the expert GEMM and the all-to-all.

What the model leaves out, on purpose: kernel launch gaps inside a CUDA graph, norms, rotary and
activation kernels (elementwise, a few per cent), the router GEMM, and queueing between ranks
beyond the imbalance factor. Of a DeltaNet: its causal conv (K taps per channel, and its conv
state, a fortieth of the recurrent state's bytes), the gates' and the gated norm's elementwise
work, the activations its kernels read and write, and prefix caching's copies of its states.
Of DeepSeek-V4: its compressors' pooling (a softmax-gated sum over `ratio` rows per entry,
elementwise), the indexer's top-k selection, the hyper head's one collapse before the LM head,
and the Sinkhorn iterations (a few thousand FLOPs a token on N x N matrices).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from moeserve.dispatch.wire import dispatch_row_bytes, ep_rows_per_token, tp_rows_per_token
from moeserve.plan.hardware import Hardware
from moeserve.plan.shapes import CompressedKind, ModelShape

DELTA_CHUNK = 32
"""Tokens per chunk of the chunked delta rule (`kernels.chunk_delta.CHUNK`, which a test pins)."""
DELTA_BLOCK_V = 32
"""Value dims per program of its state kernel (`kernels.chunk_delta.BLOCK_V`): each recomputes
its chunk's q k^T."""

PREFILL_QUERY_TILE = 128
"""Prompt tokens that share one read of their sequence's KV from HBM in prefill attention: a
flash-style kernel streams the keys once per tile of queries (64-128 rows), and the tiles of a
sequence running at once meet in L2. An assumption, not a measurement; without it every prompt
token would read the whole context, which makes long prompts look bandwidth bound."""

HYPER_STREAM_PASSES = 4
"""Passes over a token's N x H bf16 streams per hyper-connection mixer: the normalised
projection reads them, the collapse reads them, the merge reads and writes them. Counted from
`models.v4.hyper`, run as separate torch ops (no fused kernel)."""

COMPUTE_TERMS = (
    "attention_proj",
    "attention_core",
    "hyper_connections",
    "deltanet_proj",
    "deltanet_core",
    "dense_mlp",
    "shared_expert",
    "experts",
)
COMM_TERMS = ("dispatch", "combine", "tp_allreduce")


@dataclass(frozen=True)
class Layout:
    """How one EP group runs a step.

    expert_imbalance: max over mean rows an EP rank receives (1.0 = perfectly balanced; EPLB
    brings DeepSeek-V3 to ~1.1-1.3). dedupe_nodes: a token crosses to another NVLink domain once
    per destination domain and is forwarded inside it (DeepEP's normal kernels); moeserve's own
    dispatch sends one row per (token, k) pair (`moeserve.dispatch.wire`), so False here."""

    ep: int = 1
    tp: int = 1
    tbo: bool = False
    dispatch_fp8: bool = True
    num_comm_sms: int = 0
    expert_imbalance: float = 1.0
    dedupe_nodes: bool = False

    def __post_init__(self) -> None:
        if self.ep < 1 or self.tp < 1 or self.ep % self.tp:
            raise ValueError(f"ep {self.ep} must be a positive multiple of tp {self.tp}")
        if self.expert_imbalance < 1.0:
            raise ValueError(f"expert_imbalance is max/mean, >= 1, got {self.expert_imbalance}")

    @property
    def dp(self) -> int:
        """Attention data-parallel groups."""
        return self.ep // self.tp


@dataclass(frozen=True)
class Work:
    """What one attention-DP group computes in one step: decode tokens at a mean context, and
    prefill tokens whose queries attend over a mean context (prefix + half the chunk).
    decode_queries: query tokens per decoding sequence (MTP verifies drafts + 1 at once; the
    sequence's KV is read once for all of them). decode_restores: the share of decoding
    sequences that step back to a kept DeltaNet state first (MTP: one rejected a draft last
    step). prefill_seqs: the prompts the prefill tokens belong to, each of whose DeltaNet
    states the step reads and writes once."""

    decode_tokens: float = 0.0
    decode_ctx: float = 0.0
    prefill_tokens: float = 0.0
    prefill_ctx: float = 0.0
    decode_queries: int = 1
    decode_restores: float = 0.0
    prefill_seqs: float = 1.0

    @property
    def tokens(self) -> float:
        return self.decode_tokens + self.prefill_tokens

    @property
    def passes(self) -> tuple[tuple[float, float, float], ...]:
        """(queries, reads of each sequence's cache, mean context) of the decode tokens and of the
        prefill tokens: a decoding sequence's cache is read once a step for all its queries (MTP's
        drafts share it), a prompt's once per `PREFILL_QUERY_TILE` of its tokens."""
        return (
            (self.decode_tokens, self.decode_tokens / self.decode_queries, self.decode_ctx),
            (self.prefill_tokens, self.prefill_tokens / PREFILL_QUERY_TILE, self.prefill_ctx),
        )

    def halved(self) -> Work:
        """One of two-batch overlap's micro-batches."""
        return dataclasses.replace(
            self,
            decode_tokens=self.decode_tokens / 2,
            prefill_tokens=self.prefill_tokens / 2,
            prefill_seqs=self.prefill_seqs / 2,
        )


def roofline(flops: float, flop_rate: float, nbytes: float, bandwidth: float) -> float:
    """Seconds of a kernel bound by whichever of compute and memory is slower (Williams et al.,
    "Roofline", CACM 2009)."""
    return max(flops / flop_rate, nbytes / bandwidth)


def _dense_rate(shape: ModelShape, hw: Hardware) -> float:
    return hw.fp8_flops if shape.dense_weight_bytes == 1.0 else hw.bf16_flops


def weight_gemm(params: float, tokens: float, rate: float, weight_bytes: float, hw: Hardware) -> float:
    """A GEMM of every token through `params` weights: 2 FLOPs per parameter per token, the
    weights read once a step."""
    return roofline(2 * params * tokens, rate, params * weight_bytes, hw.hbm_bw)


def attention_proj(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """Q/KV/O projections over the TP shard of `attn_params` (`weight_gemm`)."""
    if shape.attention_replicated:
        return compressed_proj(shape, hw, work)
    return weight_gemm(shape.attn_params / layout.tp, work.tokens, _dense_rate(shape, hw), shape.dense_weight_bytes, hw)


def attention_core(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """Softmax attention over the context. Decode: `attn_ctx_flops` per (query, context token)
    (MLA absorbed: scores over the 512+64 latent, values over the 512), reading each sequence's
    KV once (`kv_bytes` per token and layer; MTP's drafts share it). MLA's latent is one "head"
    every TP rank holds whole; GQA's KV heads split over TP. Prefill: `prefill_ctx_flops` per
    pair (MLA not absorbed), the KV read once per `PREFILL_QUERY_TILE` prompt tokens, so compute
    bound. Heads split over TP, so FLOPs divide by tp.
    DeepSeek Sparse Attention: MLA over the top-k only (`attended_ctx`), plus the indexer.
    DeepSeek-V4: `compressed_core`."""
    if shape.attention_replicated:
        return compressed_core(shape, hw, work)
    kv_split = 1 if shape.attention == "mla" else min(layout.tp, shape.kv_heads)
    core = sum(
        roofline(
            queries * shape.attended_ctx(ctx) * flops / layout.tp,
            hw.attention_flops,
            reads * shape.attended_ctx(ctx) * shape.kv_bytes / kv_split,
            hw.hbm_bw,
        )
        for (queries, reads, ctx), flops in zip(work.passes, (shape.attn_ctx_flops, shape.prefill_ctx_flops))
    )
    return core + indexer(shape, hw, work)


def indexer(shape: ModelShape, hw: Hardware, work: Work) -> float:
    """DSA's lightning indexer, averaged over the layers (`indexer_share` run one): every query
    scores every context token (`indexer_ctx_flops`), reading each sequence's indexer keys once
    (in prefill once per `PREFILL_QUERY_TILE` prompt tokens).
    Replicated on the TP ranks of a group, as the model runs it; zero for a dense model."""
    share = shape.indexer_share
    return sum(
        roofline(
            share * queries * ctx * shape.indexer_ctx_flops,
            hw.attention_flops,
            share * reads * ctx * shape.indexer_key_bytes,
            hw.hbm_bw,
        )
        for queries, reads, ctx in work.passes
    )


def compressed_proj(shape: ModelShape, hw: Hardware, work: Work) -> float:
    """DeepSeek-V4's projections of one layer, averaged over its kinds, every rank of a TP group
    computing them all (the server replicates V4's attention): q through its low-rank path
    (H x q_lora, q_lora x Hq D), the shared key-and-value (H x D), the output's mixing
    `wo_b` (G o_lora x H) and the compressors' and indexer's per-token projections
    (`CompressedKind.compressor_params`), all as the checkpoint stores them; the grouped `wo_a`
    (Hq D x o_lora in G blocks) in bf16, its FP8 weights dequantized at load (`weight_gemm`)."""
    params = shape.attn_params + shape.compressor_params / shape.layers
    linear = weight_gemm(params, work.tokens, _dense_rate(shape, hw), shape.dense_weight_bytes, hw)
    return linear + weight_gemm(shape.grouped_out_params, work.tokens, hw.bf16_flops, 2.0, hw)


def compressed_core(shape: ModelShape, hw: Hardware, work: Work) -> float:
    """DeepSeek-V4's attention and CSA indexer of one layer, averaged over its kinds (window
    only, CSA, HCA: `compressed_attention`, `compressed_indexer`). Replicated over TP: nothing
    divides by tp."""
    total = sum(
        kind.layers * (compressed_attention(shape, kind, hw, work) + compressed_indexer(kind, hw, work))
        for kind in shape.compressed_kinds
    )
    return total / shape.layers


def compressed_attention(shape: ModelShape, kind: CompressedKind, hw: Hardware, work: Work) -> float:
    """One V4 layer's shared-KV attention (`kernels.compressed_attention.sink_attention`): a
    query at context c attends min(c, window) window keys and the layer's compressed entries,
    c / ratio of them (CSA: at most top-k, those its indexer picked; window-only layers none).
    Each key is read as key and value by every head: 4 Hq D FLOPs per (query, key). Decode
    reads each sequence's keys once a step (window entries `kv_bytes`, compressed ones
    `entry_bytes`, from the specs; MTP's drafts share them; the kernel's programs over tiles
    of heads meet in L2); prefill once per `PREFILL_QUERY_TILE` prompt tokens."""
    return sum(
        roofline(
            queries * (min(ctx, shape.window) + kind.entries(ctx)) * shape.attn_ctx_flops,
            hw.attention_flops,
            reads * (min(ctx, shape.window) * shape.kv_bytes + kind.entries(ctx) * kind.entry_bytes),
            hw.hbm_bw,
        )
        for queries, reads, ctx in work.passes
    )


def compressed_indexer(kind: CompressedKind, hw: Hardware, work: Work) -> float:
    """A CSA layer's lightning indexer (`kernels.compressed_attention.indexer_topk`): every query
    at context c scores all c / ratio closed entries (`index_ctx_flops` each), reading each
    sequence's indexer keys once a step in decode, once per `PREFILL_QUERY_TILE` prompt
    tokens in prefill. Zero for the other kinds."""
    if not kind.topk:
        return 0.0
    return sum(
        roofline(
            queries * ctx / kind.ratio * kind.index_ctx_flops,
            hw.attention_flops,
            reads * ctx / kind.ratio * kind.index_key_bytes,
            hw.hbm_bw,
        )
        for queries, reads, ctx in work.passes
    )


def hyper_connections(shape: ModelShape, hw: Hardware, work: Work) -> float:
    """DeepSeek-V4's two hyper-connection mixers of one layer (`models.v4.hyper`), on every rank
    of a TP group for every token. Each projects the token's normalised N x H streams to
    (2 + N) N mixing weights in float32 on the CUDA cores (2 FLOPs per parameter per token,
    `hyper_params` both, their float32 weights read once), and passes over the bf16 streams
    `HYPER_STREAM_PASSES` times: N times the activation traffic of a plain residual, which at
    a large batch rivals the weights' bytes, so it is priced; zero without streams."""
    if not shape.hyper_streams:
        return 0.0
    streams = work.tokens * 2 * HYPER_STREAM_PASSES * shape.hyper_streams * shape.hidden * 2
    return roofline(2 * shape.hyper_params * work.tokens, hw.fp32_flops, shape.hyper_params * 4 + streams, hw.hbm_bw)


def deltanet_proj(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """A Gated DeltaNet's projections (`weight_gemm`), split over TP as the layer splits them: a
    rank holds its Hk/tp key heads' and Hv/tp value heads' rows of the in-projections and the
    matching input columns of `out_proj`. The in-projections run in bf16 whatever the checkpoint
    (an FP8 release's are dequantized at load, their rank rows falling across scale blocks);
    `out_proj` as the other dense projections."""
    inner = weight_gemm(shape.linear_in_params / layout.tp, work.tokens, hw.bf16_flops, 2.0, hw)
    outer = weight_gemm(
        shape.linear_out_params / layout.tp, work.tokens, _dense_rate(shape, hw), shape.dense_weight_bytes, hw
    )
    return inner + outer


def deltanet_core(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """The gated delta rule of one DeltaNet layer on one rank (its Hv/tp value heads): decodes by
    the recurrent update, prompt tokens by the chunked form. Zero for a model without one."""
    return delta_recurrent(shape, hw, layout, work) + delta_chunked(shape, hw, layout, work)


def delta_recurrent(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """The recurrent update of the decode tokens (`kernels.gated_delta._delta_rule_kernel`), on
    the CUDA cores in float32. Per token and value head, over its Dk x Dv state S: the decay
    (Dk Dv FLOPs), k^T S (2 Dk Dv), the rank-one delta update (2 Dk Dv) and the read q^T S
    (2 Dk Dv): 7 Dk Dv. Each sequence's float32 state is read once and written once a step,
    its MTP drafts walking it in registers; verifying drafts, the kernel also stores the state
    after each of the sequence's decode_queries tokens, and a sequence that rejected a draft
    first copies its kept state back (a read and a write). About 1 FLOP a byte: HBM bound."""
    heads = shape.linear_value_heads / layout.tp
    flops = work.decode_tokens * heads * 7 * shape.linear_key_dim * shape.linear_value_dim
    kept = work.decode_queries if work.decode_queries > 1 else 0
    states = work.decode_tokens / work.decode_queries * (2 + kept + 2 * work.decode_restores)
    return roofline(flops, hw.fp32_flops, states * shape.linear_state_bytes / layout.tp, hw.hbm_bw)


def delta_chunked(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """The chunked delta rule of the prompt tokens (`kernels.chunk_delta`), chunks of C tokens.
    Per token and value head, on tf32 tensor cores: against the state, q S, k S and the state's
    update k^T v' (6 Dk Dv); within the chunk, k k^T for its inverse once and q k^T in each of
    the ceil(Dv / 32) programs that split the values (2 C Dk apiece), the inverse times the
    values and the scores times v' (2 C Dv each). The inverse's forward substitution runs on
    the CUDA cores: C - 1 steps over the [C, C] tile, each a masked row read and a row times
    the tile (4 C^2), so 4 C (C - 1) a token. A sequence's state is read once and written once
    a step: the kernel holds it in registers from chunk to chunk."""
    if not work.prefill_tokens:
        return 0.0
    c, dk, dv = DELTA_CHUNK, shape.linear_key_dim, shape.linear_value_dim
    heads = shape.linear_value_heads / layout.tp
    products = 6 * dk * dv + 2 * c * dk * (math.ceil(dv / DELTA_BLOCK_V) + 1) + 4 * c * dv
    tensor = roofline(
        work.prefill_tokens * heads * products,
        hw.tf32_flops,
        work.prefill_seqs * 2 * shape.linear_state_bytes / layout.tp,
        hw.hbm_bw,
    )
    return tensor + work.prefill_tokens * heads * 4 * c * (c - 1) / hw.fp32_flops


def dense_mlp(shape: ModelShape, hw: Hardware, layout: Layout, work: Work, inter: int) -> float:
    """A gated MLP of `inter` (gate, up, down: 3 H I parameters), a dense layer's or a shared
    expert (`weight_gemm`). Not sharded over TP: every rank of a group holds it whole and runs
    it on its 1/tp slice of the group's tokens (`models.tensor_parallel`), so the FLOPs divide
    by tp and the weight read does not."""
    params = 3 * shape.hidden * inter
    return weight_gemm(params, work.tokens / layout.tp, _dense_rate(shape, hw), shape.dense_weight_bytes, hw)


def expert_rows(shape: ModelShape, layout: Layout, work: Work) -> float:
    """Rows the busiest EP rank computes: each TP rank dispatches its 1/tp slice of its group's
    tokens (K rows each), a rank receives as many as it sends on average, times the imbalance."""
    return work.tokens / layout.tp * shape.top_k * layout.expert_imbalance


def active_experts(shape: ModelShape, layout: Layout, work: Work) -> float:
    """Experts of the fullest rank that any token of the step picks, under uniform routing: each
    of its ceil(E/ep) experts (placement gives the first E % ep ranks one more) is missed by all
    T K picks with probability (1 - 1/E)^(T K)."""
    picks = work.tokens * layout.dp * shape.top_k
    return experts_per_rank(shape, layout) * (1 - (1 - 1 / shape.experts) ** picks)


def experts_per_rank(shape: ModelShape, layout: Layout) -> int:
    return math.ceil(shape.experts / layout.ep)


def experts(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """Grouped expert GEMMs: 2 FLOPs per parameter per row over `expert_rows`, the weights of
    every active expert read once (FP8 w8a8 for block-FP8 checkpoints, else bf16 FLOPs)."""
    rate = hw.fp8_flops if shape.fp8_experts else hw.bf16_flops
    flops = 2 * shape.expert_params * expert_rows(shape, layout, work)
    nbytes = active_experts(shape, layout, work) * shape.expert_params * shape.expert_weight_bytes
    return roofline(flops, rate, nbytes, hw.hbm_bw)


def link_shares(ep: int, domain: int) -> tuple[float, float]:
    """Of the rows one rank sends off itself under uniform routing, the share to the other ranks
    of its NVLink domain and the share to ranks outside it."""
    if ep == 1:
        return 0.0, 0.0
    d = min(domain, ep)
    return (d - 1) / (ep - 1), (ep - d) / (ep - 1)


def remote_domains_per_token(top_k: int, domains: int) -> float:
    """Expected other NVLink domains a token's K uniform picks reach: of D domains each is hit
    with probability 1 - (1 - 1/D)^K, and (D - 1)/D of the hits are not the sender's."""
    if domains <= 1:
        return 0.0
    return domains * (1 - (1 - 1 / domains) ** top_k) * (domains - 1) / domains


def all_to_all(shape: ModelShape, hw: Hardware, layout: Layout, work: Work, row_bytes: int) -> float:
    """One dispatch or combine: a fixed latency, then the NVLink and NIC parts in parallel, each
    bytes over bandwidth. Rows per rank: K per token of the rank's slice, times the imbalance;
    the off-rank share is (ep - 1)/ep (`wire.ep_rows_per_token` out and back), split between the
    NVLink domain and the NIC by `link_shares`. With `dedupe_nodes` a token crosses the NIC once
    per remote domain (`remote_domains_per_token`) instead of once per pair."""
    if layout.ep == 1:
        return 0.0
    tokens = work.tokens / layout.tp * layout.expert_imbalance
    off_rank = tokens * ep_rows_per_token(shape.top_k, layout.ep) / 2  # out only; combine is the other half
    nvl_share, nic_share = link_shares(layout.ep, hw.gpu.nvlink_domain)
    nvl_rows, nic_rows = off_rank * nvl_share, off_rank * nic_share
    if layout.dedupe_nodes:
        nic_rows = tokens * remote_domains_per_token(shape.top_k, math.ceil(layout.ep / hw.gpu.nvlink_domain))
    return hw.a2a_latency_s + max(nvl_rows * row_bytes / hw.nvlink_bw, nic_rows * row_bytes / hw.nic_bw)


def dispatch(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """Dispatch rows: FP8 bytes + scales (`wire.dispatch_row_bytes`) or bf16 activations."""
    return all_to_all(shape, hw, layout, work, dispatch_row_bytes(shape.hidden, torch.bfloat16, layout.dispatch_fp8))


def combine(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """Combine sends the experts' bf16 outputs back: 2 H bytes a row."""
    return all_to_all(shape, hw, layout, work, dispatch_row_bytes(shape.hidden, torch.bfloat16, False))


def tp_allreduce(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> float:
    """A ring all-reduce of the group's bf16 activations over NVLink: each rank sends
    2 (tp - 1)/tp of T H 2 bytes (`wire.tp_rows_per_token` is the group's 2 (tp - 1) rows).
    DeepSeek-V4, whose attention every rank runs whole, instead all-gathers the MoE's outputs
    of its token slices: (tp - 1)/tp of T H 2 bytes, half an all-reduce's."""
    if layout.tp == 1:
        return 0.0
    nbytes = tp_rows_per_token(layout.tp) / layout.tp * work.tokens * shape.hidden * 2
    if shape.attention_replicated:
        nbytes /= 2
    return hw.allreduce_latency_s + nbytes / hw.nvlink_bw


def mixer_terms(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> dict[str, float]:
    """Seconds of each token mixer's terms on the busiest rank, summed over its layers:
    attention's over the attention layers, the Gated DeltaNet's over the DeltaNet layers (a
    hybrid's KV and its attention FLOPs come from its attention layers alone)."""
    attention, linear = shape.attention_layers, shape.linear_layers
    return {
        "attention_proj": attention * attention_proj(shape, hw, layout, work),
        "attention_core": attention * attention_core(shape, hw, layout, work),
        "hyper_connections": shape.layers * hyper_connections(shape, hw, work),
        "deltanet_proj": linear * deltanet_proj(shape, hw, layout, work),
        "deltanet_core": linear * deltanet_core(shape, hw, layout, work),
    }


def layer_terms(shape: ModelShape, hw: Hardware, layout: Layout, work: Work, moe: bool) -> dict[str, float]:
    """Seconds of each term of one layer's feed-forward half on the busiest rank, with the
    layer's TP exchange: a dense layer has its MLP, an MoE layer its shared expert, experts,
    dispatch and combine; either one reduce-scatter of the token mixer's partial output and one
    all-gather of the next layer's input (`models.tensor_parallel`), an all-reduce's volume."""
    terms = {
        "dense_mlp": 0.0 if moe else dense_mlp(shape, hw, layout, work, shape.dense_inter),
        "shared_expert": dense_mlp(shape, hw, layout, work, shape.shared_inter) if moe else 0.0,
        "experts": experts(shape, hw, layout, work) if moe else 0.0,
        "dispatch": dispatch(shape, hw, layout, work) if moe else 0.0,
        "combine": combine(shape, hw, layout, work) if moe else 0.0,
        "tp_allreduce": tp_allreduce(shape, hw, layout, work),
    }
    return terms


def lm_head(shape: ModelShape, hw: Hardware, work: Work) -> float:
    """Logits of the decode tokens (prefill samples once per prompt, left out): vocab x hidden
    bf16 weights, replicated on every attention-DP rank."""
    params = shape.vocab * shape.hidden
    return roofline(2 * params * work.decode_tokens, hw.bf16_flops, params * 2, hw.hbm_bw)


@dataclass(frozen=True)
class StepCost:
    """One step: each term summed over the layers (seconds, before overlap), and the step time."""

    terms: dict[str, float]
    seconds: float

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)


def _summed(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> dict[str, float]:
    moe = layer_terms(shape, hw, layout, work, moe=True)
    dense = layer_terms(shape, hw, layout, work, moe=False)
    ffn = {k: shape.moe_layers * moe[k] + shape.dense_layers * dense[k] for k in moe}
    return mixer_terms(shape, hw, layout, work) | ffn


def _with_comm_sms(hw: Hardware, layout: Layout) -> Hardware:
    """Compute keeps the SMs communication does not hold: rates and HBM bandwidth (which SMs
    drive) scale by (SMs - num_comm_sms) / SMs while both run at once."""
    share = (hw.gpu.sms - layout.num_comm_sms) / hw.gpu.sms
    return dataclasses.replace(
        hw,
        hbm_bw=hw.hbm_bw * share,
        bf16_flops=hw.bf16_flops * share,
        fp8_flops=hw.fp8_flops * share,
        attention_flops=hw.attention_flops * share,
        fp32_flops=hw.fp32_flops * share,
    )


def step_cost(shape: ModelShape, hw: Hardware, layout: Layout, work: Work) -> StepCost:
    """The step time. Without two-batch overlap: every term in sequence. With it, the batch
    runs as two halves, one's communication under the other's compute (on the SMs left to
    compute): per layer max(2 C_half, 2 M_half), plus one layer's min(C_half, M_half) to fill the pipe.
    Halves read every weight twice, so TBO loses where weights dominate (small batches)."""
    extra = lm_head(shape, hw, work) + hw.step_overhead_s
    if not layout.tbo:
        terms = _summed(shape, hw, layout, work)
        return StepCost(terms | {"lm_head": extra}, sum(terms.values()) + extra)
    half = _summed(shape, _with_comm_sms(hw, layout), layout, work.halved())
    compute = sum(half[k] for k in COMPUTE_TERMS)
    comm = sum(half[k] for k in COMM_TERMS)
    terms = {k: 2 * v for k, v in half.items()} | {"lm_head": extra}
    return StepCost(terms, max(2 * compute, 2 * comm) + min(compute, comm) / shape.layers + extra)


def weight_bytes_per_gpu(shape: ModelShape, layout: Layout) -> float:
    """Weights the fullest rank holds: its TP shard of attention and DeltaNets, the dense MLPs and
    shared experts whole (they run on a slice of the tokens, `dense_mlp`), its ceil(E/ep) routed
    experts, and the embedding and LM head (bf16, replicated). A DeltaNet's in-projections and
    conv are bf16 in every checkpoint. DeepSeek-V4's attention is replicated
    (`replicated_attention_bytes`)."""
    attention = 0 if shape.attention_replicated else shape.attention_layers * shape.attn_params
    mixers = attention + shape.linear_layers * shape.linear_out_params
    linear = shape.linear_layers * (shape.linear_in_params + shape.linear_conv_params) * 2
    ffn = (
        shape.dense_layers * 3 * shape.hidden * shape.dense_inter
        + shape.moe_layers * 3 * shape.hidden * shape.shared_inter
    )
    routed = shape.moe_layers * experts_per_rank(shape, layout) * shape.expert_params
    embeddings = 2 * shape.vocab * shape.hidden * 2
    sharded = (mixers * shape.dense_weight_bytes + linear) / layout.tp
    whole = ffn * shape.dense_weight_bytes + routed * shape.expert_weight_bytes + embeddings
    return sharded + whole + replicated_attention_bytes(shape)


def replicated_attention_bytes(shape: ModelShape) -> float:
    """DeepSeek-V4's attention weights, whole on every rank: its projections and compressors as
    stored, the grouped `wo_a` in bf16, the hyper-connection mixers in float32. Zero otherwise."""
    if not shape.attention_replicated:
        return 0.0
    stored = (shape.layers * shape.attn_params + shape.compressor_params) * shape.dense_weight_bytes
    return stored + shape.layers * (shape.grouped_out_params * 2 + shape.hyper_params * 4)


def kv_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """KV cache bytes one rank holds per token of its DP group (the attention layers').
    DeepSeek-V4: its compressed entries and indexer keys, an entry per `ratio` positions
    (`CacheSpecs.bytes_per_context_token`), whole on every rank; its window's are bounded by
    the window and set aside per sequence (`ModelShape.sequence_block_bytes`)."""
    if shape.attention_replicated:
        return sum(k.layers * k.bytes_per_context_token for k in shape.compressed_kinds)
    kv_split = 1 if shape.attention == "mla" else min(layout.tp, shape.kv_heads)
    return shape.attention_layers * (shape.kv_bytes / kv_split + shape.indexer_share * shape.indexer_key_bytes)


def state_bytes_per_gpu(shape: ModelShape, layout: Layout, sequences: int, draft_states: int = 0) -> float:
    """The states one rank sets aside for a DP group's `sequences` running sequences before any
    block, as the engine does (`worker.kv_cache.state_bytes` with `max_num_seqs` = `sequences`):
    a slot each, with its `draft_states` (MTP: drafts + 1, `EngineConfig.draft_states`), and as
    many saved states for prefix caching (the engine's default `saved_states` is
    `max_num_seqs`). The states split over TP with the heads. Zero without state layers.
    DeepSeek-V4 keeps each verify step's inputs instead of a state per draft
    (`models.v4.cache.kept_bytes_per_sequence`: a state and `kept_bytes_per_draft` per draft
    state), and its states are whole on every rank."""
    if shape.attention_replicated:
        kept = shape.state_bytes + draft_states * shape.kept_bytes_per_draft if draft_states else 0
        return sequences * (2 * shape.state_bytes + kept)
    return sequences * (2 + draft_states) * shape.state_bytes / layout.tp


def max_tokens_in_cache(
    shape: ModelShape, hw: Hardware, layout: Layout, usable: float = 0.9, sequences: int = 0, draft_states: int = 0
) -> float:
    """Tokens of context one DP group can hold: `usable` of HBM less the weights and the states
    of `sequences` running sequences (`state_bytes_per_gpu`) and, DeepSeek-V4, their windows'
    blocks (`ModelShape.sequence_block_bytes`), over the KV bytes per token (activations and
    graphs take the rest)."""
    free = hw.gpu.hbm_bytes * usable - weight_bytes_per_gpu(shape, layout)
    free -= state_bytes_per_gpu(shape, layout, sequences, draft_states) + sequences * shape.sequence_block_bytes
    return max(free, 0.0) / kv_bytes_per_token(shape, layout)
