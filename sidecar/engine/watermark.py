"""watermark mode: per key, release in ``(timestamp_ms, dedup_id)`` order what the watermark passed.

Rules (DESIGN §4):

- A message is releasable once ``timestamp_ms <= watermark``; per key strictly in position order.
  Before the first watermark nothing is released. The watermark never moves back (the engine
  ignores a lower one).
- A key's *released* position is the highest position ever handed out for it (after a restart: the
  acked cursor from the store). A message arriving at or behind it is *late*: ``on_late:
  dead_letter`` dead-letters it, ``deliver`` delivers it flagged ``late`` ahead of the key's backlog
  (it never moves the cursor back).
- Identity is the dedup id: a second copy while the first is held, or within ``dedup_ttl_ms`` after
  it finished (bounded memory, see ``dedup.py``), is a duplicate. A replay's identity is its replay
  id; its position stays its original's ``(timestamp_ms, dedup_id)``.
- A replay (``Message.replay_id``) at the position its key is blocked at resumes the key there
  (``resume_at``); one at or behind the key's released position is *behind*
  (``replay_place``), and ``arrival`` applies ``on_replay_behind``.

Every held message above the watermark sits once in one shared heap ordered by timestamp, so an
advance of the watermark pops exactly the messages it releases: O(log n) per message, no scan over
keys.
"""

from __future__ import annotations

import heapq

from sidecar.engine.dedup import DedupMemory, dedup_key
from sidecar.engine.state import Entry, KeyLedger
from sidecar.engine.types import Action, DeadLetter, DropDuplicate, EngineConfig, Hold, KeyCursor, Message

_FINISHING = frozenset({2, 4})  # ACKING, DONE


