"""The structured-output cost bounds checked before any compile (`structured/limits.py`) and the
byte-bounded grammar cache (`structured/lru.py`)."""

from __future__ import annotations

import json

import pytest

from moeserve.engine_config import StructuredOutputsConfig
from moeserve.sampling_params import StructuredOutputs
from moeserve.structured.limits import LimitError, check_limits
from moeserve.structured.lru import ByteLRU

LIMITS = StructuredOutputsConfig(max_spec_bytes=4096, max_enum_values=10, max_depth=4)


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "spec, option",
    [
        (StructuredOutputs("json", json.dumps({"enum": [str(i) for i in range(11)]})), "max-enum-values"),
        (StructuredOutputs("json", json.dumps({"anyOf": [{"const": i} for i in range(11)]})), "max-enum-values"),
        (StructuredOutputs("choice", json.dumps([str(i) for i in range(11)])), "max-enum-values"),
        (StructuredOutputs("json", json.dumps(nested(5))), "max-depth"),
        (StructuredOutputs("json", "[" * 5000 + "]" * 5000), "max-spec"),
        (StructuredOutputs("regex", "((((((a))))))"), "max-depth"),
        (StructuredOutputs("grammar", "root ::= " + '"a" | ' * 1000 + '"b"'), "max-spec"),
    ],
    ids=["enum", "consts", "choices", "json-depth", "spec-bytes", "regex-depth", "grammar-bytes"],
)
def test_over_a_limit_is_refused_naming_its_option(spec: StructuredOutputs, option: str) -> None:
    with pytest.raises(LimitError, match=f"--structured-outputs-{option}"):
        check_limits(spec, LIMITS)


def test_nesting_past_the_parser_is_refused_not_passed_on() -> None:
    """Python's JSON parser recurses per level: a spec too deep for it is over any depth limit."""
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(LimitError, match="--structured-outputs-max-depth"):
        check_limits(StructuredOutputs("json", deep), StructuredOutputsConfig(max_spec_bytes=1 << 20))


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs("json", json.dumps({"type": "object", "properties": {"a": {"enum": [1]}}})),  # 4 deep
        StructuredOutputs("json", json.dumps({"enum": [str(i) for i in range(10)]})),
        StructuredOutputs("regex", r"\(\(\(\(\(a[(((]"),  # escaped and bracketed parentheses are no groups
        StructuredOutputs("json_object"),
        StructuredOutputs("json", "{not json"),  # left to the grammar check, which names the error
    ],
    ids=["depth-at-limit", "enum-at-limit", "escaped-parens", "json-object", "unparsable"],
)
def test_within_the_limits_passes(spec: StructuredOutputs) -> None:
    check_limits(spec, LIMITS)


def test_byte_lru_evicts_the_least_recent_and_never_grows_past_its_limit() -> None:
    cache = ByteLRU(limit=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # now the most recent
    cache.put("c", "C", 40)  # over 100: "b", the least recent, goes
    assert (cache.get("b"), cache.get("a"), cache.get("c"), cache.size) == (None, "A", "C", 80)
    cache.put("huge", "H", 101)  # alone over the limit: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache) == 2
    cache.put("a", "A2", 10)  # replacing a key counts its new size only
    assert cache.get("a") == "A2" and cache.size == 50
    for i in range(1000):  # a flood of distinct specs evicts but never grows it
        cache.put(i, i, 30)
        assert cache.size <= 100
