"""The engine's vocabulary: messages, configuration, decisions, status and snapshots.

Small frozen dataclasses with slots, like h11's events. Everything here is plain data: no I/O, no
clock, no asyncio. Times are integers in milliseconds since the Unix epoch (``*_ms``), passed in
by the caller; the engine never reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar, dataclass_transform

from sidecar.engine.fingerprint import fingerprint

Mode = Literal["sequence", "watermark", "none"]
GapPolicy = Literal["hold", "skip"]
LatePolicy = Literal["dead_letter", "deliver"]
DeadLetterPolicy = Literal["block", "skip"]
ReplayBehindPolicy = Literal["deliver_flagged", "refuse"]

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[_T]) -> type[_T]:
    """A frozen dataclass with slots to the type checker, built without the frozen ``__init__``.

    For the records made once or more per message (``Message``, ``Payload``, ``Deliver``,
    ``AckIntent``, ``IncomingMessage``): a frozen dataclass sets each field through
    ``object.__setattr__`` and costs about five times a plain one to construct. mypy still refuses
    any assignment to a field (``frozen_default``), equality and hashing are a frozen dataclass's
    (``unsafe_hash``), so only the run-time guard against mutation is given up."""
    make: Callable[[type[_T]], type[_T]] = dataclass(slots=True, unsafe_hash=True)
    return make(cls)


@record
class Payload:
    """What the app receives besides ordering fields. The engine never looks inside."""

    data: bytes
    attributes: dict[str, str]
    publish_time_ms: int
    ordering_key: str = ""
    ref: str = ""
    """The store's handle for this message (e.g. the Firestore document id)."""
    stripped: bool = False
    """The data and attributes were left in the store to save memory (``data``/``attributes`` are
    empty): the I/O layer reads them back by ``ref`` before the message reaches the app."""


@record
class Message:
    """A message the store has made durable, classified by ingest.

    ``sequence`` is set in sequence mode, ``timestamp_ms`` (event time) in watermark mode.
    ``fingerprint`` is a hash of data and attributes: the same key and sequence with another
    fingerprint is a conflict, not a duplicate.
    """

    key: str
    dedup_id: str
    message_id: str
    stored_at_ms: int
    sequence: int | None = None
    timestamp_ms: int | None = None
    payload: Payload | None = field(default=None, compare=False, repr=False)
    replay_id: str = ""
    """Set on an operator's replay of a dead letter (``pubsub-sidecar dead-letters replay``): the
    replay's own identity. It keeps its original's key, position and dedup id, but it is a record
    of its own: not a duplicate of its original, while two copies of one replay are duplicates."""
    volatile: bool = False
    """Not stored: taken by the in-order fast path (``Engine.fast_path``). Pub/Sub keeps it (its ack
    is held) until its app ack is durable in the key's cursor; a crash before that loses nothing,
    since Pub/Sub delivers it again. Its finishes write no tombstone except a dead letter's."""
    known_fingerprint: bytes | None = field(default=None, compare=False, repr=False)
    """The fingerprint when it is known (read from the store, or computed once); None: computed
    from the payload when first asked for (``fingerprint``)."""
    prior_attempts: int = field(default=0, compare=False)
    """Deliveries to the app an earlier engine made (its shard was dropped, then taken back by this
    process, or handed over by another pod): attempt numbers, and ``max_delivery_attempts``, go on
    from there."""

    @property
    def fingerprint(self) -> bytes:
        """A hash of the content the publisher controls (``sidecar.engine.fingerprint``)."""
        known = self.known_fingerprint
        if known is None:
            payload = self.payload
            if payload is None or payload.stripped:
                raise ValueError(f"message {self.dedup_id!r}: no fingerprint known and no payload to compute it")
            known = fingerprint(payload.data, payload.attributes, payload.ordering_key)
            object.__setattr__(self, "known_fingerprint", known)  # a cache: equality ignores it
        return known


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One subscription's ordering and delivery policy (DESIGN §4, §7), durations in ms."""

    mode: Mode
    sequence_start: int = 1
    first_sequence_any: bool = False
    gap_timeout_ms: int | None = None
    on_gap_timeout: GapPolicy = "hold"
    on_late: LatePolicy = "dead_letter"
    dedup_ttl_ms: int = 7 * 24 * 3600 * 1000
    max_in_flight_per_key: int = 1
    ack_deadline_ms: int = 60_000
    max_delivery_attempts: int = 5
    backoff_initial_ms: int = 1_000
    backoff_maximum_ms: int = 600_000
    on_dead_letter: DeadLetterPolicy = "block"
    on_replay_behind: ReplayBehindPolicy = "refuse"
    """A replay whose position its key has already passed (skipped, unblocked, finished): delivered
    flagged ``replayed`` outside the key's order, or refused (dead-lettered again, ``replay_behind``)."""
    dedup_memory_max_entries: int = 200_000
    """none/watermark modes: at most this many recently seen dedup ids kept in memory (~250 bytes
    each); Firestore stays the authority for the full ``dedup_ttl_ms``."""
    max_idle_keys: int = 10_000
    """Keys with nothing held, in flight or pending kept in memory; past it the longest idle are
    forgotten and rebuilt from their durable cursor (the engine's ``cursor_source``) when a message
    for them arrives. Only with a ``cursor_source``."""


