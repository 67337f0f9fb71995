"""POST /tokenize and POST /detokenize, as vLLM serves them (at the root, not under /v1).

Clients use them to count a prompt's tokens against `max_model_len` before sending it, and to
read token ids back as text. A chat conversation is rendered by the checkpoint's chat template
(or in harmony's format, for gpt-oss) exactly as /v1/chat/completions renders it, so its count is
the prompt that route would run.
Tokenizing runs on the prompt thread, as the generation routes' does.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moeserve.api.constraints import ChatTool
from moeserve.api.errors import APIError
from moeserve.api.generation import check_model
from moeserve.api.harmony import render_conversation
from moeserve.api.input_bounds import check_prompt_chars
from moeserve.api.protocol import ChatMessageParam, OpenAIModel, parse_request
from moeserve.api.state import ServingState
from moeserve.api.transport import read_body


class TokenizeRequest(OpenAIModel):
    """Either `prompt` (a completion prompt) or `messages` (a conversation), never both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    tools: list[ChatTool] | None = None
    """Messages only: the tools the template describes to the model, as the chat route passes them."""
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS); vLLM's default: yes for a prompt, no for
    messages, whose template writes them itself."""
    add_generation_prompt: bool = True
    """Messages only: end with the template's assistant header, as the chat route does."""
    continue_final_message: bool = False
    """Messages only: leave the last (assistant) message open, for the model to continue."""
    return_token_strs: bool = False
    """Also return each token as the tokenizer spells it (`token_strs`)."""

    def check(self) -> None:
        """400 for a request that cannot be tokenized one way only."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
        if self.messages is not None and self.add_generation_prompt and self.continue_final_message:
            raise APIError(
                "add_generation_prompt and continue_final_message can not both be true",
                param="continue_final_message",
            )


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    """Only when `return_token_strs` asked for them."""


class DetokenizeResponse(OpenAIModel):
    prompt: str


def _tokenize(request: TokenizeRequest, tokenizer, harmony: bool) -> list[int]:
    if request.prompt is not None:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        return list(tokenizer.encode(request.prompt, add_special_tokens=add_special))
    messages = [m.template_message() for m in request.messages or ()]
    tools = None if not request.tools else [t.model_dump(by_alias=True, exclude_none=True) for t in request.tools]
    if harmony:
        return _tokenize_harmony(request, messages, tools, tokenizer)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tokenize=False,
        )
    except Exception as exc:  # jinja raises TemplateError (and friends) on conversations it refuses
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens)))


def _tokenize_harmony(request: TokenizeRequest, messages: list, tools: list | None, tokenizer) -> list[int]:
    """A harmony model's conversation (gpt-oss), rendered as its chat route renders it."""
    if request.continue_final_message:
        raise APIError(
            "harmony (gpt-oss) conversations cannot continue a final message", param="continue_final_message"
        )
    try:
        text = render_conversation(messages, tools, add_generation_prompt=request.add_generation_prompt)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens)))


def _detokenize(token_ids: list[int], tokenizer) -> str:
    vocab_size = len(tokenizer)
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            f"token ids must be in [0, {vocab_size}) (the tokenizer's vocabulary); got {bad[:5]}", param="tokens"
        )
    return tokenizer.decode(token_ids)


async def tokenize(raw: Request, state: ServingState) -> Response:
    request = parse_request(TokenizeRequest, await read_body(raw, state.settings.max_body_bytes))
    check_model(request.model, state)
    request.check()
    _, model = state.admit()
    if request.prompt is not None:
        check_prompt_chars([request.prompt], model.max_model_len, model.token_chars, "prompt")
    else:
        texts = [m.text() for m in request.messages or []]
        check_prompt_chars(texts, model.max_model_len, model.token_chars, "messages")

    def work(tokenizer) -> TokenizeResponse:
        ids = _tokenize(request, tokenizer, model.harmony)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)

    return JSONResponse((await model.off_loop(work)).model_dump(exclude_none=True))


async def detokenize(raw: Request, state: ServingState) -> Response:
    request = parse_request(DetokenizeRequest, await read_body(raw, state.settings.max_body_bytes))
    check_model(request.model, state)
    _, model = state.admit()
    text = await model.off_loop(lambda tokenizer: _detokenize(request.tokens, tokenizer))
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
