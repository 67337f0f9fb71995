# Server: moeserve launch --tool-call-parser hermes
import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="EMPTY")
model = client.models.list().data[0].id

tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }
]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

# A named function: the output is constrained to a call of it, whatever the model.
forced = client.chat.completions.create(
    model=model,
    messages=messages,
    tools=tools,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    max_tokens=200,
)
call = forced.choices[0].message.tool_calls[0]
print(call.function.name, json.loads(call.function.arguments))

# The tool's answer goes back as a "tool" message; the model continues from it.
messages += [
    forced.choices[0].message.model_dump(exclude_none=True),
    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'},
]
print(client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=24).choices[0].message)

# "auto": the model chooses; --tool-call-parser reads its calls from its text.
auto = client.chat.completions.create(model=model, messages=messages[:1], tools=tools, max_tokens=32)
print(auto.choices[0].finish_reason, auto.choices[0].message.tool_calls or auto.choices[0].message.content)
