"""The cost bounds a constraint must meet before anything compiles it: a 400 naming the limit.

A grammar's compile time grows with its spec: the number of alternatives (enum values, choices),
how deep its structures nest, and its size overall. These are read from the spec's text alone,
in time linear in a text the size limit has already bounded, so checking them costs less than
parsing the request did. What passes may still compile slowly; the compile timeout is the last
bound (`compile_pool`).
"""

from __future__ import annotations

import json

from moeserve.engine_config import StructuredOutputsConfig
from moeserve.sampling_params import StructuredOutputs


class LimitError(ValueError):
    """A spec over a configured limit; the message names the limit and its option."""


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "EBNF grammar"}


def check_limits(spec: StructuredOutputs, limits: StructuredOutputsConfig) -> None:
    """Raise LimitError if `spec` is over a limit; an unparsable spec is left to the grammar check."""
    if spec.kind == "json_object":
        return
    name = _NAMES[spec.kind]
    size = len(spec.spec.encode())
    if size > limits.max_spec_bytes:
        raise LimitError(
            f"the {name} has {size} bytes; the limit is {limits.max_spec_bytes} (--structured-outputs-max-spec)"
        )
    if spec.kind == "regex":
        _check_depth(name, _regex_depth(spec.spec), limits)
    elif spec.kind in ("json", "choice"):
        try:
            value = json.loads(spec.spec)
        except json.JSONDecodeError:
            return
        except RecursionError:  # Python's parser recurses per level: deeper than any limit allows
            raise LimitError(
                f"the {name} nests deeper than the parser follows; the limit is {limits.max_depth} "
                "(--structured-outputs-max-depth)"
            ) from None
        depth, values = _json_shape(value)
        _check_depth(name, depth, limits)
        if spec.kind == "choice" and isinstance(value, list):
            values = len(value)
        if values > limits.max_enum_values:
            what = "choices" if spec.kind == "choice" else "enum and const values"
            raise LimitError(
                f"the {name} has {values} {what}; the limit is {limits.max_enum_values} "
                "(--structured-outputs-max-enum-values)"
            )


def _check_depth(name: str, depth: int, limits: StructuredOutputsConfig) -> None:
    if depth > limits.max_depth:
        raise LimitError(
            f"the {name} nests {depth} levels deep; the limit is {limits.max_depth} (--structured-outputs-max-depth)"
        )


def _json_shape(root: object) -> tuple[int, int]:
    """(nesting depth, enum and const values) of a parsed schema, without recursion: the depth is
    what is being bounded, so it must not be able to exhaust the stack."""
    depth, values = 0, 0
    stack: list[tuple[object, int]] = [(root, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            for key, child in node.items():
                if key == "enum" and isinstance(child, list):
                    values += len(child)
                elif key == "const":
                    values += 1
                stack.append((child, level + 1))
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in node)
    return depth, values


def _regex_depth(pattern: str) -> int:
    """How deep a regex's groups nest (escaped and bracketed parentheses are not groups)."""
    depth = deepest = 0
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest
