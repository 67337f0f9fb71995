"""Incremental detokenization and stop-string matching for one output sequence.

Decoding the whole output every step costs O(n) per token; instead, decode only a short window
behind the newest token and emit the text once it no longer ends in an incomplete UTF-8
sequence (the prefix/read offset scheme of text-generation-inference and vLLM).

This runs once per token of every stream in the API process, so where the tokenizer allows it
the scheme runs inside the Rust tokenizer (`tokenizers.decoders.DecodeStream`, the same two
offsets and the same rule): one call per token instead of two decodes and the slicing around
them, about 5x cheaper. Where the Rust side refuses (a window whose text does not extend the
previous one, possible with unusual decoders) the sequence goes on in Python from the same
offsets, so the text is the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

INCOMPLETE = "\ufffd"  # what a byte-level BPE decodes a partial UTF-8 character to


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        # Call the Rust tokenizer directly when the wrapper would add nothing (no clean-up of
        # spaces): 5x cheaper per call, and the condition for the Rust incremental decoder.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._stream = None
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_ids = backend.decode
            if DecodeStream is not None:
                self._backend = backend
                self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        else:
            self._decode_ids = self.tokenizer.decode

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string if the text now contains one, else None.

        On a stop match the text is cut before the stop string (or after it, with
        include_stop_str_in_output), as the OpenAI API specifies.
        """
        self.token_ids.append(token_id)
        delta = self._step_in_rust(token_id) if self._stream is not None else self._step()
        if delta is None:
            return None  # wait for the rest of a multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += delta
        return self._check_stop(search_from) if self.stop else None

    def _step_in_rust(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - its refusal (an invalid prefix) is only a message: go on in Python
            self._stream = None
            return self._step()

    def _step(self) -> str | None:
        """The new text the latest token completes, decoded here: None while it is incomplete."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(INCOMPLETE):
            return None
        return new_text[len(prefix_text) :]

    def _check_stop(self, search_from: int) -> str | None:
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        self.text = self.text[: pos + len(stop)] if self.include_stop_str_in_output else self.text[:pos]
        return stop
