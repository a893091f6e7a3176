"""The engines of one subscription, one per shard this pod owns: routing and aggregation. No I/O.

With several pods on one subscription, a key belongs to shard ``shard_of(key, S)`` and only the
shard's owner delivers it (``sidecar.cluster.leases``). Each owned shard gets an ``Engine`` of its own, built
from the store's load of that shard alone: a handover is exactly a recovery, so everything the crash
simulation proves about recovery holds for it. Losing a shard is dropping its engine: its held
messages stay pending in the store, its in-flight delivery ids become unknown (their acks are
refused, never confirmed: the new owner delivers those messages again, which G3 allows for
unconfirmed acks).

Delivery ids carry the shard and epoch (``<runtime prefix><shard>.<epoch>-<n>``), so an ack finds its
engine without a table, and an id of a shard's earlier ownership never matches the current engine.

A single pod without leases (tests, ``MemoryStore``) runs one engine for every key: ``route`` is
then constant 0 and the epoch is 0.

The engines' counters (``EngineStatus.counts``) are running totals for the life of the process: an
engine's counts are kept (``retired``) when its shard is dropped, so that no total falls when a
shard moves to another pod.

Delivery attempts outlive an engine in the same process: when a shard is dropped, the attempts its
engine made of messages still pending are kept (``attempts``, the ``ATTEMPTS_KEPT`` latest), and a
message of that shard given to a later engine (the shard taken back after a lease lost in a
Firestore outage: its pages, a Pub/Sub redelivery) carries them (``with_prior``), so that its next
delivery is attempt N+1, not 1.

They also go to the next owner of a shard given up gracefully (SIGTERM, balancing): the dropped
engine's attempts are encoded per shard (``handed_attempts``: the most attempted first, at most
``HANDED_ATTEMPTS_CHARS`` characters, far below Firestore's 1 MiB document) and written in the
lease document the hand-over writes anyway; the pod that takes the lease reads that document anyway
and keeps them (``inherit_attempts``) before the shard's load, whose messages then carry them. A
crash records nothing (that would cost a write per delivery): a message delivered by a pod that
died, or by a restarted process, starts again at attempt 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sidecar.engine import Engine
from sidecar.engine.dedup import identity
from sidecar.engine.types import Deliver, EngineStatus, KeyStatus, Message

ATTEMPTS_KEPT = 100_000
"""Delivery attempts kept of dropped engines' pending messages (a few MB at most)."""

HANDED_ATTEMPTS_CHARS = 100_000
"""At most this much of a shard's attempts goes in its lease document at a hand-over (a tenth of
Firestore's 1 MiB document; every pod reads the lease documents on a full round)."""


@dataclass(slots=True)
class ShardEngine:
    shard: int
    epoch: int
    engine: Engine
    held_bytes: int = 0
    """Estimated memory of this shard's stored messages not yet handed out."""
    draining: bool = False
    """Being handed over: nothing new is handed out; in-flight acks still complete."""
    volatile: dict[int, Message] = field(default_factory=dict)
    """Fast-path messages of this shard not yet settled (by ``id``): Pub/Sub still holds each."""
    copies: dict[int, list[Message]] = field(default_factory=dict)
    """Copies of unsettled fast-path messages (by the original's ``id``), never stored: each is
    settled with its original (``Engine.volatile_original``)."""
    handed: set[str] | None = None
    """While the engine is loading (``Engine.restore_pending``): the stored records (``Payload.ref``)
    handed to it so far, by a page or as they were stored. A record reaches the engine once: a page
    read before a record was finished can still hold it, and a second hand-over of a finished
    record would be dropped as a duplicate and its tombstone overwritten."""

    def admit(self, message: Message) -> bool:
        """False when ``message``'s record was handed to the loading engine already."""
        handed = self.handed
        if handed is None or message.payload is None or not message.payload.ref:
            return True
        ref = message.payload.ref
        if ref in handed:
            return False
        handed.add(ref)
        return True


