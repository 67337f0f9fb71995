"""Structured outputs offline (`LLM`): outputs follow their grammar, greedy and seeded alike, also
under preemption; a complete grammar ends its sequence even with ignore_eos; a bad grammar
queues nothing."""

from __future__ import annotations

import json

import jsonschema
import pytest

from moeserve.llm import LLM
from moeserve.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
}


class Preemptions:
    """A stat logger counting preemptions."""

    def __init__(self) -> None:
        self.count = 0

    def record(self, stats) -> None:
        self.count += stats.num_preemptions


PREEMPTIONS = Preemptions()


@pytest.fixture(scope="module")
def llm(make_checkpoint) -> LLM:
    # A small KV pool (96 token slots): five sequences of about 35 tokens do not fit at once.
    folder = str(make_checkpoint("qwen3_moe", 0))
    return LLM(folder, [PREEMPTIONS], block_size=4, max_model_len=96, kv_cache_blocks=24)


def test_outputs_follow_their_grammar(llm: LLM) -> None:
    json_params = [
        SamplingParams(max_tokens=70, temperature=t, seed=i, structured_outputs=StructuredOutputs.json_schema(SCHEMA))
        for i, t in enumerate([0.0, 1.0, 1.5])
    ]
    choice = SamplingParams(
        max_tokens=10, temperature=1.0, seed=3, structured_outputs=StructuredOutputs.choice(["up", "down"])
    )
    free = SamplingParams(max_tokens=8, temperature=0.0)
    params = [*json_params, choice, free]
    outputs = llm.generate([f"prompt {i}" for i in range(len(params))], params)
    for out in outputs[:3]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert outputs[3].outputs[0].text in ("up", "down") and outputs[3].outputs[0].finish_reason == "stop"
    assert PREEMPTIONS.count > 0  # recomputed sequences kept their matchers' place
    assert llm.engine.core.structured._matchers == {}  # every matcher dropped with its sequence


def test_a_complete_grammar_ends_the_sequence_under_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, structured_outputs=StructuredOutputs("regex", "ab"))
    out = llm.generate(["x"], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ab", "stop")


def test_a_bad_grammar_queues_nothing(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputs("grammar", "root ::= nothing"))
    with pytest.raises(ValueError, match='Rule "nothing" is not defined'):
        llm.generate(["ok", "bad"], [SamplingParams(max_tokens=2), bad])
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.num_used_blocks == 0
