"""Grammars: a bad spec is a ValueError naming the problem; each spec compiles once; the matcher
and the bitmask it fills agree with what the spec allows."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from xgrammar.testing import _is_grammar_accept_string

from moeserve.sampling_params import SamplingParams, StructuredOutputs
from moeserve.structured import GrammarCompiler, StructuredOutputManager, build_grammar, check_structured_outputs
from moeserve.structured import manager as manager_module

VOCAB = 320
EOS = 2


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputs("json", '{"type": "objec"}'), "JSON schema: Unsupported type"),
        (StructuredOutputs("json", "{not json"), "JSON schema: the schema is not valid JSON"),
        (StructuredOutputs("json", "[1, 2]"), "a schema is a JSON object"),
        (StructuredOutputs("regex", "(("), "regex: Regex parsing error at position 3"),
        (
            StructuredOutputs("grammar", "root ::= rule"),
            'EBNF grammar: EBNF parser error at line 1, column 10: Rule "rule"',
        ),
    ],
)
def test_bad_specs_raise_value_errors_that_name_the_problem(spec: StructuredOutputs, words: str) -> None:
    with pytest.raises(ValueError) as info:
        check_structured_outputs(spec)
    assert words in str(info.value)
    assert "/project/" not in str(info.value)  # xgrammar's C++ log prefix is cut
    with pytest.raises(ValueError, match="Unsupported type|not valid|JSON object|Regex|EBNF"):
        check_structured_outputs(spec)  # remembered, and still refused


def test_sampling_params_take_the_wire_form_and_refuse_unknown_kinds() -> None:
    params = SamplingParams(structured_outputs=["regex", "a+"])
    assert params.structured_outputs == StructuredOutputs("regex", "a+")
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutputs("yaml", "")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputs.choice([])


def _manager(tokenizer_dir: Path, loads: list[int]) -> StructuredOutputManager:
    def load():
        loads.append(1)
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))

    return StructuredOutputManager(GrammarCompiler(load, VOCAB, [EOS]))


def test_each_spec_compiles_once_and_the_tokenizer_loads_once(tokenizer_dir: Path, monkeypatch) -> None:
    built: list[StructuredOutputs] = []
    real = manager_module.build_grammar
    monkeypatch.setattr(manager_module, "build_grammar", lambda spec: built.append(spec) or real(spec))
    loads: list[int] = []
    compiler = _manager(tokenizer_dir, loads).compiler
    a = StructuredOutputs.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputs("regex", "[ab]{2}")
    first = compiler.compile(a)
    assert (
        compiler.compile(StructuredOutputs.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}}))
        is first
    )
    compiler.compile(b).result(timeout=30)
    first.result(timeout=30)
    assert built == [a, b] and loads == [1]
    compiler.shutdown()


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = ((bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:VOCAB]
    return set(bits.nonzero().flatten().tolist())


def test_bitmask_follows_the_choice_and_the_grammar_ends_on_eos(tokenizer_dir: Path) -> None:
    """Choices with characters the EBNF literal must escape; only their tokens are allowed, and
    once one is complete only EOS, which terminates the matcher."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    manager = _manager(tokenizer_dir, [])
    choices = ['say "hi"', "back\\slash", "é"]
    manager.start("r", manager.compiler.compile(StructuredOutputs.choice(choices)).result(timeout=30))
    manager.start("free", manager.compiler.compile(StructuredOutputs("json_object")).result(timeout=30))
    mask = manager.start_bitmask(["other", "r"]).get()  # an unconstrained id is left out
    assert mask is not None and mask.request_ids == ("r",)
    allowed = _allowed(mask.bitmask, 0)
    starts = {tokenizer.encode(c)[0] for c in choices}
    assert starts <= allowed
    whole = [tokenizer.decode([t]) for t in allowed if "\ufffd" not in tokenizer.decode([t])]  # not half a UTF-8 char
    assert whole and all(any(c.startswith(text) for c in choices) for text in whole)
    for token in tokenizer.encode(choices[0]):
        assert manager.accept({"r": [token]}, ["r"]) == ([], [])
    mask = manager.start_bitmask(["r"]).get()
    assert _allowed(mask.bitmask, 0) == {EOS}
    assert manager.accept({"r": [EOS]}, ["r"]) == (["r"], [])
    assert manager.accept({"free": tokenizer.encode("]")[:1]}, ["free"]) == ([], ["free"])  # not a JSON object
    manager.shutdown()


