"""Tool calls in chat responses: reading them from a sample's text, whole or streamed.

`ToolCallReader` knows how this request's calls are written (see `tool_parsers`): a named
function's arguments, the "required" array, or a template's markup under "auto". A response
takes its final scan; a stream sends what each scan adds, as OpenAI streams calls: a call's first
delta with its index, id, type and name (and the arguments so far), then argument fragments.
A sample with calls that ended normally finishes with "tool_calls".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from moeserve.api.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from moeserve.api.tool_parsers import Scan, ToolParser, named_calls, required_calls


def tool_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallReader:
    """mode: "named", "required" or "auto" (with `parser`); `name`: the named function."""

    mode: str
    name: str | None = None
    parser: ToolParser | None = None

    def scan(self, text: str, final: bool) -> Scan:
        if self.mode == "named":
            return named_calls(text, self.name or "", final)
        if self.mode == "required":
            return required_calls(text)
        assert self.parser is not None
        return self.parser.scan(text, final)

    def final(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish reason) of a finished sample. Under "auto" text that holds no
        call is all content; content next to calls is None when it is only whitespace."""
        scan = self.scan(text, final=True)
        calls = [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in scan.calls
            if c.name is not None
        ]
        if not calls:
            whole = self.mode == "auto" and not (self.parser is not None and self.parser.content_is_markup)
            return (text if whole else scan.content or None), [], finish_reason
        content = scan.content if scan.content.strip() else None
        return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


@dataclass
class _SentCall:
    id: str
    arguments_sent: int


@dataclass
class ToolCallStream:
    """What of one sample's content and calls has been streamed."""

    reader: ToolCallReader
    text: str = ""
    content_sent: int = 0
    calls: list[_SentCall] = field(default_factory=list)

    def update(self, new_text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, call deltas) after `new_text` joined the sample."""
        self.text += new_text
        scan = self.reader.scan(self.text, final)
        content = scan.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(scan.content))
        deltas = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break  # later calls wait for this one's name, so indexes stay in order
            if index == len(self.calls):
                self.calls.append(_SentCall(tool_call_id(), len(call.arguments)))
                function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
                deltas.append(DeltaToolCall(index=index, id=self.calls[index].id, type="function", function=function))
                continue
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments_sent:
                fragment = call.arguments[sent.arguments_sent :]
                sent.arguments_sent = len(call.arguments)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        return content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)
