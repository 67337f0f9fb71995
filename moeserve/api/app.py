"""The FastAPI app: routes, auth, and one error format for every failure.

Every error, ours or the framework's (unknown route, wrong method), leaves as OpenAI's
`{"error": {...}}` body, and each is logged with its status, so a client's mistake is visible to
the operator without a traceback. Only a bug gets a traceback (and a 500).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import moeserve
from moeserve.api.chat import create_chat_completion
from moeserve.api.completions import create_completion
from moeserve.api.errors import APIError, error_body, error_type_for, from_error_list
from moeserve.api.metrics import CONTENT_TYPE
from moeserve.api.openapi import error_responses, install, operation_extra, streamed_response
from moeserve.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    ModelCard,
    ModelList,
)
from moeserve.api.responses import create_response, delete_response, get_response
from moeserve.api.responses_protocol import ResponseDeleted, ResponseObject, ResponsesRequest
from moeserve.api.state import ServingState
from moeserve.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from moeserve.api.transport import ClientDisconnected, check_api_key
from moeserve.kv_transfer.side_channel import fetch_metrics

logger = logging.getLogger("moeserve.api")

Handler = Callable[[Request, ServingState], Awaitable[Response]]


def build_app(state: ServingState) -> FastAPI:
    """The app over `state`; the engine may be attached later (`state.set_ready`)."""
    app = FastAPI(
        title="moeserve",
        version=moeserve.__version__,
        description="An OpenAI-compatible server for mixture-of-experts models.",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.serving = state
    _add_error_handlers(app, state)

    def guarded(handler: Handler, authenticated: bool = True) -> Callable[[Request], Awaitable[Response]]:
        """The handler counted in the HTTP metrics; behind the API key unless `authenticated` is
        False (vLLM asks for the key on /v1 routes only)."""

        async def endpoint(request: Request) -> Response:
            if authenticated:
                check_api_key(request, state.settings.api_key)
            try:
                response = await handler(request, state)
            except ClientDisconnected:
                logger.info("%s %s: client disconnected; its request was aborted", request.method, request.url.path)
                response = Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            state.metrics.count_http(request.url.path, response.status_code)
            return response

        return endpoint

    async def list_models(request: Request, state: ServingState) -> Response:
        card = ModelCard(id=state.settings.served_model_name)
        if state.model is not None:
            card = ModelCard(
                id=card.id, created=state.model.created, root=state.model.root, max_model_len=state.model.max_model_len
            )
        return JSONResponse(ModelList(data=[card]).model_dump())

    routes = _routes(list_models)
    for route in routes:
        responses = error_responses(*route.errors)
        if route.chunk is not None:
            responses = {**streamed_response(route.chunk), **responses}
        app.add_api_route(
            route.path,
            guarded(route.handler, authenticated=route.authenticated),
            methods=[route.method],
            summary=route.summary,
            response_model=route.response,
            response_model_exclude_none=route.exclude_none,
            responses=responses,
            openapi_extra=operation_extra(route.path, route.body),
        )

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "Ready to serve"}, 503: {"description": "Loading, draining or dead"}},
    )
    async def health() -> Response:
        """200 once the model is loaded and the engine runs; 503 while loading, draining or dead."""
        return Response(status_code=200 if state.is_ready else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": moeserve.__version__}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"description": "Prometheus' text format", "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}
        },
    )
    async def metrics() -> Response:
        text = state.metrics.exposition()
        kv = state.model.kv if state.model is not None else None
        if kv is not None:  # the transfer metrics live with the transfers, in the engine core's process
            text += await asyncio.to_thread(fetch_metrics, kv.kv_address)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/kv/info", responses={404: {"description": "Not a disaggregated instance (--role both)"}})
    async def kv_info() -> Response:
        """This instance's role and what a KV transfer peer must match (model, block size, tp)."""
        kv = state.model.kv if state.model is not None else None
        if kv is None:
            status = 503 if state.model is None else 404
            reason = "the model is still loading" if state.model is None else "this instance runs --role both"
            return JSONResponse(error_body(reason, error_type_for(status)), status_code=status)
        return JSONResponse(kv.to_json())

    install(
        app,
        [(route.body, "validation") for route in routes if route.body is not None]
        + [(route.chunk, "serialization") for route in routes if route.chunk is not None],
    )
    return app


@dataclass(frozen=True)
class _Route:
    """One JSON route: its handler, and what the schema says it takes, returns and refuses."""

    path: str
    handler: Handler
    method: str
    summary: str
    response: type[BaseModel]
    errors: tuple[int, ...]
    body: type[BaseModel] | None = None  # the JSON body, validated by the handler itself
    chunk: type[BaseModel] | None = None  # each streamed event's data, when the route can stream
    authenticated: bool = True
    exclude_none: bool = False


def _routes(list_models: Handler) -> list[_Route]:
    generation_errors = (400, 401, 404, 413, 429, 503)
    tokenizer_errors = (400, 404, 413, 503)
    return [
        _Route(
            "/v1/completions",
            create_completion,
            "POST",
            "Complete one or more prompts (text or token ids)",
            CompletionResponse,
            generation_errors,
            body=CompletionRequest,
            chunk=CompletionStreamChunk,
        ),
        _Route(
            "/v1/chat/completions",
            create_chat_completion,
            "POST",
            "Continue a conversation through the model's chat template",
            ChatCompletionResponse,
            generation_errors,
            body=ChatCompletionRequest,
            chunk=ChatCompletionStreamChunk,
        ),
        _Route(
            "/v1/responses",
            create_response,
            "POST",
            "A response (OpenAI's Responses API), streamed as typed events or not",
            ResponseObject,
            generation_errors,
            body=ResponsesRequest,
        ),
        _Route("/v1/responses/{response_id}", get_response, "GET", "A stored response", ResponseObject, (401, 404)),
        _Route(
            "/v1/responses/{response_id}",
            delete_response,
            "DELETE",
            "Forget a stored response",
            ResponseDeleted,
            (401, 404),
        ),
        _Route("/v1/models", list_models, "GET", "The model this server serves", ModelList, (401,)),
        _Route(
            "/tokenize",
            tokenize,
            "POST",
            "Token ids of a prompt, or of a conversation as the chat route renders it",
            TokenizeResponse,
            tokenizer_errors,
            body=TokenizeRequest,
            authenticated=False,
            exclude_none=True,
        ),
        _Route(
            "/detokenize",
            detokenize,
            "POST",
            "Text of token ids",
            DetokenizeResponse,
            tokenizer_errors,
            body=DetokenizeRequest,
            authenticated=False,
        ),
    ]


def _add_error_handlers(app: FastAPI, state: ServingState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        log = logger.warning if exc.status_code >= 500 or exc.status_code == 429 else logger.info
        log("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
        state.metrics.count_http(request.url.path, exc.status_code)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own validation (a typed parameter) answers as ours does: 400, `param` the field.
        Its locations start with where the value was (body, query, ...), which `param` leaves out."""
        errors = [{**error, "loc": tuple(error.get("loc", ()))[1:]} for error in exc.errors()]
        return await api_error(request, from_error_list(errors, "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        logger.info("-> %d: %s", exc.status_code, message)
        return JSONResponse(
            error_body(message, error_type_for(exc.status_code)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        state.metrics.count_http(request.url.path, 500)
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}", "internal_error", code=500), status_code=500
        )
