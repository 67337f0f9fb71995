"""What both generation endpoints do around the engine: check a prompt fits, submit it, map the
engine's refusals to HTTP errors, collect final outputs and log each request's outcome.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Send

from moeserve.api.errors import APIError
from moeserve.api.kv_transfer import kv_transfer_params
from moeserve.api.protocol import SSE_DONE, RequestT, parse_request
from moeserve.api.state import ModelInfo, ServingState
from moeserve.api.streaming import SSE_HEADERS, sse_error
from moeserve.api.transport import read_body, until_disconnected
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.streams import EngineClient, EngineDeadError, RequestStream
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import QueueFullError, SLORejectedError
from moeserve.slo import DEFAULT_CLASS
from moeserve.structured import check_structured_outputs
from moeserve.structured.compile_pool import CompilePoolClosedError, CompileQueueFullError
from moeserve.structured.limits import check_limits

logger = logging.getLogger("moeserve.api")

SSE_DONE_BYTES = SSE_DONE.encode()

RETRY_AFTER_S = 1
"""Seconds a shed client is told to wait: the queue drains within a few steps of capacity."""


async def admit(
    raw: Request, state: ServingState, request_class: type[RequestT]
) -> tuple[RequestT, EngineClient, ModelInfo, SamplingParams]:
    """The validated body, and the engine to serve it with: a 4xx for a bad body or an unknown
    model, a 503 while the model loads or the server drains."""
    request = parse_request(request_class, await read_body(raw, state.settings.max_body_bytes))
    check_model(request.model, state)
    engine, model = state.admit()
    params = request.to_sampling_params(default_max_tokens=None)
    if request.slo is not None:
        params.slo = request.slo.resolve(state.metrics.slo.catalog)
    params.kv_transfer = kv_transfer_params(request.kv_transfer_params, model.kv, params.n)
    return request, engine, model, params


async def compile_constraint(raw: Request, model: ModelInfo, params: SamplingParams, param: str) -> SamplingParams:
    """`params` with its output constraint compiled, out of the engine core (`compile_pool`); a
    400 naming `param` for a constraint over a limit, one that does not parse or compile in time,
    a 429 for a client with too many compiles waiting. A client that leaves cancels its compile."""
    spec = params.structured_outputs
    if spec is None:
        return params
    try:
        check_limits(spec, model.structured)
        if model.grammars is None:  # the engine compiles it; a spec that does not parse is still a 400 here
            await model.off_loop(lambda _tokenizer: check_structured_outputs(spec))
            return params
        compiled = await until_disconnected(raw, model.grammars.compile(spec, client_identity(raw)))
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None
    except CompileQueueFullError as exc:
        raise APIError(str(exc), status_code=429, param=param, headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except CompilePoolClosedError as exc:
        raise APIError(str(exc), status_code=503) from None
    return replace(params, structured_outputs=replace(spec, compiled=compiled))


def client_identity(raw: Request) -> str:
    """Who a request's cost is charged to: its API key when it sends one, else its connection."""
    scheme, _, token = raw.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
    client = raw.client
    return "conn:unknown" if client is None else f"conn:{client.host}:{client.port}"


