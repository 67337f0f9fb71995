"""The request fields that constrain an output, and the constraint they make.

Structured outputs come in OpenAI's form (`response_format`: `json_object`, or `json_schema` with
its `schema` and `strict`) and in vLLM's (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, or the newer `structured_outputs` object); one per request. Tools make a
constraint too: a named `tool_choice` constrains the output to that function's arguments, and
`"required"` to a JSON array of calls, `[{"name": ..., "arguments": {...}}, ...]` (vLLM's form;
one item only when `parallel_tool_calls` is false), each item one of the tools (`anyOf`) with
its name fixed by `const`, so whatever is sampled parses and names a real function.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moeserve.api.errors import APIError
from moeserve.sampling_params import StructuredOutputs


class _Body(BaseModel):
    """As `protocol.OpenAIModel`: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """Accepted; the schema is always enforced (as vLLM does), so strict or not the output fits."""


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` object: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _json_spec(schema: dict[str, Any] | str) -> StructuredOutputs:
    return StructuredOutputs.json_schema(schema)


def output_constraint(request: Any) -> StructuredOutputs | None:
    """The one structured-output constraint a request's fields ask for; a 400 for two or more."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt: ResponseFormat | None = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputs("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
        found.append(("response_format", _json_spec(fmt.json_schema.schema_)))
    if request.guided_json is not None:
        found.append(("guided_json", _json_spec(request.guided_json)))
    if request.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputs("regex", request.guided_regex)))
    if request.guided_choice is not None:
        found.append(("guided_choice", _choice(request.guided_choice, "guided_choice")))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputs("grammar", request.guided_grammar)))
    if request.structured_outputs is not None:
        found.extend(("structured_outputs", spec) for spec in _structured_field(request.structured_outputs))
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(name for name, _ in found))
        raise APIError(f"give one output constraint, got several ({names})", param=found[1][0])
    return found[0][1] if found else None


def constraint_param(request: Any) -> str:
    """The body field a request's output constraint came from, for a 400's `param`."""
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(request, name)
        if value is not None and not (name == "response_format" and value.type == "text"):
            return name
    return "structured_outputs" if request.structured_outputs is not None else "tool_choice"


def _choice(choices: list[str], param: str) -> StructuredOutputs:
    try:
        return StructuredOutputs.choice(choices)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None


def _structured_field(field: StructuredOutputsField) -> list[StructuredOutputs]:
    specs = []
    if field.json_ is not None:
        specs.append(_json_spec(field.json_))
    if field.regex is not None:
        specs.append(StructuredOutputs("regex", field.regex))
    if field.choice is not None:
        specs.append(_choice(field.choice, "structured_outputs"))
    if field.grammar is not None:
        specs.append(StructuredOutputs("grammar", field.grammar))
    if field.json_object:
        specs.append(StructuredOutputs("json_object"))
    return specs


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    """A function's parameter schema; none given means an object with no properties, as OpenAI."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def tool_constraint(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool
) -> StructuredOutputs | None:
    """The constraint `tool_choice` makes, or None ("none", "auto", no tools); a 400 for a named
    function that is not among the tools, or a choice that needs tools without any."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if not tools:
        raise APIError("tool_choice needs tools", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        wanted = tool_choice.function.name
        for tool in tools:
            if tool.function.name == wanted:
                return _json_spec(_parameters(tool.function))
        raise APIError(f"tool_choice names function {wanted!r}, which is not among the tools", param="tool_choice")
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t.function)},
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputs("json", json.dumps(schema))