def check_config(config: EngineConfig) -> None:
    """Raise ValueError naming every value of ``config`` the engine cannot work with."""
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


# ---- decisions -------------------------------------------------------------------------------


@record
class SkippedRange:
    first: int
    last: int


@record
class Deliver:
    """Send ``message`` to ``consumer`` (a stream) as delivery ``delivery_id``."""

    delivery_id: str
    consumer: str
    message: Message
    attempt: int
    late: bool = False
    skipped: tuple[SkippedRange, ...] = ()
    epoch: int = 0
    """The lease epoch of the key's shard at delivery (the engine's ``epoch``; 0 without leases):
    the app's fencing token for side effects of this key."""
    replayed: bool = False
    """A replay delivered outside its key's order: the key had already passed its position."""


@record
class DropDuplicate:
    """Already stored, delivered or acked: nothing reaches the app. The I/O layer acks Pub/Sub."""

    message: Message
    reason: str
    finish_record: bool = False
    """True when no message the engine still holds shares this copy's stored record, so the store
    may finish it ("dropped"): a copy below the cursor, or of a finished message. False for a
    duplicate of a held message: its record *is* the held message's, which must stay pending."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Publish to the dead-letter topic with ``reason``, then report back with ``dead_letter_done``."""

    message: Message
    reason: str
    attempts: int
    in_order: bool = False
    """True for a message in its key's order (attempts exhausted, or the app asked): the key waits
    for ``dead_letter_done`` and then blocks or skips past it. False for a message outside the
    order (late, conflicting, below the cursor), which never blocks or moves the key."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Kept back: ``reason`` says on what (e.g. "missing sequence 7", "watermark at ...")."""

    message: Message
    reason: str


Action = Deliver | DropDuplicate | DeadLetter | Hold


# ---- ack bookkeeping -------------------------------------------------------------------------


@record
class AckIntent:
    """An app ack accepted by the engine, to be made durable by the store before it counts.

    ``cursor`` is the key's cursor once this ack is durable: in sequence mode the next expected
    sequence, in watermark mode the delivered position ``(timestamp_ms, dedup_id)``, None in none mode.
    """

    delivery_id: str
    message: Message
    cursor: int | tuple[int, str] | None
    aside: bool = False
    """A replay delivered outside its key's order (flagged ``replayed``): the store records the ack
    but folds nothing into the key's cursor (its position may belong to another message)."""
    skipped: tuple[SkippedRange, ...] = ()
    """sequence mode: the ranges below ``cursor`` that a gap timeout skipped and that no ack made
    durable has carried yet (``KeyLedger.unrecorded_skips``). The store records these, and only
    these, as skipped when the cursor passes them: every other sequence a cursor passes was
    finished (acked or dead-lettered), so a copy of it is a duplicate, never late."""


