"""gpt-oss's harmony format: the prompt rendered, and the model's messages read back (reasoning,
tool calls, answer), whole and token by token, on a gpt-oss checkpoint whose tokenizer holds
harmony's markers as special tokens."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest
from helpers.harmony_cases import CONVERSATION, TOOLS

from moeserve.api.chat import ChatPlan
from moeserve.api.harmony import (
    HarmonyReasoningParser,
    HarmonyToolParser,
    parse_completion,
    render_conversation,
    speaks_harmony,
)
from moeserve.api.reasoning_parsers import ReasoningStream
from moeserve.api.tool_calls import ToolCallReader
from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.checkpoints.tokenizer import HARMONY_IDS
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.sampling_params import SamplingParams

EXPECTED_PROMPT = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n"
    "// Gets the current weather in a city.\ntype get_weather = (_: {\n// The city's name\ncity: string,\n"
    'unit?: "celsius" | "fahrenheit", // default: celsius\ndays?: number[],\n}) => any;\n\n'
    "// Where the user is.\ntype get_location = () => any;\n\n"
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    "<|call|>"
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true}<|end|>'
    "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
    "<|start|>user<|message|>And in Rome?<|end|>"
    "<|start|>assistant"
)
THINK_AND_CALL = (
    "<|channel|>analysis<|message|>The user wants Rome's weather; call the tool.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
    "<|call|>"
)
THINK_AND_ANSWER = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Rome is sunny.<|return|>"
)


@pytest.fixture(scope="module")
def harmony_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = MakeModelSpec(arch="gpt_oss", vocab=320, chat_format="harmony")
    return make_model(spec, tmp_path_factory.mktemp("gpt_oss_harmony"))


def test_render_conversation_with_tools_and_a_call_answered() -> None:
    rendered = render_conversation(CONVERSATION, TOOLS, reasoning_effort="high", today=date(2025, 6, 28))
    assert rendered == EXPECTED_PROMPT


def test_render_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_conversation(CONVERSATION, None, reasoning_effort="max")
    with pytest.raises(ValueError, match="tool_call_id"):
        render_conversation([{"role": "tool", "content": "{}"}], None)


def test_the_harmony_checkpoint_holds_the_markers_as_tokens(harmony_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(harmony_checkpoint)
    assert speaks_harmony("GptOssForCausalLM", tokenizer)
    assert not speaks_harmony("Qwen3MoeForCausalLM", tokenizer)
    ids = tokenizer.encode(EXPECTED_PROMPT, add_special_tokens=False)
    assert ids.count(HARMONY_IDS["<|start|>"]) == EXPECTED_PROMPT.count("<|start|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == EXPECTED_PROMPT
    generation = json.loads((harmony_checkpoint / "generation_config.json").read_text())
    assert {HARMONY_IDS["<|call|>"], HARMONY_IDS["<|return|>"]} <= set(generation["eos_token_id"])


def test_a_chatml_gpt_oss_checkpoint_keeps_its_template(tmp_path: Path) -> None:
    folder = make_model(MakeModelSpec(arch="gpt_oss", vocab=320), tmp_path / "chatml")
    assert not speaks_harmony("GptOssForCausalLM", load_tokenizer(folder))


def test_harmony_is_gpt_oss_only() -> None:
    with pytest.raises(ValueError, match="gpt_oss"):
        MakeModelSpec(arch="qwen3_moe", chat_format="harmony")


def plan() -> ChatPlan:
    reader = ToolCallReader("auto", parser=HarmonyToolParser())
    return ChatPlan(SamplingParams(), [], reader, HarmonyReasoningParser(), in_reasoning=False)


def stream_tokens(tokenizer, text: str) -> tuple[str, str, dict[int, dict[str, str]]]:
    """(reasoning, content, calls by index) as a stream sends them, fed one token at a time with
    the text the detokenizer would add (special tokens kept)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    chat = plan()
    thought, calls = chat.reasoning_stream(), chat.reader.stream()
    assert isinstance(thought, ReasoningStream)
    reasoning, content, found = "", "", {}
    previous = ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        new, previous = now[len(previous) :], now
        final = i == len(ids)
        thinking, answer = thought.update(new, final)
        answer, deltas = calls.update(answer, final)
        reasoning, content = reasoning + thinking, content + answer
        for delta in deltas:
            call = found.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return reasoning, content, found


def test_a_tool_call_round_trips_whole_and_streamed(harmony_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(harmony_checkpoint)
    reasoning, content, calls, finish = plan().read(THINK_AND_CALL, "stop")
    assert reasoning == "The user wants Rome's weather; call the tool."
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]

    streamed = stream_tokens(tokenizer, THINK_AND_CALL)
    assert streamed == (reasoning, "", {0: {"name": "get_weather", "arguments": calls[0].function.arguments}})


def test_an_answer_round_trips_whole_and_streamed(harmony_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(harmony_checkpoint)
    assert plan().read(THINK_AND_ANSWER, "stop") == ("Easy.", "Rome is sunny.", [], "stop")
    assert stream_tokens(tokenizer, THINK_AND_ANSWER) == ("Easy.", "Rome is sunny.", {})


def test_messages_show_once_their_header_is_whole() -> None:
    partial = "<|channel|>analysis<|message|>Hm<|en"
    assert parse_completion("<|channel|>anal", final=False) == []
    [message] = parse_completion(partial, final=False)
    assert (message.channel, message.content, message.complete) == ("analysis", "Hm", False)
    [message] = parse_completion("<|channel|>commentary to=functions.f json<|message|>{}", final=True)
    assert (message.recipient, message.content_type, message.complete) == ("functions.f", "json", True)


def test_output_without_harmony_markup_is_all_answer() -> None:
    """A model that strays from the format (the random test models do) still answers, whole."""
    assert plan().read("plain words", "length") == (None, "plain words", [], "length")
