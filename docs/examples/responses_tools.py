# Server: moeserve launch
import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("MOESERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="EMPTY")
model = client.models.list().data[0].id

tools = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    }
]
asked = client.responses.create(
    model=model,
    input="What is the weather in Paris?",
    tools=tools,
    tool_choice={"type": "function", "name": "get_weather"},
    max_output_tokens=200,
)
call = next(item for item in asked.output if item.type == "function_call")
print(call.name, json.loads(call.arguments))

# The tool's result goes back as a function_call_output item, chained to the call.
answered = client.responses.create(
    model=model,
    previous_response_id=asked.id,
    input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'}],
    max_output_tokens=16,
)
print(answered.output_text)

# A JSON schema for the answer, through the same structured-output path as chat's response_format.
schema = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 12}},
    "required": ["colour"],
    "additionalProperties": False,
}
shaped = client.responses.create(
    model=model,
    input="Name a colour as JSON.",
    text={"format": {"type": "json_schema", "name": "colour", "schema": schema}},
    max_output_tokens=200,
)
print(json.loads(shaped.output_text))
