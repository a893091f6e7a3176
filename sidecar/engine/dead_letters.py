"""Dead letters in the engine: their reasons, what a recorded one does to its key, and an unblock.

Rules (invariant 5 of ``core``):

- A dead letter is decided by an arrival (``conflict``, ``late``, ``below_cursor``,
  ``replay_behind``: outside any key's order, held in ``state.AsideDeadLetters``) or by a failed
  delivery (``max_delivery_attempts``, ``app_dead_letter``: in order unless the message was late).
  Either way the engine keeps the message until ``dead_letter_done``: until then it is pending in
  an export (G1), and an in-order one stays in its key's ``out`` so the cursor cannot pass it.
- ``dead_letter_done`` of one outside the order just forgets it. Of an in-order one it applies
  ``on_dead_letter``: ``skip`` finishes it (the key moves on), ``block`` stops the key at it
  (BLOCKED, at the head of ``out``) until an operator's ``unblock`` or a replay at its position.
  With several dead letters of a key in flight, the key stops at the first (as the store records).
- ``unblock`` comes after the store recorded it: the blocking message finishes like a skipped one,
  and a pending copy of it (stored again after its tombstone expired) is dropped, never delivered.
"""

from __future__ import annotations

from sidecar.engine.books import Books
from sidecar.engine.state import BLOCKED, DEAD, DONE
from sidecar.engine.types import Action, DropDuplicate, Message

REASON_CONFLICT = "conflict"
REASON_LATE = "late"
REASON_MAX_ATTEMPTS = "max_delivery_attempts"
REASON_APP = "app_dead_letter"
"""Dead-letter reasons: the app's nack asked for it (``dead_letter=True``)."""
REASON_REPLAY_BEHIND = "replay_behind"
"""A replay of a message its key had already passed, refused (``on_replay_behind: refuse``)."""
REASON_BELOW_CURSOR = "below_cursor"
"""sequence mode: a message below a cursor this engine was restored with, not known to be skipped:
it may be a copy of an acked message whose record expired (never delivered again, G3), or one
skipped before the restart. Dead-lettered, never dropped silently (G1)."""


class KeyNotBlocked(LookupError):
    """``unblock`` of a key that is not stopped at a dead letter (unknown, running, or still publishing it)."""


def dead_letter_done(books: Books, message: Message, now_ms: int) -> list[Action]:
    """``Engine.dead_letter_done``: the dead letter of ``message`` is published and recorded."""
    if books.aside.done(message):
        return []
    entry = books.find(message)
    if entry is None or entry.state != DEAD or entry.message != message:
        return []
    key = entry.key
    if key is None or entry.late:
        books.finish(entry, now_ms, occupied=False)
        return []
    key.dead_lettering -= 1
    if books.config.on_dead_letter == "skip":
        books.finish(entry, now_ms, occupied=False)
        return []
    entry.state = BLOCKED
    books.n_pending -= 1
    if not key.blocked:
        books.n_dead_letter_blocked += 1
        key.blocked_since = now_ms
    key.blocked = True
    # Several in flight: the key stops at the first of its dead letters (as the store records).
    if key.blocked_pos is None or entry.pos < key.blocked_pos:  # type: ignore[operator]
        key.blocked_pos = entry.pos
    books.policy.on_blocked(key, entry)
    books.refresh(key, now_ms)
    return []


def unblock(books: Books, key_name: str, position: object, now_ms: int) -> tuple[Message | None, list[Action]]:
    """``Engine.unblock``: an operator skips the dead letter at ``position`` that blocks the key."""
    key = books.keys.get(key_name)
    if key is None or not key.blocked:
        raise KeyNotBlocked(f"key {key_name!r} is not blocked by a dead letter")
    key.blocked = False
    key.blocked_since = key.blocked_pos = None
    books.n_dead_letter_blocked -= 1
    books.counts["unblocked"] += 1
    entry = next((e for e in key.out if e.state == BLOCKED), None)
    message = None
    actions: list[Action] = []
    if entry is None:
        copy = books.policy.pass_restored_block(key, position)
        if copy is not None:
            books.n_pending -= 1
            if not copy.deliveries:
                books.n_undelivered -= 1
            books.counts["duplicates"] += 1
            actions.append(DropDuplicate(copy.message, "the message an operator skipped", finish_record=True))
    else:
        # The BLOCKED entry already left the pending count; it finishes like a skipped one.
        entry.state = DONE
        message = entry.message
        books.retire_finished(key)
    books.refresh(key, now_ms)
    books.maybe_idle(key)
    return message, actions
