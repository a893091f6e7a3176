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
   but the next ``attempt`` number still counts every earlier delivery.
6. Replays (``Message.replay_id``, an operator's ``dead-letters replay``) never reorder anything
   else. A replay at the position its key is blocked at takes the dead letter's place and is the
   key's next message (its durable ack moves the key on); one at a position the key has not reached
   is an ordinary arrival there; one the key has passed (or holds another message at) is handed
   out outside the order flagged
   ``replayed`` (``on_replay_behind: deliver_flagged``, like a late message: it never moves the
   cursor) or dead-lettered aside as ``replay_behind`` (``refuse``). In none mode a replay is an
   ordinary message. Its identity is its replay id, so it is no duplicate of its original.

Backoff after the n-th failed delivery of a message (``retry_after_ms`` from the nack wins)::

    delay_ms = int(min(backoff_maximum_ms, backoff_initial_ms * 2 ** (n - 1)) * (0.5 + jitter()))

In sequence and watermark mode the whole key waits out the delay (its order depends on the nacked
message); in none mode only that message does.

Cost: O(log b) per message and event (b = the key's backlog), timers in one heap; ``status`` with
``max_keys=0`` is O(1), the per-key list costs one pass over the keys (for the status RPC only).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sidecar.engine import timers as _timers
from sidecar.engine.dedup import DedupMemory, dedup_key
from sidecar.engine.sequence import SequencePolicy
from sidecar.engine.state import ACKING, BACKOFF, BLOCKED, DEAD, DONE, HELD, OUT, Entry, KeyLedger
from sidecar.engine.types import (
    AckIntent,
    Action,
    DeadLetter,
    Deliver,
    DropDuplicate,
    EngineConfig,
    EngineSnapshot,
    EngineStatus,
    Hold,
    KeyCursor,
    KeyStatus,
    Message,
    Payload,
    SkippedRange,
)
from sidecar.engine.types import (
    KeyState as KeyStateName,
)
from sidecar.engine.unordered import UnorderedPolicy
from sidecar.engine.watermark import WatermarkPolicy

_COUNT_NAMES = (
    "stored",
    "recovered",
    "delivered",
    "acked",
    "nacked",
    "expired",
    "returned",
    "duplicates",
    "dead_lettered",
    "late",
    "skipped",
    "gap_timeouts",
    "keys_evicted",
    "unblocked",
    "replays",
    "replays_behind",
)
"""Cumulative counters in ``EngineStatus.counts`` (plus ``dead_lettered:<reason>``)."""

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

_MAX_BACKOFF_EXPONENT = 62
"""2**62 ms is far beyond any maximum: caps the exponent so a huge attempt count stays cheap."""

_ARRIVALS_COMPACT_MIN = 1024
"""The arrival queue is rebuilt without delivered entries once it is twice the undelivered count
plus this: a message held for long must not pin every finished message queued behind it."""


class UnknownDelivery(KeyError):
    """An ack or nack of a delivery id that is not in flight for that consumer."""


class KeyNotBlocked(LookupError):
    """``unblock`` of a key that is not stopped at a dead letter (unknown, running, or still publishing it)."""


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
        _validate(config)
        self._epoch = epoch
        """Stamped on every ``Deliver``: the lease epoch of the shard this engine delivers."""
        self._cursor_source = cursor_source
        """A key's durable cursor by name (the store's): lets idle keys be forgotten and rebuilt."""
        self._idle: OrderedDict[str, KeyLedger] = OrderedDict()
        """Keys with nothing held, in flight or pending, least recently active first."""
        self._max_idle = config.max_idle_keys if cursor_source is not None else None
        self._config = config
        self._mode = config.mode
        self._jitter = jitter
        self._id_prefix = id_prefix
        self._next_id = 0
        self._n = 0  # arrival number
        self._max_in_flight = config.max_in_flight_per_key
        self._ack_deadline_ms = config.ack_deadline_ms
        self._counts: dict[str, int] = dict.fromkeys(_COUNT_NAMES, 0)
        # The three counters touched once per message live in attributes (cheaper than a dict).
        self._stored = 0
        self._delivered = 0
        self._acked = 0
        self._keys: dict[str, KeyLedger] = {}
        self._deliveries: dict[str, Entry] = {}  # OUT and ACKING, by delivery id
        self._consumers: dict[str, dict[str, Entry]] = {}  # OUT only, per consumer
        self._ready: deque[KeyLedger] = deque()  # keys nobody has in flight
        self._owned: dict[str, deque[KeyLedger]] = {}  # keys with messages in flight on that consumer
        self._timers = _timers.TimerHeap()
        self._outside: dict[Message, tuple[int, int]] = {}  # dead letters outside any key order: count, n
        self._outside_ids: dict[object, int] = {}  # their identities: a copy of one is a duplicate
        self._deferred: list[Action] = []
        self._deferred_due_ms: int | None = None
        self._arrivals: deque[Entry] = deque()
        self._n_undelivered = 0
        self._n_pending = 0
        self._n_ready = 0
        self._n_out = 0
        self._n_waiting_keys = 0
        self._n_dead_letter_blocked = 0
        self._memory: DedupMemory | None = None
        self._seq: SequencePolicy | None = None
        self._wm: WatermarkPolicy | None = None
        self._none: UnorderedPolicy | None = None
        if config.mode == "sequence":
            self._seq = SequencePolicy(config)
            self._policy: SequencePolicy | WatermarkPolicy = self._seq
        else:
            self._memory = DedupMemory(config.dedup_ttl_ms, config.dedup_memory_max_entries)
            if config.mode == "watermark":
                self._wm = WatermarkPolicy(config, self._memory)
                self._policy = self._wm
            else:
                self._none = UnorderedPolicy(self._memory)
        self._gap_timeout_ms = config.gap_timeout_ms if config.mode == "sequence" else None
        self._loading = False
        """Restored from cursors while pending messages are still being read (``restore_pending``)."""
        self._loading_watermark_ms: int | None = None
        """The highest watermark offered while loading: applied by ``finish_loading``."""
        self._parked: list[Message] = []
        """sequence mode, while loading: messages of keys with no cursor yet (``first_sequence: any``),
        replayed in stored order by ``finish_loading`` so that adoption picks the same first message
        as a load of everything at once would."""

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
        engine._loading = loading
        seen: set[str] = set()
        for cursor in snapshot.cursors:
            if cursor.key in seen:
                raise ValueError(f"snapshot has two cursors for key {cursor.key!r}")
            seen.add(cursor.key)
            if engine._none is not None:
                continue  # none mode keeps no cursors
            key = engine._key(cursor.key, rebuild=False)
            engine._policy.restore_cursor(key, cursor)
            engine._n_dead_letter_blocked += key.blocked
        if snapshot.watermark_ms is not None and engine._wm is not None:
            if loading:
                engine._loading_watermark_ms = snapshot.watermark_ms  # applied by finish_loading
            else:
                engine._wm.watermark_ms = snapshot.watermark_ms
        engine._replay(sorted(snapshot.pending, key=_stored_at), now_ms)
        for key in list(engine._keys.values()):
            engine._refresh(key, now_ms)
            engine._maybe_idle(key)
        return engine

    @property
    def loading(self) -> bool:
        """Restored with ``loading=True`` and not finished yet (``finish_loading``)."""
        return self._loading

    def restore_pending(self, messages: Iterable[Message], now_ms: int) -> None:
        """More pending messages of a loading engine (one page of the store's read), replayed like
        ``restore``'s: in ``stored_at_ms`` order within the page, decisions other than holding
        returned by the next ``tick``. The caller hands each stored record once per engine."""
        if not self._loading:
            raise RuntimeError("restore_pending: the engine is not loading (restore(..., loading=True))")
        self._replay(sorted(messages, key=_stored_at), now_ms)

    def finish_loading(self, now_ms: int) -> list[Action]:
        """Every pending message has been restored: gap timers start (from ``now_ms``), the
        watermark offered meanwhile applies, the fast path opens, and keys without a cursor adopt
        their first sequence. Returns the decisions of the adoption replay (as ``on_stored`` does)."""
        if not self._loading:
            return []
        self._loading = False
        parked, self._parked = self._parked, []
        actions: list[Action] = []
        stored = self._stored  # counted when they were parked
        for message in sorted(parked, key=_stored_at):
            actions.extend(action for action in self._arrive(message, now_ms) if not isinstance(action, Hold))
        self._stored = stored
        for key in list(self._keys.values()):
            self._refresh(key, now_ms)
        watermark, self._loading_watermark_ms = self._loading_watermark_ms, None
        if watermark is not None:
            actions.extend(self.advance_watermark(watermark, now_ms))
        return actions

    def _replay(self, messages: Iterable[Message], now_ms: int) -> None:
        """Restored messages through ``on_stored``; counted as recovered, not as stored."""
        stored = self._stored
        seq = self._seq
        for message in messages:
            if self._loading and seq is not None and not message.replay_id and self._unadopted(message.key):
                # ``first_sequence: any``: the key adopts the first stored message, known only at the end.
                self._parked.append(message)
                self._stored += 1
                continue
            for action in self._arrive(message, now_ms):
                if not isinstance(action, Hold):
                    self._deferred.append(action)
        self._counts["recovered"] += self._stored - stored
        self._stored = stored
        if self._deferred:
            self._deferred_due_ms = now_ms

    def export(self) -> EngineSnapshot:
        """Cursors plus every message not yet acked durably or dead-lettered, in arrival order.

        In-flight and acking messages are pending: after a restart they are delivered again.
        """
        cursors = []
        pending: list[tuple[int, Message]] = []
        if self._none is None:
            policy = self._policy
            for key in self._keys.values():
                cursor = policy.export_cursor(key)
                if cursor is not None:
                    cursors.append(cursor)
        entries: Iterable[Entry]
        if self._seq is not None:
            entries = [entry for key in self._keys.values() for entry in key.index.values()]
            entries += self._seq.replays.values()
        else:
            entries = (self._wm or self._none).by_id.values()  # type: ignore[union-attr]
        for entry in entries:
            if entry.state not in (DONE, BLOCKED):
                pending.append((entry.n, entry.message))
        for message, (_count, n) in self._outside.items():
            pending.append((n, message))
        pending.extend((self._n + i, message) for i, message in enumerate(self._parked, 1))
        pending.sort(key=_first)
        return EngineSnapshot(
            cursors=tuple(cursors),
            pending=tuple(message for _, message in pending),
            watermark_ms=self._wm.watermark_ms if self._wm is not None else None,
        )

    # ---- events -----------------------------------------------------------------------------

    def on_stored(self, message: Message, now_ms: int) -> list[Action]:
        """A durably stored message arrives. Returns DropDuplicate, DeadLetter ("conflict" or
        "late"), Hold with its reason, or [] when it is ready (delivery is pulled with ``take``)."""
        if self._loading:
            # A record not read yet may precede it (the first stored of two conflicting copies, a
            # lower sequence, an earlier timestamp): it waits for the end of the load.
            self._parked.append(message)
            self._stored += 1
            return [Hold(message, "recovery is still reading this shard's pending messages")]
        return self._arrive(message, now_ms)

    def _unadopted(self, name: str) -> bool:
        key = self._keys.get(name)
        if key is None:
            key = self._key(name)  # an idle key is rebuilt from its cursor
        return key.cursor is None

    def _arrive(self, message: Message, now_ms: int) -> list[Action]:
        self._n += 1
        self._stored += 1
        if self._outside_ids and _identity(message) in self._outside_ids:
            # Its record is the one being dead-lettered: it must stay pending until that is recorded.
            self._counts["duplicates"] += 1
            return [DropDuplicate(message, "duplicate of a message being dead-lettered")]
        key = None
        if self._none is not None:
            action, entry = self._none.arrive(message, self._n, now_ms)
        else:
            key = self._keys.get(message.key)
            if key is None:
                if type(message.key) is not str:
                    raise ValueError(f"message {message.dedup_id!r}: key must be a str, got {message.key!r}")
                key = self._key(message.key)
            elif self._idle:
                self._idle.pop(key.name, None)
            if message.replay_id:
                action, entry = self._arrive_replay(key, message, now_ms)
            elif self._seq is not None:
                action, entry = self._seq.arrive(key, message, self._n)
            else:
                action, entry = self._wm.arrive(key, message, self._n, now_ms)  # type: ignore[union-attr]
        if entry is not None:
            self._n_pending += 1
            self._n_undelivered += 1
            self._arrivals.append(entry)
            if entry.late and not entry.replayed:
                self._counts["late"] += 1
        if action is not None:
            counts = self._counts
            kind = type(action)
            if kind is DropDuplicate:
                counts["duplicates"] += 1
            elif kind is DeadLetter:
                self._count_dead_letter(action.reason)  # type: ignore[union-attr]
                if action.reason == REASON_LATE:  # type: ignore[union-attr]
                    counts["late"] += 1
                held = self._outside.get(message)
                self._outside[message] = (1, self._n) if held is None else (held[0] + 1, held[1])
                ident = _identity(message)
                self._outside_ids[ident] = self._outside_ids.get(ident, 0) + 1
        if key is not None:
            self._refresh(key, now_ms)
        return [] if action is None else [action]

    def _arrive_replay(self, key: KeyLedger, message: Message, now_ms: int) -> tuple[Action | None, Entry | None]:
        """A replay in an ordered mode (rule 6 of the module docstring)."""
        held = self._find(message)
        if held is not None and held.message.replay_id == message.replay_id:
            # A redelivery of this very replay (its stored record is the held one's): not finished.
            return DropDuplicate(message, "duplicate of a replay the engine holds"), None
        self._counts["replays"] += 1
        policy = self._policy
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
            self._n_dead_letter_blocked -= 1
            if self._seq is not None:
                return self._seq.resume_at(key, blocking, message, self._n)
            return self._wm.resume_at(key, blocking, message, self._n, now_ms)  # type: ignore[union-attr]
        if policy.replay_place(key, message) == "ahead":
            if self._seq is not None:
                return self._seq.arrive(key, message, self._n)
            return self._wm.arrive(key, message, self._n, now_ms)  # type: ignore[union-attr]
        self._counts["replays_behind"] += 1
        if self._config.on_replay_behind == "refuse":
            return DeadLetter(message, REASON_REPLAY_BEHIND, 0), None
        entry = Entry(message, key, position, self._n)
        entry.late = entry.replayed = True
        policy.add_flagged(key, entry)
        return None, entry

    def fast_path(self, message: Message) -> bool:
        """True when ``message`` may skip the store (sequence mode's in-order fast path): it is the
        first position its key is missing, so it joins the run of messages ready in order at once
        (behind those in flight or ready, ahead of any held beyond a gap), and its key is neither
        blocked, dead-lettering nor backing off. It then waits for nothing but the app: Pub/Sub can
        keep it meanwhile. Pure query: the caller hands it to ``on_stored`` flagged ``volatile``."""
        if message.volatile is False:
            return False
        key = self._open_key(message)
        return key is not None and message.sequence == key.run_end

    def awaits_predecessor(self, message: Message) -> bool:
        """True when ``message`` is beyond the first position its key is missing, on a key the fast
        path could serve (what ``fast_path`` asks, but the sequence is above ``run_end``): once that
        position arrives and takes the fast path, this message could follow it. Pure query, like
        ``fast_path``."""
        key = self._open_key(message)
        return key is not None and message.sequence is not None and message.sequence > key.run_end

    def volatile_original(self, message: Message) -> Message | None:
        """The fast-path message this engine holds at ``message``'s position with the same content
        (fingerprint), not yet finished: ``message`` is a copy of it (a publisher's retry, a Pub/Sub
        redelivery), a duplicate once the original is. None otherwise (a conflict, a stored original,
        nothing held there). Pure query."""
        if self._seq is None or message.replay_id or message.sequence is None:
            return None
        key = self._keys.get(message.key)
        held = None if key is None else key.index.get(message.sequence)
        if held is None or held.n == 0 or not held.message.volatile or held.message.replay_id:
            return None
        return held.message if held.message.fingerprint == message.fingerprint else None

    def _open_key(self, message: Message) -> KeyLedger | None:
        """``message``'s key when the fast path could serve it at all: sequence mode, not loading, not a
        replay, a position not held already, and a key neither blocked, dead-lettering nor backing off."""
        if self._seq is None or self._loading or message.replay_id or message.sequence is None:
            return None
        key = self._keys.get(message.key) or self._key(message.key)  # an idle key is rebuilt from its cursor
        if (
            key.cursor is None
            or message.sequence in key.index
            or key.blocked
            or key.dead_lettering
            or key.backoff_until is not None
            or self._seq.replays
        ):
            return None
        return key

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
        if self._none is not None:
            ready = self._none.ready
            while ready and len(result) < max_messages:
                result.append(self._hand_out(None, ready.popleft(), consumer, now_ms))
            return result
        shared = self._ready
        owned = self._owned
        policy = self._policy
        max_in_flight = self._max_in_flight
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
                self._enqueue(key, key.consumer)
                continue
            try:
                entry = policy.pop_head(key)
            except Exception:
                # Books that do not add up (a bug): the key stays queued, as it was, never stranded.
                self._refresh(key, now_ms)
                raise
            result.append(self._hand_out(key, entry, consumer, now_ms))
            self._refresh(key, now_ms)
        return result

    def has_ready(self) -> bool:
        """True if some consumer could ``take`` a message now."""
        if self._none is not None:
            return bool(self._none.ready)
        for name, queue in ((None, self._ready), *self._owned.items()):
            queue_name = name or ""
            while queue:
                key = queue[0]
                if key.queued == queue_name and self._is_releasable(key):
                    return True
                queue.popleft()
                if key.queued == queue_name:
                    key.queued = None
        return False

    def strip_payload(self, message: Message) -> int:
        """Forget a held message's data and attributes (the store keeps them); returns the bytes
        freed, 0 when the message is not held here or already stripped. Ordering is unaffected:
        the engine never looks inside a payload."""
        entry = self._find(message)
        if entry is None and self._parked:
            return self._strip_parked(message)
        payload = None if entry is None else entry.message.payload
        if entry is None or entry.state != HELD or payload is None or payload.stripped or not payload.ref:
            return 0
        freed = payload_size(payload)
        entry.message = replace(entry.message, payload=replace(payload, data=b"", attributes={}, stripped=True))
        return freed

    def _strip_parked(self, message: Message) -> int:
        for i in range(len(self._parked) - 1, -1, -1):
            parked = self._parked[i]
            if parked is message:
                payload = parked.payload
                if payload is None or payload.stripped or not payload.ref:
                    return 0
                self._parked[i] = replace(parked, payload=replace(payload, data=b"", attributes={}, stripped=True))
                return payload_size(payload)
        return 0

    def is_in_flight(self, delivery_id: str) -> bool:
        """True while ``delivery_id`` is delivered and not yet acked, nacked, expired or returned."""
        entry = self._deliveries.get(delivery_id)
        return entry is not None and entry.state == OUT

    def ack(self, consumer: str, delivery_id: str, now_ms: int) -> AckIntent:
        """The app acked: the message is now acking (keeps its slot, never redelivered) until
        ``ack_durable``. Raises UnknownDelivery if the id is not in flight for ``consumer``."""
        entry = self._deliveries.get(delivery_id)
        if entry is None or entry.state != OUT or entry.consumer != consumer:
            raise UnknownDelivery(f"delivery {delivery_id!r} is not in flight for consumer {consumer!r}")
        entry.state = ACKING
        del self._consumers[consumer][delivery_id]
        self._timers.mark_stale()
        # The app acked: its slot is free at once (G2 asks only for the app's ack), so the key's next
        # message need not wait for the ack to become durable (a coalesced cursor may take a second).
        self._n_out -= 1
        key = entry.key
        cursor = None if key is None else self._policy.cursor_if_acked(key, entry)
        skipped: tuple[SkippedRange, ...] = ()
        if key is not None:
            key.n_out -= 1
            if key.n_out == 0:
                key.consumer = None
            if key.unrecorded_skips and type(cursor) is int and not entry.replayed:
                # The ranges a gap skip passed below this cursor ride on the ack (``AckIntent.skipped``).
                skipped = tuple(skip for skip in key.unrecorded_skips if skip.first < cursor)
                entry.unrecorded_through = cursor
            self._refresh(key, now_ms)
        return AckIntent(delivery_id, entry.message, cursor, aside=entry.replayed, skipped=skipped)

    def ack_durable(self, delivery_ids: Iterable[str], now_ms: int) -> list[Action]:
        """The store made these acks durable: cursors advance, slots free up. Ids that are not
        acking (unknown, or already durable) are ignored, so a repeated call is harmless."""
        deliveries = self._deliveries
        actions: list[Action] = []
        for delivery_id in delivery_ids:
            entry = deliveries.get(delivery_id)
            if entry is None or entry.state != ACKING:
                continue
            del deliveries[delivery_id]
            self._acked += 1
            through = entry.unrecorded_through
            if through is not None and entry.key is not None:
                # The skipped ranges this ack carried are in the store now.
                key = entry.key
                key.unrecorded_skips = [skip for skip in key.unrecorded_skips if skip.last >= through]
            self._finish(entry, now_ms, occupied=False)  # its slot was freed by ``ack``
            if entry.twin is not None:
                # The stored copy of a fast-path message: its ack is durable now, so its record may go.
                actions.append(DropDuplicate(entry.twin, "stored copy of an acked message", finish_record=True))
        return actions

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
        entry = self._deliveries.get(delivery_id)
        if entry is None or entry.state != OUT or entry.consumer != consumer:
            raise UnknownDelivery(f"delivery {delivery_id!r} is not in flight for consumer {consumer!r}")
        if retry_after_ms is not None and retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {retry_after_ms}")
        self._counts["nacked"] += 1
        return self._fail(entry, now_ms, retry_after_ms, dead_letter, from_timer=False)

    def consumer_closed(self, consumer: str, now_ms: int) -> None:
        """A stream ended: its in-flight (not acking) messages are ready again at once, in order,
        without backoff. Acking ones stay acking."""
        in_flight = self._consumers.pop(consumer, None)
        stranded = self._owned.pop(consumer, None)
        touched: dict[int, KeyLedger] = {}
        if in_flight:
            entries = sorted(in_flight.values(), key=_arrival)
            self._counts["returned"] += len(entries)
            if self._none is not None:
                for entry in entries:
                    self._end_delivery(entry, from_timer=False)
                self._none.ready.extendleft(reversed(entries))
            else:
                by_key: dict[int, list[Entry]] = {}
                for entry in entries:
                    by_key.setdefault(id(entry.key), []).append(entry)
                for group in by_key.values():
                    key = group[0].key
                    group.sort(key=_position)
                    self._give_back(key, group)  # type: ignore[arg-type]
                    touched[id(key)] = key  # type: ignore[assignment]
        if stranded:
            for key in stranded:
                if key.queued == consumer:
                    key.queued = None
                    touched[id(key)] = key
        for key in touched.values():
            self._refresh(key, now_ms)

    def dead_letter_done(self, message: Message, now_ms: int) -> list[Action]:
        """The dead letter of ``message`` is published and recorded: apply ``on_dead_letter``
        (block the key, or skip past the message). Conflicts and late messages, which never were
        in the key's order, are just forgotten. A message not being dead-lettered is ignored."""
        outside = self._outside.get(message)
        if outside is not None:
            count, n = outside
            if count > 1:
                self._outside[message] = (count - 1, n)
            else:
                del self._outside[message]
            ident = _identity(message)
            if self._outside_ids.get(ident, 0) > 1:
                self._outside_ids[ident] -= 1
            else:
                self._outside_ids.pop(ident, None)
            return []
        entry = self._find(message)
        if entry is None or entry.state != DEAD or entry.message != message:
            return []
        key = entry.key
        if key is None or entry.late:
            self._finish(entry, now_ms, occupied=False)
            return []
        key.dead_lettering -= 1
        if self._config.on_dead_letter == "skip":
            self._finish(entry, now_ms, occupied=False)
            return []
        entry.state = BLOCKED
        self._n_pending -= 1
        if not key.blocked:
            self._n_dead_letter_blocked += 1
            key.blocked_since = now_ms
        key.blocked = True
        # Several in flight: the key stops at the first of its dead letters (as the store records).
        if key.blocked_pos is None or entry.pos < key.blocked_pos:  # type: ignore[operator]
            key.blocked_pos = entry.pos
        self._policy.on_blocked(key, entry)
        self._refresh(key, now_ms)
        return []

    def is_blocked(self, key_name: str) -> bool:
        """True while the key is stopped at a dead letter (``on_dead_letter: block``)."""
        key = self._keys.get(key_name)
        return key is not None and key.blocked

    def unblock(self, key_name: str, position: object, now_ms: int) -> tuple[Message | None, list[Action]]:
        """An operator skips the dead letter at ``position`` that blocks the key; the store has
        already recorded it durably (``Store.unblock``). The key's later messages are delivered in
        order from here on, as if the dead letter had been skipped. Returns the blocking message
        when this engine holds it (None for a key restored blocked: only the store knew where),
        and a DropDuplicate (``finish_record``) for a pending copy of the skipped message (stored
        again after its tombstone expired): the operator skipped it, it is never delivered.
        Raises KeyNotBlocked when the key is not blocked."""
        key = self._keys.get(key_name)
        if key is None or not key.blocked:
            raise KeyNotBlocked(f"key {key_name!r} is not blocked by a dead letter")
        key.blocked = False
        key.blocked_since = key.blocked_pos = None
        self._n_dead_letter_blocked -= 1
        self._counts["unblocked"] += 1
        entry = next((e for e in key.out if e.state == BLOCKED), None)
        message = None
        actions: list[Action] = []
        if entry is None:
            copy = self._policy.pass_restored_block(key, position)
            if copy is not None:
                self._n_pending -= 1
                if not copy.deliveries:
                    self._n_undelivered -= 1
                self._counts["duplicates"] += 1
                actions.append(DropDuplicate(copy.message, "the message an operator skipped", finish_record=True))
        else:
            # The BLOCKED entry already left the pending count; it finishes like a skipped one.
            entry.state = DONE
            message = entry.message
            self._retire_finished(key)
        self._refresh(key, now_ms)
        self._maybe_idle(key)
        return message, actions

    def advance_watermark(self, watermark_ms: int, now_ms: int) -> list[Action]:
        """Release what the watermark passed. A watermark at or below the current one is ignored
        (it never moves back); outside watermark mode this is a no-op."""
        wm = self._wm
        if wm is None or (wm.watermark_ms is not None and watermark_ms <= wm.watermark_ms):
            return []
        if self._loading:
            # A message not read yet may be earlier than what the watermark would release.
            if self._loading_watermark_ms is None or watermark_ms > self._loading_watermark_ms:
                self._loading_watermark_ms = int(watermark_ms)
            return []
        for key in wm.advance(int(watermark_ms)):
            self._refresh(key, now_ms)
        return []

    def tick(self, now_ms: int) -> list[Action]:
        """Run what is due: ack deadlines (a nack with backoff, counted as an attempt), backoff
        ends, gap timeouts, dedup memory pruning, and decisions left over from ``restore``."""
        actions: list[Action] = []
        if self._deferred and self._deferred_due_ms is not None and self._deferred_due_ms <= now_ms:
            actions.extend(self._deferred)
            self._deferred.clear()
            self._deferred_due_ms = None
        heap = self._timers
        while (timer := heap.pop_due(now_ms)) is not None:
            _due, _, kind, subject, token = timer
            if kind == _timers.DEADLINE:
                entry: Entry = subject  # type: ignore[assignment]
                if entry.state == OUT and entry.delivery_id == token:
                    self._counts["expired"] += 1
                    actions.extend(self._fail(entry, now_ms, None, False, from_timer=True))
                else:
                    heap.forget_stale()
            elif kind == _timers.KEY_BACKOFF:
                key: KeyLedger = subject  # type: ignore[assignment]
                if key.backoff_until == token:
                    key.backoff_until = key.backoff_since = None
                    self._refresh(key, now_ms)
            elif kind == _timers.ENTRY_BACKOFF:
                entry = subject  # type: ignore[assignment]
                if entry.state == BACKOFF and entry.deliveries == token:
                    entry.state = HELD
                    self._none.ready.append(entry)  # type: ignore[union-attr]
            elif kind == _timers.GAP:
                key = subject  # type: ignore[assignment]
                if (key.gap_missing, key.gap_since) == token and self._seq.gap(key) == key.gap_missing:  # type: ignore[union-attr]
                    self._on_gap_timeout(key, now_ms)
        if self._memory is not None:
            self._memory.prune(now_ms)
        heap.maybe_compact(self._is_live)
        return actions

    def next_timer_ms(self) -> int | None:
        """When ``tick`` next has something to do (None: nothing scheduled)."""
        due = self._timers.peek_ms(self._is_live)
        if self._deferred_due_ms is not None and (due is None or self._deferred_due_ms < due):
            due = self._deferred_due_ms
        if self._memory is not None:
            prune = self._memory.next_prune_ms()
            if prune is not None and (due is None or prune < due):
                due = prune
        return due

    # ---- status -----------------------------------------------------------------------------

    def undelivered(self) -> int:
        """Messages releasable or in flight (``status``'s ready + in_flight), in O(1)."""
        ready = len(self._none.ready) if self._none is not None else self._n_ready
        return ready + self._n_out

    def status(self, now_ms: int, *, max_keys: int = 100) -> tuple[EngineStatus, list[KeyStatus]]:
        """Counters in O(1); then at most ``max_keys`` keys, waiting ones first, oldest wait first."""
        arrivals = self._arrivals
        while arrivals and (arrivals[0].deliveries or arrivals[0].state in (DONE, BLOCKED)):
            arrivals.popleft()
        ready = len(self._none.ready) if self._none is not None else self._n_ready
        status = EngineStatus(
            mode=self._mode,
            buffered=self._n_pending + len(self._parked),
            ready=ready,
            in_flight=self._n_out,
            keys=len(self._keys),
            keys_blocked=self._n_waiting_keys,
            oldest_undelivered_ms=arrivals[0].message.stored_at_ms if arrivals else None,
            watermark_ms=self._wm.watermark_ms if self._wm is not None else None,
            counts=self._all_counts(),
            keys_blocked_dead_letter=self._n_dead_letter_blocked,
        )
        if max_keys <= 0 or self._none is not None:
            return status, []
        never = float("inf")
        candidates = [
            key for key in self._keys.values() if key.n_held or key.n_out or key.blocked or key.dead_lettering
        ]
        candidates.sort(key=lambda k: (not k.waiting, k.wait_since if k.wait_since is not None else never, k.name))
        return status, [self._key_status(key) for key in candidates[:max_keys]]

    def _all_counts(self) -> dict[str, int]:
        counts = dict(self._counts)
        counts["stored"] = self._stored
        counts["delivered"] = self._delivered
        counts["acked"] = self._acked
        return counts

    def _key_status(self, key: KeyLedger) -> KeyStatus:
        state: KeyStateName
        waiting_for = ""
        since = key.wait_since
        missing = None
        blocked_id, blocked_seq = "", None
        if key.blocked:
            state, waiting_for = "blocked_dead_letter", "an operator: the key stopped at a dead letter"
            since = key.blocked_since
            blocking = next((e for e in key.out if e.state == BLOCKED), None)
            if blocking is not None:
                blocked_id, blocked_seq = blocking.message.message_id, blocking.message.sequence
            elif self._seq is not None:
                blocked_seq = key.blocked_pos  # type: ignore[assignment]  # restored blocked: the store knows where
            which = ", ".join(
                part
                for part in (f"sequence {blocked_seq}" if blocked_seq is not None else "",
                             f"message {blocked_id}" if blocked_id else "")
                if part
            )  # fmt: skip
            if which:
                waiting_for = f"an operator: the key stopped at a dead letter ({which})"
        elif key.dead_lettering:
            state, waiting_for = "blocked_dead_letter", "the dead-letter publish to finish"
        elif key.backoff_until is not None:
            state, waiting_for, since = "backoff", f"retry at {_iso(key.backoff_until)}", key.backoff_since
        elif key.n_held and not key.n_ready:
            if self._seq is not None:
                state, waiting_for, missing = "waiting_sequence", self._seq.waiting_for(key), key.next_out
            else:
                head = self._wm.head_timestamp_ms(key)  # type: ignore[union-attr]
                state = "waiting_watermark"
                waiting_for = f"watermark to pass {_iso(head)}" if head is not None else "the watermark"
        elif key.n_out and (not key.n_ready or key.n_out >= self._max_in_flight):
            state, since = "in_flight", None
        elif key.n_ready:
            state, since = "ready", None
        else:
            state, since = "idle", None
        return KeyStatus(
            key=key.name,
            state=state,
            waiting_for=waiting_for,
            since_ms=since,
            buffered=key.n_held + key.n_out,
            in_flight=key.n_out,
            next_sequence=key.cursor if self._seq is not None else None,  # type: ignore[arg-type]
            missing_sequence=missing,
            blocked_message_id=blocked_id,
            blocked_sequence=blocked_seq,
        )

    # ---- internals --------------------------------------------------------------------------

    def _key(self, name: str, *, rebuild: bool = True) -> KeyLedger:
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = KeyLedger(name)
            self._policy.new_key(key)
            if rebuild and self._cursor_source is not None:
                cursor = self._cursor_source(name)  # a key forgotten while idle: rebuilt as it was
                if cursor is not None:
                    self._policy.restore_cursor(key, cursor)
                    self._n_dead_letter_blocked += key.blocked
        return key

    def _maybe_idle(self, key: KeyLedger) -> None:
        """Track a key that holds nothing; forget the longest idle past ``max_idle_keys``."""
        if self._max_idle is None:
            return
        if (
            key.n_held
            or key.n_out
            or key.blocked
            or key.dead_lettering
            or key.backoff_until is not None
            or key.skipped
            or key.adopted
            or key.out
            or key.index
            or key.heap
        ):
            return
        idle = self._idle
        idle[key.name] = key
        idle.move_to_end(key.name)
        while len(idle) > self._max_idle:
            name, forgotten = idle.popitem(last=False)
            if self._keys.get(name) is forgotten:
                del self._keys[name]
                self._counts["keys_evicted"] += 1

    def _find(self, message: Message) -> Entry | None:
        if self._seq is not None:
            flagged = self._seq.find_replay(message)
            if flagged is not None:
                return flagged
            key = self._keys.get(message.key)
            return None if key is None else key.index.get(message.sequence)
        return (self._wm or self._none).find(message)  # type: ignore[union-attr]

    def _is_releasable(self, key: KeyLedger) -> bool:
        return (
            key.n_ready > 0
            and key.n_out < self._max_in_flight
            and key.backoff_until is None
            and not key.blocked
            and not key.dead_lettering
        )

    def _enqueue(self, key: KeyLedger, queue_name: str) -> None:
        key.queued = queue_name
        if queue_name:
            queue = self._owned.get(queue_name)
            if queue is None:
                queue = self._owned[queue_name] = deque()
            queue.append(key)
        else:
            self._ready.append(key)

    def _refresh(self, key: KeyLedger, now_ms: int) -> None:
        """Bring the key's derived state up to date after any change to it: ready queues, global
        ready count, waiting flag and since, gap timer."""
        stopped = key.blocked or key.dead_lettering > 0
        counted = 0 if stopped else key.n_ready
        if counted != key.counted_ready:
            self._n_ready += counted - key.counted_ready
            key.counted_ready = counted
        waiting = stopped or key.backoff_until is not None or (key.n_held > 0 and key.n_ready == 0)
        if waiting != key.waiting:
            key.waiting = waiting
            self._n_waiting_keys += 1 if waiting else -1
            key.wait_since = now_ms if waiting else None
        if counted and key.backoff_until is None and key.n_out < self._max_in_flight:
            target = key.consumer or ""
            if key.queued != target:
                self._enqueue(key, target)
        if self._gap_timeout_ms is not None and not self._loading:
            missing = None if stopped else self._seq.gap(key)  # type: ignore[union-attr]
            if missing != key.gap_missing:
                key.gap_missing = missing
                if missing is None:
                    key.gap_since = None
                else:
                    key.gap_since = now_ms
                    self._timers.push(now_ms + self._gap_timeout_ms, _timers.GAP, key, (missing, now_ms))

    def _hand_out(self, key: KeyLedger | None, entry: Entry, consumer: str, now_ms: int) -> Deliver:
        self._next_id += 1
        delivery_id = f"{self._id_prefix}{self._next_id}"
        if not entry.deliveries:
            self._n_undelivered -= 1
        entry.deliveries += 1
        entry.state = OUT
        entry.delivery_id = delivery_id
        entry.consumer = consumer
        self._deliveries[delivery_id] = entry
        mine = self._consumers.get(consumer)
        if mine is None:
            mine = self._consumers[consumer] = {}
        mine[delivery_id] = entry
        self._n_out += 1
        if key is not None:
            key.n_out += 1
            key.consumer = consumer
            if not entry.late:
                out = key.out
                if out and out[-1].pos > entry.pos:  # type: ignore[operator]
                    # Only after a nack's rewind past an acking entry: keep ``out`` in order.
                    i = len(out)
                    while i and out[i - 1].pos > entry.pos:  # type: ignore[operator]
                        i -= 1
                    out.insert(i, entry)
                else:
                    out.append(entry)
        self._timers.push(now_ms + self._ack_deadline_ms, _timers.DEADLINE, entry, delivery_id)
        self._delivered += 1
        skipped = entry.skipped
        return Deliver(
            delivery_id,
            consumer,
            entry.message,
            entry.deliveries,
            entry.late and not entry.replayed,
            tuple(skipped) if skipped else (),
            self._epoch,
            entry.replayed,
        )

    def _end_delivery(self, entry: Entry, *, from_timer: bool) -> None:
        """An OUT entry stops being in flight (returned or dead-lettered)."""
        delivery_id = entry.delivery_id
        del self._deliveries[delivery_id]
        mine = self._consumers.get(entry.consumer)  # type: ignore[arg-type]
        if mine is not None:
            mine.pop(delivery_id, None)
        if not from_timer:
            self._timers.mark_stale()
        self._n_out -= 1
        entry.state = HELD
        key = entry.key
        if key is not None:
            key.n_out -= 1
            if not entry.late:
                key.out.remove(entry)
            if key.n_out == 0:
                key.consumer = None

    def _give_back(self, key: KeyLedger, entries: list[Entry], *, from_timer_entry: Entry | None = None) -> None:
        for entry in entries:
            self._end_delivery(entry, from_timer=entry is from_timer_entry)
        self._policy.give_back(key, entries)

    def _fail(
        self, entry: Entry, now_ms: int, retry_after_ms: int | None, dead_letter: bool, *, from_timer: bool
    ) -> list[Action]:
        """A nack or expiry of an OUT entry."""
        key = entry.key
        exhausted = entry.deliveries >= self._config.max_delivery_attempts
        if key is not None:
            # The failed message and every later one of the key still in flight go back, in order.
            group = [entry]
            if not entry.late:
                pos = entry.pos
                group = [x for x in key.out if x.state == OUT and x.pos >= pos]  # type: ignore[operator]
        if dead_letter or exhausted:
            reason = REASON_APP if dead_letter else REASON_MAX_ATTEMPTS
            self._end_delivery(entry, from_timer=from_timer)
            entry.state = DEAD
            if key is not None:
                followers = [x for x in group if x is not entry]
                if followers:
                    self._give_back(key, followers)
                if not entry.late:
                    key.dead_lettering += 1
                    # Keep the dead-lettering entry in ``out`` so the cursor cannot pass it.
                    self._insert_out(key, entry)
                self._refresh(key, now_ms)
            self._count_dead_letter(reason)
            in_order = key is not None and not entry.late
            return [DeadLetter(entry.message, reason, entry.deliveries, in_order)]
        delay_ms = retry_after_ms if retry_after_ms is not None else self._backoff_ms(entry.deliveries)
        if key is None:
            self._end_delivery(entry, from_timer=from_timer)
            if delay_ms <= 0:
                self._none.ready.append(entry)  # type: ignore[union-attr]
            else:
                entry.state = BACKOFF
                self._timers.push(now_ms + delay_ms, _timers.ENTRY_BACKOFF, entry, entry.deliveries)
            return []
        self._give_back(key, group, from_timer_entry=entry if from_timer else None)
        if delay_ms > 0:
            until = now_ms + delay_ms
            if key.backoff_until is None or until > key.backoff_until:
                key.backoff_until = until
                key.backoff_since = now_ms
                self._timers.push(until, _timers.KEY_BACKOFF, key, until)
        self._refresh(key, now_ms)
        return []

    @staticmethod
    def _insert_out(key: KeyLedger, entry: Entry) -> None:
        out = key.out
        i = len(out)
        while i and out[i - 1].pos > entry.pos:  # type: ignore[operator]
            i -= 1
        out.insert(i, entry)

    def _finish(self, entry: Entry, now_ms: int, *, occupied: bool) -> None:
        """An entry is done for good: durably acked, or dead-lettered and not blocking."""
        self._n_pending -= 1
        if occupied:
            self._n_out -= 1
        key = entry.key
        entry.state = DONE
        if key is None:
            self._none.forget(entry)  # type: ignore[union-attr]
        else:
            if occupied:
                key.n_out -= 1
            if entry.late:
                self._policy.forget(key, entry)
            else:
                self._retire_finished(key)
            if key.n_out == 0:
                key.consumer = None
            self._refresh(key, now_ms)
            self._maybe_idle(key)
        arrivals = self._arrivals
        if len(arrivals) > 2 * self._n_undelivered + _ARRIVALS_COMPACT_MIN:
            self._arrivals = deque(e for e in arrivals if not e.deliveries and e.state not in (DONE, BLOCKED))

    def _retire_finished(self, key: KeyLedger) -> None:
        out = key.out
        policy = self._policy
        # The cursor passes a finished prefix of ``out``, but never a message a nack gave
        # back that waits before it (it is not in ``out`` until handed out again).
        while out and out[0].state == DONE and not policy.held_below(key, out[0].pos):
            policy.retire(key, out.pop(0))

    def _on_gap_timeout(self, key: KeyLedger, now_ms: int) -> None:
        self._counts["gap_timeouts"] += 1
        if self._config.on_gap_timeout != "skip":
            return  # hold: the key keeps waiting, visibly (status)
        self._counts["skipped"] += self._seq.skip_gap(key)  # type: ignore[union-attr]
        key.gap_missing = key.gap_since = None
        self._refresh(key, now_ms)

    def _backoff_ms(self, failures: int) -> int:
        jitter = self._jitter()
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter() must return a float in [0, 1), got {jitter!r}")
        config = self._config
        exponent = min(max(failures, 1) - 1, _MAX_BACKOFF_EXPONENT)
        base = min(config.backoff_maximum_ms, config.backoff_initial_ms * 2**exponent)
        return int(base * (0.5 + jitter))

    def _count_dead_letter(self, reason: str) -> None:
        counts = self._counts
        counts["dead_lettered"] += 1
        name = f"dead_lettered:{reason}"
        counts[name] = counts.get(name, 0) + 1

    def _is_live(self, timer: _timers.Timer) -> bool:
        _due, _, kind, subject, token = timer
        if kind == _timers.DEADLINE:
            return bool(subject.state == OUT and subject.delivery_id == token)  # type: ignore[attr-defined]
        if kind == _timers.KEY_BACKOFF:
            return bool(subject.backoff_until == token)  # type: ignore[attr-defined]
        if kind == _timers.ENTRY_BACKOFF:
            return bool(subject.state == BACKOFF and subject.deliveries == token)  # type: ignore[attr-defined]
        return bool((subject.gap_missing, subject.gap_since) == token)  # type: ignore[attr-defined]


def _validate(config: EngineConfig) -> None:
    problems = []
    if config.mode not in ("sequence", "watermark", "none"):
        problems.append(f"mode must be sequence, watermark or none, got {config.mode!r}")
    if config.on_gap_timeout not in ("hold", "skip"):
        problems.append(f"on_gap_timeout must be hold or skip, got {config.on_gap_timeout!r}")
    if config.on_late not in ("dead_letter", "deliver"):
        problems.append(f"on_late must be dead_letter or deliver, got {config.on_late!r}")
    if config.on_dead_letter not in ("block", "skip"):
        problems.append(f"on_dead_letter must be block or skip, got {config.on_dead_letter!r}")
    if config.on_replay_behind not in ("deliver_flagged", "refuse"):
        problems.append(f"on_replay_behind must be deliver_flagged or refuse, got {config.on_replay_behind!r}")
    if config.max_in_flight_per_key < 1:
        problems.append(f"max_in_flight_per_key must be >= 1, got {config.max_in_flight_per_key}")
    if config.max_delivery_attempts < 1:
        problems.append(f"max_delivery_attempts must be >= 1, got {config.max_delivery_attempts}")
    if config.ack_deadline_ms <= 0:
        problems.append(f"ack_deadline_ms must be > 0, got {config.ack_deadline_ms}")
    if config.backoff_initial_ms < 0 or config.backoff_maximum_ms < config.backoff_initial_ms:
        problems.append(
            f"backoff must satisfy 0 <= initial <= maximum, got {config.backoff_initial_ms}/{config.backoff_maximum_ms}"
        )
    if config.gap_timeout_ms is not None and config.gap_timeout_ms < 0:
        problems.append(f"gap_timeout_ms must be >= 0 or None, got {config.gap_timeout_ms}")
    if config.dedup_ttl_ms < 0:
        problems.append(f"dedup_ttl_ms must be >= 0, got {config.dedup_ttl_ms}")
    if config.max_idle_keys < 0:
        problems.append(f"max_idle_keys must be >= 0, got {config.max_idle_keys}")
    if config.dedup_memory_max_entries < 0:
        problems.append(f"dedup_memory_max_entries must be >= 0, got {config.dedup_memory_max_entries}")
    if problems:
        raise ValueError("invalid engine config: " + "; ".join(problems))


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


HELD_MESSAGE_OVERHEAD_BYTES = 600
"""What a held message costs in memory besides its payload, measured roughly: the message and its
entry, ids, fingerprint, heap and index slots."""


def payload_size(payload: Payload) -> int:
    """Bytes a payload holds in memory, roughly: data and attribute text plus CPython's object
    headers (a bytes object, and per attribute two strings and a dict slot)."""
    return 33 + len(payload.data) + attributes_text(payload.attributes) + 110 * len(payload.attributes)


def attributes_text(attributes: dict[str, str]) -> int:
    """Characters of all names and values (``sum(map(len, ...))``: no Python frame per attribute)."""
    return sum(map(len, attributes)) + sum(map(len, attributes.values()))


def _identity(message: Message) -> object:
    """What makes two stored copies one record: (key, sequence) in sequence mode, else the dedup id;
    a replay's replay id in every mode."""
    if message.replay_id:
        return dedup_key(message)
    if message.sequence is not None:
        return (message.key, message.sequence)
    return message.dedup_id


def _stored_at(message: Message) -> int:
    return message.stored_at_ms


def _first(item: tuple[int, Message]) -> int:
    return item[0]


def _arrival(entry: Entry) -> int:
    return entry.n


def _position(entry: Entry) -> Any:
    return entry.pos
