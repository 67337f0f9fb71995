"""Finding tool calls in a chat model's output text, whole or as it streams.

Three shapes of output carry calls:
- `tool_choice` names a function: the output is constrained to that function's arguments, so the
  whole text is one call's arguments (`named_calls`);
- `tool_choice: "required"`: the output is constrained to a JSON array of `{"name": ...,
  "arguments": {...}}` objects, vLLM's form (`required_calls`);
- `tool_choice: "auto"`: the model writes calls in its chat template's own markup, which a
  `ToolParser` chosen by `--tool-call-parser` reads: Hermes' `<tool_call>{json}</tool_call>`
  (Qwen, Hermes, many others) or DeepSeek-V3's special-token format.

Every reader returns a `Scan` of the text so far: the plain content that is certainly not part of
a call, and each call's name (once complete) and raw argument text (possibly still growing). The
stream sends what a scan adds to the previous one, the final response takes the last scan, so
streamed fragments always join up to the non-streamed arguments, byte for byte.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_JSON_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ScannedCall:
    name: str | None
    """None until the whole name has been generated."""
    arguments: str
    """The arguments' JSON text so far."""
    complete: bool


@dataclass(frozen=True)
class Scan:
    content: str
    """Text outside any call, up to where a call could still begin."""
    calls: list[ScannedCall] = field(default_factory=list)


def scan_value(text: str, start: int) -> tuple[int, bool]:
    """Where the JSON value at `start` ends (exclusive) and whether it is complete; an incomplete
    value runs to the end of `text`. Strings and nesting are followed, nothing is validated."""
    n = len(text)
    if start >= n:
        return n, False
    first = text[start]
    if first not in '{["':
        end = start
        while end < n and text[end] not in ",}]" + _JSON_WHITESPACE:
            end += 1
        return end, end < n
    depth, in_string, escaped = 0, False, False
    for i in range(start, n):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1, True
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return n, False


def _skip(text: str, i: int, chars: str = _JSON_WHITESPACE) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def scan_call_object(text: str, start: int) -> tuple[ScannedCall | None, int]:
    """The `{"name": ..., "arguments": {...}}` object at `start` (`parameters` is read as
    `arguments`, as some templates spell it): the call so far and where the object ends."""
    i = _skip(text, start)
    if i >= len(text) or text[i] != "{":
        return None, len(text)
    name, arguments, complete = None, "", False
    i += 1
    while True:
        i = _skip(text, i, _JSON_WHITESPACE + ",")
        if i >= len(text):
            break
        if text[i] == "}":
            return ScannedCall(name, arguments, complete), i + 1
        key_end, key_done = scan_value(text, i)
        if not key_done:
            break
        key = json.loads(text[i:key_end])
        i = _skip(text, _skip(text, key_end) + 1)  # past the colon
        value_end, value_done = scan_value(text, i)
        if key == "name" and value_done:
            name = json.loads(text[i:value_end])
        elif key in ("arguments", "parameters"):
            arguments, complete = text[i:value_end], value_done
        if not value_done:
            break
        i = value_end
    return ScannedCall(name, arguments, False), len(text)


def named_calls(text: str, name: str, final: bool) -> Scan:
    """The output of a named `tool_choice`: all of it is the one call's arguments."""
    body = text.lstrip(_JSON_WHITESPACE)
    return Scan("", [ScannedCall(name, body, final)])


def required_calls(text: str) -> Scan:
    """The output of `tool_choice: "required"`: a JSON array of call objects."""
    calls: list[ScannedCall] = []
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        return Scan("", calls)
    i += 1
    while i < len(text):
        i = _skip(text, i, _JSON_WHITESPACE + ",")
        if i >= len(text) or text[i] == "]":
            break
        call, i = scan_call_object(text, i)
        if call is None:
            break
        calls.append(call)
    return Scan("", calls)


class ToolParser(ABC):
    """Reads calls in a chat template's markup (tool_choice "auto")."""

    name: str
    start_marker: str
    """What opens the calls: text before it is content, and a tail of the text that could still
    become it is held back."""

    markers_are_special = False
    """Whether the markup is made of special tokens, which the text must then keep."""

    content_is_markup = False
    """Whether the content too is wrapped in markup (harmony's channels), so that an output
    without calls is still the scan's content rather than the raw text."""

    def scan(self, text: str, final: bool) -> Scan:
        begin = text.find(self.start_marker)
        if begin < 0:
            return Scan(text if final else text[: len(text) - partial_suffix(text, self.start_marker)])
        return Scan(text[:begin], self.calls(text[begin:]))

    @abstractmethod
    def calls(self, text: str) -> list[ScannedCall]:
        """The calls in `text`, which starts with `start_marker`."""


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def calls(self, text: str) -> list[ScannedCall]:
        found = []
        at = text.find(self.start_marker)
        while at >= 0:
            call, _ = scan_call_object(text, at + len(self.start_marker))
            if call is None:
                break
            found.append(call)
            at = text.find(self.start_marker, at + len(self.start_marker))
        return found


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3's template: `<｜tool▁calls▁begin｜>`, then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a json code fence with the arguments +
    `<｜tool▁call▁end｜>`, and `<｜tool▁calls▁end｜>`."""

    name = "deepseek_v3"
    markers_are_special = True
    start_marker = "<｜tool▁calls▁begin｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    separator = "<｜tool▁sep｜>"
    fence = "```json"

    def calls(self, text: str) -> list[ScannedCall]:
        found = []
        at = text.find(self.call_begin)
        while at >= 0:
            sep = text.find(self.separator, at)
            if sep < 0:
                break
            name_start = sep + len(self.separator)
            name_end = text.find("\n", name_start)
            if name_end < 0:
                break
            fence = text.find(self.fence, name_end)
            if fence < 0:
                found.append(ScannedCall(text[name_start:name_end].strip(), "", False))
                break
            args_start = _skip(text, fence + len(self.fence))
            args_end, done = scan_value(text, args_start)
            found.append(ScannedCall(text[name_start:name_end].strip(), text[args_start:args_end], done))
            at = text.find(self.call_begin, args_end)
        return found


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, DeepSeekV3ToolParser)}
"""`--tool-call-parser` names."""
