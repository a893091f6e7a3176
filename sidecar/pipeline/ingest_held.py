"""Messages kept back, unstored, for their key's missing position (``Sorter._hold``), until a deadline.

``Held`` keeps them two ways: in the order they were held (so by deadline: ``expired`` takes from
the front) and by key (so that ``of_keys`` looks only at the keys a predecessor's pass names, not at
every held message). A message released before its deadline (the fast path took it) leaves its
entry in the deadline order, where it is skipped when met: removing it from the middle would cost a
scan. An entry keeps its item referenced until then, so ``id`` names one item for as long as it
stands there.

Rules: everything runs on the event loop; a leaf (it imports nothing of the pipeline), generic over
the item.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

Item = TypeVar("Item")


class Held(Generic[Item]):
    """Items waiting until a deadline, by deadline and by key."""

    def __init__(self, key: Callable[[Item], str]) -> None:
        self._key = key
        self._by_deadline: collections.deque[tuple[float, Item]] = collections.deque()
        self._by_key: dict[str, list[Item]] = {}
        self._live: set[int] = set()
        """``id`` of every item held and not released."""

    def __len__(self) -> int:
        return len(self._live)

    def hold(self, item: Item, until: float) -> None:
        """Keep ``item`` until ``until`` (``time.monotonic``); deadlines come in order."""
        self._by_deadline.append((until, item))
        self._by_key.setdefault(self._key(item), []).append(item)
        self._live.add(id(item))

    def next_deadline(self) -> float | None:
        """When the first held item's wait ends; None when none is held."""
        entries, live = self._by_deadline, self._live
        while entries and id(entries[0][1]) not in live:
            entries.popleft()
        return entries[0][0] if entries else None

    def expired(self, now: float) -> list[Item]:
        """Release and return the items whose wait ended by ``now``, in the order they were held."""
        entries, live = self._by_deadline, self._live
        ended: list[Item] = []
        while entries and entries[0][0] <= now:
            item = entries.popleft()[1]
            if id(item) in live:
                ended.append(item)
        self.release(ended)
        return ended

    def of_keys(self, keys: Iterable[str]) -> list[Item]:
        """The items held for ``keys``."""
        by_key = self._by_key
        return [item for key in keys for item in by_key.get(key, ())]

    def release(self, items: list[Item]) -> None:
        """``items``, all held, are held no longer."""
        if not items:
            return
        live, by_key = self._live, self._by_key
        live.difference_update(id(item) for item in items)
        for key in {self._key(item) for item in items}:
            still = [item for item in by_key.get(key, ()) if id(item) in live]
            if still:
                by_key[key] = still
            else:
                by_key.pop(key, None)

    def clear(self) -> None:
        self._by_deadline.clear()
        self._by_key.clear()
        self._live.clear()
