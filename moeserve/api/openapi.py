"""The routes' OpenAPI description, served at /openapi.json and rendered at /docs.

The generation and tokenizer routes read their bodies themselves rather than through a typed
FastAPI parameter: `transport.read_body` counts bytes against the body limit as they arrive
(FastAPI would buffer the whole body first), the API key is checked before anything is parsed,
and pydantic parses the raw JSON in one pass (json.loads plus validation, FastAPI's way, measured
1.46x slower on a chat body). So FastAPI cannot infer those bodies, and each route declares its
pydantic request model here instead; the models' JSON schemas join the document's components, so
the description comes from the same classes that validate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from starlette.routing import compile_path

from moeserve.api.errors import ErrorResponse
from moeserve.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS

_REF = "#/components/schemas/{model}"

_ERROR_WHEN: dict[int, str] = {
    400: "A malformed body, a bad field (`param` names it) or a prompt that does not fit the context",
    401: "Missing or wrong API key (only when the server has one)",
    404: "A model this server does not serve",
    413: "A body over the server's size limit",
    429: "The waiting queue is full: retry after `Retry-After` seconds",
    503: "The model is loading, or the server is draining or its engine died",
}


SAMPLING_RANGES: dict[str, dict[str, float]] = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": INT64_MAX},
    "min_p": {"minimum": 0, "maximum": 1},
    "seed": {"minimum": INT64_MIN, "maximum": INT64_MAX},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
}
"""The ranges `SamplingParams` enforces, as JSON Schema keywords on the request fields that feed
them (they bind numbers only, so a field's null stays allowed). The check stays in
`SamplingParams`, shared with the offline path; this only tells clients and fuzzers."""


def document_sampling_ranges(schema: dict[str, Any], model: type[BaseModel] | None = None) -> None:
    """A request model's `json_schema_extra`: add `SAMPLING_RANGES` to its properties."""
    for name, bounds in SAMPLING_RANGES.items():
        if name in schema.get("properties", {}):
            schema["properties"][name].update(bounds)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The listed error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": _ERROR_WHEN[status]} for status in statuses}


PATH_PARAMETERS: dict[str, str] = {
    "response_id": "The `id` of a response that /v1/responses created with `store` (`resp_...`)",
}
"""What each path parameter names. The handlers read `request.path_params` themselves (they take
the raw request, see above), so FastAPI cannot see the parameters either; a path naming one not
listed here is refused when the app is built, since a document that uses a parameter without
declaring it is not valid OpenAPI and generated clients cannot call the route."""


def operation_extra(path: str, body: type[BaseModel] | None) -> dict[str, Any] | None:
    """A route's `openapi_extra`: its path parameters and, if it has one, its required JSON body."""
    extra: dict[str, Any] = {}
    names = compile_path(path)[2]
    if names:
        extra["parameters"] = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "description": PATH_PARAMETERS[name],
                "schema": {"type": "string"},
            }
            for name in names
        ]
    if body is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    return extra or None


def streamed_response(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route that streams when asked: `text/event-stream` beside the JSON body. As
    OpenAPI 3.1 reads it, the schema describes one event: its `data` is a JSON chunk, an in-band
    error (the engine failed mid-stream), or the final `[DONE]`."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": data},
        "description": f"With `stream: true`: events `data: <{chunk.__name__}>`, then `data: [DONE]`.",
    }
    return {200: {"content": {"text/event-stream": {"schema": event}}}}


def install(app: FastAPI, models: Sequence[tuple[type[BaseModel], JsonSchemaMode]]) -> None:
    """Make `app.openapi()` (what /openapi.json and /docs read) include `models`' schemas.

    A name FastAPI already gave a different model would make one route's reference point at
    another's model, so it is refused rather than overwritten.
    """

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, extra = models_json_schema(models, ref_template=_REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in extra.get("$defs", {}).items():
                if not _same_shape(components.setdefault(name, definition), definition):
                    raise RuntimeError(f"two different OpenAPI schemas are named {name!r}")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _same_shape(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same fields and required ones: FastAPI writes a model's output schema with small
    differences from pydantic's own (no null defaults), which do not make it another model."""
    return set(a.get("properties", {})) == set(b.get("properties", {})) and a.get("required") == b.get("required")
