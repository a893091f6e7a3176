"""Per-key cursors of the store: what is durable per key, and how it folds. Pure.

A key's durable state (``CursorState``) is a fold over the finishes the store made durable, in the
order their Commits succeeded: acks (with the engine's cursor for them, ``AckIntent.cursor``) and
dead letters in the key's order. ``fold_ack`` and ``fold_dead_letter`` are that fold; the book
applies them after each Commit, and recovery (``sidecar.store.recovery``) applies the very same
functions to the cursor documents and the tombstones it reads back, so the book before a crash and
the state rebuilt after it cannot disagree.

Invariants:

- **Nothing runs ahead of durability.** A change enters the book only after the Commit holding
  the tombstones behind it succeeded (the book's ``propose`` returns copies; its ``accept`` keeps them). The
  writer puts all of one key's tombstones of an ack batch in one Commit, so a cursor never becomes
  durable past a message whose tombstone is in a later Commit (a crash between two Commits of one
  batch leaves the cursor behind, never ahead).
- **Sequence mode keeps the finished sequences above the cursor** (``done_above``): an app with
  ``max_in_flight_per_key`` > 1 may ack N+1 before N, and a dead letter under ``skip`` may finish
  N+1 while N is in flight. The cursor then walks over them as soon as N finishes, before and
  after a restart alike. The set is bounded by the key's in-flight window.
- **Dead letters in the key's order**: under ``skip`` they finish their position like an ack;
  under ``block`` they record ``blocked_at``. Late messages are dead-lettered *aside*
  (``layout.DEAD_LETTERED_ASIDE``): they never block a key; in sequence mode they finish their
  position (it will never be delivered), so a restarted key does not wait for it again.
- **An operator's unblock** (``fold_unblock``) passes the dead letter a key is blocked at as if it
  had been skipped, and adds its position to ``unblocked``. The unblock is made durable by writing
  the key's cursor document at once; recovery then folds the blocking message's ``dead_lettered``
  tombstone after that document, and ``fold_dead_letter`` treats an in-order dead letter at a
  position in ``unblocked`` as skipped, so a restart never blocks the key again. Exactly that
  position: a message below it may still be dead-lettered in order later (one in flight when the
  key blocked, or one a gap timeout skipped before a restart) and must block. Positions the cursor
  passed are forgotten (a block there would not count any more), so the set stays within the
  key's in-flight window.
- **Skipped ranges are what the engine says** (``AckIntent.skipped``: the ranges a gap timeout
  passed below the ack's cursor, carried by every ack until one that carried them is durable; on
  the ack's tombstone as ``cursor_skips``). ``fold_ack`` records as skipped exactly the carried
  ranges the cursor passes, less what is known finished; every other sequence it passes was acked
  or dead-lettered, though the book may not have folded that yet (a fast-path ack folded after a
  later stored one, a lost answer retried later). Inferring skips from the cursor's movement made
  those copies ``late`` after a restart. Only a tombstone of an earlier release, which carries no
  ranges, is still folded by inference (a copy there is late, never dropped: G1).
- **An operator's gap skip** (``fold_skip_gap``) moves the cursor from the first missing sequence
  past the last one it names and records that range as skipped, exactly as an ack carrying a gap
  timeout's range would. It is made durable by writing the key's cursor document at once, before
  the engine applies it; recovery reads the cursor document first, so the skip holds after a
  restart and is never applied twice (the key no longer waits there).
- **Cursors never move back**: every fold takes the maximum.

The book that applies the fold after each Commit and decides when each key's cursor is written is
``sidecar.store.cursor_book``; the cursor documents' fields, both ways, are
``sidecar.store.cursor_documents``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.engine.types import AckIntent, DeadLetterPolicy, KeyCursor, Message, Mode
from sidecar.shards import shard_of
from sidecar.store.api import SubscriptionStoreConfig

Position = tuple[int, str]
Cursor = int | Position


@dataclass(slots=True)
class CursorState:
    key: str
    next_sequence: int | None = None
    """sequence mode: the next sequence to deliver (None: nothing known)."""
    last_position: Position | None = None
    """watermark mode: the highest position acked in order."""
    done_above: set[int] = field(default_factory=set)
    """sequence mode: sequences above ``next_sequence`` already finished durably."""
    blocked_at: Cursor | None = None
    """The in-order dead letter the key stopped at under ``on_dead_letter: block``."""
    unblocked: set[Any] = field(default_factory=set)
    """Positions of blocking dead letters an operator passed, not yet behind the cursor (``fold_unblock``)."""
    written_ms: int | None = None
    """When this process last wrote the key's cursor document (None: not since start)."""
    dirty_since_ms: int | None = None
    """Oldest durable change not yet written to a cursor record (None: its record is current)."""
    known_from: int | None = None
    """sequence mode: every sequence from here to ``next_sequence`` is finished unless in ``skips``."""
    skips: list[list[int]] = field(default_factory=list)
    """sequence mode: ranges [first, last] below ``next_sequence`` the cursor passed unfinished (a gap
    timeout skipped them: ``AckIntent.skipped``), at most ``MAX_SKIPS``; the oldest are forgotten by
    raising ``known_from``."""
    in_overlay: bool = False
    """The key's latest written state is in its shard's checkpoint (``cursors``), not (only) in its
    own cursor document, which may be older or missing: recovery takes the checkpoint's."""
    changed_ms: int = 0
    """When the state last changed (which keys move from the checkpoint to their own documents first)."""

    def copy(self) -> CursorState:
        """A copy sharing nothing mutable. Field by field (a test checks that every field is copied):
        ``dataclasses.replace`` costs several times more, and this runs once per ack."""
        return CursorState(
            key=self.key,
            next_sequence=self.next_sequence,
            last_position=self.last_position,
            done_above=set(self.done_above),
            blocked_at=self.blocked_at,
            unblocked=set(self.unblocked),
            written_ms=self.written_ms,
            dirty_since_ms=self.dirty_since_ms,
            known_from=self.known_from,
            skips=[list(bounds) for bounds in self.skips],
            in_overlay=self.in_overlay,
            changed_ms=self.changed_ms,
        )


