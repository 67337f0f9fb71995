# Server: moeserve launch
import os

from openai import OpenAI

base_url = os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1"
client = OpenAI(base_url=base_url, api_key="EMPTY")  # any key, unless the server has --api-key
model = client.models.list().data[0].id

reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name three prime numbers."}],
    max_tokens=24,
    temperature=0,
)
print(reply.choices[0].message.content, reply.usage)

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Count to five."}],
    max_tokens=16,
    stream=True,
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
