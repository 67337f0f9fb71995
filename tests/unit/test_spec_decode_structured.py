"""Speculative decoding under structured outputs: a sequence with a grammar drafts (n-gram), each
draft judged under the grammar's mask at its position, and its greedy output is that of decoding
without drafts, token for token, and follows its grammar (JSON schema, regex, choice)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams
from moeserve.sampling_params import StructuredOutputs

ENGINE = dict(block_size=4, max_model_len=128)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "tags"],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
REGEX = r"(ab|ba|abc)+"
CHOICES = ["abab", "abba", "baba"]


def params() -> list[SamplingParams]:
    json_schema, choice = StructuredOutputs.json_schema(SCHEMA), StructuredOutputs.choice(CHOICES)
    specs = [json_schema, StructuredOutputs("regex", REGEX), choice]
    return [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec) for spec in specs]


def prompts() -> list[str]:
    return ["ab ab ab ab ab ab", '{"name": "abab", "tags": ["a", "a", "a"]}', "abba baba abba"]


def check(text: str, kind: str) -> None:
    """`text` follows its grammar."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return str(make_checkpoint("deepseek_v3", 3))


def test_greedy_structured_outputs_with_ngram_drafts_are_those_without(folder):
    """Every sequence is under a grammar, so the drafts counted are theirs."""
    batch = [prompts()[i % 3] for i in range(6)]
    batch_params = [params()[(i + i // 3) % 3] for i in range(6)]
    expected = LLM(folder, **ENGINE).generate(batch, batch_params, use_tqdm=False)
    counts = CountingStatLogger()
    llm = LLM(folder, stat_loggers=[counts], speculative_config=NGRAM, **ENGINE)
    got = llm.generate(batch, batch_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for out, sp in zip(got, batch_params):
        check(out.outputs[0].text, sp.structured_outputs.kind)
    spec = counts.spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    assert llm.engine.scheduler.num_used_blocks == 0


def test_sampled_structured_outputs_with_drafts_follow_their_grammar_and_reproduce(folder):
    """Rejection sampling judges each draft on the grammar-masked distribution at its position."""
    batch = prompts() * 2
    batch_params = [
        SamplingParams(max_tokens=100, temperature=0.7, seed=i, structured_outputs=p.structured_outputs)
        for i, p in enumerate(params() * 2)
    ]
    runs = []
    for _ in range(2):
        counts = CountingStatLogger()
        llm = LLM(folder, stat_loggers=[counts], speculative_config=NGRAM, **ENGINE)
        outputs = llm.generate(batch, batch_params, use_tqdm=False)
        assert counts.spec_decode.num_draft_tokens > 0
        for out, sp in zip(outputs, batch_params):
            assert out.outputs[0].finish_reason == "stop"
            check(out.outputs[0].text, sp.structured_outputs.kind)
        runs.append([o.outputs[0].token_ids for o in outputs])
    assert runs[0] == runs[1]
