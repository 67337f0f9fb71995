"""Stored responses of /v1/responses, for `GET`, `DELETE` and `previous_response_id`.

In this process's memory, bounded in bytes (`--responses-store-bytes`, the
`moeserve:responses_store_bytes` gauge): a count would not bound it, since one response may
carry a whole 16 MiB conversation. The oldest response is dropped first, so a chain older than
what the budget holds cannot be continued (the 404 says so), and nothing survives a restart. A
client that needs more sends the whole conversation as `input` instead.

A chain stores its history once: each response keeps only the messages it added (its input after
its predecessor's conversation, and its output) and a link to its predecessor's, which later
responses share. A link is counted in the size while any stored response's chain passes through
it, so a link outlives its own response's eviction only as long as a later response needs it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

EVICTED_IDS_KEPT = 10_000
"""Ids of evicted responses remembered (about a megabyte), so that a request naming one hears
it was evicted rather than that it never existed."""


@dataclass(eq=False)
class _Link:
    """The messages one response added to its chain's conversation."""

    messages: list[dict[str, Any]]
    previous: _Link | None
    size: int
    refs: int = 0
    """Stored responses ending here plus links continuing from here: counted in the size while > 0."""


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object as sent."""
    link: _Link = field(repr=False)
    size: int

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation through this response's output, as chat messages: what a response that
        names this one as `previous_response_id` continues (its instructions are not carried over)."""
        links = []
        link: _Link | None = self.link
        while link is not None:
            links.append(link)
            link = link.previous
        return [message for link in reversed(links) for message in link.messages]


def _bytes(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")))


class ResponseStore:
    """Responses by id, their bodies and conversations at most `limit` bytes as JSON (0: none are
    stored)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(
        self, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]], previous: StoredResponse | None
    ) -> None:
        """Store a response whose conversation is `previous`'s (None: it starts one) followed by
        `messages`; then drop the oldest responses until the store is within its limit (this one
        too, if it alone is over it)."""
        if self.limit <= 0:
            return
        link = _Link(messages, None if previous is None else previous.link, _bytes(messages))
        stored = StoredResponse(body, link, _bytes(body))
        self._retain(link)
        self.size += stored.size
        self._items[response_id] = stored
        while self.size > self.limit:
            evicted_id, evicted = self._items.popitem(last=False)
            self._drop(evicted)
            self._evicted[evicted_id] = None
            if len(self._evicted) > EVICTED_IDS_KEPT:
                self._evicted.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self._drop(stored)
        return True

    def missing(self, response_id: str, what: str = "Response") -> str:
        """Why `response_id` is not stored, for a 404: evicted (and why), or not found."""
        if response_id in self._evicted:
            return (
                f"{what} with id '{response_id}' was evicted: stored responses are kept within "
                f"{self.limit} bytes (--responses-store-bytes), the oldest dropped first. "
                "Send the whole conversation as `input` instead."
            )
        return f"{what} with id '{response_id}' not found."

    def _drop(self, stored: StoredResponse) -> None:
        self.size -= stored.size
        self._release(stored.link)

    def _retain(self, link: _Link | None) -> None:
        """One more holder of `link`; a link that had none is counted again, with its predecessors."""
        while link is not None:
            link.refs += 1
            if link.refs > 1:
                return
            self.size += link.size
            link = link.previous

    def _release(self, link: _Link | None) -> None:
        """One holder fewer; a link with none left is no longer counted, nor held by it."""
        while link is not None:
            link.refs -= 1
            if link.refs > 0:
                return
            self.size -= link.size
            link = link.previous
