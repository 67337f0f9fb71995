"""OpenAI protocol models: requests as the openai client sends them, errors, and response shapes."""

from __future__ import annotations

import json

import pytest

from moeserve.api import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    chat_chunk,
    chat_response,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    parse_request,
    random_id,
    sse,
)
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput


class FakeTokenizer:
    """Decodes id i to VOCAB[i]; enough for the response builders."""

    VOCAB = ["<s>", "</s>", "Hello", " world", "!", " there", "é"]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.VOCAB[t] for t in token_ids)


TOK = FakeTokenizer()


def chat_body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def completion_body(**extra) -> dict:
    return {"model": "m", "prompt": "Hello", **extra}


def api_error(model, body: dict, default_max_tokens: int | None = 100) -> APIError:
    """The APIError that parsing `body` and building its SamplingParams raises."""
    with pytest.raises(APIError) as info:
        parse_request(model, body).to_sampling_params(default_max_tokens)
    return info.value


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("Hello", ["Hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert parse_request(CompletionRequest, completion_body(prompt=prompt)).prompts() == expected


def test_completion_defaults_follow_openai():
    req = parse_request(CompletionRequest, completion_body())
    params = req.to_sampling_params(default_max_tokens=500)
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.logprobs) == (16, 1.0, 1.0, 1, None)
    assert req.stream is False and req.include_usage is False
    assert parse_request(CompletionRequest, completion_body(max_tokens=None)).to_sampling_params(500).max_tokens == 500


def test_completion_openai_and_vllm_fields_reach_sampling_params():
    body = completion_body(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop="\n",
        seed=3,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logprobs=3,
        echo=True,
        user="u",
        stream=True,
        stream_options={"include_usage": True},
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        stop_token_ids=[9],
        min_tokens=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        logit_bias={"1": 2},
        suffix="ignored",  # unknown to us: ignored, as OpenAI and vLLM do
    )
    req = parse_request(CompletionRequest, json.dumps(body))
    p = req.to_sampling_params(None)
    assert req.echo and req.include_usage
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed) == (7, 0.5, 0.9, 2, ["\n"], 3)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.1, 0.2, 3)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.stop_token_ids) == (5, 0.05, 1.1, True, [9])
    assert (p.min_tokens, p.include_stop_str_in_output, p.skip_special_tokens) == (2, True, False)


def test_chat_max_completion_tokens_wins_and_logprobs_map():
    req = parse_request(
        ChatCompletionRequest, chat_body(max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=4)
    )
    params = req.to_sampling_params(100)
    assert (params.max_tokens, params.logprobs) == (9, 4)
    assert parse_request(ChatCompletionRequest, chat_body(max_tokens=5)).to_sampling_params(100).max_tokens == 5
    assert parse_request(ChatCompletionRequest, chat_body(logprobs=True)).to_sampling_params(100).logprobs == 0
    unset = parse_request(ChatCompletionRequest, chat_body()).to_sampling_params(None)
    assert (unset.max_tokens, unset.logprobs, unset.temperature) == (None, None, 1.0)


def test_chat_content_parts_flatten_for_the_template():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": messages})
    assert req.template_messages() == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "body, param",
    [
        (completion_body(temperature=-1), "temperature"),
        (completion_body(top_p=0), "top_p"),
        (completion_body(top_p=1.5), "top_p"),
        (completion_body(max_tokens=0), "max_tokens"),
        (completion_body(n=17), "n"),
        (completion_body(n=0), "n"),
        (completion_body(logprobs=6), "logprobs"),
        (completion_body(presence_penalty=3), "presence_penalty"),
        (completion_body(min_tokens=20, max_tokens=10), "min_tokens"),
        (completion_body(stop=[""]), "stop"),
        (completion_body(temperature="0.5"), "temperature"),
        (completion_body(stream="yes"), "stream"),
        (completion_body(prompt=[]), "prompt"),
        (completion_body(prompt=[[1], []]), "prompt"),
        (completion_body(prompt=[1, -2]), "prompt"),
        (completion_body(prompt=5), "prompt"),
        ({"model": "m"}, "prompt"),
    ],
)
def test_completion_bad_values_are_400_naming_the_field(body, param):
    err = api_error(CompletionRequest, body)
    assert (err.status_code, err.param, err.type) == (400, param, "invalid_request_error")


