"""Restore and export: an engine rebuilt from the store's cursors and pending messages, and back.

Rules (invariant 4 of ``core``, and docs/store.md's recovery rules):

- ``export`` is the cursors plus every message not yet acked durably or dead-lettered (in flight
  and acking ones included: after a restart they are delivered again), in arrival order; dead
  letters aside and messages parked while loading are pending too. Nothing held is left out (G1).
- A restore replays pending messages through the ordinary arrival in ``stored_at_ms`` order,
  counted as recovered, not stored. What that replay decides besides holding (a duplicate below the
  cursor, a late or conflicting message not yet dead-lettered) is deferred to the first ``tick``.
- While loading (pending messages read page by page), nothing that a record not read yet could
  precede is released: no gap timer runs, the watermark offered meanwhile waits, the fast path is
  closed, a key without a cursor adopts no first sequence (its messages are parked and replayed in
  stored order at the end), and messages stored meanwhile are parked too, so that of two copies of
  one position the first stored still wins.
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.engine.arrival import arrive
from sidecar.engine.books import Books
from sidecar.engine.dedup import identity
from sidecar.engine.state import BLOCKED, DONE, Entry
from sidecar.engine.types import Action, EngineSnapshot, Hold, Message

LOADING_HOLD = "recovery is still reading this shard's pending messages"
"""The reason of the ``Hold`` a message stored while the engine is loading is returned with."""


def restore(books: Books, snapshot: EngineSnapshot, now_ms: int, *, loading: bool) -> None:
    """Fill a new engine's books from ``snapshot`` (``Engine.restore``)."""
    books.loading = loading
    seen: set[str] = set()
    for cursor in snapshot.cursors:
        if cursor.key in seen:
            raise ValueError(f"snapshot has two cursors for key {cursor.key!r}")
        seen.add(cursor.key)
        if books.none is not None:
            continue  # none mode keeps no cursors
        key = books.key(cursor.key, rebuild=False)
        books.policy.restore_cursor(key, cursor)
        books.n_dead_letter_blocked += key.blocked
    if snapshot.watermark_ms is not None and books.wm is not None:
        if loading:
            books.loading_watermark_ms = snapshot.watermark_ms  # applied by finish_loading
        else:
            books.wm.watermark_ms = snapshot.watermark_ms
    replay(books, sorted(snapshot.pending, key=_stored_at), now_ms)
    for key in list(books.keys.values()):
        books.refresh(key, now_ms)
        books.maybe_idle(key)


def park(books: Books, message: Message) -> list[Action]:
    """A message stored while loading (``Engine.on_stored``): it waits for the end of the load."""
    books.parked.append(message)
    books.stored += 1
    return [Hold(message, LOADING_HOLD)]


def restore_pending(books: Books, messages: Iterable[Message], now_ms: int) -> None:
    """``Engine.restore_pending``: one more page of a loading engine's pending messages."""
    if not books.loading:
        raise RuntimeError("restore_pending: the engine is not loading (restore(..., loading=True))")
    replay(books, sorted(messages, key=_stored_at), now_ms)


def finish_loading(books: Books, now_ms: int) -> tuple[list[Action], int | None]:
    """``Engine.finish_loading``: the decisions of the adoption replay, and the watermark offered while
    loading, for the engine to apply now (None: none was)."""
    if not books.loading:
        return [], None
    books.loading = False
    parked, books.parked = books.parked, []
    actions: list[Action] = []
    stored = books.stored  # counted when they were parked
    for message in sorted(parked, key=_stored_at):
        actions.extend(action for action in arrive(books, message, now_ms) if not isinstance(action, Hold))
    books.stored = stored
    for key in list(books.keys.values()):
        books.refresh(key, now_ms)
    watermark, books.loading_watermark_ms = books.loading_watermark_ms, None
    return actions, watermark


def replay(books: Books, messages: Iterable[Message], now_ms: int) -> None:
    """Restored messages through the arrival; counted as recovered, not as stored."""
    stored = books.stored
    seq = books.seq
    for message in messages:
        if books.loading and seq is not None and not message.replay_id and _unadopted(books, message.key):
            # ``first_sequence: any``: the key adopts the first stored message, known only at the end.
            books.parked.append(message)
            books.stored += 1
            continue
        for action in arrive(books, message, now_ms):
            if not isinstance(action, Hold):
                books.deferred.append(action)
    books.counts["recovered"] += books.stored - stored
    books.stored = stored
    if books.deferred:
        books.deferred_due_ms = now_ms


def export(books: Books) -> EngineSnapshot:
    """``Engine.export``."""
    cursors = []
    pending: list[tuple[int, Message]] = []
    if books.none is None:
        policy = books.policy
        for key in books.keys.values():
            cursor = policy.export_cursor(key)
            if cursor is not None:
                cursors.append(cursor)
    entries: Iterable[Entry]
    if books.seq is not None:
        entries = [entry for key in books.keys.values() for entry in key.index.values()]
        entries += books.seq.replays.values()
    else:
        entries = (books.wm or books.none).by_id.values()  # type: ignore[union-attr]
    for entry in entries:
        if entry.state not in (DONE, BLOCKED):
            pending.append((entry.n, entry.message))
    for message, (_count, n) in books.aside.messages.items():
        pending.append((n, message))
    pending.extend((books.n + i, message) for i, message in enumerate(books.parked, 1))
    pending.sort(key=_first)
    return EngineSnapshot(
        cursors=tuple(cursors),
        pending=tuple(message for _, message in pending),
        watermark_ms=books.wm.watermark_ms if books.wm is not None else None,
    )


def delivery_attempts(books: Books) -> dict[object, int]:
    """``Engine.delivery_attempts``."""
    entries: Iterable[Entry]
    if books.seq is not None:
        entries = [entry for key in books.keys.values() for entry in key.index.values()]
        entries += books.seq.replays.values()
    else:
        entries = (books.wm or books.none).by_id.values()  # type: ignore[union-attr]
    return {
        identity(entry.message): entry.deliveries + entry.message.prior_attempts
        for entry in entries
        if entry.deliveries and entry.state not in (DONE, BLOCKED)
    }


def _unadopted(books: Books, name: str) -> bool:
    key = books.keys.get(name)
    if key is None:
        key = books.key(name)  # an idle key is rebuilt from its cursor
    return key.cursor is None


def _stored_at(message: Message) -> int:
    return message.stored_at_ms


def _first(item: tuple[int, Message]) -> int:
    return item[0]
