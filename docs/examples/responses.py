# Server: moeserve launch
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="EMPTY")
model = client.models.list().data[0].id

first = client.responses.create(
    model=model, instructions="Answer briefly.", input="Name a colour.", max_output_tokens=16
)
print(first.id, first.output_text)

# Continue the conversation from the stored response: its input and output come first.
second = client.responses.create(
    model=model, previous_response_id=first.id, input="And another one?", max_output_tokens=16
)
print(second.output_text)

# Streamed as typed events (response.created, response.output_text.delta, ..., response.completed).
with client.responses.stream(model=model, input="Count to three.", max_output_tokens=16) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
        elif event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens ran out
            print("\n", event.response.status, event.response.usage)

# Stored responses can be read back and forgotten.
print(client.responses.retrieve(first.id).status)
client.responses.delete(first.id)
