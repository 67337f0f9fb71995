"""Random JSON schemas for structured-output tests: nested objects, arrays, enums, bounded
numbers, required and optional fields.

Every leaf is bounded (strings by `maxLength`, arrays by `maxItems`, numbers by
`minimum`/`maximum`) and objects are small, so a random model forced through the schema finishes
within a known number of tokens (about 170 at most, keys spelt one character a token): an
unbounded string would let it write until `max_tokens` cut the JSON short.
"""

from __future__ import annotations

import random
from typing import Any

MAX_DEPTH = 2
MAX_PROPERTIES = 4  # at the top; nested objects have up to 2


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema; nested objects and arrays down to `MAX_DEPTH`."""
    names = rng.sample(["id", "name", "size", "kind", "tags", "score", "ok", "items", "meta", "note"], MAX_PROPERTIES)
    count = rng.randint(1, MAX_PROPERTIES if depth == 0 else 2)
    properties = {name: _value(rng, depth + 1) for name in names[:count]}
    required = [name for name in properties if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < MAX_DEPTH:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "x y", 'q"t'], rng.randint(1, 4))}
    if kind == "object":
        return random_schema(rng, depth)
    return {"type": "array", "items": _value(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 2)}
