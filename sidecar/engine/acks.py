"""Acks and rewinds: what the app's answers (and their absence) do to a delivered message.

Rules (invariants 2, 3 and 5 of ``core``):

- ``ack``: the message is ACKING (never handed out again, G3) until ``ack_durable``; its in-flight
  slot is free at once (G2 asks only for the app's ack). The ``AckIntent`` carries the cursor the
  ack gives once durable, and in sequence mode the gap-skipped ranges below that cursor that no
  durable ack has carried yet. A replay delivered aside (``replayed``) acks ``aside``: the store
  folds nothing into the key's cursor for it.
- ``ack_durable``: the cursor passes the finished prefix of the key's ``out``; unknown or repeated
  ids are ignored. The stored copy of a fast-path message may go once its ack is durable.
- A nack or an expiry (``fail``) gives back the message and every later one of its key still in
  flight, in order (a rewind); acks already given stay. The key (ordered modes) or the message
  (none mode) backs off: ``retry_after_ms`` if the nack gave one, else ``backoff_ms``. A nack
  asking for it, or a failure of delivery attempt ``max_delivery_attempts``, dead-letters instead.
- ``consumer_closed`` gives back a stream's in-flight messages at once, in order, without backoff
  and without counting a failure; acking ones stay acking.

Backoff after the n-th failed delivery of a message (``retry_after_ms`` from the nack wins)::

    delay_ms = int(min(backoff_maximum_ms, backoff_initial_ms * 2 ** (n - 1)) * (0.5 + jitter()))

In sequence and watermark mode the whole key waits out the delay (its order depends on the nacked
message); in none mode only that message does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sidecar.engine import timers as _timers
from sidecar.engine.books import Books
from sidecar.engine.dead_letters import REASON_APP, REASON_MAX_ATTEMPTS
from sidecar.engine.state import ACKING, BACKOFF, DEAD, OUT, Entry, KeyLedger
from sidecar.engine.types import AckIntent, Action, DeadLetter, DropDuplicate, SkippedRange

_MAX_BACKOFF_EXPONENT = 62
"""2**62 ms is far beyond any maximum: caps the exponent so a huge attempt count stays cheap."""


class UnknownDelivery(KeyError):
    """An ack or nack of a delivery id that is not in flight for that consumer."""


def _in_flight(books: Books, consumer: str, delivery_id: str) -> Entry:
    """The entry delivered as ``delivery_id`` to ``consumer`` and not answered; raises UnknownDelivery."""
    entry = books.deliveries.get(delivery_id)
    if entry is None or entry.state != OUT or entry.consumer != consumer:
        raise UnknownDelivery(f"delivery {delivery_id!r} is not in flight for consumer {consumer!r}")
    return entry


def ack(books: Books, consumer: str, delivery_id: str, now_ms: int) -> AckIntent:
    """``Engine.ack``: the app acked."""
    entry = _in_flight(books, consumer, delivery_id)
    entry.state = ACKING
    del books.consumers[consumer][delivery_id]
    books.timers.mark_stale()
    # The app acked: its slot is free at once (G2 asks only for the app's ack), so the key's next
    # message need not wait for the ack to become durable (a coalesced cursor may take a second).
    books.n_out -= 1
    key = entry.key
    cursor = None if key is None else books.policy.cursor_if_acked(key, entry)
    skipped: tuple[SkippedRange, ...] = ()
    if key is not None:
        key.n_out -= 1
        if key.n_out == 0:
            key.consumer = None
        if key.unrecorded_skips and type(cursor) is int and not entry.replayed:
            # The ranges a gap skip passed below this cursor ride on the ack (``AckIntent.skipped``).
            skipped = tuple(skip for skip in key.unrecorded_skips if skip.first < cursor)
            entry.unrecorded_through = cursor
        books.refresh(key, now_ms)
    return AckIntent(delivery_id, entry.message, cursor, aside=entry.replayed, skipped=skipped)


def ack_durable(books: Books, delivery_ids: Iterable[str], now_ms: int) -> list[Action]:
    """``Engine.ack_durable``: the store made these acks durable."""
    deliveries = books.deliveries
    actions: list[Action] = []
    for delivery_id in delivery_ids:
        entry = deliveries.get(delivery_id)
        if entry is None or entry.state != ACKING:
            continue
        del deliveries[delivery_id]
        books.acked += 1
        through = entry.unrecorded_through
        if through is not None and entry.key is not None:
            # The skipped ranges this ack carried are in the store now.
            key = entry.key
            key.unrecorded_skips = [skip for skip in key.unrecorded_skips if skip.last >= through]
        books.finish(entry, now_ms, occupied=False)  # its slot was freed by ``ack``
        if entry.twin is not None:
            # The stored copy of a fast-path message: its ack is durable now, so its record may go.
            actions.append(DropDuplicate(entry.twin, "stored copy of an acked message", finish_record=True))
    return actions


def nack(
    books: Books, consumer: str, delivery_id: str, now_ms: int, retry_after_ms: int | None, dead_letter: bool
) -> list[Action]:
    """``Engine.nack``: the app nacked."""
    entry = _in_flight(books, consumer, delivery_id)
    if retry_after_ms is not None and retry_after_ms < 0:
        raise ValueError(f"retry_after_ms must be >= 0, got {retry_after_ms}")
    books.counts["nacked"] += 1
    return fail(books, entry, now_ms, retry_after_ms, dead_letter, from_timer=False)


def consumer_closed(books: Books, consumer: str, now_ms: int) -> None:
    """``Engine.consumer_closed``: a stream ended."""
    returned = books.consumers.pop(consumer, None)
    stranded = books.owned.pop(consumer, None)
    touched: dict[int, KeyLedger] = {}
    if returned:
        entries = sorted(returned.values(), key=_arrival)
        books.counts["returned"] += len(entries)
        if books.none is not None:
            for entry in entries:
                books.end_delivery(entry, from_timer=False)
            books.none.ready.extendleft(reversed(entries))
        else:
            by_key: dict[int, list[Entry]] = {}
            for entry in entries:
                by_key.setdefault(id(entry.key), []).append(entry)
            for group in by_key.values():
                key = group[0].key
                group.sort(key=_position)
                books.give_back(key, group)  # type: ignore[arg-type]
                touched[id(key)] = key  # type: ignore[assignment]
    if stranded:
        for key in stranded:
            if key.queued == consumer:
                key.queued = None
                touched[id(key)] = key
    for key in touched.values():
        books.refresh(key, now_ms)


def fail(
    books: Books, entry: Entry, now_ms: int, retry_after_ms: int | None, dead_letter: bool, *, from_timer: bool
) -> list[Action]:
    """A nack or expiry of an OUT entry."""
    key = entry.key
    attempts = entry.deliveries + entry.message.prior_attempts
    exhausted = attempts >= books.config.max_delivery_attempts
    if key is not None:
        # The failed message and every later one of the key still in flight go back, in order.
        group = [entry]
        if not entry.late:
            pos = entry.pos
            group = [x for x in key.out if x.state == OUT and x.pos >= pos]  # type: ignore[operator]
    if dead_letter or exhausted:
        reason = REASON_APP if dead_letter else REASON_MAX_ATTEMPTS
        books.end_delivery(entry, from_timer=from_timer)
        entry.state = DEAD
        if key is not None:
            followers = [x for x in group if x is not entry]
            if followers:
                books.give_back(key, followers)
            if not entry.late:
                key.dead_lettering += 1
                # Keep the dead-lettering entry in ``out`` so the cursor cannot pass it.
                books.insert_out(key, entry)
            books.refresh(key, now_ms)
        books.count_dead_letter(reason)
        in_order = key is not None and not entry.late
        return [DeadLetter(entry.message, reason, attempts, in_order)]
    delay_ms = retry_after_ms if retry_after_ms is not None else backoff_ms(books, attempts)
    if key is None:
        books.end_delivery(entry, from_timer=from_timer)
        if delay_ms <= 0:
            books.none.ready.append(entry)  # type: ignore[union-attr]
        else:
            entry.state = BACKOFF
            books.timers.push(now_ms + delay_ms, _timers.ENTRY_BACKOFF, entry, entry.deliveries)
        return []
    books.give_back(key, group, from_timer_entry=entry if from_timer else None)
    if delay_ms > 0:
        until = now_ms + delay_ms
        if key.backoff_until is None or until > key.backoff_until:
            key.backoff_until = until
            key.backoff_since = now_ms
            books.timers.push(until, _timers.KEY_BACKOFF, key, until)
    books.refresh(key, now_ms)
    return []


def backoff_ms(books: Books, failures: int) -> int:
    """The delay after the ``failures``-th failed delivery of a message (the module docstring's formula)."""
    jitter = books.jitter()
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter() must return a float in [0, 1), got {jitter!r}")
    config = books.config
    exponent = min(max(failures, 1) - 1, _MAX_BACKOFF_EXPONENT)
    base = min(config.backoff_maximum_ms, config.backoff_initial_ms * 2**exponent)
    return int(base * (0.5 + jitter))


def _arrival(entry: Entry) -> int:
    return entry.n


def _position(entry: Entry) -> Any:
    return entry.pos
