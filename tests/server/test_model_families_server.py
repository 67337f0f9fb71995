"""The server serves each newer checkpoint family through the `openai` client: GLM-4.5 MoE,
MiniMax-M2, gpt-oss in bf16 and in MXFP4, OLMoE, and an FP8 block-quantized checkpoint. Each
answers a chat completion and a streamed completion with the greedy text of an in-process `LLM`
on the same checkpoint.

gpt-oss MXFP4, the family furthest from the others (packed experts, attention sinks, sliding
windows), is served by a real `moeserve launch --model DIR` (started in the background while the
others run). A launch costs two fresh interpreters, so the other families are served in process:
the server's own app (`build_app`) over the engine in a thread (`AsyncEngine`), the same handlers,
tokenizer and chat template, without the process boundary that tests/server/ covers elsewhere.
DeepSeek-V4 is served so too, its /metrics read for the block-table groups' usage.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MAX_MODEL_LEN

from moeserve import LLM, CompletionOutput, SamplingParams
from moeserve.api import ServerSettings, ServingState, build_app
from moeserve.api.metrics import ServerMetrics
from moeserve.api.state import ModelInfo
from moeserve.checkpoints import quantize_fp8, quantize_mxfp4
from moeserve.config import SLOConfig
from moeserve.engine.async_engine import AsyncEngine
from moeserve.engine.tokenizer import load_tokenizer

LAUNCHED = "gpt_oss_mxfp4"
FAMILIES = ("glm4_moe", "minimax_m2", "gpt_oss", "olmoe", "qwen3_moe_fp8", LAUNCHED)
MESSAGES = [{"role": "user", "content": "Which experts answer?"}]
PROMPT = "Mixture of experts models route"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
ENGINE = dict(max_model_len=MAX_MODEL_LEN, kv_cache_blocks=32)


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint, tmp_path_factory) -> dict[str, Path]:
    folders = {arch: make_checkpoint(arch) for arch in ("gpt_oss", "glm4_moe", "minimax_m2", "olmoe")}
    root = tmp_path_factory.mktemp("quantized")
    folders[LAUNCHED] = shutil.copytree(folders["gpt_oss"], root / LAUNCHED)
    quantize_mxfp4.quantize_checkpoint(folders[LAUNCHED])
    folders["qwen3_moe_fp8"] = shutil.copytree(make_checkpoint("qwen3_moe"), root / "qwen3_moe_fp8")
    quantize_fp8.quantize_checkpoint(folders["qwen3_moe_fp8"], (16, 16))
    return folders


@pytest.fixture(scope="module")
def launching(start_server, checkpoints):
    """The `moeserve launch` of LAUNCHED, under way in the background (a future of the server).
    Its steps last at least 80 ms: a stream whose tokens all come out before the server writes
    its first chunk is sent as one chunk (the server catches up), which happened under the full
    suite's load and would fail the check that an answer streams in several (at 40 ms too, once:
    twelve tokens in under half a second)."""
    with ThreadPoolExecutor(1) as pool:
        args = ("--kv-cache-memory", "16MiB", "--min-step-time-ms", "80")
        future = pool.submit(start_server, *args, checkpoint=checkpoints[LAUNCHED], wait=False)
        yield future
    future.result().stop()


Expected = tuple[CompletionOutput, CompletionOutput]


def greedy_answers(llm: LLM) -> Expected:
    """The in-process engine's greedy chat answer to MESSAGES and completion of PROMPT."""
    chat = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0]
    return chat, llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]


def in_process_http(llm: LLM, folder: Path) -> Iterator[TestClient]:
    """The server's app over `llm`'s engine in a thread of this process, reached over HTTP in
    process (`llm` is not used directly from here on: the engine thread owns it)."""
    state = ServingState(ServerSettings(served_model_name="tiny"), ServerMetrics("tiny", SLOConfig()))
    llm.engine.stat_loggers.append(state.metrics)  # as the server's engine records into its /metrics
    engine = AsyncEngine(llm.engine)
    engine.start()
    tokenizers = load_tokenizer(folder), load_tokenizer(folder)
    state.set_ready(engine, ModelInfo(MAX_MODEL_LEN, tokenizers[0], str(folder), prompt_tokenizer=tokenizers[1]))
    try:
        with TestClient(build_app(state)) as http:
            yield http
    finally:
        engine.shutdown()