class ShardEngines:
    """Engines by shard, with the routing rules above."""

    def __init__(self, id_prefix: str, route: Callable[[str], int]) -> None:
        self.id_prefix = id_prefix
        self.route = route
        self._by_shard: dict[int, ShardEngine] = {}
        self._by_prefix: dict[str, ShardEngine] = {}
        """``engine_prefix`` -> its engine: a delivery id is that prefix plus the engine's counter."""
        self._turn = 0
        self.retired: dict[str, int] = {}
        """The counts of the engines removed so far (shards lost or handed over), summed."""
        self.attempts: dict[object, int] = {}
        """Delivery attempts of pending messages of removed engines, by identity (module docstring)."""
        self._handed: dict[int, dict[object, int]] = {}
        """Shard -> the attempts of its last removed engine, for its hand-over's lease write (no more
        than its engine held)."""

    def engine_prefix(self, shard: int, epoch: int) -> str:
        return f"{self.id_prefix}{shard}.{epoch}-"

    def add(self, shard: int, epoch: int, engine: Engine, held_bytes: int) -> ShardEngine:
        if shard in self._by_shard:
            raise ValueError(f"shard {shard} already has an engine (epoch {self._by_shard[shard].epoch})")
        entry = ShardEngine(shard, epoch, engine, held_bytes)
        self._handed.pop(shard, None)
        self._by_shard[shard] = entry
        self._by_prefix[self.engine_prefix(shard, epoch)] = entry
        return entry

    def remove(self, shard: int) -> ShardEngine | None:
        entry = self._by_shard.pop(shard, None)
        if entry is not None:
            del self._by_prefix[self.engine_prefix(shard, entry.epoch)]
            retired = self.retired
            for name, value in entry.engine.status(0, max_keys=0)[0].counts.items():
                retired[name] = retired.get(name, 0) + value
            made = entry.engine.delivery_attempts()
            self._keep(made)
            self._handed[shard] = made
        return entry

    def _keep(self, made: dict[object, int]) -> None:
        attempts = self.attempts
        for ident, count in made.items():
            attempts[ident] = max(count, attempts.pop(ident, 0))
        for stale in list(itertools.islice(attempts, max(0, len(attempts) - ATTEMPTS_KEPT))):
            del attempts[stale]  # the oldest first: a dict keeps insertion order

    def handed_attempts(self, shard: int) -> str:
        """The attempts of ``shard``'s removed engine, for the lease write that gives the shard up
        (``""``: none; the same on a retried write, until the shard is taken again)."""
        made = self._handed.get(shard)
        return encode_attempts(made) if made else ""

    def inherit_attempts(self, shard: int, encoded: str) -> None:
        """Keep the attempts another pod recorded when it gave ``shard`` up (before its load)."""
        self._keep(decode_attempts(encoded))

    def with_prior(self, message: Message) -> Message:
        """``message`` carrying the attempts an earlier engine of this process made of it, if any."""
        attempts = self.attempts
        if not attempts:
            return message
        prior = attempts.pop(identity(message), 0)
        return dataclasses.replace(message, prior_attempts=prior) if prior else message

    def get(self, shard: int) -> ShardEngine | None:
        return self._by_shard.get(shard)

    def for_key(self, key: str) -> ShardEngine | None:
        return self._by_shard.get(self.route(key))

    def for_delivery(self, delivery_id: str) -> ShardEngine | None:
        """The engine that handed out ``delivery_id``, if it still runs at the same epoch."""
        # The counter has no dash: the prefix ends at the last one. An id of another engine, epoch or
        # sidecar, or no id of ours at all, finds no prefix.
        return self._by_prefix.get(delivery_id[: delivery_id.rfind("-") + 1])

    def __iter__(self) -> Iterator[ShardEngine]:
        return iter(list(self._by_shard.values()))

    def __len__(self) -> int:
        return len(self._by_shard)

    def shards(self) -> dict[int, int]:
        """Shard -> epoch of every engine."""
        return {entry.shard: entry.epoch for entry in self._by_shard.values()}

    @property
    def held_bytes(self) -> int:
        return sum(entry.held_bytes for entry in self._by_shard.values())

    def has_ready(self) -> bool:
        return any(not entry.draining and entry.engine.has_ready() for entry in self._by_shard.values())

    def next_timer_ms(self) -> int | None:
        due = [d for entry in self._by_shard.values() if (d := entry.engine.next_timer_ms()) is not None]
        return min(due) if due else None

    def take(self, consumer: str, max_messages: int, now_ms: int) -> list[tuple[ShardEngine, Deliver]]:
        """Up to ``max_messages`` ready messages, taking from the shards in turn (no shard starves)."""
        entries = [entry for entry in self._by_shard.values() if not entry.draining]
        if not entries:
            return []
        out: list[tuple[ShardEngine, Deliver]] = []
        start = self._turn % len(entries)
        self._turn += 1
        for entry in entries[start:] + entries[:start]:
            room = max_messages - len(out)
            if room <= 0:
                break
            if entry.engine.has_ready():
                out.extend((entry, delivery) for delivery in entry.engine.take(consumer, room, now_ms))
        return out

    def status(self, mode: str, now_ms: int, max_keys: int) -> tuple[EngineStatus, list[KeyStatus]]:
        """One status over all engines: sums, the oldest age, and the keys that waited longest; the
        counts include those of the engines removed before (``retired``)."""
        statuses = [entry.engine.status(now_ms, max_keys=max_keys) for entry in self._by_shard.values()]
        if not statuses:
            empty = EngineStatus(mode, 0, 0, 0, 0, 0, None, None, dict(self.retired))  # type: ignore[arg-type]
            return empty, []
        if len(statuses) == 1 and not self.retired:
            return statuses[0]
        counts: dict[str, int] = dict(self.retired)
        for status, _ in statuses:
            for name, value in status.counts.items():
                counts[name] = counts.get(name, 0) + value
        oldest = [s.oldest_undelivered_ms for s, _ in statuses if s.oldest_undelivered_ms is not None]
        watermarks = [s.watermark_ms for s, _ in statuses if s.watermark_ms is not None]
        first = statuses[0][0]
        total = dataclasses.replace(
            first,
            buffered=sum(s.buffered for s, _ in statuses),
            ready=sum(s.ready for s, _ in statuses),
            in_flight=sum(s.in_flight for s, _ in statuses),
            keys=sum(s.keys for s, _ in statuses),
            keys_blocked=sum(s.keys_blocked for s, _ in statuses),
            keys_blocked_dead_letter=sum(s.keys_blocked_dead_letter for s, _ in statuses),
            oldest_undelivered_ms=min(oldest) if oldest else None,
            watermark_ms=min(watermarks) if watermarks else None,
            counts=counts,
        )
        keys = sorted((k for _, detail in statuses for k in detail), key=_waited_since)
        return total, keys[:max_keys]


