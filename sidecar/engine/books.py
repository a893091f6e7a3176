"""The engine's books: every key, every delivery in flight, and the counts derived from them.

``Books`` is the state one ``Engine`` owns, with the primitives every event handler (``arrival``,
``acks``, ``dead_letters``, ``recovery``, the engine's ``take`` and ``tick``) changes it through;
``fast_path`` and ``status`` only read it. Its attributes are public to those modules of the
engine and to nothing else.

Rules the primitives keep (the invariants themselves are stated in ``core``):

- ``refresh`` is called after any change to a key: it alone brings the key's derived state up to
  date (the global ready and waiting counts, the ready queue the key belongs in, its gap timer).
- A key sits in at most one ready queue that counts: "" the shared one (nobody has it in flight),
  else its consumer's. A queue may still hold a key that moved; ``KeyLedger.queued`` says which
  entry counts, so a stale one is skipped when popped, never acted on.
- ``hand_out`` is the only way into OUT, ``end_delivery`` (a nack, an expiry, a close, a dead
  letter) and an ack the ways out: they keep the deliveries by id and by consumer, ``n_out`` and
  the key's ``out`` list (sorted by position) in step. ``finish`` ends an entry that counts as
  pending (durably acked, or dead-lettered and not blocking); a BLOCKED entry, no longer pending,
  is ended where its block is lifted (``dead_letters.unblock``, a replay in ``arrival``).
- The cursor passes only a finished prefix of ``out`` (``retire_finished``), never a message a
  nack gave back that waits before it.
- An idle key (nothing held, in flight, pending or blocked) may be forgotten past ``max_idle_keys``
  when a ``cursor_source`` can rebuild it; ``key`` rebuilds it as it was.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from sidecar.engine import timers as _timers
from sidecar.engine.dedup import DedupMemory
from sidecar.engine.sequence import SequencePolicy
from sidecar.engine.state import BLOCKED, DONE, HELD, OUT, AsideDeadLetters, Entry, KeyLedger
from sidecar.engine.types import Action, Deliver, EngineConfig, KeyCursor, Message
from sidecar.engine.unordered import UnorderedPolicy
from sidecar.engine.watermark import WatermarkPolicy

COUNT_NAMES = (
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

_ARRIVALS_COMPACT_MIN = 1024
"""The arrival queue is rebuilt without delivered entries once it is twice the undelivered count
plus this: a message held for long must not pin every finished message queued behind it."""


class Books:
    """One engine's state. Not thread-safe: one caller at a time (the engine's)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        jitter: Callable[[], float],
        id_prefix: str,
        cursor_source: Callable[[str], KeyCursor | None] | None,
        epoch: int,
    ) -> None:
        self.config = config
        self.mode = config.mode
        self.jitter = jitter
        self.id_prefix = id_prefix
        self.epoch = epoch
        """Stamped on every ``Deliver``: the lease epoch of the shard this engine delivers."""
        self.cursor_source = cursor_source
        """A key's durable cursor by name (the store's): lets idle keys be forgotten and rebuilt."""
        self.idle: OrderedDict[str, KeyLedger] = OrderedDict()
        """Keys with nothing held, in flight or pending, least recently active first."""
        self.max_idle = config.max_idle_keys if cursor_source is not None else None
        self.max_in_flight = config.max_in_flight_per_key
        self.ack_deadline_ms = config.ack_deadline_ms
        self.next_id = 0
        self.n = 0
        """Arrival number of the last message stored."""
        self.counts: dict[str, int] = dict.fromkeys(COUNT_NAMES, 0)
        # The three counters touched once per message live in attributes (cheaper than a dict).
        self.stored = 0
        self.delivered = 0
        self.acked = 0
        self.keys: dict[str, KeyLedger] = {}
        self.deliveries: dict[str, Entry] = {}  # OUT and ACKING, by delivery id
        self.consumers: dict[str, dict[str, Entry]] = {}  # OUT only, per consumer
        self.ready: deque[KeyLedger] = deque()  # keys nobody has in flight
        self.owned: dict[str, deque[KeyLedger]] = {}  # keys with messages in flight on that consumer
        self.timers = _timers.TimerHeap()
        self.aside = AsideDeadLetters()
        self.deferred: list[Action] = []
        """Decisions of a restore's replay besides holding, returned by the next ``tick``."""
        self.deferred_due_ms: int | None = None
        self.arrivals: deque[Entry] = deque()
        self.n_undelivered = 0
        self.n_pending = 0
        self.n_ready = 0
        self.n_out = 0
        self.n_waiting_keys = 0
        self.n_dead_letter_blocked = 0
        self.memory: DedupMemory | None = None
        self.seq: SequencePolicy | None = None
        self.wm: WatermarkPolicy | None = None
        self.none: UnorderedPolicy | None = None
        if config.mode == "sequence":
            self.seq = SequencePolicy(config)
            self.policy: SequencePolicy | WatermarkPolicy = self.seq
        else:
            self.memory = DedupMemory(config.dedup_ttl_ms, config.dedup_memory_max_entries)
            if config.mode == "watermark":
                self.wm = WatermarkPolicy(config, self.memory)
                self.policy = self.wm
            else:
                self.none = UnorderedPolicy(self.memory)
        self.gap_timeout_ms = config.gap_timeout_ms if config.mode == "sequence" else None
        self.loading = False
        """Restored from cursors while pending messages are still being read (``restore_pending``)."""
        self.loading_watermark_ms: int | None = None
        """The highest watermark offered while loading: applied by ``finish_loading``."""
        self.parked: list[Message] = []
        """sequence mode, while loading: messages of keys with no cursor yet (``first_sequence: any``),
        replayed in stored order by ``finish_loading`` so that adoption picks the same first message
        as a load of everything at once would."""

    # ---- keys -------------------------------------------------------------------------------

    def key(self, name: str, *, rebuild: bool = True) -> KeyLedger:
        key = self.keys.get(name)
        if key is None:
            key = self.keys[name] = KeyLedger(name)
            self.policy.new_key(key)
            if rebuild and self.cursor_source is not None:
                cursor = self.cursor_source(name)  # a key forgotten while idle: rebuilt as it was
                if cursor is not None:
                    self.policy.restore_cursor(key, cursor)
                    self.n_dead_letter_blocked += key.blocked
        return key

    def maybe_idle(self, key: KeyLedger) -> None:
        """Track a key that holds nothing; forget the longest idle past ``max_idle_keys``."""
        if self.max_idle is None:
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
        idle = self.idle
        idle[key.name] = key
        idle.move_to_end(key.name)
        while len(idle) > self.max_idle:
            name, forgotten = idle.popitem(last=False)
            if self.keys.get(name) is forgotten:
                del self.keys[name]
                self.counts["keys_evicted"] += 1

    def find(self, message: Message) -> Entry | None:
        """The entry this engine holds for ``message``'s record (its position, or its identity)."""
        if self.seq is not None:
            flagged = self.seq.find_replay(message)
            if flagged is not None:
                return flagged
            key = self.keys.get(message.key)
            return None if key is None else key.index.get(message.sequence)
        return (self.wm or self.none).find(message)  # type: ignore[union-attr]

    # ---- ready queues -----------------------------------------------------------------------

    def is_releasable(self, key: KeyLedger) -> bool:
        return (
            key.n_ready > 0
            and key.n_out < self.max_in_flight
            and key.backoff_until is None
            and not key.blocked
            and not key.dead_lettering
        )

    def enqueue(self, key: KeyLedger, queue_name: str) -> None:
        key.queued = queue_name
        if queue_name:
            queue = self.owned.get(queue_name)
            if queue is None:
                queue = self.owned[queue_name] = deque()
            queue.append(key)
        else:
            self.ready.append(key)

    def refresh(self, key: KeyLedger, now_ms: int) -> None:
        """Bring the key's derived state up to date after any change to it: ready queues, global
        ready count, waiting flag and since, gap timer."""
        stopped = key.blocked or key.dead_lettering > 0
        counted = 0 if stopped else key.n_ready
        if counted != key.counted_ready:
            self.n_ready += counted - key.counted_ready
            key.counted_ready = counted
        waiting = stopped or key.backoff_until is not None or (key.n_held > 0 and key.n_ready == 0)
        if waiting != key.waiting:
            key.waiting = waiting
            self.n_waiting_keys += 1 if waiting else -1
            key.wait_since = now_ms if waiting else None
        if counted and key.backoff_until is None and key.n_out < self.max_in_flight:
            target = key.consumer or ""
            if key.queued != target:
                self.enqueue(key, target)
        if self.gap_timeout_ms is not None and not self.loading:
            missing = None if stopped else self.seq.gap(key)  # type: ignore[union-attr]
            if missing != key.gap_missing:
                key.gap_missing = missing
                if missing is None:
                    key.gap_since = None
                else:
                    key.gap_since = now_ms
                    self.timers.push(now_ms + self.gap_timeout_ms, _timers.GAP, key, (missing, now_ms))

    # ---- in flight --------------------------------------------------------------------------

    def hand_out(self, key: KeyLedger | None, entry: Entry, consumer: str, now_ms: int) -> Deliver:
        self.next_id += 1
        delivery_id = f"{self.id_prefix}{self.next_id}"
        if not entry.deliveries:
            self.n_undelivered -= 1
        entry.deliveries += 1
        entry.state = OUT
        entry.delivery_id = delivery_id
        entry.consumer = consumer
        self.deliveries[delivery_id] = entry
        mine = self.consumers.get(consumer)
        if mine is None:
            mine = self.consumers[consumer] = {}
        mine[delivery_id] = entry
        self.n_out += 1
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
        self.timers.push(now_ms + self.ack_deadline_ms, _timers.DEADLINE, entry, delivery_id)
        self.delivered += 1
        skipped = entry.skipped
        return Deliver(
            delivery_id,
            consumer,
            entry.message,
            entry.deliveries + entry.message.prior_attempts,
            entry.late and not entry.replayed,
            tuple(skipped) if skipped else (),
            self.epoch,
            entry.replayed,
        )

    def end_delivery(self, entry: Entry, *, from_timer: bool) -> None:
        """An OUT entry stops being in flight (returned or dead-lettered)."""
        delivery_id = entry.delivery_id
        del self.deliveries[delivery_id]
        mine = self.consumers.get(entry.consumer)  # type: ignore[arg-type]
        if mine is not None:
            mine.pop(delivery_id, None)
        if not from_timer:
            self.timers.mark_stale()
        self.n_out -= 1
        entry.state = HELD
        key = entry.key
        if key is not None:
            key.n_out -= 1
            if not entry.late:
                key.out.remove(entry)
            if key.n_out == 0:
                key.consumer = None

    def give_back(self, key: KeyLedger, entries: list[Entry], *, from_timer_entry: Entry | None = None) -> None:
        for entry in entries:
            self.end_delivery(entry, from_timer=entry is from_timer_entry)
        self.policy.give_back(key, entries)

    @staticmethod
    def insert_out(key: KeyLedger, entry: Entry) -> None:
        out = key.out
        i = len(out)
        while i and out[i - 1].pos > entry.pos:  # type: ignore[operator]
            i -= 1
        out.insert(i, entry)

    # ---- finishing --------------------------------------------------------------------------

    def finish(self, entry: Entry, now_ms: int, *, occupied: bool) -> None:
        """An entry is done for good: durably acked, or dead-lettered and not blocking."""
        self.n_pending -= 1
        if occupied:
            self.n_out -= 1
        key = entry.key
        entry.state = DONE
        if key is None:
            self.none.forget(entry)  # type: ignore[union-attr]
        else:
            if occupied:
                key.n_out -= 1
            if entry.late:
                self.policy.forget(key, entry)
            else:
                self.retire_finished(key)
            if key.n_out == 0:
                key.consumer = None
            self.refresh(key, now_ms)
            self.maybe_idle(key)
        arrivals = self.arrivals
        if len(arrivals) > 2 * self.n_undelivered + _ARRIVALS_COMPACT_MIN:
            self.arrivals = deque(e for e in arrivals if not e.deliveries and e.state not in (DONE, BLOCKED))

    def retire_finished(self, key: KeyLedger) -> None:
        out = key.out
        policy = self.policy
        # The cursor passes a finished prefix of ``out``, but never a message a nack gave
        # back that waits before it (it is not in ``out`` until handed out again).
        while out and out[0].state == DONE and not policy.held_below(key, out[0].pos):
            policy.retire(key, out.pop(0))

    # ---- counts -----------------------------------------------------------------------------

    def count_dead_letter(self, reason: str) -> None:
        counts = self.counts
        counts["dead_lettered"] += 1
        name = f"dead_lettered:{reason}"
        counts[name] = counts.get(name, 0) + 1

    def all_counts(self) -> dict[str, int]:
        counts = dict(self.counts)
        counts["stored"] = self.stored
        counts["delivered"] = self.delivered
        counts["acked"] = self.acked
        return counts
