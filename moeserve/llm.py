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
) -> EngineConfig:
    """The engine's config from the user-facing knobs `LLM` and `moeserve launch` share.

    model: a Hugging Face checkpoint folder; None serves the built-in demo model.
    dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
    ep, tp: expert / tensor parallel sizes (multi-process EP is a separate launcher; 1 here).
    """
    if ep != 1 or tp != 1:
        raise ValueError(f"ep={ep}, tp={tp}: multi-process expert/tensor parallelism is not available in this build; use ep=1, tp=1")
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
        parallel=ParallelConfig(ep=ep, tp=tp),
        seed=seed,
        scheduling_policy=scheduling_policy,
        slo=SLOConfig(ttft_s=slo_ttft_ms / 1000.0, tbt_s=slo_tbt_ms / 1000.0),
        max_waiting=max_waiting,
        min_step_time_s=min_step_time_ms / 1000.0,
    )


class LLM:
    """Load a checkpoint and generate for batches of prompts with continuous batching.

    Takes `engine_config`'s arguments (model=None serves the built-in demo model).
    """

    def __init__(self, model: str | None = None, stat_loggers: Sequence[StatLogger] = (), **kwargs) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs), stat_loggers)

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
