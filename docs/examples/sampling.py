# Server: moeserve launch
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="EMPTY")
model = client.models.list().data[0].id

completion = client.completions.create(
    model=model,
    prompt="Once upon a time",
    max_tokens=16,
    n=2,
    temperature=0.8,
    top_p=0.95,
    seed=1234,
    logprobs=2,
    # vLLM's sampling fields, which the openai SDK passes through `extra_body`.
    extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "stop_token_ids": []},
)
for choice in completion.choices:
    print(choice.index, repr(choice.text), choice.finish_reason, choice.logprobs.top_logprobs[0])
