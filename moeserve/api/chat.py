"""POST /v1/chat/completions: messages through the checkpoint's chat template, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moeserve.api.chunks import ChatChunks
from moeserve.api.constraints import constraint_param
from moeserve.api.errors import APIError
from moeserve.api.generation import (
    EventStreamResponse,
    admit,
    check_context,
    collect,
    compile_constraint,
    log_finished,
    submit_all,
)
from moeserve.api.input_bounds import check_prompt_chars
from moeserve.api.protocol import (
    ChatCompletionRequest,
    chat_logprobs,
    chat_response,
    chat_usage_chunk,
    random_id,
    sse,
    usage_info,
)
from moeserve.api.state import ModelInfo, ServingState
from moeserve.api.streaming import SampleCursor
from moeserve.api.tool_calls import ToolCallReader
from moeserve.api.tool_parsers import TOOL_PARSERS
from moeserve.engine.streams import RequestStream
from moeserve.sampling_params import SamplingParams


def _render(request: ChatCompletionRequest, tokenizer) -> list[int]:
    """The conversation as prompt token ids; a template that rejects it is the client's 400."""
    try:
        ids = tokenizer.apply_chat_template(
            request.template_messages(),
            tools=request.template_tools(),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except Exception as exc:  # jinja raises TemplateError (and friends) on conversations it refuses
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from None
    return list(ids)


def _tool_reader(request: ChatCompletionRequest, state: ServingState) -> ToolCallReader | None:
    """How this request's tool calls are read from its output; None when it makes none."""
    mode = request.tool_mode
    if mode == "none":
        return None
    if mode == "named":
        return ToolCallReader("named", name=request.tool_choice.function.name)  # type: ignore[union-attr]
    if mode == "required":
        return ToolCallReader("required")
    parser = state.settings.tool_call_parser
    if parser is None:
        raise APIError(
            'tool_choice "auto" (the default with tools) needs the server started with --tool-call-parser; '
            'or name a function, or ask for "required" or "none"',
            param="tool_choice",
        )
    return ToolCallReader("auto", parser=TOOL_PARSERS[parser]())


async def create_chat_completion(raw: Request, state: ServingState) -> Response:
    request, engine, model, params = await admit(raw, state, ChatCompletionRequest)
    if request.tools is not None and len(request.tools) > model.structured.max_tools:
        raise APIError(
            f"the request has {len(request.tools)} tools; the limit is {model.structured.max_tools} (--max-tools)",
            param="tools",
        )
    reader = _tool_reader(request, state)
    if reader is not None and reader.parser is not None and reader.parser.markers_are_special:
        params = replace(params, skip_special_tokens=False)
    params = await compile_constraint(raw, model, params, constraint_param(request))
    texts = [m["content"] for m in request.template_messages() if isinstance(m.get("content"), str)]
    check_prompt_chars(texts, model.max_model_len, model.token_chars, "messages")
    prompt_ids = await model.off_loop(lambda tokenizer: _render(request, tokenizer))
    check_context(len(prompt_ids), params.max_tokens, model.max_model_len, "messages")
    request_id = random_id("chatcmpl")
    streams = await submit_all(state, engine, [{"prompt_token_ids": prompt_ids}], params, request_id, "messages")
    model_name = state.settings.served_model_name
    num_top = request.top_logprobs or 0
    if request.stream:
        events = _stream_events(streams[0], request, params, request_id, model_name, model, num_top, reader)
        return EventStreamResponse(events, streams, request_id)
    outputs = await collect(raw, streams, request_id)
    read_calls = None if reader is None else reader.final
    body = chat_response(
        request_id, model_name, outputs[0], model.tokenizer, num_top, read_calls, request.prompt_logprobs
    )
    return JSONResponse(body.model_dump())


async def _stream_events(
    stream: RequestStream,
    request: ChatCompletionRequest,
    params: SamplingParams,
    request_id: str,
    model_name: str,
    model: ModelInfo,
    num_top: int,
    reader: ToolCallReader | None,
) -> AsyncIterator[str]:
    """SSE events as OpenAI sends them: each choice opens with an assistant role delta, then its
    content (or tool call) deltas, the last with `finish_reason`; a usage chunk if asked
    (`EventStreamResponse` adds [DONE]). The chunks of one engine output (its n samples) go out
    as one write."""
    chunks = ChatChunks(request_id, model_name, int(time.time()))
    cursors = [SampleCursor(params) for _ in range(params.n)]
    calls = None if reader is None else [reader.stream() for _ in range(params.n)]
    final = None
    yield "".join(chunks.event(index, "", role="assistant") for index in range(params.n))
    async for output in stream:
        events = []
        for sample in output.outputs:
            delta = cursors[sample.index].advance(sample)
            if delta is None:
                continue
            logprobs = None
            if delta.logprobs is not None:
                logprobs = chat_logprobs(delta.token_ids, delta.logprobs, model.tokenizer, num_top)
            finish_reason = delta.finish_reason
            if calls is None:
                events.append(chunks.event(sample.index, delta.text or None, finish_reason, logprobs))
            else:
                call_stream = calls[sample.index]
                text, call_deltas = call_stream.update(delta.text, finish_reason is not None)
                if finish_reason == "stop" and call_stream.has_calls:
                    finish_reason = "tool_calls"
                events.append(chunks.event(sample.index, text or None, finish_reason, logprobs, tool_calls=call_deltas))
        if output.finished:
            final = output
        if events:
            yield "".join(events)
    for index, cursor in enumerate(cursors):
        if not cursor.finished:  # aborted by the server (shutdown): say so rather than stop silently
            yield chunks.event(index, None, "abort")
    if request.include_usage and final is not None:
        yield sse(chat_usage_chunk(request_id, model_name, chunks.created, usage_info([final])))
    if final is not None:
        log_finished(request_id, [final], streamed=True)
