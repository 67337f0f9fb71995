"""An LRU bounded in bytes rather than entries: what a cache of grammars needs, whose sizes
range from kilobytes (a small schema) to tens of megabytes (a big enum), so that a flood of
distinct specs can evict but never grow it."""

from __future__ import annotations

from collections import OrderedDict


class ByteLRU:
    """Values by key, the least recently used dropped once their sizes sum past `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._items: OrderedDict[object, tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: object) -> object | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: object, value: object, size: int) -> None:
        """Keep `value`, unless it alone is over the limit (it would evict everything else)."""
        if key in self._items:
            self.size -= self._items.pop(key)[1]
        if size > self.limit:
            return
        self._items[key] = (value, size)
        self.size += size
        while self.size > self.limit:
            self.size -= self._items.popitem(last=False)[1][1]