def test_drafts_get_a_mask_per_position_and_the_grammar_advances_over_accepted_tokens_only(
    tokenizer_dir: Path,
) -> None:
    """A sequence verifying drafts gets a row after each: the grammar walked over the drafts
    before it. A draft the grammar refuses repeats the row before (it fails there); the matcher
    is rolled back after the fill, and moves only when the step's tokens are accepted."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    manager = _manager(tokenizer_dir, [])
    compiled = manager.compiler.compile(StructuredOutputs.choice(["abcabc", "xyz"])).result(timeout=30)
    manager.start("r", compiled)
    manager.start("plain", compiled)
    a, b, c = (tokenizer.encode(ch)[0] for ch in "abc")
    assert tokenizer.decode([a, b, c]) == "abc"
    mask = manager.start_bitmask(["plain", "r"], {"r": [a, b, a, c]}).get()
    assert mask.request_ids == ("plain", "r") and mask.num_rows == (1, 5)
    first = _allowed(mask.bitmask, 0)
    assert a in first and b not in first and _allowed(mask.bitmask, 1) == first  # "r"'s row 0 as "plain"'s
    assert _allowed(mask.bitmask, 2) == {b} and _allowed(mask.bitmask, 3) == {c}  # after "a", after "ab"
    assert a not in _allowed(mask.bitmask, 3)  # the third draft is refused there...
    assert _allowed(mask.bitmask, 4) == _allowed(mask.bitmask, 5) == {c}  # ...and the rows after repeat it
    again = manager.start_bitmask(["r"]).get()  # rolled back: the grammar is where it was
    assert again.num_rows == () and _allowed(again.bitmask, 0) == first
    assert manager.accept({"r": [a, b]}, ["r"]) == ([], [])  # one kept draft and the sampled token
    assert _allowed(manager.start_bitmask(["r"]).get().bitmask, 0) == {c}
    manager.shutdown()


def test_the_bitmask_fills_beside_the_step(tokenizer_dir: Path, monkeypatch) -> None:
    """start_bitmask hands back at once while the fill runs on the filler thread (beside the
    forward); get() waits for it; nothing to fill is None, with no thread work at all."""
    manager = _manager(tokenizer_dir, [])
    manager.start("r", manager.compiler.compile(StructuredOutputs.choice(["ab"])).result(timeout=30))
    release, filled_on = threading.Event(), []
    fill = manager._fill

    def held_fill(request_ids, walks):
        filled_on.append(threading.current_thread().name)
        assert release.wait(30)
        return fill(request_ids, walks)

    monkeypatch.setattr(manager, "_fill", held_fill)
    assert manager.start_bitmask(["free"]) is None
    pending = manager.start_bitmask(["r"])  # returns although the fill cannot finish yet
    assert pending is not None and not release.is_set()
    release.set()
    assert pending.get().request_ids == ("r",) and filled_on[0].startswith("moeserve-bitmask")
    manager.shutdown()


def test_json_grammar_is_compact_and_strict() -> None:
    """No free whitespace (a random model could pad forever) and no properties beyond the schema."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    ebnf = str(build_grammar(StructuredOutputs("json", json.dumps(schema))))
    assert "[ \\n\\t]" not in ebnf and "basic_object_properties" not in ebnf.split("root ::=")[1]


def test_length_bounded_strings_stay_valid_json(tokenizer_dir: Path) -> None:
    """xgrammar 0.2.8 lets control characters into a maxLength string; ours keeps them out."""
    import xgrammar as xgr

    manager = _manager(tokenizer_dir, [])
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}},
        "required": ["s"],
    }
    compiled = manager.compiler.compile(StructuredOutputs.json_schema(schema)).result(timeout=30)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts('{"s": "abé"}')
    assert not any(accepts(t) for t in ['{"s": "\x07"}', '{"s": ""}', '{"s": "abcd"}', '{"s": "a"b"}'])
    manager.shutdown()


ANSWER = '{"a": 1}'


@pytest.mark.parametrize(
    ("start", "text", "accepted"),
    [
        # the prompt opened the thinking (DeepSeek-R1): think, close, answer
        ("", "hmm</think>" + ANSWER, True),
        ("", "<think>hm</t<</th<</think>" + ANSWER, True),  # near-markers and an old template's opening
        ("", ANSWER, False),  # no answer before the thinking ends
        ("", "x</think>y</think>" + ANSWER, False),  # the first </think> ends it, as the parser splits
        ("", "x</think>{}", False),  # the answer is constrained
        # the model may open the thinking itself (Qwen3, GLM-4.5): or answer at once
        ("<think>", ANSWER, True),
        ("<think>", "<think>hm</think>" + ANSWER, True),
        ("<think>", "hm</think>" + ANSWER, False),
    ],
)
def test_a_reasoning_model_is_constrained_after_its_thinking(start: str, text: str, accepted: bool) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    grammar = build_grammar(StructuredOutputs("json", schema, reasoning_start=start, reasoning_end="</think>"))
    assert _is_grammar_accept_string(grammar, text) is accepted


def test_reasoning_markers_cross_the_wire() -> None:
    spec = StructuredOutputs("regex", "a+", "<think>", "</think>")
    assert SamplingParams(structured_outputs=list(dataclasses.astuple(spec))).structured_outputs == spec
    with pytest.raises(ValueError, match="needs reasoning_end"):
        StructuredOutputs("regex", "a+", reasoning_start="<think>")