def _max(current: Any, new: Any) -> Any:
    return new if current is None or (new is not None and new > current) else current


def _walk(state: CursorState) -> None:
    """Sequence mode: move the cursor over finished sequences at it; forget those below it."""
    if state.next_sequence is None or not state.done_above:
        return
    while state.next_sequence in state.done_above:
        state.done_above.discard(state.next_sequence)
        state.next_sequence += 1
    nxt = state.next_sequence
    state.done_above = {seq for seq in state.done_above if seq > nxt}
    if state.unblocked:
        state.unblocked = {seq for seq in state.unblocked if seq >= nxt}


@dataclass(frozen=True, slots=True)
class CursorRules:
    """What the fold needs to know of a subscription's configuration."""

    mode: Mode
    on_dead_letter: DeadLetterPolicy = "block"
    sequence_start: int | None = 1
    """Where a new key starts in sequence mode; None with ``first_sequence: any`` (adopted)."""
    shards: int = 1
    """S, the subscription's shard count."""

    def shard(self, key: str) -> int:
        return shard_of(key, self.shards)

    def new_state(self, key: str) -> CursorState:
        start = self.sequence_start if self.mode == "sequence" else None
        return CursorState(key, next_sequence=start, known_from=start)


def rules_of(config: SubscriptionStoreConfig) -> CursorRules:
    """The fold's rules for a subscription's configuration."""
    start = None if config.first_sequence_any else config.sequence_start
    return CursorRules(config.mode, config.on_dead_letter, start, config.shards)


MAX_SKIPS = 64
"""Skipped ranges kept per key (the engine keeps as many)."""


Skips = Sequence[tuple[int, int]]
"""Ranges ``(first, last)`` of sequences a gap timeout skipped (``AckIntent.skipped``)."""