def check_model(requested: str | None, state: ServingState) -> None:
    """404 for a model this server does not serve (None picks the only one, as vLLM allows)."""
    served = state.settings.served_model_name
    if requested is not None and requested != served:
        raise APIError(
            f"the model '{requested}' does not exist; this server serves '{served}'",
            status_code=404,
            param="model",
            code="model_not_found",
        )


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> None:
    """400 unless the prompt and the tokens asked for fit the context, in OpenAI's words."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion. "
            "Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def engine_error(exc: BaseException, prompt_param: str) -> APIError | None:
    """The HTTP error for an engine refusal; None for anything else (a bug: let it become a 500)."""
    if isinstance(exc, SLORejectedError):
        return APIError(
            f"the server cannot meet this request's time-to-first-token target: {exc}; retry later or with a "
            "looser slo.ttft_ms",
            status_code=429,
            code="slo_unattainable",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, QueueFullError):
        return APIError(
            f"the server is at capacity ({exc}); retry later",
            status_code=429,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status_code=503)
    if isinstance(exc, ValueError):
        return APIError(str(exc), status_code=400, param=prompt_param)
    return None


async def submit_all(
    state: ServingState,
    engine: EngineClient,
    prompts: Sequence[dict],
    params: SamplingParams,
    request_id: str,
    prompt_param: str,
) -> list[RequestStream]:
    """Submit every prompt, or none: if one is refused the others are aborted. SLO admission's
    refusals are counted by class.

    The prompts go to the engine together, each queued before any acceptance is awaited: awaited
    one by one, each waited for the core's answer, which comes between steps, so a request of n
    prompts reached the scheduler over n steps (and its last prompt's TTFT grew by n step times)."""
    ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
    submissions = [asyncio.ensure_future(engine.submit(p, params, sub_id)) for p, sub_id in zip(prompts, ids)]
    try:
        await asyncio.wait(submissions)
    except BaseException:  # cancelled (the client left): none of them is wanted
        for submission in submissions:
            submission.cancel()  # one still waiting for its answer aborts its own request
        await close_all([s.result() for s in submissions if s.done() and not s.cancelled() and not s.exception()])
        raise
    streams = [s.result() for s in submissions if s.exception() is None]
    refusal = next((s.exception() for s in submissions if s.exception() is not None), None)
    if refusal is None:
        return streams
    await close_all(streams)
    if isinstance(refusal, SLORejectedError):
        state.metrics.record_slo_rejection(DEFAULT_CLASS if params.slo is None else params.slo.label)
    error = engine_error(refusal, prompt_param)
    if error is None:
        raise refusal
    raise error from None


async def close_all(streams: Sequence[RequestStream]) -> None:
    """Abort every stream that has not finished; finished ones are left alone."""
    for stream in streams:
        await stream.aclose()


async def final_output(stream: RequestStream) -> RequestOutput | None:
    """The finished output, or None if the request was aborted (server shutdown)."""
    last = None
    async for output in stream:
        last = output
    return last if last is not None and last.finished else None


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Every stream's finished output; a 503 if any was aborted by the server."""
    outputs = await asyncio.gather(*(final_output(s) for s in streams))
    if any(out is None for out in outputs):
        raise APIError("the request was aborted because the server is shutting down", status_code=503)
    return list(outputs)  # type: ignore[arg-type]


async def collect(raw: Request, streams: Sequence[RequestStream], request_id: str) -> list[RequestOutput]:
    """A non-streamed request's final outputs, logged; a client that disconnects first aborts them."""
    try:
        outputs = await until_disconnected(raw, final_outputs(streams))
    finally:
        await close_all(streams)
    log_finished(request_id, outputs, streamed=False)
    return outputs


class EventStreamResponse(StreamingResponse):
    """The SSE response: `events`, then [DONE]. The 200 is sent with the first event, so an engine
    that dies mid-stream is reported in-band, as an error event before [DONE]; a client that leaves
    early aborts every unfinished stream (Starlette's `__call__` watches for the disconnect).

    `stream_response` is Starlette's loop with the guard folded in: one async iterator between
    the engine and the socket per chunk rather than two, and [DONE] sent with the end of the body.
    """

    def __init__(self, events: AsyncIterator[str], streams: Sequence[RequestStream], request_id: str) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._streams = streams
        self._request_id = request_id

    async def stream_response(self, send: Send) -> None:
        events = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            except Exception as exc:  # the engine died: the client must not mistake the end for a finish
                logger.error("%s failed mid-stream: %s", self._request_id, exc)
                await send({"type": "http.response.body", "body": sse_error(str(exc)).encode(), "more_body": True})
            await send({"type": "http.response.body", "body": SSE_DONE_BYTES, "more_body": False})
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            await close_all(self._streams)


def log_finished(request_id: str, outputs: Sequence[RequestOutput], streamed: bool) -> None:
    """One INFO line per finished request: sizes, why it ended, and its latencies."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    reasons = sorted({s.finish_reason or "abort" for o in outputs for s in o.outputs})
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    ttfts = [m.ttft_s for m in metrics if m.ttft_s is not None]
    ttft = f"{1000 * max(ttfts):.1f} ms" if ttfts else "-"
    e2e = f"{1000 * max(m.e2e_s for m in metrics):.1f} ms" if metrics else "-"
    logger.info(
        "%s finished (%s): prompt %d tokens, completion %d tokens, finish %s, ttft %s, e2e %s",
        request_id,
        "stream" if streamed else "full",
        prompt_tokens,
        completion_tokens,
        "/".join(reasons),
        ttft,
        e2e,
    )
