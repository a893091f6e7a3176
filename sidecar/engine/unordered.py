"""none mode: no ordering, deduplication only.

Rules (DESIGN §4):

- A message is ready on arrival; there is no per-key order, no per-key in-flight limit and no key
  affinity (any stream may take any message), and ``on_dead_letter`` has nothing to block.
- A second copy with the same dedup id is dropped while the first is held, and for
  ``dedup_ttl_ms`` after the first was stored (bounded memory, ``dedup.py``).
- A replay (``Message.replay_id``) is deduplicated by its replay id and delivered like any other
  message: with no order there is nothing for it to be behind.
- A nack backs off that message alone; the rest keeps flowing.

Messages wait in one FIFO queue: take is O(1) per message.
"""

from __future__ import annotations

from collections import deque

from sidecar.engine.dedup import DedupMemory, dedup_key
from sidecar.engine.state import Entry
from sidecar.engine.types import Action, DropDuplicate, Message


class UnorderedPolicy:
    __slots__ = ("by_id", "memory", "ready")

    def __init__(self, memory: DedupMemory) -> None:
        self.memory = memory
        self.by_id: dict[object, Entry] = {}
        self.ready: deque[Entry] = deque()

    def arrive(self, message: Message, n: int, now_ms: int) -> tuple[Action | None, Entry | None]:
        dedup_id = dedup_key(message)
        if dedup_id in self.by_id:
            return DropDuplicate(message, "duplicate of a message the engine holds"), None
        if self.memory.contains(dedup_id, now_ms):
            return DropDuplicate(message, "duplicate within the dedup TTL", finish_record=True), None
        entry = Entry(message, None, None, n)
        self.by_id[dedup_id] = entry
        self.memory.remember(dedup_id, message.stored_at_ms)
        self.ready.append(entry)
        return None, entry

    def forget(self, entry: Entry) -> None:
        del self.by_id[dedup_key(entry.message)]

    def find(self, message: Message) -> Entry | None:
        return self.by_id.get(dedup_key(message))
