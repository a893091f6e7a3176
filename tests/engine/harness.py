"""A driver for property tests: runs an engine through operations, plays the I/O layers (store,
dead-letter publisher, app) and checks the guarantees after every step.

The "store" is the engine's own ``export()``: a crash keeps what it holds (cursors that only durable
acks moved, pending messages) and loses everything else (in-flight deliveries, acks not durable).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from sidecar.engine import (
    DeadLetter,
    Deliver,
    DropDuplicate,
    Engine,
    EngineConfig,
    EngineSnapshot,
    Hold,
    Message,
)
from sidecar.engine.state import ACKING, DONE


def seq_message(key: str, seq: int, *, variant: int = 0, stored_at_ms: int = 0) -> Message:
    return Message(
        key=key,
        dedup_id=f"{key}/{seq}" + (f"~{variant}" if variant else ""),
        message_id=f"m-{key}-{seq}-{variant}",
        known_fingerprint=f"{key}/{seq}/{variant}".encode(),
        stored_at_ms=stored_at_ms,
        sequence=seq,
    )


def wm_message(key: str, timestamp_ms: int, dedup_id: str, *, stored_at_ms: int = 0) -> Message:
    return Message(
        key=key,
        dedup_id=dedup_id,
        message_id=f"m-{dedup_id}",
        known_fingerprint=dedup_id.encode(),
        stored_at_ms=stored_at_ms,
        timestamp_ms=timestamp_ms,
    )


def replay_of(message: Message, replay_id: str) -> Message:
    """An operator's replay of ``message`` (a dead letter): same key, position, dedup id and
    content, a new Pub/Sub message id and its own replay id."""
    return replace(message, message_id=f"replay-{replay_id}", replay_id=replay_id)


def walked_cursor(engine: Engine, key_name: str) -> object:
    """The key's cursor once its acking entries are durable, walked from the head of ``out``
    without the engine's memo (white-box: reads the key's state)."""
    key = engine._keys[key_name]
    cursor = key.cursor
    for handed in key.out:
        if key.heap and key.heap[0] < handed.pos:
            break
        if handed.state not in (ACKING, DONE):
            break
        cursor = handed.pos + 1
    return cursor


def identity(message: Message) -> tuple[object, ...]:
    """What makes two copies "the same message" (DESIGN §4); a replay is a message of its own."""
    if message.replay_id:
        return ("replay", message.replay_id)
    if message.sequence is not None:
        return (message.key, message.sequence)
    return (message.dedup_id,)


def position(message: Message) -> object:
    if message.sequence is not None:
        return message.sequence
    if message.timestamp_ms is not None:
        return (message.timestamp_ms, message.dedup_id)
    return message.dedup_id


@dataclass
class Harness:
    config: EngineConfig
    now_ms: int = 1_000
    engine: Engine = field(init=False)
    accepted: dict[tuple[object, ...], Message] = field(default_factory=dict)
    """First copy of every identity given to on_stored (the store would have kept exactly that)."""
    durable: set[tuple[object, ...]] = field(default_factory=set)
    dead_lettered: set[tuple[object, ...]] = field(default_factory=set)
    skipped: dict[str, set[int]] = field(default_factory=dict)
    in_flight: dict[str, tuple[str, Deliver]] = field(default_factory=dict)  # delivery id -> consumer, deliver
    acking: list[str] = field(default_factory=list)
    ack_ids: dict[str, tuple[object, ...]] = field(default_factory=dict)
    acked_this_life: set[tuple[object, ...]] = field(default_factory=set)
    handed_this_life: set[tuple[object, ...]] = field(default_factory=set)
    furthest_this_life: dict[str, object] = field(default_factory=dict)
    """Per key, the furthest position handed out in order in this life (late and replays aside)."""
    durable_cursors: dict[str, int] = field(default_factory=dict)
    """sequence mode: per key, the furthest cursor the engine exported once acks were durable."""
    stored_copies: list[Message] = field(default_factory=list)
    """Every message given to ``store`` (a publisher's retry or a redelivery may bring any again)."""
    failures_this_life: dict[tuple[object, ...], int] = field(default_factory=dict)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    dead_letter_done: set[tuple[object, ...]] = field(default_factory=set)
    dead_letter_messages: list[Message] = field(default_factory=list)
    """Every message whose dead letter was published (what an operator could replay)."""
    replays: int = 0
    replayed_keys: set[str] = field(default_factory=set)
    flagged: set[tuple[object, ...]] = field(default_factory=set)
    """Replays the engine placed outside their key's order (to be delivered flagged ``replayed``)."""
    watermark_ms: int | None = None
    deliveries: int = 0
    pages: random.Random | None = None
    """Recover by pages (``restore(loading=True)``, ``restore_pending``, ``finish_loading``), in an
    order drawn from this generator, as the runtime does; None: everything at once."""
    unloaded: list[Message] = field(default_factory=list)
    """Pending in the store, not restored yet (a paged recovery in progress)."""
    recovered_by_pages: set[Message] = field(default_factory=set)
    """Every record a paged recovery restored or will restore."""
    restored_by_pages: set[Message] = field(default_factory=set)
    """The records the load in progress has restored from its pages so far."""

    def __post_init__(self) -> None:
        self.engine = Engine(self.config, id_prefix="life0-")
        self.lives = 0

    # ---- operations ---------------------------------------------------------------------------

    def store(self, message: Message) -> None:
        self.stored_copies.append(message)
        ident = identity(message)
        if self.lives and (ident in self.durable or ident in self.dead_letter_done):
            # Firestore keeps a tombstone: a copy of a finished message never reaches the engine
            # again. (Before the first crash the engine's own memory must catch these copies.)
            return
        if self.engine.loading and message in self.restored_by_pages:
            return  # that record reached the engine from its page: the runtime hands it once (admit)
        if self.unloaded:
            # A copy of a record not restored yet: the runtime hands the record now (its store
            # read it back) and leaves it out of the page that holds it.
            self.unloaded = [m for m in self.unloaded if m != message]
        first = self.accepted.get(ident)
        actions = self.engine.on_stored(message, self.now_ms)
        assert len(actions) <= 1
        for action in actions:
            assert not isinstance(action, Deliver)
            if isinstance(action, DropDuplicate):
                # Only a copy of something already known may be dropped (G1): for a replay, a copy
                # of that very replay (never its original, nor another replay of it).
                assert first is not None, f"distinct message dropped as duplicate: {message}"
            elif isinstance(action, DeadLetter) and action.reason == "replay_behind":
                assert message.replay_id and self.config.on_replay_behind == "refuse", action
                self.accepted.setdefault(ident, message)
                self.dead_lettered.add(ident)
                self.dead_letters.append(action)
            elif isinstance(action, DeadLetter):
                if action.reason == "conflict":
                    assert first is not None and first.fingerprint != message.fingerprint
                else:
                    # below_cursor: below a restored cursor, where the engine cannot tell skipped from acked.
                    assert action.reason == "late" or (action.reason == "below_cursor" and self.lives), action
                    self.accepted.setdefault(ident, message)
                    self.dead_lettered.add(ident)
                self.dead_letters.append(action)
            else:
                assert isinstance(action, Hold)
        if (first is None and not actions) or (actions and isinstance(actions[0], Hold)):
            self.accepted.setdefault(ident, message)
            self._note_replay_place(message)

    def _note_replay_place(self, message: Message) -> None:
        """Where the engine put a replay: flagged, or in its key's order (checked by G2 then)."""
        entry = self.engine._find(message)
        if message.replay_id and entry is not None and entry.message == message:
            if entry.replayed:
                self.flagged.add(identity(message))
            else:
                self.flagged.discard(identity(message))

    def replay(self, index: int, copies: int) -> None:
        """An operator replays a dead letter (each ``copies`` times: a replay run killed and run again)."""
        if not self.dead_letter_messages:
            return
        original = self.dead_letter_messages[index % len(self.dead_letter_messages)]
        self.replays += 1
        self.replayed_keys.add(original.key)
        message = replay_of(original, f"r{self.replays}")
        for _ in range(copies):
            self.store(message)

    def take(self, consumer: str, count: int) -> list[Deliver]:
        deliveries = self.engine.take(consumer, count, self.now_ms)
        for delivery in deliveries:
            self._check_delivery(delivery)
            self.in_flight[delivery.delivery_id] = (consumer, delivery)
            self.handed_this_life.add(identity(delivery.message))
            self.deliveries += 1
        return deliveries

    def ack(self, index: int) -> None:
        if not self.in_flight:
            return
        delivery_id = sorted(self.in_flight)[index % len(self.in_flight)]
        consumer, delivery = self.in_flight.pop(delivery_id)
        intent = self.engine.ack(consumer, delivery_id, self.now_ms)
        assert intent.message == delivery.message
        if delivery.message.sequence is not None and not delivery.late and not delivery.replayed:
            # The cursor an ack gives is memoised across acks; it must equal a walk from the start.
            assert intent.cursor == walked_cursor(self.engine, delivery.message.key), (intent, delivery)
        self.acking.append(delivery_id)
        self.ack_ids[delivery_id] = identity(delivery.message)
        self.acked_this_life.add(identity(delivery.message))

    def store_copy(self, index: int) -> None:
        """A copy of a message stored earlier arrives again (a publisher's retry, a redelivery)."""
        if self.stored_copies:
            self.store(self.stored_copies[index % len(self.stored_copies)])

    def make_acks_durable(self, pick: random.Random | None = None) -> None:
        """The store makes the acks durable: all at once, or (``pick``) some of them, in any order
        (commits of separate batches finish in any order)."""
        ids, self.acking = self.acking, []
        if pick is not None and ids:
            pick.shuffle(ids)
            cut = pick.randrange(1, len(ids) + 1)
            ids, self.acking = ids[:cut], ids[cut:]
        self._made_durable(ids)

    def _made_durable(self, ids: list[str]) -> None:
        self.engine.ack_durable(ids, self.now_ms)
        for delivery_id in ids:
            self.durable.add(self.ack_ids.pop(delivery_id))
        if self.config.mode == "sequence":
            # The cursor written to the store never moves back: a key's durable order only grows.
            for cursor in self.engine.export().cursors:
                before = self.durable_cursors.get(cursor.key)
                if before is not None and cursor.next_sequence is not None:
                    assert cursor.next_sequence >= before, f"cursor moved back: {cursor} after {before}"
                if cursor.next_sequence is not None:
                    self.durable_cursors[cursor.key] = max(before or 0, cursor.next_sequence)

    def nack(self, index: int, *, retry_after_ms: int | None, dead_letter: bool) -> None:
        if not self.in_flight:
            return
        delivery_id = sorted(self.in_flight)[index % len(self.in_flight)]
        consumer, delivery = self.in_flight[delivery_id]
        actions = self.engine.nack(
            consumer, delivery_id, self.now_ms, retry_after_ms=retry_after_ms, dead_letter=dead_letter
        )
        self._after_failure(delivery, actions)

    def close(self, consumer: str) -> None:
        self.engine.consumer_closed(consumer, self.now_ms)
        for delivery_id, (owner, _) in list(self.in_flight.items()):
            if owner == consumer:
                del self.in_flight[delivery_id]

    def advance(self, milliseconds: int) -> None:
        self.now_ms += milliseconds
        due = self.engine.next_timer_ms()
        while due is not None and due <= self.now_ms:
            self._apply_tick(self.engine.tick(self.now_ms))
            following = self.engine.next_timer_ms()
            if following == due:
                break
            due = following

    def advance_watermark(self, watermark_ms: int) -> None:
        self.engine.advance_watermark(watermark_ms, self.now_ms)
        if self.watermark_ms is None or watermark_ms > self.watermark_ms:
            self.watermark_ms = watermark_ms

    def finish_dead_letters(self) -> None:
        letters, self.dead_letters = self.dead_letters, []
        for letter in letters:
            self.engine.dead_letter_done(letter.message, self.now_ms)
            self.dead_letter_messages.append(letter.message)
            if letter.reason != "conflict":
                self.dead_letter_done.add(identity(letter.message))

    def crash_and_recover(self) -> None:
        snapshot = self.engine.export()
        if self.unloaded:  # still pending in the store
            snapshot = EngineSnapshot(snapshot.cursors, snapshot.pending + tuple(self.unloaded), snapshot.watermark_ms)
        self.lives += 1
        if self.pages is not None:
            restored = EngineSnapshot(snapshot.cursors, (), snapshot.watermark_ms)
            self.engine = Engine.restore(
                self.config, restored, self.now_ms, id_prefix=f"life{self.lives}-", loading=True
            )
            self.unloaded = list(snapshot.pending)
            self.recovered_by_pages = set(snapshot.pending)
            self.restored_by_pages = set()
            self.pages.shuffle(self.unloaded)  # pages come in document-name order, not stored order
        else:
            self.engine = Engine.restore(self.config, snapshot, self.now_ms, id_prefix=f"life{self.lives}-")
        self.in_flight.clear()
        self.acking.clear()  # not durable: lost with the process
        self.ack_ids.clear()
        self.acked_this_life = set()
        self.handed_this_life = set()
        self.furthest_this_life = {}
        self.failures_this_life = {}
        self.dead_letters.clear()  # not done: still pending in the snapshot, decided again
        for message in snapshot.pending:
            self._note_replay_place(message)
        self._apply_tick(self.engine.tick(self.now_ms))

    def restore_page(self, size: int) -> None:
        """The next page of a paged recovery; after the last one, ``finish_loading``."""
        if not self.engine.loading:
            return
        page, self.unloaded = self.unloaded[:size], self.unloaded[size:]
        self.engine.restore_pending(page, self.now_ms)
        self.restored_by_pages.update(page)
        for message in page:
            self._note_replay_place(message)
        self._apply_tick(self.engine.tick(self.now_ms))
        if not self.unloaded:
            self._apply_tick(self.engine.finish_loading(self.now_ms))

    # ---- checks -------------------------------------------------------------------------------

    def _check_delivery(self, delivery: Deliver) -> None:
        message = delivery.message
        ident = identity(message)
        # G3: a durably acked message is never delivered again.
        assert ident not in self.durable, f"durably acked message delivered again: {message}"
        if self.accepted.get(ident) != message and message in self.recovered_by_pages:
            # Two conflicting records of one position were both pending at a crash (the second's
            # dead letter not yet recorded): read by pages, either may come first and be the one
            # delivered, the other dead-lettered as the conflict (docs/store.md).
            self.accepted[ident] = message
        assert self.accepted.get(ident) == message, "delivered a copy that was not the accepted one"
        # Bounded attempts (per engine life: attempts are not part of a snapshot).
        assert delivery.attempt >= 1
        for skipped in delivery.skipped:
            self.skipped.setdefault(message.key, set()).update(range(skipped.first, skipped.last + 1))
            # A gap timeout passes only sequences nobody stored: never one still unread by a paged recovery.
            unread = [
                m.sequence
                for m in self.recovered_by_pages
                if m.key == message.key and m.sequence is not None and skipped.first <= m.sequence <= skipped.last
            ]
            assert not unread, f"skipped {unread} of key {message.key}: pending in the store, not read yet"
        assert not delivery.replayed or (message.replay_id and self.config.on_replay_behind == "deliver_flagged")
        if delivery.late or delivery.replayed:
            return
        if self.config.mode == "watermark":
            assert self.watermark_ms is not None and message.timestamp_ms <= self.watermark_ms, "watermark rule"
        if self.config.mode == "none":
            return
        # G2: every earlier message of the key is acked, skipped or dead-lettered (one in flight),
        # or at least handed out already (several in flight).
        strict = self.config.max_in_flight_per_key == 1
        done = self.durable | self.dead_lettered | self.acked_this_life
        key_skipped = self.skipped.get(message.key, set())
        if self.config.mode == "sequence":
            for seq in range(self.config.sequence_start, message.sequence):
                other = (message.key, seq)
                if seq in key_skipped or other in done:
                    continue
                assert not strict and other in self.handed_this_life, f"G2: {message.key}/{seq} before {message}"
            # A replay the engine put in its key's order holds back what follows it like any message.
            for other_ident, other in self.accepted.items():
                if (
                    other.replay_id
                    and other.key == message.key
                    and other.sequence < message.sequence  # type: ignore[operator]
                    and other_ident not in done
                    and other_ident not in self.flagged
                ):
                    assert not strict and other_ident in self.handed_this_life, f"G2: {other} before {message}"
        else:
            mine = position(message)
            for other_ident, other in self.accepted.items():
                if other.key != message.key or position(other) >= mine or other_ident in done:  # type: ignore[operator]
                    continue
                if other_ident in self.flagged:
                    continue  # a replay outside the order: delivered flagged, whenever
                assert not strict and other_ident in self.handed_this_life, f"G2: {other} before {message}"
        if not message.replay_id and ident not in self.handed_this_life:
            # G2 the other way round: a message handed out in order for the first time comes after
            # nothing of its key that was handed out in order before it (in this life: a restart
            # forgets the skips that were not made durable, and redelivers from the cursor).
            mine = position(message)
            furthest = self.furthest_this_life.get(message.key)
            assert furthest is None or furthest < mine, f"G2: {message} first handed out after {furthest}"  # type: ignore[operator]
            self.furthest_this_life[message.key] = mine
        if strict:
            for _, flying in self.in_flight.values():
                assert flying.message.key != message.key or flying.late, "two in flight on one key"

    def _after_failure(self, delivery: Deliver, actions: list) -> None:
        ident = identity(delivery.message)
        self.failures_this_life[ident] = self.failures_this_life.get(ident, 0) + 1
        # G5: never more failed attempts than allowed before the dead letter.
        assert self.failures_this_life[ident] <= self.config.max_delivery_attempts
        # The nacked delivery and later ones of its key that were in flight are no longer valid.
        for delivery_id in list(self.in_flight):
            if not self._is_in_flight(delivery_id):
                del self.in_flight[delivery_id]
        for action in actions:
            assert isinstance(action, DeadLetter)
            assert action.message == delivery.message
            self.dead_letters.append(action)
            self.dead_lettered.add(ident)

    def _apply_tick(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, DeadLetter):
                # below_cursor: a late message pending at a crash, replayed below the restored cursor.
                reasons = ("max_delivery_attempts", "late", "app_dead_letter", "replay_behind", "below_cursor")
                if action.reason in reasons:
                    self.dead_lettered.add(identity(action.message))
                self.dead_letters.append(action)
        # An expiry fails the expired delivery and gives back the later ones of its key: count a
        # failure only for the first of each key (late deliveries fail on their own).
        vanished: dict[object, Deliver] = {}
        for delivery_id in list(self.in_flight):
            if not self._is_in_flight(delivery_id):
                _, delivery = self.in_flight.pop(delivery_id)
                group = (
                    (delivery.message.key, delivery.delivery_id)
                    if delivery.late or self.config.mode == "none"
                    else delivery.message.key
                )
                first = vanished.get(group)
                if first is None or position(delivery.message) < position(first.message):  # type: ignore[operator]
                    vanished[group] = delivery
        for delivery in vanished.values():
            ident = identity(delivery.message)
            self.failures_this_life[ident] = self.failures_this_life.get(ident, 0) + 1
            assert self.failures_this_life[ident] <= self.config.max_delivery_attempts

    def _is_in_flight(self, delivery_id: str) -> bool:
        entry = self.engine._deliveries.get(delivery_id)
        return entry is not None and entry.state == 1  # OUT

    def drain(self, max_rounds: int = 400) -> None:
        """Play a well-behaved app until nothing moves: ack everything, finish dead letters."""
        while self.engine.loading:
            self.restore_page(3)
        for _ in range(max_rounds):
            self.advance_watermark(10**12)
            self.finish_dead_letters()
            while self.in_flight:
                self.ack(0)
            self.make_acks_durable()
            self.take("drain", 1000)
            if not self.in_flight and not self.dead_letters:
                due = self.engine.next_timer_ms()
                if due is None or due > self.now_ms + 10**10:
                    return
                self.advance(max(due - self.now_ms, 1))
        raise AssertionError("engine did not settle")

    def check_nothing_lost(self) -> None:
        """Every accepted message is durably acked, dead-lettered, or still visibly held."""
        pending = {identity(m) for m in self.engine.export().pending}
        status, keys = self.engine.status(self.now_ms, max_keys=10**6)
        assert self.engine.undelivered() == status.ready + status.in_flight
        for ident, message in self.accepted.items():
            if ident in self.durable or ident in self.dead_lettered:
                continue
            assert ident in pending, f"lost: {message}"
        if pending:
            assert status.buffered >= 1
            waiting = {k.key for k in keys if k.state != "idle"}
            # After draining, a key may only hold messages for a real reason: a dead letter that
            # blocks it, or (sequence mode) a sequence that never arrived.
            for key_status in keys:
                if key_status.state == "blocked_dead_letter":
                    continue
                assert self.config.mode == "sequence", f"held after drain: {key_status}"
                assert key_status.state == "waiting_sequence", key_status
                missing = (key_status.key, key_status.missing_sequence)
                if missing in self.dead_lettered and key_status.key in self.replayed_keys:
                    # Known limit: several in flight, two dead letters of one key under ``block``: a
                    # replay of the first moves the key on to the second, which waits for its own
                    # replay (or an unblock) like a missing sequence. Visible, never passed.
                    continue
                assert missing not in self.accepted, key_status
            for ident in pending:
                message = self.accepted.get(ident)
                if message is not None and message.key is not None and self.config.mode != "none":
                    assert message.key in waiting, f"held silently: {message}"
