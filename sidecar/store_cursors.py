"""Per-key cursors of the Firestore store: coalescing and recovery rules. Pure: no I/O.

Invariants:

- ``CursorBook`` holds only what is durable: a change enters it after the Commit that made the
  tombstones behind it durable succeeded (``propose`` returns copies; ``accept`` applies them).
  A cursor document therefore never runs ahead of the acks it reflects.
- A key's cursor document is written at most once per ``interval_ms`` (Firestore sustains about
  one write per second per document); changes in between leave the key ``dirty`` with the time of
  its oldest unwritten change, and a later Commit (an ack batch or the background flush) writes it.
- ``clean_through_ms`` is the time before which every durable change is in a cursor document.
  Recovery reads tombstones finished at or after the checkpointed value (minus a margin) and
  takes the maximum of their cursors, so a lagging cursor document loses nothing.
- Cursors never move back: every merge takes the maximum.
- Dead letters: the highest dead-lettered position of a key is kept (``dead_letter``). At
  recovery, in sequence mode a dead letter exactly at ``next_sequence`` blocks the key under
  ``on_dead_letter: block`` and is stepped over under ``skip``; in watermark mode a dead letter
  beyond ``last_position`` does the same. A dead letter behind the cursor (late, or a skipped
  sequence that showed up) changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.engine.types import AckIntent, DeadLetterPolicy, KeyCursor, Message, Mode

Position = tuple[int, str]


@dataclass(slots=True)
class KeyState:
    key: str
    next_sequence: int | None = None
    last_position: Position | None = None
    dead_letter: int | Position | None = None
    written_ms: int | None = None
    """When this process last wrote the key's cursor document (None: not since start)."""
    dirty_since_ms: int | None = None
    """Oldest durable change not yet in the cursor document (None: the document is current)."""


def _max_cursor(current: Any, new: Any) -> Any:
    return new if current is None or (new is not None and new > current) else current


class CursorBook:
    """The durable per-key cursors of one subscription, and which of them still need writing."""

    def __init__(self, interval_ms: int) -> None:
        self.interval_ms = interval_ms
        self.states: dict[str, KeyState] = {}
        self._dirty: set[str] = set()

    def _copy(self, key: str, proposed: dict[str, KeyState]) -> KeyState:
        state = proposed.get(key)
        if state is None:
            current = self.states.get(key)
            state = dataclasses.replace(current) if current is not None else KeyState(key)
            proposed[key] = state
        return state

    def propose(self, acks: Sequence[AckIntent], dead_letters: Sequence[Message], now_ms: int) -> dict[str, KeyState]:
        """Copies of the affected keys' states with ``acks`` and ``dead_letters`` applied."""
        proposed: dict[str, KeyState] = {}
        for ack in acks:
            cursor = ack.cursor
            if cursor is None:
                continue  # none mode keeps no cursor
            state = self._copy(ack.message.key, proposed)
            if isinstance(cursor, int):
                state.next_sequence = _max_cursor(state.next_sequence, cursor)
            else:
                state.last_position = _max_cursor(state.last_position, (int(cursor[0]), str(cursor[1])))
            state.dirty_since_ms = now_ms if state.dirty_since_ms is None else state.dirty_since_ms
        for message in dead_letters:
            position = dead_letter_position(message)
            if position is None:
                continue
            state = self._copy(message.key, proposed)
            state.dead_letter = _max_cursor(state.dead_letter, position)
            state.dirty_since_ms = now_ms if state.dirty_since_ms is None else state.dirty_since_ms
        return proposed

    def due(self, now_ms: int, proposed: dict[str, KeyState], limit: int) -> list[KeyState]:
        """Dirty states (proposed first, then the book's) whose document may be written now."""
        candidates = dict(proposed)
        for key in self._dirty:
            candidates.setdefault(key, self.states[key])
        due = [
            state
            for state in candidates.values()
            if state.dirty_since_ms is not None
            and (state.written_ms is None or now_ms - state.written_ms >= self.interval_ms)
        ]
        return due[:limit]

    def accept(self, proposed: dict[str, KeyState], written: Iterable[KeyState], now_ms: int) -> None:
        """After a successful Commit: keep ``proposed``, and mark ``written`` documents current."""
        self.states.update(proposed)
        self._dirty.update(key for key, state in proposed.items() if state.dirty_since_ms is not None)
        for state in written:
            kept = self.states.setdefault(state.key, state)
            kept.written_ms = now_ms
            kept.dirty_since_ms = None
            self._dirty.discard(state.key)

    def restore(self, states: dict[str, KeyState], dirty_since_ms: int) -> None:
        """Replace the book with recovered states; keys whose document lagged are dirty."""
        self.states = states
        self._dirty = {key for key, state in states.items() if state.dirty_since_ms is not None}
        for key in self._dirty:
            states[key].dirty_since_ms = dirty_since_ms

    def dirty_states(self, proposed: dict[str, KeyState]) -> list[KeyState]:
        """Every state with an unwritten change, ``proposed`` taking precedence over the book."""
        merged = {key: self.states[key] for key in self._dirty}
        merged.update(proposed)
        return [state for state in merged.values() if state.dirty_since_ms is not None]

    def clean_through_ms(self, now_ms: int) -> int:
        return min((self.states[key].dirty_since_ms or now_ms for key in self._dirty), default=now_ms)

    def has_dirty(self) -> bool:
        return bool(self._dirty)


