"""Speculative decoding through `moeserve launch --speculative-config`: streamed greedy
completions of a DeepSeek-V3 checkpoint are the in-process engine's tokens without drafts, several
tokens may share a chunk, and /metrics counts the drafts; with n-gram drafts and with MTP drafts."""

from __future__ import annotations

import json

import openai
import pytest
from helpers.mtp_checkpoints import mtp_checkpoint
from server_utils import MAX_MODEL_LEN

from moeserve import LLM, SamplingParams

PROMPTS = [[40, 41, 42, 43] * 5, [7, 8] * 9 + [9], [101, 57, 230, 12, 99, 3, 64]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def check_streamed(api: openai.OpenAI, folder: str) -> None:
    """Streamed greedy completions are the in-process engine's tokens without drafts, and their
    logprobs (kept drafts' included, which cross the engine core's wire with the tokens) its
    logprobs."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = LLM(folder, max_model_len=MAX_MODEL_LEN).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    for prompt, want in zip(PROMPTS, expected):
        body = dict(max_tokens=24, temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        chunks = list(api.completions.create(model="tiny", prompt=prompt, **body))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    want = expected[0].outputs[0]
    body = dict(max_tokens=24, temperature=0.0, stream=True, logprobs=2, extra_body={"ignore_eos": True})
    chunks = [c for c in api.completions.create(model="tiny", prompt=PROMPTS[0], **body) if c.choices]
    got = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx([pos[t].logprob for pos, t in zip(want.logprobs, want.token_ids)], abs=1e-4)


def test_streamed_greedy_completions_with_drafts_are_the_tokens_without(start_server, make_checkpoint) -> None:
    folder = make_checkpoint("deepseek_v3", 3)
    server = start_server("--speculative-config", json.dumps(NGRAM), checkpoint=folder)
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    check_streamed(api, str(folder))
    metrics = server.metrics()
    drafted = metrics["moeserve:spec_decode_num_draft_tokens_total"]
    accepted = metrics["moeserve:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and 0 < accepted <= drafted
    server.stop()


def test_streamed_greedy_completions_with_mtp_drafts_are_the_tokens_without(start_server, tmp_path_factory) -> None:
    folder = mtp_checkpoint(tmp_path_factory.mktemp("mtp"), "deepseek_v3")
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    server = start_server("--speculative-config", json.dumps(mtp), checkpoint=folder)
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    check_streamed(api, str(folder))
    metrics = server.metrics()
    assert (
        0
        < metrics["moeserve:spec_decode_num_accepted_tokens_total"]
        <= metrics["moeserve:spec_decode_num_draft_tokens_total"]
    )
    server.stop()
