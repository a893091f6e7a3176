"""sequence mode's in-order fast path: which messages may skip the store. Pure queries, no change.

Rules:

- A message may skip the store (``may_skip_store``) only when it is the first position its key is
  missing (``run_end``): it joins the run of messages ready in order at once, behind those in
  flight or ready and ahead of any held beyond a gap, so it waits for nothing but the app and
  Pub/Sub can keep it meanwhile (its ack is held until the app's ack is durable in the cursor).
- Never while the engine is loading, never for a replay or a position the key already holds, and
  never on a key that is blocked, dead-lettering or backing off, nor while any replay is delivered
  aside (each of these may put something else first).
- A message beyond ``run_end`` on such a key ``awaits_predecessor``: once the missing position
  takes the fast path, it could follow.
- A copy of a fast-path message still held (same position, same fingerprint) is a duplicate of it
  once the original is finished (``volatile_original``); another fingerprint there is a conflict.
"""

from __future__ import annotations

from sidecar.engine.books import Books
from sidecar.engine.state import KeyLedger
from sidecar.engine.types import Message


def may_skip_store(books: Books, message: Message) -> bool:
    """``Engine.fast_path``."""
    if message.volatile is False:
        return False
    key = _open_key(books, message)
    return key is not None and message.sequence == key.run_end


def awaits_predecessor(books: Books, message: Message) -> bool:
    """``Engine.awaits_predecessor``."""
    key = _open_key(books, message)
    return key is not None and message.sequence is not None and message.sequence > key.run_end


def volatile_original(books: Books, message: Message) -> Message | None:
    """``Engine.volatile_original``."""
    if books.seq is None or message.replay_id or message.sequence is None:
        return None
    key = books.keys.get(message.key)
    held = None if key is None else key.index.get(message.sequence)
    if held is None or held.n == 0 or not held.message.volatile or held.message.replay_id:
        return None
    return held.message if held.message.fingerprint == message.fingerprint else None


def _open_key(books: Books, message: Message) -> KeyLedger | None:
    """``message``'s key when the fast path could serve it at all: sequence mode, not loading, not a
    replay, a position not held already, and a key neither blocked, dead-lettering nor backing off."""
    if books.seq is None or books.loading or message.replay_id or message.sequence is None:
        return None
    key = books.keys.get(message.key) or books.key(message.key)  # an idle key is rebuilt from its cursor
    if (
        key.cursor is None
        or message.sequence in key.index
        or key.blocked
        or key.dead_lettering
        or key.backoff_until is not None
        or books.seq.replays
    ):
        return None
    return key
