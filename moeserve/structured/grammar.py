"""From a request's `StructuredOutputs` to an xgrammar `Grammar`, and the check behind a 400.

xgrammar (the grammar engine vLLM and SGLang default to) parses a JSON schema, a regex or EBNF
into one grammar form without the tokenizer; the tokenizer only enters when the grammar is
compiled (`manager.py`, in the engine core). So a bad spec is found here, in whichever process
validates the request, cheaply and before anything is queued.

JSON is generated compact (`any_whitespace=False`): a grammar that allows any whitespace lets a
weak or random model pad its output with whitespace until it runs out of tokens, which is the
reason vLLM offers `disable_any_whitespace`. Schemas are strict (no properties beyond the
schema's unless it says `additionalProperties`), as OpenAI's `strict: true` is.

xgrammar 0.2.8 writes a string with `minLength`/`maxLength` as that many characters other than
quote, backslash and newline, so control characters (invalid JSON unescaped) get through; such a
string is given to it as a pattern instead, of printable characters other than quote and
backslash (`bounded_strings`): always valid JSON of the right length, if narrower than the schema.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import xgrammar as xgr

from moeserve.sampling_params import StructuredOutputs

_CHECKED_LIMIT = 1024  # distinct specs whose check result is remembered
_ANY_OBJECT = json.dumps({"type": "object"})
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def build_grammar(spec: StructuredOutputs) -> xgr.Grammar:
    """The grammar of `spec` (after the thinking, for a reasoning model); ValueError naming the
    problem when it does not parse."""
    answer = _answer_grammar(spec)
    return answer if not spec.reasoning_end else after_reasoning(answer, spec.reasoning_start, spec.reasoning_end)


def _answer_grammar(spec: StructuredOutputs) -> xgr.Grammar:
    try:
        if spec.kind == "json":
            schema = json.dumps(bounded_strings(_schema(spec.spec)))
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.spec)))
        return xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid {_NAMES[spec.kind]}: {_clean(str(exc))}") from None


def after_reasoning(answer: xgr.Grammar, start: str, end: str) -> xgr.Grammar:
    """Thinking, then `answer`: any text without `end`, then `end`, then the answer. With
    `start`, the model opens the thinking itself: the output is the answer, or `start` and the
    above. The constraint holds on the answer only, and the text splits there as the reasoning
    parser splits it (at the first `end`)."""
    thinking = xgr.Grammar.concat(xgr.Grammar.from_ebnf(until_marker_ebnf(end)), answer)
    if not start:
        return thinking
    return xgr.Grammar.union(answer, xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {_literal(start)}"), thinking))


def until_marker_ebnf(marker: str) -> str:
    """EBNF of any text that holds `marker` only at its end. Rule `s{i}` reads on after `i`
    characters of the marker matched (the KMP automaton: on a mismatch, the longest end of what
    was read that begins the marker is kept), so nothing is excluded but the marker itself."""
    chars = sorted(set(marker))
    others = "[^" + "".join(_class_char(c) for c in chars) + "]"
    rules = []
    for i in range(len(marker)):
        options = [f"{others} s0"]
        for c in chars:
            j = _next_state(marker, i, c)
            options.append(_literal(c) if j == len(marker) else f"{_literal(c)} s{j}")
        rules.append(f"s{i} ::= " + " | ".join(options))
    return "root ::= s0\n" + "\n".join(rules)


def _next_state(marker: str, matched: int, c: str) -> int:
    """Characters of `marker` matched after `c` follows its first `matched` ones."""
    text = marker[:matched] + c
    for size in range(min(len(text), len(marker)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "EBNF grammar",
}


def _schema(text: str) -> dict:
    """The schema re-serialised, after checking it is a JSON object: xgrammar's own message for
    invalid JSON quotes the whole input, and a schema that is a bare string or list is a client
    mistake worth naming as such."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a schema is a JSON object, got {type(schema).__name__}")
    return schema


_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # keys whose values are data, not schemas


def bounded_strings(node: object) -> object:
    """The schema with every length-bounded string (no pattern or format of its own) turned into
    a pattern of that many printable characters other than quote and backslash."""
    if isinstance(node, list):
        return [bounded_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _NOT_SCHEMAS else bounded_strings(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{high}}}$'
    return out


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b" | ...`: JSON's string escapes are also the EBNF literal's."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(message: str) -> str:
    """xgrammar's C++ message without its log prefix (time, source file and line)."""
    return _LOG_PREFIX.sub("", message.strip()).strip()


class _CheckCache:
    """Bounded memory of which specs parse, so a schema sent again is not parsed again."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._results: OrderedDict[StructuredOutputs, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutputs) -> None:
        with self._lock:
            known = spec in self._results
            error = self._results.get(spec)
            if known:
                self._results.move_to_end(spec)
        if not known:
            try:
                build_grammar(spec)
                error = None
            except ValueError as exc:
                error = str(exc)
            with self._lock:
                self._results[spec] = error
                while len(self._results) > self._limit:
                    self._results.popitem(last=False)
        if error is not None:
            raise ValueError(error)


_checks = _CheckCache(_CHECKED_LIMIT)


def check_structured_outputs(spec: StructuredOutputs | None) -> None:
    """Raise ValueError (a 400 at the API) if `spec` does not parse; remembered per spec."""
    if spec is not None:
        _checks.check(spec)
