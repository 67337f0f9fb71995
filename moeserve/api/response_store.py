"""Stored responses of /v1/responses, for `GET`, `DELETE` and `previous_response_id`.

In this process's memory and bounded (`--responses-store-size`): the oldest is dropped first, so
a chain older than the last N stored responses cannot be continued, and nothing survives a
restart. A client that needs more sends the whole conversation as `input` instead.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object as sent."""
    messages: list[dict[str, Any]]
    """The conversation through this response's output, as chat messages: what a response that
    names this one as `previous_response_id` continues (its instructions are not carried over)."""


class ResponseStore:
    """Responses by id, at most `capacity` (0: none are stored)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
