"""A stored message's way into the engine: dropped, dead-lettered aside, or held in its key's order.

Rules (invariants 1, 4 and 6 of ``core``):

- Every message arriving is accounted for (G1): a duplicate is returned as ``DropDuplicate``, a
  message outside any order as ``DeadLetter`` (held in ``state.AsideDeadLetters`` until its
  ``dead_letter_done``), anything else becomes an entry the engine holds until it is finished.
- A copy of a record being dead-lettered aside is a duplicate: that record stays pending until the
  dead letter is recorded, so the copy adds nothing.
- Placement in a key's order is the policy's (``sequence``, ``watermark``; ``unordered`` has none):
  this module only routes a message to it and keeps the engine's counts.
- A replay (``Message.replay_id``) in an ordered mode: at the position its key is blocked at it
  takes the dead letter's place and the key resumes with it; at a position the key has not
  reached it is an ordinary arrival; anywhere else it is behind and ``on_replay_behind`` applies
  (delivered outside the order flagged ``replayed``, like a late message, or dead-lettered aside as
  ``replay_behind``). A redelivery of a replay the engine holds is a duplicate.
"""

from __future__ import annotations

from sidecar.engine.books import Books
from sidecar.engine.dead_letters import REASON_LATE, REASON_REPLAY_BEHIND
from sidecar.engine.dedup import identity
from sidecar.engine.state import BLOCKED, DONE, Entry, KeyLedger
from sidecar.engine.types import Action, DeadLetter, DropDuplicate, Message


def arrive(books: Books, message: Message, now_ms: int) -> list[Action]:
    """One stored message (``Engine.on_stored`` once the engine is not loading, and restores)."""
    books.n += 1
    books.stored += 1
    aside = books.aside
    if aside.identities and identity(message) in aside.identities:
        # Its record is the one being dead-lettered: it must stay pending until that is recorded.
        books.counts["duplicates"] += 1
        return [DropDuplicate(message, "duplicate of a message being dead-lettered")]
    key = None
    if books.none is not None:
        action, entry = books.none.arrive(message, books.n, now_ms)
    else:
        key = books.keys.get(message.key)
        if key is None:
            if type(message.key) is not str:
                raise ValueError(f"message {message.dedup_id!r}: key must be a str, got {message.key!r}")
            key = books.key(message.key)
        elif books.idle:
            books.idle.pop(key.name, None)
        if message.replay_id:
            action, entry = _arrive_replay(books, key, message, now_ms)
        elif books.seq is not None:
            action, entry = books.seq.arrive(key, message, books.n)
        else:
            action, entry = books.wm.arrive(key, message, books.n, now_ms)  # type: ignore[union-attr]
    if entry is not None:
        books.n_pending += 1
        books.n_undelivered += 1
        books.arrivals.append(entry)
        if entry.late and not entry.replayed:
            books.counts["late"] += 1
    if action is not None:
        counts = books.counts
        kind = type(action)
        if kind is DropDuplicate:
            counts["duplicates"] += 1
        elif kind is DeadLetter:
            books.count_dead_letter(action.reason)  # type: ignore[union-attr]
            if action.reason == REASON_LATE:  # type: ignore[union-attr]
                counts["late"] += 1
            aside.add(message, books.n)
    if key is not None:
        books.refresh(key, now_ms)
    return [] if action is None else [action]


def _arrive_replay(books: Books, key: KeyLedger, message: Message, now_ms: int) -> tuple[Action | None, Entry | None]:
    """A replay in an ordered mode (the module docstring's last rule)."""
    held = books.find(message)
    if held is not None and held.message.replay_id == message.replay_id:
        # A redelivery of this very replay (its stored record is the held one's): not finished.
        return DropDuplicate(message, "duplicate of a replay the engine holds"), None
    books.counts["replays"] += 1
    policy = books.policy
    position = policy.position(message)
    blocking = next((e for e in key.out if e.state == BLOCKED), None) if key.blocked else None
    if (
        key.blocked
        and key.blocked_pos == position
        and (blocking is not None or policy.replay_place(key, message) == "ahead")
    ):
        # It takes the place of the dead letter the key stopped at: the key resumes with it.
        # (Restored blocked, the engine holds no entry for it: only if nothing sits there.)
        if blocking is not None:
            key.out.remove(blocking)
            blocking.state = DONE
        key.blocked = False
        key.blocked_since = key.blocked_pos = None
        books.n_dead_letter_blocked -= 1
        if books.seq is not None:
            return books.seq.resume_at(key, blocking, message, books.n)
        return books.wm.resume_at(key, blocking, message, books.n, now_ms)  # type: ignore[union-attr]
    if policy.replay_place(key, message) == "ahead":
        if books.seq is not None:
            return books.seq.arrive(key, message, books.n)
        return books.wm.arrive(key, message, books.n, now_ms)  # type: ignore[union-attr]
    books.counts["replays_behind"] += 1
    if books.config.on_replay_behind == "refuse":
        return DeadLetter(message, REASON_REPLAY_BEHIND, 0), None
    entry = Entry(message, key, position, books.n)
    entry.late = entry.replayed = True
    policy.add_flagged(key, entry)
    return None, entry