def _record_skips(state: CursorState, before: int, after: int, position: int | None, skipped: Skips | None) -> None:
    """The cursor moved from ``before`` to ``after``: record as skipped the part of ``skipped`` (the
    ranges a gap timeout passed, as the engine carried them with the ack) in ``[before, after)``,
    less the sequences known finished (``position``, ``done_above``). Every other sequence passed
    was finished: a copy of it is a duplicate.

    ``skipped`` None: a tombstone written before acks carried their skipped ranges (no
    ``cursor_skips``): what the cursor passed without the fold having seen it finish is taken as
    skipped, as that release did (a copy there is late, never dropped: G1)."""
    if skipped is not None and not skipped:
        return  # the usual ack: nothing skipped
    if skipped is None and position == before and after == before + 1:
        return  # the usual in-order ack: the cursor passed nothing but the acked position
    finished = {seq for seq in state.done_above if before <= seq < after}
    if position is not None:
        finished.add(position)
    ranges = [(before, after - 1)] if skipped is None else sorted(skipped)
    for first, last in ranges:
        start, end = max(first, before), min(last, after - 1)
        for seq in [*sorted(seq for seq in finished if start <= seq <= end), end + 1]:
            if seq > start:
                if state.skips and state.skips[-1][1] == start - 1:
                    state.skips[-1][1] = seq - 1
                else:
                    state.skips.append([start, seq - 1])
            start = max(start, seq + 1)
    while len(state.skips) > MAX_SKIPS:
        _, last = state.skips.pop(0)
        state.known_from = max(state.known_from or 0, last + 1)


def _unskip(state: CursorState, seq: int) -> None:
    """``seq`` finished after all (a late message acked or dead-lettered): no longer skipped."""
    for i, (first, last) in enumerate(state.skips):
        if first <= seq <= last:
            parts = [[first, seq - 1], [seq + 1, last]]
            state.skips[i : i + 1] = [part for part in parts if part[0] <= part[1]]
            return


def fold_ack(
    state: CursorState, mode: Mode, position: int | Position | None, cursor: Cursor | None, skipped: Skips | None = ()
) -> None:
    """A durable ack of the message at ``position`` whose cursor, once durable, is ``cursor``, with
    the ranges a gap timeout skipped below it (``AckIntent.skipped``; None: unknown, ``_record_skips``)."""
    if mode == "sequence":
        before = state.next_sequence
        if isinstance(cursor, int):
            state.next_sequence = _max(state.next_sequence, cursor)
        if before is None and state.next_sequence is not None and state.known_from is None:
            state.known_from = position if isinstance(position, int) else state.next_sequence  # adopted
            if skipped:
                before = state.known_from  # an adopted key whose first durable ack passed a skipped range
        if before is not None and state.next_sequence is not None and state.next_sequence > before:
            _record_skips(state, before, state.next_sequence, position if isinstance(position, int) else None, skipped)
        if isinstance(position, int) and state.next_sequence is not None and position >= state.next_sequence:
            state.done_above.add(position)
        elif isinstance(position, int):
            _unskip(state, position)  # acked after all: never skipped (a late copy, or folded out of order)
        _walk(state)
    elif mode == "watermark" and isinstance(cursor, tuple):
        state.last_position = _max(state.last_position, (int(cursor[0]), str(cursor[1])))
        if state.unblocked:
            last = state.last_position
            state.unblocked = {pos for pos in state.unblocked if pos > last}
    if state.blocked_at is not None and _behind_cursor(state, state.blocked_at):
        # The cursor passed the dead letter the key was blocked at: a replay of it was acked in its
        # place. Forgotten, so that a later dead letter of the key blocks it again.
        state.blocked_at = None


