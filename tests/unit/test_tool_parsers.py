"""Tool calls read from output text: each format whole, and streamed in every possible cut the
deltas join up to exactly what the whole text gives."""

from __future__ import annotations

import json

import pytest

from moeserve.api.tool_calls import ToolCallReader
from moeserve.api.tool_parsers import DeepSeekV3ToolParser, HermesToolParser, scan_value

ARGS = '{"city": "Pa}ris \\"x\\"", "days": [1, {"n": 2}]}'
HERMES = (
    f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {}, "name": "time"}\n</tool_call>'
)
DEEPSEEK = (
    "Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
    f"{ARGS}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n```json\n{{}}\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
REQUIRED = f'[{{"name": "weather", "arguments": {ARGS}}}, {{"name": "time", "arguments": {{}}}}]'

CASES = {
    "hermes": (ToolCallReader("auto", parser=HermesToolParser()), HERMES, "Let me look.\n"),
    "deepseek_v3": (ToolCallReader("auto", parser=DeepSeekV3ToolParser()), DEEPSEEK, "Sure"),
    "required": (ToolCallReader("required"), REQUIRED, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_text_gives_both_calls(case: str) -> None:
    reader, text, content = CASES[case]
    got_content, calls, finish = reader.final(text, "stop")
    assert got_content == content and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", json.loads(ARGS)),
        ("time", {}),
    ]
    assert calls[0].function.arguments == ARGS  # the model's own text, not a re-serialisation
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_join_up_to_the_final_calls(case: str, step: int) -> None:
    reader, text, content = CASES[case]
    stream = reader.stream()
    sent_content, names, arguments, ids = "", {}, {}, {}
    for start in range(0, len(text), step):
        piece = text[start : start + step]
        delta_content, deltas = stream.update(piece, final=start + step >= len(text))
        sent_content += delta_content
        for d in deltas:
            if d.id is not None:
                assert d.index not in ids and d.type == "function" and d.function.name
                ids[d.index], names[d.index] = d.id, d.function.name
                arguments[d.index] = ""
            else:
                assert d.function.name is None
            arguments[d.index] += d.function.arguments or ""
    _, calls, _ = reader.final(text, "stop")
    assert sent_content == (content or "")
    assert [names[i] for i in sorted(names)] == [c.function.name for c in calls]
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in calls]


def test_named_function_output_is_its_arguments() -> None:
    reader = ToolCallReader("named", name="weather")
    content, calls, finish = reader.final(ARGS, "stop")
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("weather", ARGS)]
    stream = reader.stream()
    _, first = stream.update(ARGS[:5], False)
    _, rest = stream.update(ARGS[5:], True)
    assert first[0].function.name == "weather" and first[0].function.arguments + rest[0].function.arguments == ARGS


def test_auto_without_calls_is_all_content_and_a_marker_start_is_held_back() -> None:
    reader = ToolCallReader("auto", parser=HermesToolParser())
    assert reader.final("no calls <tool", "length") == ("no calls <tool", [], "length")
    stream = reader.stream()
    assert stream.update("hello <tool", False) == ("hello ", [])
    assert stream.update("box", True) == ("<toolbox", [])


@pytest.mark.parametrize(
    ("text", "end", "complete"),
    [
        ('{"a": "}"} tail', 10, True),
        ('[1, {"b": [2]', 13, False),
        ("123,", 3, True),
        ("12", 2, False),
        ('"a\\"', 4, False),
    ],
)
def test_scan_value_follows_strings_and_nesting(text: str, end: int, complete: bool) -> None:
    assert scan_value(text, 0) == (end, complete)
