"""OpenAI's harmony format (gpt-oss): rendering a conversation and reading the model's messages.

gpt-oss does not speak through a generic chat template: every message is
``<|start|>{role}<|channel|>{channel}[ to={recipient}][<|constrain|>{type}]<|message|>{text}``
ended by ``<|end|>``, or by ``<|call|>`` (a tool call) or ``<|return|>`` (the last answer), which
stop generation. The assistant thinks on the ``analysis`` channel, calls tools on ``commentary``
(recipient ``functions.NAME``, JSON arguments as the message) and answers on ``final``; tools are
declared in the developer message as a TypeScript-like ``namespace functions``. The response maps
them as vLLM does: analysis to ``reasoning_content``, commentary calls to ``tool_calls``, final (and
commentary addressed to no one, the preambles) to ``content``.

Why our own module rather than the ``openai-harmony`` package: that package works on o200k token
ids only, and loads the o200k vocabulary from OpenAI's servers or from a local copy of that exact
file (its hash is checked), so it cannot run where no such file can be fetched, nor on a checkpoint
with another vocabulary (the tiny test models). This module works on text, through the
checkpoint's own tokenizer, which on gpt-oss holds harmony's markers as special tokens.

Reading is incremental like the other parsers (`reasoning_parsers`, `tool_parsers`): each call
parses the whole output so far and returns only what can no longer change (a marker still
forming is held back), so streamed pieces join up to the non-streamed response.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date
from typing import Any

from moeserve.api.reasoning_parsers import ReasoningParser, Split
from moeserve.api.tool_parsers import Scan, ScannedCall, ToolParser, partial_suffix
from moeserve.checkpoints.tokenizer import HARMONY_TOKENS

MARKERS = HARMONY_TOKENS
START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN = MARKERS
REASONING_EFFORTS = ("low", "medium", "high")
FUNCTIONS = "functions."

_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of the model's output, as far as it has been generated."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    content: str
    complete: bool


def parse_completion(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of an assistant output that starts right after ``<|start|>assistant``.

    A message shows up once its header is whole (``<|message|>`` seen); its text grows, holding
    back a tail that could still become an end marker, until an end marker or, with ``final``, the
    end of the output closes it. Later messages may begin with ``<|start|>assistant``.
    """
    messages: list[HarmonyMessage] = []
    at = 0
    while at < len(text):
        body = text.find(MESSAGE, at)
        if body < 0:
            break
        channel, recipient, content_type = _parse_header(text[at:body])
        body += len(MESSAGE)
        end, marker = _first_end(text, body)
        if end < 0:
            content = text[body:]
            held = 0 if final else max(partial_suffix(content, m) for m in _ENDS)
            messages.append(HarmonyMessage(channel, recipient, content_type, content[: len(content) - held], final))
            break
        messages.append(HarmonyMessage(channel, recipient, content_type, text[body:end], True))
        at = end + len(marker)
        if text.startswith(START, at):
            at += len(START)
    return messages


def _first_end(text: str, start: int) -> tuple[int, str]:
    """Where the first end marker after `start` is, and which; (-1, "") if none."""
    found = [(at, marker) for marker in _ENDS if (at := text.find(marker, start)) >= 0]
    return min(found) if found else (-1, "")