def in_process(llm: LLM, folder: Path) -> Iterator[openai.OpenAI]:
    """`in_process_http`'s server through the openai client."""
    for http in in_process_http(llm, folder):
        yield openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0, http_client=http)


@pytest.fixture
def served(request, checkpoints, launching) -> Iterator[tuple[openai.OpenAI, Expected]]:
    """(a client of the family's server, the in-process LLM's greedy answers on its checkpoint)."""
    family = request.node.callspec.params["family"]
    llm = LLM(str(checkpoints[family]), **ENGINE)
    expected = greedy_answers(llm)
    if family != LAUNCHED:
        for api in in_process(llm, checkpoints[family]):
            yield api, expected
        return
    server = launching.result()
    server.wait_healthy()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60), expected


@pytest.mark.parametrize("family", FAMILIES)
def test_family_serves_chat_and_streamed_completions(served, family: str) -> None:
    api, (want_chat, want_text) = served
    chat = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0)
    assert chat.choices[0].message.content == want_chat.text
    assert chat.usage.completion_tokens == len(want_chat.token_ids) > 0

    chunks = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True))
    assert len(chunks) > 1, "the answer arrives in several chunks"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [want_text.finish_reason]


def test_deepseek_v4_serves_and_metrics_count_its_blocks_per_group(make_checkpoint) -> None:
    """A DeepSeek-V4 checkpoint (a window of 8, entries per 4 and per 16 positions) answers a
    completion (its tokens are checked against transformers in tests/distributed), and /metrics
    labels its blocks by block-table group: each group's pool, adding up to the unlabelled total,
    none held once the answer is done."""
    folder = make_checkpoint("deepseek_v4")
    for http in in_process_http(LLM(str(folder), **ENGINE), folder):
        body = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0)
        assert http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] > 0
        samples = [s for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples]
    by_group = {(s.name, s.labels["group"]): s.value for s in samples if "group" in s.labels}
    total = next(s.value for s in samples if s.name == "moeserve:kv_cache_blocks_total")
    groups = ("window", "compressed_4", "compressed_16")
    assert {group for _, group in by_group} == set(groups)
    assert all(by_group["moeserve:kv_cache_group_blocks_total", g] > 0 for g in groups)
    assert sum(by_group["moeserve:kv_cache_group_blocks_total", g] for g in groups) == total
    assert all(by_group["moeserve:kv_cache_group_blocks_used", g] == 0 for g in groups)


def test_kimi_tiktoken_tokenizer_serves_chat_through_its_template(make_checkpoint, tmp_path) -> None:
    """A checkpoint whose tokenizer is released as Kimi's (tiktoken ranks behind custom code, no
    tokenizer.json) answers a chat completion on the prompt tiktoken makes of the release's chat
    template rendered independently (jinja2), special tokens as their own ids."""
    import jinja2
    from helpers.tiktoken_release import CHAT_TEMPLATE, reference_encoding, special_tokens, train_ranks, write_release

    ranks = train_ranks()
    folder = shutil.copytree(make_checkpoint("deepseek_v3"), tmp_path / "kimi")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    write_release(folder, ranks)
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    prompt = reference_encoding(ranks).encode(rendered, allowed_special="all")
    assert special_tokens(len(ranks))["<|im_user|>"] in prompt
    llm = LLM(str(folder), **ENGINE)
    want = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]
    for api in in_process(llm, folder):
        chat = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0)
    assert chat.usage.prompt_tokens == len(prompt)
    assert chat.choices[0].message.content == want.text
    assert chat.usage.completion_tokens == len(want.token_ids) > 0