def dead_letter_position(message: Message) -> int | Position | None:
    if message.sequence is not None:
        return message.sequence
    if message.timestamp_ms is not None:
        return (message.timestamp_ms, message.dedup_id)
    return None


def cursor_fields(state: KeyState) -> dict[str, Any]:
    """A cursor document's fields (without ``written_ms``/``expire_at``, which the writer adds)."""
    fields: dict[str, Any] = {"key": state.key}
    if state.next_sequence is not None:
        fields["next_seq"] = state.next_sequence
    if state.last_position is not None:
        fields["pos_ts"], fields["pos_id"] = state.last_position
    if isinstance(state.dead_letter, int):
        fields["dl_seq"] = state.dead_letter
    elif state.dead_letter is not None:
        fields["dl_ts"], fields["dl_id"] = state.dead_letter
    return fields


def state_from_cursor_doc(fields: dict[str, Any]) -> KeyState:
    state = KeyState(str(fields["key"]))
    if fields.get("next_seq") is not None:
        state.next_sequence = int(fields["next_seq"])
    if fields.get("pos_ts") is not None:
        state.last_position = (int(fields["pos_ts"]), str(fields.get("pos_id", "")))
    if fields.get("dl_seq") is not None:
        state.dead_letter = int(fields["dl_seq"])
    elif fields.get("dl_ts") is not None:
        state.dead_letter = (int(fields["dl_ts"]), str(fields.get("dl_id", "")))
    return state


def merge_tombstone(states: dict[str, KeyState], fields: dict[str, Any]) -> None:
    """Fold a tombstone finished after the checkpoint into the recovered states."""
    key = fields.get("key")
    if not isinstance(key, str):
        return
    state = states.get(key)
    if state is None:
        state = states[key] = KeyState(key)
    if fields.get("state") == "acked":
        if fields.get("cursor_seq") is not None:
            state.next_sequence = _max_cursor(state.next_sequence, int(fields["cursor_seq"]))
        if fields.get("cursor_ts") is not None:
            position = (int(fields["cursor_ts"]), str(fields.get("cursor_id", "")))
            state.last_position = _max_cursor(state.last_position, position)
    elif fields.get("state") == "dead_lettered":
        if fields.get("seq") is not None:
            state.dead_letter = _max_cursor(state.dead_letter, int(fields["seq"]))
        elif fields.get("ts") is not None:
            state.dead_letter = _max_cursor(state.dead_letter, (int(fields["ts"]), str(fields.get("dedup_id", ""))))


def step_dead_letter(state: KeyState, mode: Mode, policy: DeadLetterPolicy) -> bool:
    """Apply the key's dead letter at its cursor; True when the key is blocked on it."""
    if mode == "sequence":
        if state.dead_letter is None or state.next_sequence is None or state.dead_letter != state.next_sequence:
            return False
        if policy == "block":
            return True
        state.next_sequence += 1
        return False
    if mode == "watermark" and isinstance(state.dead_letter, tuple):
        if state.last_position is not None and state.dead_letter <= state.last_position:
            return False
        if policy == "block":
            return True
        state.last_position = state.dead_letter
    return False


def key_cursor(state: KeyState, mode: Mode, blocked: bool) -> KeyCursor | None:
    if mode == "sequence" and state.next_sequence is not None:
        return KeyCursor(key=state.key, next_sequence=state.next_sequence, blocked=blocked)
    if mode == "watermark" and (state.last_position is not None or blocked):
        return KeyCursor(key=state.key, last_position=state.last_position, blocked=blocked)
    return None
