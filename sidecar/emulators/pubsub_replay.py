"""Message retention, snapshots and Seek: replaying a subscription, as production does.

Rules (from the ``google.pubsub.v1`` API reference):
- A subscription keeps unacked messages for ``message_retention_duration`` (10 minutes to 31 days,
  7 days by default) from their publish time, then expunges them, delivered or not. With
  ``retain_acked_messages`` acked messages are kept as long, so Seek can bring them back.
- A topic with ``message_retention_duration`` keeps every message published to it that long; its
  subscriptions can then Seek back over all of them, acked or published before they existed.
- A snapshot retains the messages unacked in its subscription when it is created, and every
  message published to the topic afterwards. It lives ``7 days - age of the oldest unacked
  message``; creating one that would live less than an hour is FAILED_PRECONDITION; an expired one
  is gone (NOT_FOUND).
- Seek to a time marks the retained messages published before it acked and those after unacked;
  expunged messages are not restored, and without ``retain_acked_messages`` (or topic retention)
  only messages that were still unacked can be. Seek to a snapshot makes exactly the snapshot's
  messages unacked; its topic must be the subscription's. Either way outstanding leases are
  revoked (their ack ids go stale) and delivery restarts from the rebuilt backlog, in publish order.

Expiry is checked against the broker's clock (the wall clock plus an offset the admin API can move
forward, so that tests can age messages by days), on every snapshot or seek call and by a sweep
every ``SWEEP_PERIOD_SECONDS``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import grpc
from google.pubsub_v1 import types

from sidecar.emulators.pubsub_model import Pending, PubsubError, Snapshot, Subscription
from sidecar.emulators.pubsub_rpc import duration_ns
from sidecar.emulators.pubsub_state import Broker

_NS = 1_000_000_000
MIN_RETENTION_SECONDS = 10 * 60
MAX_RETENTION_SECONDS = 31 * 24 * 3600
SNAPSHOT_MAX_LIFETIME_NS = 7 * 24 * 3600 * _NS
SNAPSHOT_MIN_LIFETIME_NS = 3600 * _NS
"""Production refuses a snapshot that would expire within an hour of its creation."""
SWEEP_PERIOD_SECONDS = 30.0
"""Retention is counted in minutes at least: a sweep every half minute is precise enough."""

_Snapshot = types.Snapshot.pb()

_Candidate = tuple[Any, int, Pending | None]
"""A message a seek may make unacked: (message, publish time ns, its current Pending if any)."""


def check_retention(duration: Any, what: str) -> None:
    """Refuse a retention outside production's 10 minutes .. 31 days."""
    seconds = duration_ns(duration) / _NS
    if not MIN_RETENTION_SECONDS <= seconds <= MAX_RETENTION_SECONDS:
        raise PubsubError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} must be between 10 minutes and 31 days (got {seconds:g} s)",
        )


