"""The offline API, in vLLM's shape:

    llm = LLM("path/to/checkpoint", dtype="float32")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from __future__ import annotations

import logging
from typing import Sequence

from tqdm import tqdm

from moeserve.config import CacheConfig, EngineConfig, ParallelConfig, SLOConfig, parse_dtype
from moeserve.engine.engine import LLMEngine
from moeserve.engine.stats import StatLogger
from moeserve.engine.outputs import RequestOutput
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict | list[int]


def parallel_config(
    ep: int = 1,
    tp: int = 1,
    nnodes: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    distributed_backend: str = "auto",
    collective_timeout_s: float = 120.0,
    heartbeat_timeout_s: float = 5.0,
    node_rank: int = 0,
) -> ParallelConfig:
    """The process layout from the user-facing knobs (node 0's engine and other nodes alike)."""
    return ParallelConfig(
        ep=ep, tp=tp, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
        backend=distributed_backend, collective_timeout_s=collective_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
    )


def engine_config(
    model: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    ep: int = 1,
    tp: int = 1,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    block_size: int = 16,
    kv_cache_blocks: int | None = None,
    kv_cache_memory: int = 512 * 1024**2,
    seed: int = 0,
    scheduling_policy: str = "fcfs",
    slo_ttft_ms: float = 5000.0,
    slo_tbt_ms: float = 25.0,
    max_waiting: int | None = None,
    min_step_time_ms: float = 0.0,
    kernels: str = "auto",
    nnodes: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    distributed_backend: str = "auto",
    collective_timeout_s: float = 120.0,
    heartbeat_timeout_s: float = 5.0,
) -> EngineConfig:
    """The engine's config from the user-facing knobs `LLM` and `moeserve launch` share.

    model: a Hugging Face checkpoint folder; None serves the built-in demo model.
    dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
    ep, tp: expert-parallel ranks (one process each) and the tensor-parallel size of attention
        inside each of the ep / tp data-parallel groups; see `ParallelConfig` for the rest.
    """
    if model is None:
        from moeserve.checkpoints import demo_model_path

        model = str(demo_model_path())
    return EngineConfig(
        model=model,
        dtype=parse_dtype(dtype),
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        cache=CacheConfig(block_size=block_size, num_blocks=kv_cache_blocks, memory_bytes=kv_cache_memory),
        parallel=parallel_config(ep, tp, nnodes, master_addr, master_port, distributed_backend, collective_timeout_s, heartbeat_timeout_s),
        seed=seed,
        scheduling_policy=scheduling_policy,
        slo=SLOConfig(ttft_s=slo_ttft_ms / 1000.0, tbt_s=slo_tbt_ms / 1000.0),
        max_waiting=max_waiting,
        min_step_time_s=min_step_time_ms / 1000.0,
        kernels=kernels,
    )


class LLM:
    """Load a checkpoint and generate for batches of prompts with continuous batching.

    Takes `engine_config`'s arguments (model=None serves the built-in demo model). With ep or
    tp above 1 it starts one process per rank; `shutdown()` (or leaving a `with` block, or the
    interpreter's exit) stops them.
    """

    def __init__(self, model: str | None = None, stat_loggers: Sequence[StatLogger] = (), **kwargs) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs), stat_loggers)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is validated before any is queued;
        a progress bar counts finished prompts (as vLLM's does)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids = engine.add_requests(list(zip(prompts, params)))
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as progress:
            while len(results) < len(ids):
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        progress.update(1)
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the checkpoint's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            {"prompt_token_ids": list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
