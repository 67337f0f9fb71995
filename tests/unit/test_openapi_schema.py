"""/openapi.json describes every route from the models that validate it, and FastAPI's own
validation errors answer in OpenAI's format (the app is built without an engine: no model needed)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import OpenAPIV31SpecValidator
from pydantic import BaseModel

from moeserve.api import ServerMetrics, ServerSettings, ServingState, build_app
from moeserve.api.openapi import SAMPLING_RANGES
from moeserve.api.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.config import SLOConfig
from moeserve.sampling_params import SamplingParams

ROUTES = {
    ("post", "/v1/completions"): ("CompletionRequest", "CompletionResponse"),
    ("post", "/v1/chat/completions"): ("ChatCompletionRequest", "ChatCompletionResponse"),
    ("get", "/v1/models"): (None, "ModelList"),
    ("post", "/v1/responses"): ("ResponsesRequest", "ResponseObject"),
    ("get", "/v1/responses/{response_id}"): (None, "ResponseObject"),
    ("delete", "/v1/responses/{response_id}"): (None, "ResponseDeleted"),
    ("post", "/tokenize"): ("TokenizeRequest", "TokenizeResponse"),
    ("post", "/detokenize"): ("DetokenizeRequest", "DetokenizeResponse"),
    ("get", "/health"): (None, None),
    ("get", "/version"): (None, None),
    ("get", "/metrics"): (None, None),
    ("get", "/kv/info"): (None, None),  # a disaggregated instance's identity, for the router's handshake
}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


class TypedBody(BaseModel):
    count: int


def _app():
    return build_app(ServingState(ServerSettings(served_model_name="m"), ServerMetrics("m", SLOConfig())))


@pytest.fixture(scope="module")
def doc() -> dict:
    http = TestClient(_app())
    assert http.get("/docs").status_code == 200
    return http.get("/openapi.json").json()


def _resolve(doc: dict, schema: dict) -> dict:
    ref = schema["$ref"]
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_the_document_is_valid_openapi_3_1(doc: dict) -> None:
    """Checked by a validator, not by hand: every path parameter a route uses is declared (the
    Responses routes' `response_id` was not, so fuzzers stopped on them and generated clients
    could not call them), every reference resolves, every schema is one OpenAPI 3.1 accepts."""
    assert doc["openapi"].startswith("3.1")
    errors = [error.message for error in OpenAPIV31SpecValidator(doc).iter_errors()]
    assert not errors, errors


def test_path_parameters_are_declared_as_required_strings(doc: dict) -> None:
    for method in ("get", "delete"):
        (parameter,) = doc["paths"]["/v1/responses/{response_id}"][method]["parameters"]
        assert parameter["name"] == "response_id" and parameter["in"] == "path" and parameter["required"]
        assert parameter["schema"] == {"type": "string"} and parameter["description"]


def test_every_route_has_its_request_and_response_schema(doc: dict) -> None:
    described = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert described == set(ROUTES)
    for (method, path), (request, response) in ROUTES.items():
        op = doc["paths"][path][method]
        if request is None:
            assert "requestBody" not in op
        else:
            body = op["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{request}"} and _resolve(doc, body)["type"] == "object"
            assert op["responses"]["400"]["content"]["application/json"]["schema"] == ERROR_REF
        if response is not None:
            assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{response}"
            }
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"]
        assert {"401", "404", "413", "429", "503"} <= set(responses)
    error = doc["components"]["schemas"]["ErrorInfo"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_request_schemas_are_the_models_own(doc: dict, model: type[BaseModel]) -> None:
    schema = doc["components"]["schemas"][model.__name__]
    assert set(schema["properties"]) == set(model.model_fields)
    assert set(schema["required"]) == {name for name, field in model.model_fields.items() if field.is_required()}


def test_framework_validation_errors_use_the_openai_format() -> None:
    """A typed FastAPI parameter's failure is a 400 naming the field, not FastAPI's 422."""
    app = _app()

    @app.post("/typed")
    async def typed(body: TypedBody, limit: int = 1) -> dict:
        return {"count": body.count, "limit": limit}

    http = TestClient(app)
    assert http.post("/typed", json={"count": 2}).json() == {"count": 2, "limit": 1}
    bad_body = http.post("/typed", json={"count": "many"})
    assert bad_body.status_code == 400
    error = bad_body.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "count" and error["type"] == "invalid_request_error" and "count" in error["message"]
    bad_query = http.post("/typed?limit=x", json={"count": 2})
    assert bad_query.status_code == 400 and bad_query.json()["error"]["param"] == "limit"


INT_FIELDS = {"top_k", "seed", "max_tokens", "min_tokens", "prompt_logprobs"}


@pytest.mark.parametrize("field", sorted(SAMPLING_RANGES))
def test_documented_ranges_are_the_ones_sampling_params_enforces(field: str) -> None:
    """Each documented bound is the edge of what SamplingParams accepts, so a schema-valid value
    is never refused for its range and a value just past a bound always is."""
    name = "max_tokens" if field == "max_completion_tokens" else field
    step = 1 if name in INT_FIELDS else 0.01
    bounds = SAMPLING_RANGES[field]

    def accepted(value: float) -> bool:
        try:
            SamplingParams(**{"max_tokens": 16, name: int(value) if name in INT_FIELDS else value})
        except ValueError:
            return False
        return True

    for keyword, edge in bounds.items():
        inside, outside = {
            "minimum": (edge, edge - step),
            "maximum": (edge, edge + step),
            "exclusiveMinimum": (edge + step, edge),
        }[keyword]
        assert accepted(inside) and not accepted(outside), (keyword, edge)