# ---- status ----------------------------------------------------------------------------------

KeyState = Literal[
    "waiting_sequence", "waiting_watermark", "blocked_dead_letter", "backoff", "in_flight", "ready", "idle"
]
"""What a key waits for, as ``status`` reports it (the engine's record of a key is ``state.KeyLedger``)."""


@dataclass(frozen=True, slots=True)
class KeyStatus:
    key: str
    state: KeyState
    waiting_for: str
    """Human-readable: "sequence 7", "watermark to pass 2026-12-01T00:00:00Z", ... ("" when not waiting)."""
    since_ms: int | None
    buffered: int
    in_flight: int
    next_sequence: int | None = None
    missing_sequence: int | None = None
    last_missing_sequence: int | None = None
    """waiting_sequence: the last of the missing sequences at the key's head (what a skip passes at most)."""
    blocked_message_id: str = ""
    """blocked_dead_letter: the Pub/Sub id of the dead letter the key stopped at ("" when unknown)."""
    blocked_sequence: int | None = None


@dataclass(frozen=True, slots=True)
class EngineStatus:
    mode: Mode
    buffered: int
    """Messages stored and not yet acked, dead-lettered or dropped (held + ready + in flight)."""
    ready: int
    in_flight: int
    keys: int
    keys_blocked: int
    """Keys that wait on a gap, the watermark, a backoff or a dead letter while holding messages."""
    oldest_undelivered_ms: int | None
    """``stored_at_ms`` of the oldest message not yet delivered to the app (None when there is none)."""
    watermark_ms: int | None
    counts: dict[str, int]
    """Cumulative counters: stored, delivered, acked, nacked, expired, duplicates, dead_lettered, late,
    skipped, and dead_lettered:<reason> per reason."""
    keys_blocked_dead_letter: int = 0
    """Keys stopped at a dead letter (``on_dead_letter: block``) until an operator acts: the alarm."""


# ---- recovery --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyCursor:
    """What the store keeps per key to rebuild the engine.

    sequence mode: ``next_sequence``; watermark mode: ``last_position`` delivered and acked.
    ``blocked`` is True when the key stopped on a dead letter with ``on_dead_letter: block``.
    """

    key: str
    next_sequence: int | None = None
    last_position: tuple[int, str] | None = None
    blocked: bool = False
    acked_above: tuple[int, ...] = ()
    """sequence mode with ``max_in_flight_per_key > 1``: sequences above ``next_sequence`` already
    acked durably (an app may ack N+1 before N). Without them a restart would wait for N+1 forever."""
    blocked_position: int | tuple[int, str] | None = None
    """The position of the dead letter the key is blocked at, when ``blocked`` and known: a replay
    of that very message lifts the block (None: sequence mode reads the cursor instead)."""
    known_from: int | None = field(default=None, compare=False)
    """Not part of equality (nor ``skipped``): what the store knows below the cursor, not where it is.
    sequence mode: every sequence from here up to ``next_sequence`` is finished (acked or
    dead-lettered) unless it lies in ``skipped`` (passed by a gap timeout). A copy there is then a
    duplicate, or late when skipped. None: the store knows nothing below ``next_sequence`` (a copy
    below it is dead-lettered as ``below_cursor``)."""
    skipped: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    """sequence mode: ranges (first, last) below ``next_sequence`` a gap timeout skipped."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Everything needed to rebuild an engine: cursors plus messages still pending.

    In-flight deliveries are not part of a snapshot: after a restart they are pending again and
    are delivered once more (an ack that was not confirmed may lead to one redelivery, G3).
    """

    cursors: tuple[KeyCursor, ...]
    pending: tuple[Message, ...]
    watermark_ms: int | None = None