class WatermarkPolicy:
    __slots__ = ("_above", "_deliver_late", "by_id", "memory", "watermark_ms")

    def __init__(self, config: EngineConfig, memory: DedupMemory) -> None:
        self._deliver_late = config.on_late == "deliver"
        self.memory = memory
        self.by_id: dict[object, Entry] = {}
        self._above: list[tuple[int, int, Entry]] = []
        self.watermark_ms: int | None = None

    def new_key(self, key: KeyLedger) -> None:
        key.cursor = None

    def restore_cursor(self, key: KeyLedger, cursor: KeyCursor) -> None:
        if cursor.next_sequence is not None:
            raise ValueError(f"key {cursor.key!r}: a sequence cursor (next_sequence) in a watermark-mode snapshot")
        if cursor.last_position is not None:
            timestamp_ms, dedup_id = cursor.last_position
            key.cursor = key.released = (int(timestamp_ms), str(dedup_id))
        key.blocked = cursor.blocked
        position = cursor.blocked_position
        key.blocked_pos = (int(position[0]), str(position[1])) if cursor.blocked and position is not None else None  # type: ignore[index]

    def export_cursor(self, key: KeyLedger) -> KeyCursor | None:
        if key.cursor is None and not key.blocked:
            return None
        return KeyCursor(
            key=key.name,
            last_position=key.cursor,  # type: ignore[arg-type]
            blocked=key.blocked,
            blocked_position=key.blocked_pos if key.blocked else None,  # type: ignore[arg-type]
        )

    def position(self, message: Message) -> tuple[int, str]:
        timestamp_ms = message.timestamp_ms
        if type(timestamp_ms) is not int:
            raise ValueError(
                f"watermark mode: message {message.dedup_id!r} of key {message.key!r} has no integer "
                f"timestamp_ms ({timestamp_ms!r})"
            )
        return (timestamp_ms, message.dedup_id)

    def replay_place(self, key: KeyLedger, message: Message) -> str:
        """Where a replay that is not at its key's block falls: "behind" (at or behind the key's
        released position: something at or after it reached the app) or "ahead" (in order)."""
        released = key.released
        return "behind" if released is not None and self.position(message) <= released else "ahead"  # type: ignore[operator]

    def resume_at(
        self, key: KeyLedger, blocking: Entry | None, message: Message, n: int, now_ms: int
    ) -> tuple[Action | None, Entry | None]:
        """A replay of the dead letter the key was blocked at takes its place (the block is lifted):
        back into the key's order at that position (the blocking entry was forgotten when it blocked)."""
        return self.arrive(key, message, n, now_ms, resume=True)

    def add_flagged(self, key: KeyLedger, entry: Entry) -> None:
        """A replay delivered outside the key's order, ahead of its backlog (like a late message)."""
        self.by_id[dedup_key(entry.message)] = entry
        key.late.append(entry)
        key.n_held += 1
        key.n_ready += 1

    def arrive(
        self, key: KeyLedger, message: Message, n: int, now_ms: int, *, resume: bool = False
    ) -> tuple[Action | None, Entry | None]:
        """``resume``: a replay taking the place of the dead letter its key was blocked at, which
        was released already: it goes back into the key's order there, never late."""
        pos = self.position(message)
        timestamp_ms = pos[0]
        dedup_id = dedup_key(message)
        if dedup_id in self.by_id:
            return DropDuplicate(message, "duplicate of a message the engine holds"), None
        if self.memory.contains(dedup_id, now_ms):
            return DropDuplicate(message, "duplicate of a recently finished message", finish_record=True), None
        released: tuple[int, str] | None = key.released  # type: ignore[assignment]
        if released is not None and pos <= released and not resume:
            if pos == released:
                return DropDuplicate(message, "duplicate of the key's last released message"), None
            if not self._deliver_late:
                return DeadLetter(message, "late", 0), None
            entry = Entry(message, key, pos, n)
            entry.late = True
            self.by_id[dedup_id] = entry
            key.late.append(entry)
            key.n_held += 1
            key.n_ready += 1
            return None, entry
        entry = Entry(message, key, pos, n)
        self.by_id[dedup_id] = entry
        # The arrival number breaks ties: two replays of one message share a position.
        heapq.heappush(key.heap, (pos, n, entry))
        key.n_held += 1
        watermark_ms = self.watermark_ms
        if watermark_ms is not None and timestamp_ms <= watermark_ms:
            key.n_ready += 1
            if key.blocked:
                return Hold(message, "key blocked by a dead letter"), entry
            return None, entry
        heapq.heappush(self._above, (timestamp_ms, n, entry))
        return Hold(message, self.hold_reason()), entry

    def hold_reason(self) -> str:
        if self.watermark_ms is None:
            return "watermark not yet known"
        return f"watermark at {self.watermark_ms}"

    def advance(self, watermark_ms: int) -> list[KeyLedger]:
        """Set a higher watermark; returns the keys that got releasable messages."""
        self.watermark_ms = watermark_ms
        above = self._above
        touched: dict[int, KeyLedger] = {}
        while above and above[0][0] <= watermark_ms:
            entry = heapq.heappop(above)[2]
            key = entry.key
            key.n_ready += 1  # type: ignore[union-attr]
            touched[id(key)] = key  # type: ignore[assignment]
        return list(touched.values())

    def pop_head(self, key: KeyLedger) -> Entry:
        """The next releasable entry (precondition: ``key.n_ready > 0``); raises before it changes
        anything if the books were wrong."""
        if key.late:
            popped: Entry = key.late.popleft()
        else:
            pos, _n, popped = heapq.heappop(key.heap)
            if key.released is None or pos > key.released:
                key.released = pos
        key.n_held -= 1
        key.n_ready -= 1
        return popped

    def give_back(self, key: KeyLedger, entries: list[Entry]) -> None:
        # Delivered entries were below the watermark, which never moves back: releasable again.
        for entry in entries:
            key.n_held += 1
            key.n_ready += 1
            if entry.late:
                key.late.appendleft(entry)
            else:
                heapq.heappush(key.heap, (entry.pos, entry.n, entry))

    def retire(self, key: KeyLedger, entry: Entry) -> None:
        pos = entry.pos
        if key.cursor is None or pos > key.cursor:  # type: ignore[operator]
            key.cursor = pos
        self.forget(key, entry)

    def forget(self, key: KeyLedger, entry: Entry) -> None:
        message = entry.message
        # pop: an entry that blocked its key was forgotten then and is retired after an unblock.
        identity = dedup_key(message)
        self.by_id.pop(identity, None)
        self.memory.remember(identity, message.stored_at_ms)

    def on_blocked(self, key: KeyLedger, entry: Entry) -> None:
        self.forget(key, entry)

    def pass_restored_block(self, key: KeyLedger, position: object) -> Entry | None:
        """Unblock a key restored blocked: the next ack's cursor moves past the dead letter. A copy of
        it stored again after its tombstone expired is not looked for here (it is delivered)."""
        return None

    def held_below(self, key: KeyLedger, pos: object) -> bool:
        """A message given back by a nack waits before ``pos``: the cursor must not pass it."""
        heap = key.heap
        return bool(heap) and heap[0][0] < pos

    def cursor_if_acked(self, key: KeyLedger, entry: Entry) -> tuple[int, str] | None:
        cursor = key.cursor
        if not entry.late:
            for handed in key.out:
                if self.held_below(key, handed.pos):
                    break
                if handed is entry or handed.state in _FINISHING:
                    if cursor is None or handed.pos > cursor:  # type: ignore[operator]
                        cursor = handed.pos
                else:
                    break
        return cursor  # type: ignore[return-value]

    def find(self, message: Message) -> Entry | None:
        return self.by_id.get(dedup_key(message))

    def head_timestamp_ms(self, key: KeyLedger) -> int | None:
        return key.heap[0][0][0] if key.heap else None
