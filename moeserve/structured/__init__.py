"""Structured outputs: constraining generation to a JSON schema, regex, choice or EBNF grammar.

`check_structured_outputs` validates a request's constraint wherever requests are validated (a
bad one is a 400); `GrammarCompiler` and `StructuredOutputManager` live in the engine core,
compile grammars with the served tokenizer and keep each constrained sequence's matcher, whose
per-step token bitmask the sampler applies. xgrammar does the grammar work.
"""

from moeserve.structured.grammar import build_grammar, check_structured_outputs, choice_ebnf
from moeserve.structured.manager import GrammarCompiler, StructuredOutputManager

__all__ = [
    "GrammarCompiler",
    "StructuredOutputManager",
    "build_grammar",
    "check_structured_outputs",
    "choice_ebnf",
]