class Replay:
    """Retention sweeps, snapshots and seeks over one :class:`Broker`."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._sweeper: asyncio.TimerHandle | None = None

    def start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_PERIOD_SECONDS, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self.expunge()
        self.start_sweeper()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    # -- retention -----------------------------------------------------------------------------

    def expunge(self) -> None:
        """Drop what retention no longer keeps: old messages, expired snapshots."""
        broker = self._broker
        now = broker.now_ns()
        for sub in broker.subscriptions.values():
            self._expunge_subscription(sub, now - sub.retention_ns)
        for topic_name, log in broker.topic_logs.items():
            cutoff = now - duration_ns(broker.topics[topic_name].message_retention_duration)
            while log and log[0][1] < cutoff:
                log.popleft()
        for name, snapshot in list(broker.snapshots.items()):
            if snapshot.expire_ns <= now:
                self._drop_snapshot(name)

    def _expunge_subscription(self, sub: Subscription, cutoff_ns: int) -> None:
        if sub.acked:
            for seq in [seq for seq, p in sub.acked.items() if p.publish_time_ns < cutoff_ns]:
                del sub.acked[seq]
        if not sub.unacked or next(iter(sub.unacked.values())).publish_time_ns >= cutoff_ns:
            return
        # A message out on a lease is expunged once it comes back; everything else goes now.
        leased = {lease.pending.seq for lease in sub.leases.values()}
        gone = {seq for seq, p in sub.unacked.items() if p.publish_time_ns < cutoff_ns and seq not in leased}
        if not gone:
            return
        for seq in gone:
            del sub.unacked[seq]
        sub.available = deque(p for p in sub.available if p.seq not in gone)
        for key, queue in list(sub.held.items()):
            sub.held[key] = deque(p for p in queue if p.seq not in gone)
        if sub.is_ordered:
            self._recompute_busy_keys(sub)

    def _recompute_busy_keys(self, sub: Subscription) -> None:
        """After messages vanished: a key stays busy only while one of its messages is leased or waiting."""
        placed = {p.seq for p in sub.available} | {p.seq for q in sub.held.values() for p in q}
        placed |= {lease.pending.seq for lease in sub.leases.values()}
        busy = {lease.pending.ordering_key for lease in sub.leases.values()}
        busy |= {p.ordering_key for seq, p in sub.unacked.items() if seq not in placed}  # waiting out a backoff
        busy.discard("")
        freed = [key for key in sub.busy_keys | set(sub.held) if key not in busy]
        sub.busy_keys = busy
        for key in freed:
            queue = sub.held.pop(key, None)
            if queue:
                sub.available.extendleft(reversed(queue))
        self._broker.notify(sub)

    # -- snapshots -------------------------------------------------------------------------------

    def create_snapshot(self, name: str, sub: Subscription, labels: Any) -> Any:
        broker = self._broker
        self.expunge()
        if name in broker.snapshots:
            raise PubsubError(grpc.StatusCode.ALREADY_EXISTS, f"Snapshot already exists: {name}")
        if sub.config.topic not in broker.topics:
            raise PubsubError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Cannot create a snapshot of {sub.name}: its topic was deleted",
            )
        now = broker.now_ns()
        oldest = next(iter(sub.unacked.values())).publish_time_ns if sub.unacked else now
        expire_ns = oldest + SNAPSHOT_MAX_LIFETIME_NS
        if expire_ns - now < SNAPSHOT_MIN_LIFETIME_NS:
            raise PubsubError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Cannot create a snapshot of {sub.name}: its oldest unacked message is so old that the "
                "snapshot would expire in less than 1 hour",
            )
        config = _Snapshot(name=name, topic=sub.config.topic, labels=dict(labels))
        config.expire_time.FromNanoseconds(expire_ns)
        snapshot = Snapshot(config, expire_ns)
        for pending in sorted(sub.unacked.values(), key=lambda p: p.seq):
            snapshot.messages[pending.message.message_id] = (pending.message, pending.publish_time_ns)
        broker.snapshots[name] = snapshot
        broker.topic_snapshots.setdefault(sub.config.topic, set()).add(name)
        return config

    def snapshot(self, name: str) -> Snapshot:
        self.expunge()
        try:
            return self._broker.snapshots[name]
        except KeyError:
            raise PubsubError(grpc.StatusCode.NOT_FOUND, f"Snapshot does not exist: {name}") from None

    def delete_snapshot(self, name: str) -> None:
        self.snapshot(name)
        self._drop_snapshot(name)

    def _drop_snapshot(self, name: str) -> None:
        snapshot = self._broker.snapshots.pop(name)
        self._broker.iam_policies.pop(name, None)
        self._broker.topic_snapshots.get(snapshot.config.topic, set()).discard(name)

    # -- seek --------------------------------------------------------------------------------------

    def seek_to_time(self, sub: Subscription, target_ns: int) -> None:
        self.expunge()
        candidates = self._retained(sub)
        unacked = {mid: c for mid, c in candidates.items() if c[1] >= target_ns}
        retain = sub.config.retain_acked_messages
        acked = {mid: c for mid, c in candidates.items() if c[1] < target_ns} if retain else {}
        self._rebuild(sub, unacked, acked)

    def seek_to_snapshot(self, sub: Subscription, snapshot_name: str) -> None:
        snapshot = self.snapshot(snapshot_name)
        if snapshot.config.topic != sub.config.topic:
            raise PubsubError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"The snapshot's topic ({snapshot.config.topic}) is not the topic of {sub.name} ({sub.config.topic})",
            )
        candidates = self._retained(sub)
        unacked: dict[str, _Candidate] = {}
        for message_id, (message, publish_ns) in snapshot.messages.items():
            current = candidates.pop(message_id, None)
            unacked[message_id] = (message, publish_ns, current[2] if current else None)
        self._rebuild(sub, unacked, candidates if sub.config.retain_acked_messages else {})

    def _retained(self, sub: Subscription) -> dict[str, _Candidate]:
        """Every message the subscription (or its topic) still keeps, acked or not, by message id."""
        found: dict[str, _Candidate] = {}
        log = self._broker.topic_logs.get(sub.config.topic)
        for message, publish_ns, _size in log or ():
            found[message.message_id] = (message, publish_ns, None)
        for pending in (*sub.acked.values(), *sub.unacked.values()):
            found[pending.message.message_id] = (pending.message, pending.publish_time_ns, pending)
        return found

    def _rebuild(self, sub: Subscription, unacked: dict[str, _Candidate], acked: dict[str, _Candidate]) -> None:
        """Replace the subscription's backlog: outstanding leases end, delivery restarts in publish order."""
        broker = self._broker
        broker.revoke_leases(sub)
        for stream in sub.streams:
            stream.outbox.clear()

        def pendings(chosen: dict[str, _Candidate]) -> dict[int, Pending]:
            result: dict[int, Pending] = {}
            for message_id in sorted(chosen, key=int):
                message, publish_ns, current = chosen[message_id]
                attempts = current.attempts if current is not None else 0
                pending = Pending(broker.next_seq(), message, publish_ns, message.ByteSize(), attempts)
                result[pending.seq] = pending
            return result

        sub.unacked = pendings(unacked)
        sub.acked = pendings(acked)
        sub.available = deque(sub.unacked.values())
        broker.notify(sub)