def fold_dead_letter(
    state: CursorState, mode: Mode, position: int | Position, policy: DeadLetterPolicy, *, in_order: bool = True
) -> None:
    """A durable dead letter of the key's message at ``position``.

    In the key's order it blocks the key (``block``) or finishes its position (``skip``). Aside (a
    late message) it never blocks; in sequence mode it still finishes its position, since that
    sequence will never be delivered: a restarted key does not wait for it again.
    """
    if not in_order:
        if mode == "sequence" and isinstance(position, int):
            if state.next_sequence is not None and position >= state.next_sequence:
                state.done_above.add(position)
                _walk(state)
            else:
                _unskip(state, position)  # a late message, finished: a copy of it is a duplicate now
        return
    if mode == "sequence" and isinstance(position, int) and state.next_sequence is None:
        state.next_sequence = position  # an adopted key (``first_sequence: any``) stopped at its first message
    if position in state.unblocked:
        policy = "skip"  # an operator passed it (module docstring)
    if _behind_cursor(state, position):
        return  # already passed (skipped, or unblocked and then forgotten): it cannot block any more
    if policy == "block":
        if state.blocked_at is None or position < state.blocked_at:  # type: ignore[operator]
            state.blocked_at = position
        return
    if mode == "sequence" and isinstance(position, int):
        if state.next_sequence is not None and position >= state.next_sequence:
            state.done_above.add(position)
            _walk(state)
    # watermark + skip: the ack after it carries a cursor past it (the engine counts it as finished).


def _behind_cursor(state: CursorState, position: int | Position) -> bool:
    if isinstance(position, int):
        return state.next_sequence is not None and position < state.next_sequence
    return state.last_position is not None and position <= state.last_position


def fold_unblock(state: CursorState, mode: Mode, position: Cursor) -> None:
    """An operator passed the dead letter at ``position`` the key was blocked at: it counts as skipped."""
    state.unblocked.add(position)
    if state.blocked_at == position:
        state.blocked_at = None
    if mode == "sequence" and isinstance(position, int):
        if state.next_sequence is not None and position >= state.next_sequence:
            state.done_above.add(position)
            _walk(state)
    # watermark: like a skip, the next ack carries a cursor past it.


def fold_skip_gap(state: CursorState, first: int, through: int) -> bool:
    """An operator skipped the missing sequences ``first..through`` of a key whose cursor stands at
    ``first`` (or that has none yet: adopted by ``first_sequence: any``): the cursor passes them and
    they count as skipped, as a gap timeout's skip carried by an ack would (a copy of one later is
    ``late``). False, and nothing changed, when the cursor stands elsewhere or a sequence of the
    range is known finished (the engine and the store disagree: the operator tries again)."""
    if state.next_sequence not in (None, first) or through < first:
        return False
    if any(first <= seq <= through for seq in state.done_above):
        return False
    if state.known_from is None:
        state.known_from = first
    state.next_sequence = first
    _record_skips(state, first, through + 1, None, [(first, through)])
    state.next_sequence = through + 1
    _walk(state)
    return True


def is_blocked(state: CursorState) -> bool:
    if state.blocked_at is None:
        return False
    if isinstance(state.blocked_at, int):
        return state.next_sequence is None or state.blocked_at >= state.next_sequence
    return state.last_position is None or state.blocked_at > state.last_position


def skips_of(ack: AckIntent) -> list[tuple[int, int]]:
    """The ranges a gap timeout skipped below the ack's cursor, as the engine carried them."""
    return [(skip.first, skip.last) for skip in ack.skipped]


def position_of(message: Message) -> int | Position | None:
    if message.sequence is not None:
        return message.sequence
    if message.timestamp_ms is not None:
        return (message.timestamp_ms, message.dedup_id)
    return None


def key_cursor(state: CursorState, mode: Mode) -> KeyCursor | None:
    """The engine's view of a recovered key (None when there is nothing to restore)."""
    blocked = is_blocked(state)
    blocked_position = state.blocked_at if blocked else None
    if mode == "sequence" and state.next_sequence is not None:
        return KeyCursor(
            key=state.key,
            next_sequence=state.next_sequence,
            blocked=blocked,
            acked_above=tuple(sorted(state.done_above)),
            blocked_position=blocked_position,
            known_from=state.known_from,
            skipped=tuple((first, last) for first, last in state.skips),
        )
    if mode == "watermark" and (state.last_position is not None or blocked):
        return KeyCursor(
            key=state.key, last_position=state.last_position, blocked=blocked, blocked_position=blocked_position
        )
    return None
