"""A conversation with tools and an answered call, for the harmony tests (unit and server)."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Gets the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                    "days": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_location", "description": "Where the user is."}},
]
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true}'},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "And in Rome?"},
]
