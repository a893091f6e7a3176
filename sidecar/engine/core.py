"""The ordering engine: events in, decisions out. Pure: no I/O, no clock, no asyncio, no randomness.

Time is the ``now_ms`` argument of every call, randomness the injected ``jitter``, delivery ids
``id_prefix`` plus a counter. The I/O layers execute the returned decisions and report back
(``ack_durable``, ``dead_letter_done``). Delivery is pulled: ``take`` hands out what is ready.

Invariants kept for every key (G2/G3/G5, checked by the property tests in tests/engine):

1. Order. Messages of one key are handed out in position order (sequence, or
   ``(timestamp_ms, dedup_id)``), at most ``max_in_flight_per_key`` at a time, and never past a
   gap, the watermark, a backoff or a dead letter in progress. Late messages are the one exception
   and are flagged ``late``.
2. After a nack or an expiry the nacked message and every later one of its key still in flight go
   back and are handed out again in order; acks already given (``ACKING``) are never undone, and
   what the key passed stays passed (sequence mode: a skipped sequence is not waited for or skipped
   again, and arriving later it is late; a finished late message leaves no gap, and a copy of it
   is a duplicate).
3. An acked message is never handed out again: it keeps its slot while acking, is not returned by
   expiry or a consumer close, and the cursor passes it once durable.
4. Nothing is lost: every message given to ``on_stored`` is either dropped as a duplicate (returned
   DropDuplicate), dead-lettered (returned DeadLetter), or held by the engine until acked durably or
   dead-lettered, and visible in ``status`` and ``export`` until then.
5. Bounded retries: after a nack or expiry of delivery attempt ``max_delivery_attempts`` (or a nack
   asking for it) the message is dead-lettered; the key then waits for ``dead_letter_done`` and
   follows ``on_dead_letter``. Consumer closes give messages back without counting as failures,
   but the next ``attempt`` number still counts every earlier delivery, and those an earlier
   engine made before its shard was dropped (``Message.prior_attempts``).
6. Replays (``Message.replay_id``, an operator's ``dead-letters replay``) never reorder anything
   else. A replay at the position its key is blocked at takes the dead letter's place and is the
   key's next message (its durable ack moves the key on); one at a position the key has not reached
   is an ordinary arrival there; one the key has passed (or holds another message at) is handed
   out outside the order flagged
   ``replayed`` (``on_replay_behind: deliver_flagged``, like a late message: it never moves the
   cursor) or dead-lettered aside as ``replay_behind`` (``refuse``). In none mode a replay is an
   ordinary message. Its identity is its replay id, so it is no duplicate of its original.

Backoff after a failed delivery: ``acks`` (in sequence and watermark mode the whole key waits out
the delay, in none mode only that message does).

Where each job lives: ``Engine`` (here) takes events and hands out ready messages (``take``),
runs the timers (``tick``) and delegates the rest; ``books`` holds the state and the primitives
that keep it consistent; ``arrival`` places a stored message; ``acks`` handles acks, nacks,
expiries and closes (the rewinds); ``dead_letters`` what a recorded dead letter and an unblock do;
``recovery`` restore, loading and export; ``fast_path`` which messages may skip the store;
``status`` the counters and per-key report; ``payloads`` the memory a held message costs. The
policies (``sequence``, ``watermark``, ``unordered``) place messages in a key's order.

Cost: O(log b) per message and event (b = the key's backlog), timers in one heap; ``status`` with
``max_keys=0`` is O(1), the per-key list costs one pass over the keys (for the status RPC only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sidecar.engine import acks, arrival, dead_letters, fast_path, gap_skip, recovery, status
from sidecar.engine import timers as _timers
from sidecar.engine.books import Books
from sidecar.engine.payloads import payload_size, strippable, stripped
from sidecar.engine.state import BACKOFF, HELD, OUT, Entry, KeyLedger
from sidecar.engine.types import (
    AckIntent,
    Action,
    Deliver,
    EngineConfig,
    EngineSnapshot,
    EngineStatus,
    KeyCursor,
    KeyStatus,
    Message,
    SkippedRange,
    check_config,
)


class Engine:
    """One subscription's ordering and delivery state. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        jitter: Callable[[], float] = lambda: 0.5,
        id_prefix: str = "",
        cursor_source: Callable[[str], KeyCursor | None] | None = None,
        epoch: int = 0,
    ) -> None:
        """``epoch`` is stamped on every ``Deliver`` (the lease epoch of the shard this engine
        delivers); ``cursor_source`` gives a key's durable cursor by name (the store's), which lets
        idle keys be forgotten and rebuilt."""
        check_config(config)
        self._books = Books(config, jitter=jitter, id_prefix=id_prefix, cursor_source=cursor_source, epoch=epoch)

    # ---- recovery ---------------------------------------------------------------------------

    @classmethod
    def restore(
        cls,
        config: EngineConfig,
        snapshot: EngineSnapshot,
        now_ms: int,
        *,
        jitter: Callable[[], float] = lambda: 0.5,
        id_prefix: str = "",
        cursor_source: Callable[[str], KeyCursor | None] | None = None,
        loading: bool = False,
        epoch: int = 0,
    ) -> Engine:
        """Rebuild from the store's cursors and pending messages.

        Pending messages are replayed through ``on_stored`` in ``stored_at_ms`` order. What that
        replay decides besides holding (a duplicate below the cursor, a late or conflicting message
        that was not yet dead-lettered) is returned by the first ``tick``: ``next_timer_ms`` is
        ``now_ms`` until then.

        ``loading``: more pending messages follow (``restore_pending``, page by page) until
        ``finish_loading``. Meanwhile the engine delivers restored messages it can prove are next
        (sequence mode: the cursor's successor; none mode: any) and nothing that a record not read
        yet could precede: no gap timer runs (the missing sequence may be on a later page), the
        watermark releases nothing (an earlier timestamp may be unread), the fast path is closed,
        a key without a cursor adopts no first sequence, and messages stored meanwhile
        (``on_stored``) wait for the end of the load, so that of two copies of one position the
        first stored still wins.
        """
        engine = cls(config, jitter=jitter, id_prefix=id_prefix, cursor_source=cursor_source, epoch=epoch)
        recovery.restore(engine._books, snapshot, now_ms, loading=loading)
        return engine

    @property
    def loading(self) -> bool:
        """Restored with ``loading=True`` and not finished yet (``finish_loading``)."""
        return self._books.loading

    def restore_pending(self, messages: Iterable[Message], now_ms: int) -> None:
        """More pending messages of a loading engine (one page of the store's read), replayed like
        ``restore``'s: in ``stored_at_ms`` order within the page, decisions other than holding
        returned by the next ``tick``. The caller hands each stored record once per engine."""
        recovery.restore_pending(self._books, messages, now_ms)

    def finish_loading(self, now_ms: int) -> list[Action]:
        """Every pending message has been restored: gap timers start (from ``now_ms``), the
        watermark offered meanwhile applies, the fast path opens, and keys without a cursor adopt
        their first sequence. Returns the decisions of the adoption replay (as ``on_stored`` does)."""
        actions, watermark = recovery.finish_loading(self._books, now_ms)
        if watermark is not None:
            actions.extend(self.advance_watermark(watermark, now_ms))
        return actions

    def export(self) -> EngineSnapshot:
        """Cursors plus every message not yet acked durably or dead-lettered, in arrival order.

        In-flight and acking messages are pending: after a restart they are delivered again.
        """
        return recovery.export(self._books)

    def delivery_attempts(self) -> dict[object, int]:
        """The attempts made so far of every pending message delivered at least once, by identity
        (``dedup.identity``): the runtime keeps them when it drops this engine, so that a later
        engine of the process goes on counting (``Message.prior_attempts``). One pass over the keys."""
        return recovery.delivery_attempts(self._books)

    # ---- events -----------------------------------------------------------------------------

    def on_stored(self, message: Message, now_ms: int) -> list[Action]:
        """A durably stored message arrives. Returns DropDuplicate, DeadLetter ("conflict" or
        "late"), Hold with its reason, or [] when it is ready (delivery is pulled with ``take``)."""
        if self._books.loading:
            # A record not read yet may precede it (the first stored of two conflicting copies, a
            # lower sequence, an earlier timestamp): it waits for the end of the load.
            return recovery.park(self._books, message)
        return arrival.arrive(self._books, message, now_ms)

    def fast_path(self, message: Message) -> bool:
        """True when ``message`` may skip the store (sequence mode's in-order fast path): it is the
        first position its key is missing, so it joins the run of messages ready in order at once
        (behind those in flight or ready, ahead of any held beyond a gap), and its key is neither
        blocked, dead-lettering nor backing off. It then waits for nothing but the app: Pub/Sub can
        keep it meanwhile. Pure query: the caller hands it to ``on_stored`` flagged ``volatile``."""
        return fast_path.may_skip_store(self._books, message)

    def awaits_predecessor(self, message: Message) -> bool:
        """True when ``message`` is beyond the first position its key is missing, on a key the fast
        path could serve (what ``fast_path`` asks, but the sequence is above ``run_end``): once that
        position arrives and takes the fast path, this message could follow it. Pure query, like
        ``fast_path``."""
        return fast_path.awaits_predecessor(self._books, message)

    def volatile_original(self, message: Message) -> Message | None:
        """The fast-path message this engine holds at ``message``'s position with the same content
        (fingerprint), not yet finished: ``message`` is a copy of it (a publisher's retry, a Pub/Sub
        redelivery), a duplicate once the original is. None otherwise (a conflict, a stored original,
        nothing held there). Pure query."""
        return fast_path.volatile_original(self._books, message)

    def take(self, consumer: str, max_messages: int, now_ms: int) -> list[Deliver]:
        """Hand up to ``max_messages`` ready messages to ``consumer``: per key in order, within
        ``max_in_flight_per_key``, round-robin over ready keys, never a key another consumer has
        messages in flight (or acking) on.

        Should it raise (a bug: a key's books that do not add up), no key is left out of the ready
        queues: the failing key is queued again as it was, and what this call handed out before is
        in flight for ``consumer`` (``consumer_closed``, or its ack deadline, gives it back)."""
        if not consumer or type(consumer) is not str:
            raise ValueError(f"consumer must be a non-empty str, got {consumer!r}")
        result: list[Deliver] = []
        if max_messages <= 0:
            return result
        books = self._books
        if books.none is not None:
            ready = books.none.ready
            while ready and len(result) < max_messages:
                result.append(books.hand_out(None, ready.popleft(), consumer, now_ms))
            return result
        shared = books.ready
        owned = books.owned
        policy = books.policy
        max_in_flight = books.max_in_flight
        mine_turn = True
        while len(result) < max_messages:
            mine = owned.get(consumer)
            if mine and (mine_turn or not shared):
                key = mine.popleft()
                queue_name = consumer
            elif shared:
                key = shared.popleft()
                queue_name = ""
            else:
                break
            mine_turn = not mine_turn
            if key.queued != queue_name:
                continue  # stale: the key was queued again elsewhere
            key.queued = None
            if (
                key.n_ready <= 0
                or key.n_out >= max_in_flight
                or key.backoff_until is not None
                or key.blocked
                or key.dead_lettering
            ):
                continue
            if key.consumer is not None and key.consumer != consumer:
                books.enqueue(key, key.consumer)
                continue
            try:
                entry = policy.pop_head(key)
            except Exception:
                # Books that do not add up (a bug): the key stays queued, as it was, never stranded.
                books.refresh(key, now_ms)
                raise
            result.append(books.hand_out(key, entry, consumer, now_ms))
            books.refresh(key, now_ms)
        return result

    def has_ready(self) -> bool:
        """True if some consumer could ``take`` a message now."""
        books = self._books
        if books.none is not None:
            return bool(books.none.ready)
        for name, queue in ((None, books.ready), *books.owned.items()):
            queue_name = name or ""
            while queue:
                key = queue[0]
                if key.queued == queue_name and books.is_releasable(key):
                    return True
                queue.popleft()
                if key.queued == queue_name:
                    key.queued = None
        return False

    def strip_payload(self, message: Message) -> int:
        """Forget a held message's data and attributes (the store keeps them); returns the bytes
        freed, 0 when the message is not held here or already stripped. Ordering is unaffected:
        the engine never looks inside a payload."""
        books = self._books
        entry = books.find(message)
        if entry is None and books.parked:
            return self._strip_parked(message)
        payload = None if entry is None else entry.message.payload
        if entry is None or entry.state != HELD or payload is None or not strippable(payload):
            return 0
        freed = payload_size(payload)
        entry.message = stripped(entry.message, payload)
        return freed

    def _strip_parked(self, message: Message) -> int:
        parked = self._books.parked
        for i in range(len(parked) - 1, -1, -1):
            held = parked[i]
            if held is message:
                payload = held.payload
                if payload is None or not strippable(payload):
                    return 0
                parked[i] = stripped(held, payload)
                return payload_size(payload)
        return 0

    def is_in_flight(self, delivery_id: str) -> bool:
        """True while ``delivery_id`` is delivered and not yet acked, nacked, expired or returned."""
        entry = self._books.deliveries.get(delivery_id)
        return entry is not None and entry.state == OUT

    def ack(self, consumer: str, delivery_id: str, now_ms: int) -> AckIntent:
        """The app acked: the message is now acking (keeps its slot, never redelivered) until
        ``ack_durable``. Raises UnknownDelivery if the id is not in flight for ``consumer``."""
        return acks.ack(self._books, consumer, delivery_id, now_ms)

    def ack_durable(self, delivery_ids: Iterable[str], now_ms: int) -> list[Action]:
        """The store made these acks durable: cursors advance, slots free up. Ids that are not
        acking (unknown, or already durable) are ignored, so a repeated call is harmless."""
        return acks.ack_durable(self._books, delivery_ids, now_ms)

    def nack(
        self,
        consumer: str,
        delivery_id: str,
        now_ms: int,
        *,
        retry_after_ms: int | None = None,
        dead_letter: bool = False,
    ) -> list[Action]:
        """The app nacked: redeliver after ``retry_after_ms`` or the backoff, with everything after
        it on the key in order; DeadLetter if asked or the attempts are exhausted."""
        return acks.nack(self._books, consumer, delivery_id, now_ms, retry_after_ms, dead_letter)

    def consumer_closed(self, consumer: str, now_ms: int) -> None:
        """A stream ended: its in-flight (not acking) messages are ready again at once, in order,
        without backoff. Acking ones stay acking."""
        acks.consumer_closed(self._books, consumer, now_ms)

    def dead_letter_done(self, message: Message, now_ms: int) -> list[Action]:
        """The dead letter of ``message`` is published and recorded: apply ``on_dead_letter``
        (block the key, or skip past the message). Conflicts and late messages, which never were
        in the key's order, are just forgotten. A message not being dead-lettered is ignored."""
        return dead_letters.dead_letter_done(self._books, message, now_ms)

    def is_blocked(self, key_name: str) -> bool:
        """True while the key is stopped at a dead letter (``on_dead_letter: block``)."""
        key = self._books.keys.get(key_name)
        return key is not None and key.blocked

    def unblock(self, key_name: str, position: object, now_ms: int) -> tuple[Message | None, list[Action]]:
        """An operator skips the dead letter at ``position`` that blocks the key; the store has
        already recorded it durably (``Store.unblock``). The key's later messages are delivered in
        order from here on, as if the dead letter had been skipped. Returns the blocking message
        when this engine holds it (None for a key restored blocked: only the store knew where),
        and a DropDuplicate (``finish_record``) for a pending copy of the skipped message (stored
        again after its tombstone expired): the operator skipped it, it is never delivered.
        Raises KeyNotBlocked when the key is not blocked."""
        return dead_letters.unblock(self._books, key_name, position, now_ms)

    def skip_gap(self, key_name: str, through: int, now_ms: int) -> SkippedRange:
        """An operator skips the missing sequences the key waits on, up to ``through``; the store has
        already recorded the range durably (``Store.skip_gap``). What follows is released as after a
        gap timeout's skip, and a skipped sequence that arrives later is late. Raises
        KeyNotWaitingOnGap or SkipOutOfRange (``gap_skip``); ``missing_range`` checks without applying."""
        return gap_skip.skip_gap(self._books, key_name, through, now_ms)

    def missing_range(self, key_name: str, through: int) -> SkippedRange:
        """What ``skip_gap`` would skip, without skipping it (raises as it does)."""
        return gap_skip.missing_range(self._books, key_name, through)

    def advance_watermark(self, watermark_ms: int, now_ms: int) -> list[Action]:
        """Release what the watermark passed. A watermark at or below the current one is ignored
        (it never moves back); outside watermark mode this is a no-op."""
        books = self._books
        wm = books.wm
        if wm is None or (wm.watermark_ms is not None and watermark_ms <= wm.watermark_ms):
            return []
        if books.loading:
            # A message not read yet may be earlier than what the watermark would release.
            if books.loading_watermark_ms is None or watermark_ms > books.loading_watermark_ms:
                books.loading_watermark_ms = int(watermark_ms)
            return []
        for key in wm.advance(int(watermark_ms)):
            books.refresh(key, now_ms)
        return []

    def tick(self, now_ms: int) -> list[Action]:
        """Run what is due: ack deadlines (a nack with backoff, counted as an attempt), backoff
        ends, gap timeouts, dedup memory pruning, and decisions left over from ``restore``."""
        books = self._books
        actions: list[Action] = []
        if books.deferred and books.deferred_due_ms is not None and books.deferred_due_ms <= now_ms:
            actions.extend(books.deferred)
            books.deferred.clear()
            books.deferred_due_ms = None
        heap = books.timers
        while (timer := heap.pop_due(now_ms)) is not None:
            _due, _, kind, subject, token = timer
            if kind == _timers.DEADLINE:
                entry: Entry = subject  # type: ignore[assignment]
                if entry.state == OUT and entry.delivery_id == token:
                    books.counts["expired"] += 1
                    actions.extend(acks.fail(books, entry, now_ms, None, False, from_timer=True))
                else:
                    heap.forget_stale()
            elif kind == _timers.KEY_BACKOFF:
                key: KeyLedger = subject  # type: ignore[assignment]
                if key.backoff_until == token:
                    key.backoff_until = key.backoff_since = None
                    books.refresh(key, now_ms)
            elif kind == _timers.ENTRY_BACKOFF:
                entry = subject  # type: ignore[assignment]
                if entry.state == BACKOFF and entry.deliveries == token:
                    entry.state = HELD
                    books.none.ready.append(entry)  # type: ignore[union-attr]
            elif kind == _timers.GAP:
                key = subject  # type: ignore[assignment]
                if (key.gap_missing, key.gap_since) == token and books.seq.gap(key) == key.gap_missing:  # type: ignore[union-attr]
                    self._on_gap_timeout(key, now_ms)
        if books.memory is not None:
            books.memory.prune(now_ms)
        heap.maybe_compact(_is_live)
        return actions

    def next_timer_ms(self) -> int | None:
        """When ``tick`` next has something to do (None: nothing scheduled)."""
        books = self._books
        due = books.timers.peek_ms(_is_live)
        if books.deferred_due_ms is not None and (due is None or books.deferred_due_ms < due):
            due = books.deferred_due_ms
        if books.memory is not None:
            prune = books.memory.next_prune_ms()
            if prune is not None and (due is None or prune < due):
                due = prune
        return due

    def _on_gap_timeout(self, key: KeyLedger, now_ms: int) -> None:
        books = self._books
        books.counts["gap_timeouts"] += 1
        if books.config.on_gap_timeout != "skip":
            return  # hold: the key keeps waiting, visibly (status)
        books.counts["skipped"] += books.seq.skip_gap(key)  # type: ignore[union-attr]
        key.gap_missing = key.gap_since = None
        books.refresh(key, now_ms)

    # ---- status -----------------------------------------------------------------------------

    def undelivered(self) -> int:
        """Messages releasable or in flight (``status``'s ready + in_flight), in O(1)."""
        return status.undelivered(self._books)

    def status(self, now_ms: int, *, max_keys: int = 100) -> tuple[EngineStatus, list[KeyStatus]]:
        """Counters in O(1); then at most ``max_keys`` keys, waiting ones first, oldest wait first."""
        return status.status(self._books, now_ms, max_keys)

    # ---- white-box views (the property tests check the books through these) --------------

    @property
    def _keys(self) -> dict[str, KeyLedger]:
        return self._books.keys

    @property
    def _deliveries(self) -> dict[str, Entry]:
        return self._books.deliveries

    def _find(self, message: Message) -> Entry | None:
        return self._books.find(message)


def _is_live(timer: _timers.Timer) -> bool:
    """Whether a timer still applies (the token it was set with still matches its subject)."""
    _due, _, kind, subject, token = timer
    if kind == _timers.DEADLINE:
        return bool(subject.state == OUT and subject.delivery_id == token)  # type: ignore[attr-defined]
    if kind == _timers.KEY_BACKOFF:
        return bool(subject.backoff_until == token)  # type: ignore[attr-defined]
    if kind == _timers.ENTRY_BACKOFF:
        return bool(subject.state == BACKOFF and subject.deliveries == token)  # type: ignore[attr-defined]
    return bool((subject.gap_missing, subject.gap_since) == token)  # type: ignore[attr-defined]