def encode_attempts(made: dict[object, int]) -> str:
    """``made`` (identity -> attempts) as JSON, the most attempted first, cut to
    ``HANDED_ATTEMPTS_CHARS``: ``[["s", key, sequence, n] | ["d", dedup_id, n] | ["r", replay_id, n], ...]``."""
    rows: list[str] = []
    size = 2
    for ident, count in sorted(made.items(), key=lambda item: -item[1]):
        row: list[object]
        if isinstance(ident, str):
            row = ["d", ident, count]
        elif isinstance(ident, tuple) and len(ident) == 2 and ident[0] == "replay" and isinstance(ident[1], str):
            row = ["r", ident[1], count]
        elif isinstance(ident, tuple) and len(ident) == 2 and isinstance(ident[1], int):
            row = ["s", ident[0], ident[1], count]
        else:
            continue
        text = json.dumps(row, separators=(",", ":"))
        size += len(text) + 1
        if size > HANDED_ATTEMPTS_CHARS:
            break
        rows.append(text)
    return f"[{','.join(rows)}]" if rows else ""


def decode_attempts(encoded: str) -> dict[object, int]:
    """``encode_attempts`` read back; what cannot be read is left out (it only numbers attempts)."""
    try:
        rows = json.loads(encoded)
    except ValueError:
        return {}
    made: dict[object, int] = {}
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, list) or not row or not isinstance(count := row[-1], int) or count < 1:
            continue
        if row[0] == "d" and len(row) == 3 and isinstance(row[1], str):
            made[row[1]] = count
        elif row[0] == "r" and len(row) == 3 and isinstance(row[1], str):
            made[("replay", row[1])] = count
        elif row[0] == "s" and len(row) == 4 and isinstance(row[1], str) and isinstance(row[2], int):
            made[(row[1], row[2])] = count
    return made


def _waited_since(key: KeyStatus) -> float:
    return float(key.since_ms) if key.since_ms is not None else float("inf")
