"""The DeepSeek-V4 model: embeddings spread over the hyper-connection streams, decoder layers
(attention then MoE, each between its hyper-connections), the hyper head, the final norm.

A step packs its sequences' tokens (`V4Batch`): attention runs sequence by sequence against each
one's cache (`CompressedAttention.forward_cached`), the MoE over all tokens at once through the
dispatcher, hash-routed layers by the token ids. Under tensor parallelism the attention and the
hyper-connections are replicated on every rank of the group (as transformers' plan keeps them:
one shared KV head does not split), and each rank's MoE takes its slice of the tokens, gathered
back after the combine. `forward_steps` is the same pass yielding at each layer's dispatch and
combine, for two-batch overlap's micro-batches of whole sequences. The bookkeeping of expert load and placement is
`MoECausalLM`'s, which reads only the layers' MoE blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.dispatch import Dispatcher
from moeserve.dispatch.base import Steps, finish
from moeserve.models.decoder import MoECausalLM
from moeserve.models.layers.moe import MoEBlock
from moeserve.models.tensor_parallel import SINGLE, TensorParallel
from moeserve.models.v4.attention import CompressedAttention
from moeserve.models.v4.cache import LayerCache, V4Batch
from moeserve.models.v4.hyper import HyperConnection, HyperHead, merge
from moeserve.models.v4.mtp import V4MTPBlock
from moeserve.models.v4.norm import Float32RMSNorm
from moeserve.ops import TORCH_OPS, LayerOps


class V4DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dispatcher: Dispatcher,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        hc = cfg.hyper_connections
        assert hc is not None
        self.tp = tp
        self.input_norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.attn = CompressedAttention(cfg, layer, dtype, device, ops)
        self.post_attn_norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        hashed = layer < cfg.num_layers and cfg.hash_moe_layers[layer]  # an MTP block routes by scores
        self.mlp = MoEBlock(cfg, dispatcher, dtype, device, ops, hash_routed=hashed)
        self.attn_hc = HyperConnection(hc, cfg.hidden_size, cfg.rms_norm_eps, device)
        self.ffn_hc = HyperConnection(hc, cfg.hidden_size, cfg.rms_norm_eps, device)

    def forward(self, *args) -> torch.Tensor:
        """streams `[T, N, H]` -> `[T, N, H]`: forward_steps()' body in one step, the MoE block
        called as a module (its forward hooks fire)."""
        return finish(self.forward_steps(*args, in_steps=False))

    def forward_steps(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        batch: V4Batch,
        cache: LayerCache,
        max_tokens_per_rank: int | None,
        in_steps: bool = True,
    ) -> Steps[torch.Tensor]:
        """The layer in steps: yields at the MoE's dispatch and combine (`MoEBlock.forward_steps`),
        hash-routed or learned alike. The attention, the hyper-connections and the
        tensor-parallel gather run inside a step, so every rank of a group makes its collectives
        in the same order whatever the interleaving."""
        post, comb, collapsed = self.attn_hc(streams)
        normed = self.input_norm(collapsed)
        mixed = [
            self.attn.forward_cached(rows, cache, seq)
            for rows, seq in zip(normed.split(list(batch.query_lens)), batch.sequences, strict=True)
        ]
        streams = merge(torch.cat(mixed) if mixed else normed, streams, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        rows = self.tp.token_slice(token_ids.shape[0])
        args = (self.post_attn_norm(collapsed[rows]), max_tokens_per_rank, token_ids[rows])
        out = (yield from self.mlp.forward_steps(*args)) if in_steps else self.mlp(*args)
        return merge(self.tp.all_gather_tokens(out, token_ids.shape[0]), streams, post, comb)


class DeepseekV4CausalLM(nn.Module):
    """Parameters named as `MoECausalLM`'s where they match (`embed_tokens`, `layers.N.attn`,
    `layers.N.mlp`, `norm`, `lm_head`) so that one checkpoint mapping serves both."""

    def __init__(
        self,
        cfg: ModelConfig,
        dispatcher: Dispatcher,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
        with_mtp: bool = False,
    ) -> None:
        super().__init__()
        hc = cfg.hyper_connections
        assert hc is not None
        self.cfg, self.dtype, self.tp, self.ops = cfg, dtype, tp, ops
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            V4DecoderLayer(cfg, i, dispatcher, dtype, device, tp, ops) for i in range(cfg.num_layers)
        )
        self.hc_head = HyperHead(hc, cfg.hidden_size, cfg.rms_norm_eps, device)
        self.norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.lm_head = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        blocks = (
            V4DecoderLayer(cfg, cfg.num_layers + i, dispatcher, dtype, device, tp, ops)
            for i in range(cfg.num_mtp_layers if with_mtp else 0)
        )
        self.mtp = nn.ModuleList(V4MTPBlock(cfg, block, dtype, device, ops) for block in blocks)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: V4Batch,
        caches: list[LayerCache],
        max_tokens_per_rank: int | None = None,
    ) -> torch.Tensor:
        """input_ids `[T]` (the batch's sequences packed) -> final hidden states `[T, H]`."""
        return self.forward_with_stream(input_ids, batch, caches, max_tokens_per_rank)[0]

    def forward_with_stream(
        self,
        input_ids: torch.Tensor,
        batch: V4Batch,
        caches: list[LayerCache],
        max_tokens_per_rank: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(), and what the MTP blocks read: the streams `[T, N, H]` before the hyper head
        (whole on every rank: the MoE's rows are gathered back in each layer). `caches` may hold
        the MTP blocks' after the decoder's."""
        streams = finish(self._layers(input_ids, batch, caches, max_tokens_per_rank, in_steps=False))
        return self.norm(self.hc_head(streams)), streams

    def forward_steps(
        self,
        input_ids: torch.Tensor,
        batch: V4Batch,
        caches: list[LayerCache],
        max_tokens_per_rank: int | None = None,
    ) -> Steps[torch.Tensor]:
        """forward() in steps, for one micro-batch of two-batch overlap (whole sequences): yields
        at every layer's dispatch and combine as `MoECausalLM.forward_steps` does, as often on
        every rank (each layer is an MoE layer). A micro-batch may be empty (T = 0): it still
        joins every collective."""
        streams = yield from self._layers(input_ids, batch, caches, max_tokens_per_rank, in_steps=True)
        return self.norm(self.hc_head(streams))

    def _layers(
        self,
        input_ids: torch.Tensor,
        batch: V4Batch,
        caches: list[LayerCache],
        max_tokens_per_rank: int | None,
        in_steps: bool,
    ) -> Steps[torch.Tensor]:
        """The one body of forward_with_stream() and forward_steps(): the streams before the hyper
        head. Without `in_steps` each layer is called as a module (one step, forward hooks fire);
        with it, through its own steps. `caches` may hold the MTP blocks' after the decoder's."""
        x = F.embedding(input_ids, self.embed_tokens)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hyper_connections.mult, -1).contiguous()
        for layer, cache in zip(self.layers, caches[: len(self.layers)], strict=True):
            args = (streams, input_ids, batch, cache, max_tokens_per_rank)
            if in_steps:
                streams = yield from layer.forward_steps(*args)
            else:
                streams = layer(*args)
        return streams

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    # Expert bookkeeping reads only `self.layers[i].mlp`: MoECausalLM's serves as it is.
    moe_blocks = MoECausalLM.moe_blocks
    set_expert_map = MoECausalLM.set_expert_map
    rehome = MoECausalLM.rehome
    counting_rows = MoECausalLM.counting_rows
    take_dispatch_rows = MoECausalLM.take_dispatch_rows
    take_routed_tokens = MoECausalLM.take_routed_tokens
