"""Separating a reasoning model's thinking from its answer, whole or as it streams.

Reasoning models write `<think>...</think>` before the answer; `--reasoning-parser` names the
family, and the response carries the thinking as `reasoning_content` beside `content`, as vLLM
returns it. Templates differ in who writes the opening `<think>`: DeepSeek-R1's template ends the
prompt with it, so the output starts inside the thinking and only closes it; Qwen3's and
GLM-4.5's let the model open it, or (with `enable_thinking` false, passed through the request's
`chat_template_kwargs`) write an empty `<think></think>` into the prompt, so the output is all
answer. Newer templates of the latter two open the thinking in the prompt too, so whether a
sample starts inside it is read from the prompt's end (`ReasoningParser.opens_in`), whatever the
template's version.

A parser returns a `Split` of the text so far: the reasoning and the answer, each held back where
a marker could still be forming, so a stream sends what a split adds to the previous one and its
pieces join up to the whole response's, as tool calls do (`tool_parsers`). The answer then goes
on to the tool call reader, if any.

Structured outputs (response_format, guided_*, a forced tool_choice) constrain the answer: the
grammar lets the output think first, up to the first end marker, as `split` reads it
(`structured.grammar.after_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.api.tool_parsers import partial_suffix


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


class ReasoningParser:
    """`<think>` reasoning `</think>` answer; a family's parser says how its templates begin it."""

    name: str
    start_marker = "<think>"
    end_marker = "</think>"

    def opens_in(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with `prompt_tail` leaves the thinking open for the output."""
        return prompt_tail.rfind(self.start_marker) > prompt_tail.rfind(self.end_marker)

    def split(self, text: str, final: bool, in_reasoning: bool) -> Split:
        """Reasoning and answer of `text`; `in_reasoning`: the prompt opened the thinking.
        Text that opens no thinking is all answer; thinking never closed is all reasoning."""
        body = text.lstrip()
        if body.startswith(self.start_marker):
            in_reasoning, text = True, body[len(self.start_marker) :]
        elif not final and self.start_marker.startswith(body):
            return Split("", "")  # nothing yet, or the opening marker still forming
        if not in_reasoning:
            return Split("", text)
        end = text.find(self.end_marker)
        if end < 0:
            held = 0 if final else partial_suffix(text, self.end_marker)
            return Split(text[: len(text) - held], "")
        return Split(text[:end], text[end + len(self.end_marker) :])


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens the thinking (older ones let the model write `<think>`),
    so an output without `</think>` is all reasoning, as vLLM reads it."""

    name = "deepseek_r1"

    def opens_in(self, prompt_tail: str) -> bool:
        return True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens the thinking unless `enable_thinking` is false (then the prompt
    holds an empty block); the 2507 thinking models' template opens it in the prompt."""

    name = "qwen3"


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5: as Qwen3, with the answer after `</think>` usually on a new line, which is kept."""

    name = "glm45"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, Glm45ReasoningParser)
}
"""`--reasoning-parser` names."""


@dataclass
class ReasoningStream:
    """What of one sample's reasoning and answer has been streamed."""

    parser: ReasoningParser
    in_reasoning: bool
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def update(self, new_text: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, answer delta) after `new_text` joined the sample."""
        self.text += new_text
        split = self.parser.split(self.text, final, self.in_reasoning)
        reasoning = split.reasoning[self.reasoning_sent :]
        content = split.content[self.content_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(split.reasoning))
        self.content_sent = max(self.content_sent, len(split.content))
        return reasoning, content
