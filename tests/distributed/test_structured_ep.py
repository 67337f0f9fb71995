"""Structured outputs across rank processes: at ep=2 the engine sends each step's grammar bitmask
after the plan (the ranks run the forward while it fills), each group's sampling rank masks its
own rows, and every output is one process's, token for token (greedy), grammar kept."""

from __future__ import annotations

import json
import re

import jsonschema

from moeserve import LLM, SamplingParams
from moeserve.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}
REGEX = "[a-c]{3}-[0-9]{2}"
ENGINE = dict(max_model_len=96, block_size=8, kv_cache_blocks=96)


def test_grammars_hold_at_ep2_and_match_one_process(make_checkpoint) -> None:
    folder = str(make_checkpoint("qwen3_moe", 5, num_experts=8))  # the EP parity tests' checkpoint
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs.json_schema(SCHEMA)),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs.choice(["yes", "no"])),
        SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputs("regex", REGEX)),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    prompts = [f"request {i}" for i in range(len(params))]
    expected = LLM(folder, **ENGINE).generate(prompts, params, use_tqdm=False)
    with LLM(folder, ep=2, **ENGINE) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    json_out, choice_out, regex_out, _ = (o.outputs[0] for o in got)
    jsonschema.validate(json.loads(json_out.text), SCHEMA)
    assert choice_out.text in ("yes", "no") and re.fullmatch(REGEX, regex_out.text)
    assert json_out.finish_reason == choice_out.finish_reason == regex_out.finish_reason == "stop"
