"""The offline API, in vLLM's shape:

llm = LLM("path/to/checkpoint", dtype="float32")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tqdm import tqdm

from moeserve.engine.engine import LLMEngine
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.stats import StatLogger
from moeserve.engine_config import EngineConfig
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict | list[int]


class LLM:
    """Load a checkpoint and generate for batches of prompts with continuous batching.

    Takes the options `moeserve launch` takes as flags, by the same names (`EngineConfig`'s
    documented fields: dtype, max_num_seqs, kv_cache_memory, slo_ttft_ms, ep, ...); an unknown
    one is a TypeError that lists them. model=None serves the built-in demo model. With ep or tp
    above 1 it starts one process per rank; `shutdown()` (or leaving a `with` block, or the
    interpreter's exit) stops them.
    """

    def __init__(self, model: str | None = None, stat_loggers: Sequence[StatLogger] = (), **options: object) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options).with_model_folder(), stat_loggers)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
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
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
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

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": list(
                    tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
