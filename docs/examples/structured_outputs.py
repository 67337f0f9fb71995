# Server: moeserve launch
import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="EMPTY")
model = client.models.list().data[0].id

schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Give the largest city of France as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    max_tokens=200,
)
answer = json.loads(reply.choices[0].message.content)  # the grammar admits only text that matches the schema
print(answer)

# vLLM's guided fields: a choice, a regular expression.
choice = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Is the sky blue?"}],
    max_tokens=4,
    extra_body={"guided_choice": ["yes", "no"]},
)
print(choice.choices[0].message.content)
date = client.completions.create(
    model=model, prompt="A date: ", max_tokens=16, extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"}
)
print(date.choices[0].text)
