"""POST /v1/chat/completions: messages through the checkpoint's chat template, streamed or not."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

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
from moeserve.api.harmony import HarmonyReasoningParser, HarmonyToolParser, render_conversation
from moeserve.api.input_bounds import check_prompt_chars
from moeserve.api.kv_transfer import phase_timings_event, with_phase_timings
from moeserve.api.protocol import (
    ChatCompletionRequest,
    ToolCall,
    chat_logprobs,
    chat_response,
    chat_usage_chunk,
    random_id,
    sse,
    usage_info,
)
from moeserve.api.reasoning_parsers import REASONING_PARSERS, ReasoningParser, ReasoningStream
from moeserve.api.state import ModelInfo, ServingState
from moeserve.api.streaming import SampleCursor
from moeserve.api.tool_calls import ToolCallReader
from moeserve.api.tool_parsers import TOOL_PARSERS
from moeserve.engine.streams import RequestStream
from moeserve.sampling_params import SamplingParams

PROMPT_TAIL_TOKENS = 16
"""Prompt tokens decoded to see whether the template left the thinking open (`ReasoningParser.opens_in`)."""


def _render(request: ChatCompletionRequest, tokenizer, template_kwargs: dict[str, Any]) -> list[int]:
    """The conversation as prompt token ids; a template that rejects it is the client's 400."""
    reserved = set(template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters)
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
    try:
        ids = tokenizer.apply_chat_template(
            request.template_messages(),
            tools=request.template_tools(),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
    except Exception as exc:  # jinja raises TemplateError (and friends) on conversations it refuses
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from None
    return list(ids)


def _render_harmony(request: ChatCompletionRequest, tokenizer) -> list[int]:
    """The conversation in harmony's format (gpt-oss), tokenized by the checkpoint's tokenizer,
    which holds harmony's markers as special tokens."""
    tools = request.template_tools() if request.tool_mode != "none" else None
    try:
        text = render_conversation(request.template_messages(), tools, reasoning_effort=request.reasoning_effort)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_harmony(request: ChatCompletionRequest, params: SamplingParams) -> None:
    """What harmony's reader cannot honour yet: constrained output would have to skip the
    channel headers, which the grammars do not."""
    if request.tool_mode in ("named", "required"):
        raise APIError(
            'this model speaks harmony (gpt-oss): tool_choice may be "auto" or "none", not force a call',
            param="tool_choice",
        )
    if params.structured_outputs is not None:
        raise APIError("structured outputs are not supported with harmony (gpt-oss) yet", param="response_format")
    if request.chat_template_kwargs:
        raise APIError("harmony (gpt-oss) prompts are not rendered by a chat template", param="chat_template_kwargs")


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request's output is generated and read: shared by /v1/chat/completions and
    /v1/responses, which differ only in how they report it."""

    params: SamplingParams
    prompt_ids: list[int]
    reader: ToolCallReader | None
    reasoning: ReasoningParser | None
    in_reasoning: bool
    """The prompt left the thinking open: the output starts inside it."""

    def read(self, text: str, finish_reason: str | None) -> tuple[str | None, str | None, list[ToolCall], str | None]:
        """(reasoning, content, calls, finish reason) of a finished sample; with a reasoning
        parser an empty answer is None (all thinking, or all calls), as vLLM answers."""
        reasoning, answer = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text, True, self.in_reasoning)
            reasoning, answer = split.reasoning or None, split.content
        content: str | None = answer
        calls: list[ToolCall] = []
        if self.reader is not None:
            content, calls, finish_reason = self.reader.final(answer, finish_reason)
        if self.reasoning is not None and not content:
            content = None
        return reasoning, content, calls, finish_reason

    def reasoning_stream(self) -> ReasoningStream | None:
        return None if self.reasoning is None else ReasoningStream(self.reasoning, self.in_reasoning)


async def plan_chat(
    raw: Request, request: ChatCompletionRequest, state: ServingState, model: ModelInfo, params: SamplingParams
) -> ChatPlan:
    """Render the prompt, compile the output's constraint and choose its readers. A reasoning
    model's constrained output (structured outputs, a forced call) is constrained after its
    thinking: the answer is what must parse, and the split the parser makes is where the
    grammar's thinking ends, so the constraint is compiled once the prompt shows whether the
    output starts inside the thinking. The cheap bounds (tools, text past the context) come first."""
    if request.tools is not None and len(request.tools) > model.structured.max_tools:
        raise APIError(
            f"the request has {len(request.tools)} tools; the limit is {model.structured.max_tools} (--max-tools)",
            param="tools",
        )
    check_prompt_chars([m.text() for m in request.messages], model.max_model_len, model.token_chars, "messages")
    if model.harmony:
        _check_harmony(request, params)
        reader: ToolCallReader | None = ToolCallReader("auto", parser=HarmonyToolParser())
        reasoning: ReasoningParser | None = HarmonyReasoningParser()
    else:
        reader = _tool_reader(request, state)
        name = state.settings.reasoning_parser
        reasoning = None if name is None else REASONING_PARSERS[name]()
    if reader is not None and reader.parser is not None and reader.parser.markers_are_special:
        params = replace(params, skip_special_tokens=False)
    template_kwargs = request.chat_template_kwargs or {}

    def render(tokenizer) -> tuple[list[int], bool]:
        if model.harmony:
            return _render_harmony(request, tokenizer), False
        ids = _render(request, tokenizer, template_kwargs)
        opens = reasoning is not None and reasoning.opens_in(tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
        return ids, opens

    prompt_ids, in_reasoning = await model.off_loop(render)
    check_context(len(prompt_ids), params.max_tokens, model.max_model_len, "messages")
    spec = params.structured_outputs
    if reasoning is not None and spec is not None:
        start = "" if in_reasoning else reasoning.start_marker
        spec = replace(spec, reasoning_start=start, reasoning_end=reasoning.end_marker)
        params = replace(params, structured_outputs=spec)
    params = await compile_constraint(raw, model, params, constraint_param(request))
    return ChatPlan(params, prompt_ids, reader, reasoning, in_reasoning)


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
    plan = await plan_chat(raw, request, state, model, params)
    params = plan.params
    request_id = random_id("chatcmpl")
    streams = await submit_all(state, engine, [{"prompt_token_ids": plan.prompt_ids}], params, request_id, "messages")
    model_name = state.settings.served_model_name
    num_top = request.top_logprobs or 0
    if request.stream:
        events = _stream_events(streams[0], request, plan, request_id, model_name, model, num_top)
        return EventStreamResponse(events, streams, request_id)
    outputs = await collect(raw, streams, request_id)
    body = chat_response(
        request_id,
        model_name,
        outputs[0],
        model.tokenizer,
        num_top,
        plan.read if plan.reader is not None or plan.reasoning is not None else None,
        request.prompt_logprobs,
    )
    if request.kv_transfer_params is not None:
        return JSONResponse(with_phase_timings(body.model_dump(), outputs, model.kv))
    return JSONResponse(body.model_dump())


async def _stream_events(
    stream: RequestStream,
    request: ChatCompletionRequest,
    plan: ChatPlan,
    request_id: str,
    model_name: str,
    model: ModelInfo,
    num_top: int,
) -> AsyncIterator[str]:
    """SSE events as OpenAI sends them: each choice opens with an assistant role delta, then its
    reasoning, content (or tool call) deltas, the last with `finish_reason`; a usage chunk if
    asked (`EventStreamResponse` adds [DONE]). The chunks of one engine output (its n samples)
    go out as one write."""
    params, reader = plan.params, plan.reader
    chunks = ChatChunks(request_id, model_name, int(time.time()))
    cursors = [SampleCursor(params) for _ in range(params.n)]
    calls = None if reader is None else [reader.stream() for _ in range(params.n)]
    thoughts = [plan.reasoning_stream() for _ in range(params.n)]
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
            text, reasoning = delta.text, None
            thought = thoughts[sample.index]
            if thought is not None:
                reasoning, text = thought.update(text, finish_reason is not None)
            if calls is None:
                event = chunks.event(sample.index, text or None, finish_reason, logprobs, reasoning=reasoning or None)
                events.append(event)
            else:
                call_stream = calls[sample.index]
                text, call_deltas = call_stream.update(text, finish_reason is not None)
                if finish_reason == "stop" and call_stream.has_calls:
                    finish_reason = "tool_calls"
                events.append(
                    chunks.event(
                        sample.index,
                        text or None,
                        finish_reason,
                        logprobs,
                        tool_calls=call_deltas,
                        reasoning=reasoning or None,
                    )
                )
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
        if request.kv_transfer_params is not None and (event := phase_timings_event([final], model.kv)):
            yield event
        log_finished(request_id, [final], streamed=True)
