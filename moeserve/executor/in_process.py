"""The whole model in the engine's process (ep = tp = 1)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moeserve.config import EngineConfig, ModelConfig
from moeserve.dispatch import ExpertMap, create_dispatcher
from moeserve.dispatch.expert_load import RoutedTokens, logical_rows
from moeserve.eplb.record import LoadRecord
from moeserve.executor.base import Executor
from moeserve.kv_transfer.agent import KvAgent, KvRegistration
from moeserve.kv_transfer.rank_writer import KvWriter
from moeserve.models import load_model
from moeserve.ops import create_ops
from moeserve.scheduler import StepPlan
from moeserve.worker.decode_graphs import GraphSettings, create_decode_graphs
from moeserve.worker.kv_cache import allocate_kv_caches
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import ModelRunner, SampledToken
from moeserve.worker.sampling_metadata import PendingBitmask


class InProcessExecutor(Executor):
    """The whole model in this process (ep = tp = 1): the `local` dispatcher, one group."""

    num_groups = 1

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        num_kv_blocks: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        mtp_drafts = config.mtp_drafts
        eplb = config.parallel.eplb
        self._moe_layers = model_config.moe_layer_indices
        self._load_record = None
        if eplb.record_expert_load is not None:
            self._load_record = LoadRecord(eplb.record_expert_load, model_config.num_experts, self._moe_layers)
        self.expert_map = ExpertMap.initial(
            model_config.num_experts, len(self._moe_layers), 1, eplb.num_redundant_experts, eplb.expert_placement
        )
        dispatcher = create_dispatcher(
            "local", self.expert_map.slot_placement(), config.device, dispatch_fp8=config.parallel.dispatch_fp8
        )
        self.model = load_model(
            Path(config.model),
            dtype,
            config.device,
            dispatcher,
            ops=create_ops(config.kernels, config.device),
            expert_map=self.expert_map,
            with_mtp=mtp_drafts > 0,
            indexer_key_dtype=config.indexer_key_dtype,
        )
        # One block more when decode graphs may be captured: their pad rows' scratch block.
        scratch = 1 if config.cuda_graphs.wanted(config.device) else 0
        block_size = config.cache.block_size
        kv_caches = allocate_kv_caches(
            model_config,
            num_kv_blocks + scratch,
            block_size,
            dtype,
            config.device,
            mtp_layers=len(self.model.mtp),
            num_state_slots=config.max_num_seqs,
            draft_states=config.draft_states,
            num_saved_states=config.num_saved_states,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        settings = GraphSettings(
            config.device,
            config.max_num_seqs,
            config.max_model_len or model_config.max_position_embeddings,
            two_batch_overlap=config.parallel.two_batch_overlap,
        )
        graphs = create_decode_graphs(self.model, kv_caches, block_size, num_kv_blocks, config.cuda_graphs, settings)
        self.kv_agent = KvAgent(kv_caches, config.kv_transfer.role) if config.kv_transfer.enabled else None
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            config.cache.block_size,
            eos_token_ids,
            config.device,
            seed=config.seed,
            two_batch_overlap=config.parallel.two_batch_overlap,
            graphs=graphs,
            mtp_drafts=mtp_drafts,
        )

    def execute(
        self, plan: StepPlan, token_bitmask: PendingBitmask | None = None, *, profile: bool = False
    ) -> dict[str, SampledToken]:
        (group,) = plan.groups
        sampled = self.runner.execute(group, token_bitmask=token_bitmask)
        if profile:
            self.model.take_routed_tokens()
        return sampled

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        return self.runner.take_prompt_logprobs()

    def take_routed_tokens(self) -> RoutedTokens | None:
        routed = logical_rows(self.model.take_routed_tokens(), self.expert_map, 0)
        if self._load_record is not None:
            self._load_record.add(routed)
        return RoutedTokens.from_ranks([routed], self._moe_layers)

    def kv_registrations(self) -> list[KvRegistration]:
        if self.kv_agent is None:
            raise ValueError("the KV cache was not registered for transfers (no --kv-transfer)")
        return [self.kv_agent.registration]

    def kv_writers(self) -> list[KvWriter]:
        """The cache is in this process: its agent writes the blocks itself."""
        if self.kv_agent is None:
            raise ValueError("the KV cache was not registered for transfers (no --kv-transfer)")
        return [self.kv_agent]

    def shutdown(self) -> None:
        """Write the recorded expert load (`--record-expert-load`), the last rows included."""
        if self._load_record is not None:
            self.take_routed_tokens()
            self._load_record.save()
            self._load_record = None