def _parse_header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header such as
    ``assistant<|channel|>commentary to=functions.f <|constrain|>json``; the role is dropped."""
    recipient_match = _RECIPIENT.search(header)
    recipient = recipient_match.group(1) if recipient_match else None
    channel = None
    if CHANNEL in header:
        channel = re.split(r"\s|<\|", header.split(CHANNEL, 1)[1], maxsplit=1)[0] or None
    if CONSTRAIN in header:  # `<|constrain|>json`
        words = header.split(CONSTRAIN, 1)[1].split()
    elif channel is not None:  # `<|channel|>commentary json`, the form without the marker
        words = _RECIPIENT.sub("", header.split(CHANNEL, 1)[1][len(channel) :]).split()
    else:
        words = []
    return channel, recipient, words[0] if words else None


def serialize(messages: list[HarmonyMessage]) -> str:
    """Messages back as harmony text (``<|channel|>`` onwards, no role), an open one unended, so
    that the text of a growing output only grows."""
    parts = []
    for message in messages:
        header = CHANNEL + (message.channel or "")
        if message.recipient:
            header += f" to={message.recipient}"
        if message.content_type:
            header += f" {CONSTRAIN}{message.content_type}"
        parts.append(header + MESSAGE + message.content + (END if message.complete else ""))
    return "".join(parts)


class HarmonyReasoningParser(ReasoningParser):
    """The analysis channel is the reasoning; the other messages pass on, still in harmony's
    markup, to `HarmonyToolParser`. Output without any harmony message is all answer."""

    name = "harmony"
    start_marker = CHANNEL + "analysis" + MESSAGE
    end_marker = END

    def opens_in(self, prompt_tail: str) -> bool:
        return False  # the prompt ends with the assistant's `<|start|>`; the model names the channel

    def split(self, text: str, final: bool, in_reasoning: bool) -> Split:
        if MESSAGE not in text:
            return Split("", text if final else "")
        messages = parse_completion(text, final)
        analysis = [m.content for m in messages if m.channel == "analysis"]
        return Split("\n\n".join(analysis), serialize([m for m in messages if m.channel != "analysis"]))


class HarmonyToolParser(ToolParser):
    """Commentary messages to ``functions.NAME`` are calls, their text the arguments; final and
    commentary to no one are content. Reads what `HarmonyReasoningParser` passes on."""

    name = "harmony"
    start_marker = CHANNEL
    markers_are_special = True
    content_is_markup = True

    def scan(self, text: str, final: bool) -> Scan:
        if MESSAGE not in text:
            return Scan(text if final else "")
        messages = parse_completion(text, final)
        content = "".join(m.content for m in messages if m.recipient is None and m.channel != "analysis")
        return Scan(content, self._calls(messages))

    def calls(self, text: str) -> list[ScannedCall]:
        return self._calls(parse_completion(text, final=False))

    @staticmethod
    def _calls(messages: list[HarmonyMessage]) -> list[ScannedCall]:
        return [
            ScannedCall(m.recipient.removeprefix(FUNCTIONS), m.content, m.complete)
            for m in messages
            if m.recipient is not None and m.recipient.startswith(FUNCTIONS)
        ]


# ---------------------------------------------------------------- rendering


def render_conversation(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    reasoning_effort: str = "medium",
    today: date | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for the assistant's next turn: harmony's system message, a developer message
    with the system/developer instructions and the tools, the conversation, ``<|start|>assistant``
    (without it if not ``add_generation_prompt``).

    ``messages`` are as chat templates take them (`ChatMessageParam.template_message`).
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort {reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}")
    instructions = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    parts = [_system_message(reasoning_effort, today or date.today(), bool(tools))]
    developer = _developer_message("\n\n".join(instructions), tools or [])
    if developer:
        parts.append(_message("developer", None, developer))
    call_names: dict[str, str] = {}
    for message in messages:
        role = message["role"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            parts.append(_message("user", None, message["content"]))
        elif role == "assistant":
            parts.extend(_assistant_messages(message, call_names))
        elif role == "tool":
            name = message.get("name") or call_names.get(message.get("tool_call_id") or "", "")
            if not name:
                raise ValueError("a tool message needs the name of its function, or the tool_call_id of its call")
            parts.append(f"{START}{FUNCTIONS}{name} to=assistant{CHANNEL}commentary{MESSAGE}{message['content']}{END}")
        else:
            raise ValueError(f"unsupported role: {role}")
    return "".join(parts) + (START + "assistant" if add_generation_prompt else "")


def _message(role: str, channel: str | None, content: str) -> str:
    return START + role + (CHANNEL + channel if channel else "") + MESSAGE + content + END


def _system_message(reasoning_effort: str, today: date, has_tools: bool) -> str:
    lines = [
        "You are ChatGPT, a large language model trained by OpenAI.",
        "Knowledge cutoff: 2024-06",
        f"Current date: {today.isoformat()}",
        "",
        f"Reasoning: {reasoning_effort}",
        "",
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.",
    ]
    if has_tools:
        lines.append("Calls to these tools must go to the commentary channel: 'functions'.")
    return _message("system", None, "\n".join(lines))


def _developer_message(instructions: str, tools: list[dict[str, Any]]) -> str:
    sections = []
    if instructions:
        sections.append("# Instructions\n\n" + instructions)
    if tools:
        sections.append(
            "# Tools\n\n## functions\n\nnamespace functions {\n\n"
            + "".join(map(_tool, tools))
            + "} // namespace functions"
        )
    return "\n\n".join(sections)


def _tool(tool: dict[str, Any]) -> str:
    """One function of the namespace: its description as a comment, its parameters as a type."""
    function = tool.get("function", tool)
    head = f"// {function['description']}\n" if function.get("description") else ""
    parameters = function.get("parameters") or {}
    if not parameters.get("properties"):
        return f"{head}type {function['name']} = () => any;\n\n"
    return f"{head}type {function['name']} = (_: {_object_type(parameters, '')}) => any;\n\n"


def _object_type(schema: dict[str, Any], indent: str) -> str:
    required = set(schema.get("required", ()))
    lines = ["{"]
    for name, prop in schema.get("properties", {}).items():
        if prop.get("description"):
            lines.append(f"{indent}// {prop['description']}")
        optional = "" if name in required else "?"
        default = f" // default: {_literal(prop['default'])}" if "default" in prop else ""
        lines.append(f"{indent}{name}{optional}: {_type(prop, indent + '  ')},{default}")
    lines.append(indent[:-2] + "}" if indent else "}")
    return "\n".join(lines)


def _literal(value: Any) -> str:
    """A default as harmony writes it in a comment: a string bare, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _type(schema: dict[str, Any], indent: str) -> str:
    """A JSON schema as the TypeScript type harmony declares tools with."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return " | ".join(_type(option, indent) for option in schema[union])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type({**schema, "type": k}, indent) for k in kind)
    if kind == "object" and schema.get("properties"):
        return _object_type(schema, indent)
    if kind == "array":
        return _type(schema.get("items", {}), indent) + "[]"
    return {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}.get(
        kind or "", "any"
    )


def _assistant_messages(message: dict[str, Any], call_names: dict[str, str]) -> list[str]:
    """A past assistant turn: its text (a preamble on commentary if it called tools, else the
    final answer), then one commentary message per call, ended as the model ended it."""
    calls = message.get("tool_calls") or []
    parts = []
    if message.get("content"):
        parts.append(_message("assistant", "commentary" if calls else "final", message["content"]))
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        if call.get("id"):
            call_names[call["id"]] = function["name"]
        header = f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{function['name']} {CONSTRAIN}json"
        parts.append(header + MESSAGE + arguments + CALL)
    return parts


def speaks_harmony(architecture: str, tokenizer: Any) -> bool:
    """Whether chat goes through harmony: a gpt-oss checkpoint whose tokenizer holds harmony's
    markers as tokens, as every released one does (a test checkpoint with a ChatML tokenizer
    keeps its template)."""
    vocab = tokenizer.get_vocab()
    return architecture == "GptOssForCausalLM" and all(marker in vocab for marker in MARKERS)
