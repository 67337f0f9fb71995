"""POST /v1/completions: text or token-id prompts, one or many, streamed or not."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moeserve.api.chunks import CompletionChunks
from moeserve.api.constraints import constraint_param
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
from moeserve.api.kv_transfer import phase_timings_event, with_phase_timings
from moeserve.api.protocol import (
    CompletionRequest,
    completion_logprobs,
    completion_response,
    completion_usage_chunk,
    random_id,
    sse,
    usage_info,
)
from moeserve.api.state import ModelInfo, ServingState
from moeserve.api.streaming import SampleCursor
from moeserve.api.transport import merge
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.streams import RequestStream
from moeserve.sampling_params import SamplingParams


def _prepare_prompts(request: CompletionRequest, tokenizer) -> list[dict]:
    """Each prompt as the engine takes it, tokenized here so its length can be checked first."""
    prompts = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            prompts.append({"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)})
        else:
            prompts.append({"prompt_token_ids": list(prompt)})
    return prompts


async def create_completion(raw: Request, state: ServingState) -> Response:
    request, engine, model, params = await admit(raw, state, CompletionRequest)
    params = await compile_constraint(raw, model, params, constraint_param(request))
    for prompt in request.prompts():
        if isinstance(prompt, str):
            check_prompt_chars([prompt], model.max_model_len, model.token_chars, "prompt")
    prompts = await model.off_loop(lambda tokenizer: _prepare_prompts(request, tokenizer))
    for prompt in prompts:
        check_context(len(prompt["prompt_token_ids"]), params.max_tokens, model.max_model_len, "prompt")
    request_id = random_id("cmpl")
    streams = await submit_all(state, engine, prompts, params, request_id, "prompt")
    model_name = state.settings.served_model_name
    if request.stream:
        events = _stream_events(streams, request, params, request_id, model_name, model)
        return EventStreamResponse(events, streams, request_id)
    outputs = await collect(raw, streams, request_id)
    body = completion_response(
        request_id,
        model_name,
        outputs,
        model.tokenizer,
        echo_prompts=request.echo,
        num_logprobs=request.logprobs or 0,
        num_prompt_logprobs=request.prompt_logprobs,
    )
    if request.kv_transfer_params is not None:
        return JSONResponse(with_phase_timings(body.model_dump(), outputs, model.kv))
    return JSONResponse(body.model_dump())


async def _stream_events(
    streams: list[RequestStream],
    request: CompletionRequest,
    params: SamplingParams,
    request_id: str,
    model_name: str,
    model: ModelInfo,
) -> AsyncIterator[str]:
    """SSE events: one chunk per new piece of text of each choice, then usage (`EventStreamResponse`
    adds [DONE], and aborts every unfinished prompt when the client leaves early). The chunks of
    one engine output (its n samples) go out as one write.

    Choice `i * n + j` is sample j of prompt i.
    """
    chunks = CompletionChunks(request_id, model_name, int(time.time()))
    n = params.n
    cursors = [[SampleCursor(params) for _ in range(n)] for _ in streams]
    finals: dict[int, RequestOutput] = {}
    prompt_texts: dict[int, str] = {}  # echo: each prompt's text, decoded once rather than per chunk

    def events_of(prompt_index: int, output: RequestOutput) -> str:
        events = []
        for sample in output.outputs:
            delta = cursors[prompt_index][sample.index].advance(sample)
            if delta is None:
                continue
            text, prompt_ids, offset = delta.text, None, delta.text_offset
            if request.echo:  # the prompt goes first, in the choice's first chunk
                if prompt_index not in prompt_texts:
                    prompt_texts[prompt_index] = (
                        output.prompt if output.prompt is not None else model.tokenizer.decode(output.prompt_token_ids)
                    )
                prompt_text = prompt_texts[prompt_index]
                if delta.text_offset == 0:
                    text, prompt_ids = prompt_text + text, output.prompt_token_ids
                else:
                    offset += len(prompt_text)
            logprobs = None
            if delta.logprobs is not None:
                logprobs = completion_logprobs(
                    delta.token_ids,
                    delta.logprobs,
                    model.tokenizer,
                    prompt_ids,
                    start_offset=offset,
                    prompt_logprobs=output.prompt_logprobs,
                    num_prompt_top=request.logprobs or 0,
                )
            events.append(chunks.event(prompt_index * n + sample.index, text, delta.finish_reason, logprobs))
        if output.finished:
            finals[prompt_index] = output
        return "".join(events)

    if len(streams) == 1:  # the common case, without merge's extra iterator per chunk
        async for output in streams[0]:
            if events := events_of(0, output):
                yield events
    else:
        async with contextlib.aclosing(merge(streams)) as merged:
            async for prompt_index, output in merged:
                if events := events_of(prompt_index, output):
                    yield events
    for prompt_index, prompt_cursors in enumerate(cursors):
        for index, cursor in enumerate(prompt_cursors):
            if not cursor.finished:  # aborted by the server (shutdown): say so rather than stop silently
                yield chunks.event(prompt_index * n + index, "", "abort")
    if request.include_usage:
        yield sse(completion_usage_chunk(request_id, model_name, chunks.created, usage_info(list(finals.values()))))
    if request.kv_transfer_params is not None and (event := phase_timings_event(list(finals.values()), model.kv)):
        yield event
    log_finished(request_id, list(finals.values()), streamed=True)