@pytest.mark.parametrize(
    "body, param",
    [
        (chat_body(messages=[]), "messages"),
        (chat_body(messages="hi"), "messages"),
        (chat_body(messages=[{"role": "robot", "content": "x"}]), "messages"),
        (chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
        (chat_body(max_completion_tokens=0), "max_completion_tokens"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(top_logprobs=21, logprobs=True), "top_logprobs"),
        (chat_body(top_logprobs=2), "top_logprobs"),
        (chat_body(logprobs=1), "logprobs"),
        (chat_body(temperature=-0.5), "temperature"),
    ],
)
def test_chat_bad_values_are_400_naming_the_field(body, param):
    err = api_error(ChatCompletionRequest, body)
    assert (err.status_code, err.param) == (400, param)


def test_image_parts_are_refused_by_name():
    """A vision model's image part (Kimi-K2.5 and Qwen3.5-MoE are served as their text models) is a
    400 that says why."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = api_error(
        ChatCompletionRequest,
        chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]),
    )
    assert (err.status_code, err.param) == (400, "messages")
    assert "content part type 'image_url' is not supported: this server runs text models only" in err.message


def test_invalid_json_and_error_body_shape():
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, b"{not json")
    assert info.value.status_code == 400 and info.value.param is None
    assert info.value.body() == error_body(info.value.message, "invalid_request_error", None, None)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    assert APIError("no such model", status_code=404).type == "not_found_error"
    assert APIError("slow down", status_code=429).type == "rate_limit_exceeded"


# ---------------------------------------------------------------- responses


def lp(logprob: float, rank: int) -> Logprob:
    return Logprob(logprob=logprob, rank=rank)


def sample(index: int = 0, with_logprobs: bool = False) -> CompletionOutput:
    """' world!' with the sampled token plus one alternative at each step."""
    logprobs = [{3: lp(-0.1, 1), 5: lp(-2.0, 2)}, {4: lp(-0.5, 2), 1: lp(-0.4, 1)}] if with_logprobs else None
    return CompletionOutput(index=index, text=" world!", token_ids=[3, 4], logprobs=logprobs, finish_reason="length")


def request_output(n: int = 1, with_logprobs: bool = False, prompt: str | None = "Hello") -> RequestOutput:
    return RequestOutput("r", prompt, [0, 2], [sample(i, with_logprobs) for i in range(n)], finished=True)


def test_completion_response_shape_indexes_and_usage():
    resp = completion_response("cmpl-1", "m", [request_output(n=2), request_output(n=2, prompt=None)], TOK)
    body = json.loads(resp.model_dump_json())
    assert set(body) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert body["object"] == "text_completion" and isinstance(body["created"], int)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert set(body["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}


def test_completion_echo_decodes_token_prompts_and_logprobs():
    resp = completion_response("cmpl-1", "m", [request_output(with_logprobs=True, prompt=None)], TOK, echo_prompts=True)
    choice = resp.model_dump()["choices"][0]
    assert choice["text"] == "<s>Hello world!"
    assert choice["logprobs"] == {
        "tokens": ["<s>", "Hello", " world", "!"],
        "token_logprobs": [None, None, -0.1, -0.5],
        "top_logprobs": [None, None, {" world": -0.1, " there": -2.0}, {"</s>": -0.4, "!": -0.5}],
        "text_offset": [0, 3, 8, 14],
    }


def test_completion_logprobs_use_engine_decoding_and_clamp_minus_inf():
    logprobs = [{6: Logprob(float("-inf"), 1, decoded_token="É")}]
    out = completion_logprobs([6], logprobs, TOK)
    assert out.tokens == ["É"] and out.token_logprobs == [-9999.0]


def test_chat_response_shape_and_logprobs():
    resp = chat_response("chatcmpl-1", "m", request_output(with_logprobs=True), TOK, num_top_logprobs=1)
    body = json.loads(resp.model_dump_json())
    assert set(body) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["message"] == {"role": "assistant", "content": " world!"}
    first, second = choice["logprobs"]["content"]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first == {
        "token": " world",
        "logprob": -0.1,
        "bytes": list(b" world"),
        "top_logprobs": [{"token": " world", "logprob": -0.1, "bytes": list(b" world")}],
    }
    assert second["token"] == "!" and [t["token"] for t in second["top_logprobs"]] == ["</s>"]
    assert chat_response("c", "m", request_output(), TOK).choices[0].logprobs is None


def test_stream_chunks_match_openai():
    first = json.loads(
        chat_chunk("chatcmpl-1", "m", 7, 0, DeltaMessage(role="assistant", content="")).model_dump_json()
    )
    assert set(first) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert first["object"] == "chat.completion.chunk" and first["created"] == 7
    assert first["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    last = chat_chunk("chatcmpl-1", "m", 7, 0, DeltaMessage(), finish_reason="stop").model_dump()
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    usage = chat_usage_chunk(
        "chatcmpl-1", "m", 7, UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    ).model_dump()
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    text = completion_chunk("cmpl-1", "m", 7, 1, "hi").model_dump()
    assert text["object"] == "text_completion" and text["choices"][0] == {
        "index": 1,
        "text": "hi",
        "logprobs": None,
        "finish_reason": None,
    }
    event = sse(completion_chunk("cmpl-1", "m", 7, 0, "x"))
    assert event.startswith("data: {") and event.endswith("\n\n") and SSE_DONE == "data: [DONE]\n\n"


def test_ids_and_model_list():
    assert random_id("cmpl").startswith("cmpl-") and len(random_id("chatcmpl")) == len("chatcmpl-") + 32
    body = ModelList(data=[ModelCard(id="m")]).model_dump()
    assert body["object"] == "list" and set(body["data"][0]) == {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "max_model_len",
    }
    assert body["data"][0]["object"] == "model"
