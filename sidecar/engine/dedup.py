"""Bounded memory of dedup ids seen recently (none and watermark modes).

The engine remembers a dedup id for ``dedup_ttl_ms`` after the message was stored, so that a
Pub/Sub redelivery or publisher retry within that window is dropped even after the original was
acked. Memory is bounded: at most ``max_entries`` ids are kept (about 250 bytes each with the id
string), the oldest forgotten first. Firestore is the authority for the full TTL (a duplicate is a
failed create there); this memory only saves the store a round trip and protects the engine's own
G3 guarantee for what it has seen recently.

Expiry is checked on lookup, so an id is never trusted past its TTL even before it is pruned.
Pruning pops from the front of an arrival-ordered queue: O(1) amortised per id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from sidecar.engine.types import Message

PRUNE_SLACK_MS = 1_000
"""Prune at most about once a second: a timer per expiring id would wake the runtime per message."""


def dedup_key(message: Message) -> Hashable:
    """What makes two copies one message in watermark and none modes: the dedup id, or for a replay
    its replay id (a tuple, so that no dedup id can ever equal it): a replay is not a duplicate of
    its original, and two copies of one replay are duplicates of each other."""
    return ("replay", message.replay_id) if message.replay_id else message.dedup_id


def identity(message: Message) -> object:
    """What makes two stored copies one record: (key, sequence) in sequence mode, else the dedup id;
    a replay's replay id in every mode."""
    if message.replay_id:
        return dedup_key(message)
    if message.sequence is not None:
        return (message.key, message.sequence)
    return message.dedup_id


class DedupMemory:
    __slots__ = ("_expiry", "_max_entries", "_order", "_ttl_ms")

    def __init__(self, ttl_ms: int, max_entries: int) -> None:
        self._ttl_ms = ttl_ms
        self._max_entries = max_entries
        self._expiry: dict[Hashable, int] = {}
        self._order: deque[tuple[int, Hashable]] = deque()

    def __len__(self) -> int:
        return len(self._expiry)

    def contains(self, dedup_id: Hashable, now_ms: int) -> bool:
        expiry = self._expiry.get(dedup_id)
        return expiry is not None and expiry > now_ms

    def remember(self, dedup_id: Hashable, stored_at_ms: int) -> None:
        if self._max_entries <= 0:
            return
        expiry = stored_at_ms + self._ttl_ms
        previous = self._expiry.get(dedup_id)
        if previous is not None and previous >= expiry:
            return
        self._expiry[dedup_id] = expiry
        self._order.append((expiry, dedup_id))
        while len(self._expiry) > self._max_entries:
            self._drop_front()

    def next_prune_ms(self) -> int | None:
        return self._order[0][0] + PRUNE_SLACK_MS if self._order else None

    def prune(self, now_ms: int) -> None:
        order = self._order
        while order and order[0][0] <= now_ms:
            self._drop_front()

    def _drop_front(self) -> None:
        expiry, dedup_id = self._order.popleft()
        # A later remember() of the same id queued a newer expiry: only that one removes it.
        if self._expiry.get(dedup_id) == expiry:
            del self._expiry[dedup_id]
