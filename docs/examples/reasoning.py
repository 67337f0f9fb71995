# Server: moeserve launch --reasoning-parser qwen3
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="EMPTY")
model = client.models.list().data[0].id
question = [{"role": "user", "content": "What is 17 * 3?"}]

reply = client.chat.completions.create(model=model, messages=question, max_tokens=48)
message = reply.choices[0].message
# Not part of the openai SDK's types: vLLM's field, which the SDK keeps as an extra attribute.
print("thinking:", getattr(message, "reasoning_content", None))
print("answer:", message.content)

# Streamed, the thinking arrives as delta.reasoning_content before the answer's delta.content.
for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=24, stream=True):
    if chunk.choices:
        delta = chunk.choices[0].delta
        print(getattr(delta, "reasoning_content", None) or "", delta.content or "", sep="", end="", flush=True)
print()

# Qwen3's template skips the thinking when asked to, through chat_template_kwargs.
quick = client.chat.completions.create(
    model=model, messages=question, max_tokens=16, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
)
print(quick.choices[0].message.content)
