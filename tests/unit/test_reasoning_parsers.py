"""Reasoning parsers on model-like text: whole, and streamed in every chunking, the pieces joining
up to the whole response's reasoning and answer."""

from __future__ import annotations

import random

import pytest

from moeserve.api.reasoning_parsers import REASONING_PARSERS, ReasoningStream

R1_PROMPT_END = "<｜User｜>2+2?<｜Assistant｜><think>\n"
QWEN3_PROMPT_END = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING_END = QWEN3_PROMPT_END + "<think>\n\n</think>\n\n"
GLM_PROMPT_END = "[gMASK]<sop><|user|>\n2+2?<|assistant|>"
GLM_NO_THINKING_END = GLM_PROMPT_END + "<think></think>"

CASES = [
    # (parser, prompt's end, output, reasoning, answer)
    ("deepseek_r1", R1_PROMPT_END, "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n", "\n\nIt is 4."),
    ("deepseek_r1", R1_PROMPT_END, "<think>Old templates.</think>4", "Old templates.", "4"),
    ("deepseek_r1", R1_PROMPT_END, "Cut off while think", "Cut off while think", ""),
    ("qwen3", QWEN3_PROMPT_END, "<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "\n\nIt is 4."),
    ("qwen3", QWEN3_NO_THINKING_END, "It is 4 <think> literally.", "", "It is 4 <think> literally."),
    ("qwen3", QWEN3_PROMPT_END + "<think>\n", "Opened by the template.</think>4", "Opened by the template.", "4"),
    ("qwen3", QWEN3_PROMPT_END, "<think>Cut off", "Cut off", ""),
    ("glm45", GLM_PROMPT_END, "\n<think>Two and two.</think>\nIt is 4.", "Two and two.", "\nIt is 4."),
    ("glm45", GLM_NO_THINKING_END, "\nIt is 4.", "", "\nIt is 4."),
]


@pytest.mark.parametrize(("name", "prompt_end", "output", "reasoning", "answer"), CASES)
def test_split_whole_and_streamed(name: str, prompt_end: str, output: str, reasoning: str, answer: str) -> None:
    parser = REASONING_PARSERS[name]()
    in_reasoning = parser.opens_in(prompt_end)
    whole = parser.split(output, True, in_reasoning)
    assert (whole.reasoning, whole.content) == (reasoning, answer)
    rng = random.Random(0)
    for chunking in ([1] * len(output), *([rng.randint(1, 6) for _ in output] for _ in range(20))):
        stream = ReasoningStream(parser, in_reasoning)
        sent_reasoning, sent_answer, at = "", "", 0
        for size in chunking:
            if at >= len(output):
                break
            piece = output[at : at + size]
            at += size
            r, a = stream.update(piece, final=at >= len(output))
            assert not (r and sent_answer), "reasoning after the answer began"
            sent_reasoning, sent_answer = sent_reasoning + r, sent_answer + a
        assert (sent_reasoning, sent_answer) == (reasoning, answer), chunking


def test_a_marker_forming_is_held_back() -> None:
    parser = REASONING_PARSERS["qwen3"]()
    stream = ReasoningStream(parser, in_reasoning=False)
    assert stream.update("<thi", False) == ("", "")  # could still open the thinking
    assert stream.update("nk>abc</th", False) == ("abc", "")  # could still close it
    assert stream.update("ink>4", True) == ("", "4")


def test_only_r1_assumes_the_template_opened_the_thinking() -> None:
    assert REASONING_PARSERS["deepseek_r1"]().opens_in(QWEN3_PROMPT_END)
    assert not REASONING_PARSERS["qwen3"]().opens_in(QWEN3_NO_THINKING_END)
    assert REASONING_PARSERS["qwen3"]().opens_in(QWEN3_PROMPT_END + "<think>\n")
    assert not REASONING_PARSERS["glm45"]().opens_in(GLM_NO_THINKING_END)
