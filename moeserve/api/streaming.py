"""Turning cumulative engine outputs into stream deltas.

The engine reports each sample's whole text so far; a stream sends only what is new. While a
sample runs, the last `longest stop string - 1` characters are held back: they may be the start
of a stop string that the engine will cut from the text, and sent text can not be taken back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moeserve.api.errors import error_body
from moeserve.engine.outputs import CompletionOutput, Logprob
from moeserve.sampling_params import SamplingParams

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer a stream


@dataclass(slots=True)
class Delta:
    """What is new in one sample since the previous chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    text_offset: int
    """Characters of this sample sent before `text` (for completion logprobs' text_offset)."""


class SampleCursor:
    """How much of one sample has been sent."""

    def __init__(self, params: SamplingParams) -> None:
        longest = max((len(s) for s in params.stop), default=0)
        self._holdback = 0 if params.include_stop_str_in_output else max(longest - 1, 0)
        self.chars_sent = 0
        self.tokens_sent = 0
        self.finished = False

    def advance(self, sample: CompletionOutput) -> Delta | None:
        """The unsent part of `sample`, or None when there is nothing worth a chunk yet."""
        if self.finished:
            return None
        finishing = sample.finish_reason is not None
        visible = len(sample.text) if finishing else max(len(sample.text) - self._holdback, self.chars_sent)
        text = sample.text[self.chars_sent : visible]
        if not text and not finishing:
            return None  # tokens that decode to nothing yet (a partial character): send them with the next text
        token_ids = sample.token_ids[self.tokens_sent :]
        logprobs = None if sample.logprobs is None else sample.logprobs[self.tokens_sent :]
        delta = Delta(text, token_ids, logprobs, sample.finish_reason, self.chars_sent)
        self.chars_sent = visible
        self.tokens_sent = len(sample.token_ids)
        self.finished = finishing
        return delta


def sse_error(message: str) -> str:
    """An error event for a stream whose 200 status is already sent, as vLLM sends it."""
    return f"data: {json.dumps(error_body(message, 'internal_error', code=500))}\n\n"
