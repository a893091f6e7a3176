"""The Pub/Sub emulator's broker: topics, subscriptions, messages, leases, dispatch and timers.

This module knows nothing of gRPC transport; it holds raw protobuf messages handed to it by
``pubsub.py`` and only reads or copies them. It runs on one asyncio loop and is not thread-safe.
Retention, snapshots and seek are in ``pubsub_replay.py``; the data classes in ``pubsub_model.py``.

Invariants:
- A published message is copied (by reference: messages are read-only once published) into every
  subscription attached to the topic at publish time; with none, it is dropped.
- Per subscription every unacked message (a :class:`Pending`) is in exactly one place: the
  ``available`` queue, leased (one :class:`Lease` with a fresh ack id per delivery), held behind
  its ordering key, or waiting in the timer heap for a delayed release (retry backoff or the
  "delay deliveries" fault).
- ``unacked`` holds every unacked message in publish order, so its first entry is the oldest:
  that is what Cloud Monitoring's ``oldest_unacked_message_age`` reads.
- A lease ends exactly once: ack (message gone, or kept in ``acked`` for Seek), nack/modack 0 or
  expiry (message available again, or forwarded to the dead-letter topic once
  ``max_delivery_attempts`` deliveries were made), or revocation by Seek. Stale ack ids (of an
  ended lease) are accepted and ignored, as production does.
- Dispatch spreads messages over all open streams of a subscription that have flow-control room
  and nothing left unwritten in their outbox, each getting an equal share of what is available,
  the least loaded (fewest outstanding messages) first, ties round-robin from a rotating start
  (as production does; the first stream to wake, or one that never acks, does not get
  everything). A stream whose writer has not written all it was given (its client stopped
  reading) gets nothing more; its writer asks for a dispatch once caught up (``writer_idle``).
  Dispatch runs once per loop iteration at most, after whatever made messages available or
  freed room.
- A stream that ends (half-close, cancel, lost connection, failed read or write, server break,
  subscription deleted) is forgotten at once by ``end_stream``, not when its RPC's generator
  happens to finish: it leaves ``sub.streams`` (no dispatch reaches it again) and the leases in
  its outbox, never written, are given back (not counted as an attempt).
- With ``enable_message_ordering``, a message with an ordering key is leased only while no other
  message of its key is leased or waiting out a backoff; the rest of the key waits in ``held`` in
  publish order. A nack or expiry puts the message back in front of them, so the key is
  redelivered from that message on, in order.
- Expiry and delayed releases share one heap ordered by loop time, served by a single timer
  handle; superseded heap entries are skipped when they come due, so a modack costs O(log n).
- A stream's flow-control budget counts its live leases (written or still in its outbox);
  ending a lease frees it. A stream always gets at least one message when it has none outstanding.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from sidecar.emulators.pubsub_model import (
    MAX_MESSAGES_PER_RESPONSE,
    MAX_RESPONSE_BYTES,
    RESPONSE_OVERHEAD_BYTES,
    Backlog,
    Finished,
    Lease,
    Pending,
    PubsubError,
    Snapshot,
    StreamState,
    Subscription,
)
from sidecar.emulators.pubsub_timers import TimerHeap

_LOGGER = logging.getLogger(__name__)

_LEASE = 0
_RELEASE = 1


class Broker:
    """Topics and subscriptions of the emulator, and message delivery between them."""

    def __init__(self, wall_clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._wall_clock_ns = wall_clock_ns
        self.clock_offset_ns = 0
        """Admin API: how far the emulator's clock runs ahead of the wall clock (to age messages in tests)."""
        self.topics: dict[str, Any] = {}
        self.subscriptions: dict[str, Subscription] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self._topic_subs: dict[str, set[str]] = {}
        self.topic_snapshots: dict[str, set[str]] = {}
        self.iam_policies: dict[str, Any] = {}
        """Resource name -> its IAM policy (raw ``google.iam.v1.Policy``); gone with the resource."""
        self.topic_logs: dict[str, deque[tuple[Any, int, int]]] = {}
        """Topics with message retention: (message, publish ns, size) of what they retain, in publish order."""
        self._seq = itertools.count(1)
        self._ack_seq = itertools.count(1)
        self._message_ids = itertools.count(1)
        self._stream_numbers = itertools.count(1)
        self._timers = TimerHeap(self._on_due)
        self._to_dispatch: dict[Subscription, None] = {}
        self._dispatch_handle: asyncio.Handle | None = None
        self.delivery_delay_seconds: dict[str, float] = {}
        """Fault: subscription name (or "*") -> seconds every new message waits before it is deliverable."""

    def now_ns(self) -> int:
        """The emulator's clock: publish times, retention, snapshot expiry and Monitoring samples read it.

        The wall clock plus the offset the admin API can move forward; lease deadlines do not use it
        (they run on the event loop's monotonic clock)."""
        return self._wall_clock_ns() + self.clock_offset_ns

    def next_seq(self) -> int:
        return next(self._seq)

    # -- topics and subscriptions ------------------------------------------------------------

    def add_topic(self, config: Any) -> None:
        if config.name in self.topics:
            raise PubsubError(grpc.StatusCode.ALREADY_EXISTS, f"Topic already exists: {config.name}")
        self.topics[config.name] = config
        self._topic_subs.setdefault(config.name, set())
        self.set_topic_retention(config)

    def set_topic_retention(self, config: Any) -> None:
        """Start or stop keeping a topic's messages, and show its retention on its subscriptions."""
        retained = config.HasField("message_retention_duration")
        if retained:
            self.topic_logs.setdefault(config.name, deque())
        else:
            self.topic_logs.pop(config.name, None)
        for sub_name in self._topic_subs.get(config.name, ()):
            sub_config = self.subscriptions[sub_name].config
            if retained:
                sub_config.topic_message_retention_duration.CopyFrom(config.message_retention_duration)
            else:
                sub_config.ClearField("topic_message_retention_duration")

    def topic(self, name: str) -> Any:
        try:
            return self.topics[name]
        except KeyError:
            raise PubsubError(grpc.StatusCode.NOT_FOUND, f"Topic not found: {name}") from None

    def delete_topic(self, name: str, deleted_marker: str) -> None:
        self.topic(name)
        del self.topics[name]
        self.topic_logs.pop(name, None)
        self.iam_policies.pop(name, None)
        # Production keeps the subscriptions (and snapshots) and reports their topic as deleted.
        for sub_name in self._topic_subs.pop(name, set()):
            self.subscriptions[sub_name].config.topic = deleted_marker
            self.subscriptions[sub_name].config.ClearField("topic_message_retention_duration")
        for snapshot_name in self.topic_snapshots.pop(name, set()):
            self.snapshots[snapshot_name].config.topic = deleted_marker

    def topic_subscriptions(self, name: str) -> list[str]:
        self.topic(name)
        return sorted(self._topic_subs.get(name, ()))

    def add_subscription(self, config: Any) -> Subscription:
        if config.name in self.subscriptions:
            raise PubsubError(grpc.StatusCode.ALREADY_EXISTS, f"Subscription already exists: {config.name}")
        topic = self.topic(config.topic)
        if topic.HasField("message_retention_duration"):
            config.topic_message_retention_duration.CopyFrom(topic.message_retention_duration)
        sub = Subscription(config=config, created_ns=self.now_ns())
        self.subscriptions[config.name] = sub
        self._topic_subs[config.topic].add(config.name)
        return sub

    def subscription(self, name: str) -> Subscription:
        try:
            return self.subscriptions[name]
        except KeyError:
            raise PubsubError(grpc.StatusCode.NOT_FOUND, f"Subscription does not exist: {name}") from None

    def delete_subscription(self, name: str) -> None:
        sub = self.subscription(name)
        del self.subscriptions[name]
        self.iam_policies.pop(name, None)
        self._topic_subs.get(sub.config.topic, set()).discard(name)
        sub.deleted = True
        for lease in sub.leases.values():
            lease.active = False
        sub.leases.clear()
        sub.unacked.clear()
        sub.acked.clear()
        sub.available.clear()
        sub.held.clear()
        for stream in list(sub.streams):
            self.end_stream(stream, grpc.StatusCode.NOT_FOUND, f"Subscription does not exist: {name}")
        sub.pull_wake.set()

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, topic_name: str, messages: Iterable[Any]) -> list[str]:
        """Assign ids and publish time to ``messages`` (mutated in place) and fan them out."""
        self.topic(topic_name)
        subs = [self.subscriptions[n] for n in self._topic_subs.get(topic_name, ())]
        log = self.topic_logs.get(topic_name)
        snapshots = [self.snapshots[n] for n in self.topic_snapshots.get(topic_name, ())]
        now_ns = self.now_ns()
        seconds, nanos = divmod(now_ns, 1_000_000_000)
        ids: list[str] = []
        for message in messages:
            message_id = str(next(self._message_ids))
            message.message_id = message_id
            message.publish_time.seconds = seconds
            message.publish_time.nanos = nanos
            ids.append(message_id)
            if subs or log is not None:
                size = message.ByteSize()
                for sub in subs:
                    self._enqueue(sub, Pending(next(self._seq), message, now_ns, size))
                if log is not None:
                    log.append((message, now_ns, size))
            for snapshot in snapshots:
                snapshot.messages[message_id] = (message, now_ns)
        for sub in subs:
            self.notify(sub)
        return ids

    def _enqueue(self, sub: Subscription, pending: Pending) -> None:
        sub.unacked[pending.seq] = pending
        delay = self.delivery_delay_seconds.get(sub.name, self.delivery_delay_seconds.get("*", 0.0))
        if delay > 0:
            self._push_release(sub, pending, delay)
        else:
            sub.available.append(pending)

    # -- streams and dispatch ------------------------------------------------------------------

    def open_stream(
        self, sub: Subscription, deadline_seconds: int, max_messages: int, max_bytes: int, client_id: str = ""
    ) -> StreamState:
        stream = StreamState(sub, deadline_seconds, max_messages, max_bytes, next(self._stream_numbers), client_id)
        sub.streams[stream] = None
        self.notify(sub)
        return stream

    def end_stream(self, stream: StreamState, code: grpc.StatusCode, message: str) -> None:
        """End a stream (its writer then finishes the RPC with ``code``) and forget it at once: no
        dispatch reaches it from now on, even while its writer still waits on a blocked write."""
        stream.end(code, message)
        self.close_stream(stream)

    def close_stream(self, stream: StreamState) -> None:
        """Forget a stream (idempotent). Leases it wrote stay valid (the client acks through unary
        calls) until they expire; leases still in its outbox were never delivered and are given back
        at once, to go to the other streams."""
        if stream.closed:
            return
        stream.closed = True
        sub = stream.subscription
        sub.streams.pop(stream, None)
        unsent = [lease for lease in stream.outbox if lease.active]
        stream.outbox.clear()
        now = self._now() if unsent else 0.0
        for lease in reversed(unsent):
            del sub.leases[lease.ack_id]
            lease.active = False
            lease.pending.attempts -= 1
            lease.pending.history.append((now, f"{lease.ack_id} given back unwritten: {stream.label} ended"))
            self._put_back(sub, lease.pending, front=True)
        if unsent:
            self.notify(sub)

    def break_streams(self, code: grpc.StatusCode, message: str) -> int:
        streams = [s for sub in self.subscriptions.values() for s in sub.streams]
        for stream in streams:
            self.end_stream(stream, code, message)
        return len(streams)

    def notify(self, sub: Subscription) -> None:
        """Something became available or room was freed: dispatch (once per loop iteration) and wake Pulls."""
        sub.pull_wake.set()
        if not sub.streams or sub in self._to_dispatch:
            return
        self._to_dispatch[sub] = None
        if self._dispatch_handle is None:
            self._dispatch_handle = asyncio.get_running_loop().call_soon(self._dispatch_all)

    def _dispatch_all(self) -> None:
        self._dispatch_handle = None
        pending, self._to_dispatch = self._to_dispatch, {}
        for sub in pending:
            if not sub.deleted:
                self.dispatch(sub)

    def dispatch(self, sub: Subscription) -> None:
        """Lease available messages to the open streams that take them: equal shares, least loaded
        first (ties round-robin). A stream with leases not yet written (its writer waits on a client
        that stopped reading, or has not run yet) gets nothing; its writer asks again once caught up."""
        if not sub.available or not sub.streams:
            return
        streams = list(sub.streams)
        start = sub.next_stream % len(streams)
        sub.next_stream = start + 1  # the next dispatch starts one stream further on
        ready = [s for s in streams[start:] + streams[:start] if s.is_open and not s.outbox and s.has_room()]
        ready.sort(key=_load)  # stable: equal loads keep the rotation
        now = self._now()
        # Rounds of equal shares: a stream that filled up (or got nothing: what is left does not fit
        # its budget, or is held behind busy keys) drops out and the rest share what remains.
        while ready and sub.available:
            share = -(-len(sub.available) // len(ready))  # ceil: nobody waits for a remainder
            still_ready: list[StreamState] = []
            for stream in ready:
                leases = self._lease_batch(sub, stream, share, now, unbounded=True)
                if leases:
                    stream.outbox.extend(leases)
                    stream.wake.set()
                    if stream.has_room():
                        still_ready.append(stream)
                if not sub.available:
                    break
            ready = still_ready

    def writer_idle(self, stream: StreamState) -> None:
        """A stream's writer has written everything leased to it: dispatch again if messages wait."""
        if stream.is_open and stream.subscription.available:
            self.notify(stream.subscription)

    def take(self, sub: Subscription, max_messages: int) -> list[Lease]:
        """A unary Pull: lease up to ``max_messages`` available messages, within one response."""
        if sub.deleted or not sub.available:
            return []
        return self._lease_batch(sub, None, min(max_messages, MAX_MESSAGES_PER_RESPONSE), self._now(), False)

    def _lease_batch(
        self, sub: Subscription, stream: StreamState | None, limit: int, now: float, unbounded: bool
    ) -> list[Lease]:
        """Lease up to ``limit`` messages from the front of ``available`` to ``stream`` (None: a Pull).

        Stream leases are bounded by its flow control; a Pull's by one response's size (streams cut
        their outbox into responses themselves, so ``unbounded`` skips that check)."""
        deadline = now + (stream.deadline_seconds if stream is not None else sub.ack_deadline_seconds)
        leases: list[Lease] = []
        response_bytes = 0
        available = sub.available
        ordered = sub.is_ordered
        while available and len(leases) < limit:
            pending = available[0]
            if ordered and pending.message.ordering_key:
                key = pending.message.ordering_key
                if key in sub.busy_keys:
                    available.popleft()
                    sub.held.setdefault(key, deque()).append(pending)
                    continue
            if not unbounded and leases and response_bytes + pending.size > MAX_RESPONSE_BYTES:
                break
            if stream is not None:
                if not stream.can_take(pending.size):
                    break
                stream.outstanding_messages += 1
                stream.outstanding_bytes += pending.size
            available.popleft()
            if ordered and pending.message.ordering_key:
                sub.busy_keys.add(pending.message.ordering_key)
            response_bytes += pending.size + RESPONSE_OVERHEAD_BYTES
            pending.attempts += 1
            lease = Lease(f"{next(self._ack_seq):x}-{pending.seq:x}", sub, pending, deadline, stream)
            pending.history.append((now, f"leased {lease.ack_id} to {'a Pull' if stream is None else stream.label}"))
            sub.leases[lease.ack_id] = lease
            leases.append(lease)
        for lease in leases:
            self._push(deadline, _LEASE, lease)
        return leases

    # -- acks and deadlines ------------------------------------------------------------------------

    def acknowledge(self, sub: Subscription, ack_ids: Iterable[str]) -> None:
        retain = sub.config.retain_acked_messages
        for ack_id in ack_ids:
            lease = sub.leases.pop(ack_id, None)
            if lease is None:
                continue  # stale or unknown: production ignores it
            self._end_lease(lease)
            pending = lease.pending
            pending.history.append((self._now(), f"acked {ack_id}"))
            sub.unacked.pop(pending.seq, None)
            sub.finished.append(Finished(pending.message.message_id, "acked", pending.attempts, pending.history))
            if retain:
                sub.acked[pending.seq] = pending
            if sub.is_ordered and pending.message.ordering_key:
                self._free_key(sub, pending.message.ordering_key, None)

    def modify_deadline(self, sub: Subscription, ack_ids: Iterable[str], seconds: int) -> None:
        if seconds == 0:
            for ack_id in ack_ids:
                lease = sub.leases.pop(ack_id, None)
                if lease is not None:
                    self._end_lease(lease)
                    lease.pending.history.append((self._now(), f"nacked {ack_id}"))
                    self._redeliver(sub, lease.pending)
            return
        deadline = self._now() + seconds
        for ack_id in ack_ids:
            lease = sub.leases.get(ack_id)
            if lease is not None:
                # Shorter or longer alike: the new deadline counts from now, as production does.
                lease.deadline = deadline
                lease.extensions += 1
                lease.pending.history.append((deadline - seconds, f"deadline of {ack_id} set to {seconds}s"))
                self._push(deadline, _LEASE, lease)

    def _end_lease(self, lease: Lease) -> None:
        lease.active = False
        stream = lease.stream
        if stream is not None and not stream.closed:
            stream.outstanding_messages -= 1
            stream.outstanding_bytes -= lease.pending.size
            if lease.subscription.available:
                self.notify(lease.subscription)

    def revoke_leases(self, sub: Subscription) -> None:
        """End every lease without redelivering (Seek rebuilds the backlog); their ack ids go stale."""
        for lease in sub.leases.values():
            self._end_lease(lease)
        sub.leases.clear()
        sub.busy_keys.clear()
        sub.held.clear()

    def _redeliver(self, sub: Subscription, pending: Pending) -> None:
        """After a nack or an expiry: dead-letter after the last attempt, else make it available again."""
        max_attempts = sub.max_delivery_attempts
        if max_attempts and pending.attempts >= max_attempts:
            sub.unacked.pop(pending.seq, None)
            pending.history.append((self._now(), "forwarded to the dead-letter topic"))
            sub.finished.append(
                Finished(pending.message.message_id, "dead-lettered", pending.attempts, pending.history)
            )
            self._dead_letter(sub, pending)
            if sub.is_ordered and pending.message.ordering_key:
                self._free_key(sub, pending.message.ordering_key, None)
            return
        backoff = sub.retry_backoff_seconds
        if backoff > 0:
            self._push_release(sub, pending, backoff)  # an ordering key stays busy meanwhile
            return
        self._put_back(sub, pending, front=sub.is_ordered)
        self.notify(sub)

    def _put_back(self, sub: Subscription, pending: Pending, front: bool) -> None:
        """Make a message that was leased (or waited) available again; its key, if busy, goes first."""
        key = pending.message.ordering_key
        if sub.is_ordered and key:
            self._free_key(sub, key, pending)
        elif front:
            sub.available.appendleft(pending)
        else:
            sub.available.append(pending)

    def _free_key(self, sub: Subscription, key: str, first: Pending | None) -> None:
        """An ordering key's message was acked or given back: its held messages (after ``first``) go
        to the front of the queue, in publish order, ahead of anything published later."""
        sub.busy_keys.discard(key)
        held = sub.held.pop(key, None)
        if held:
            sub.available.extendleft(reversed(held))
        if first is not None:
            sub.available.appendleft(first)
        if held or first is not None:
            self.notify(sub)

    def _dead_letter(self, sub: Subscription, pending: Pending) -> None:
        topic_name = sub.config.dead_letter_policy.dead_letter_topic
        if topic_name not in self.topics:
            # Production keeps retrying delivery when the dead-letter topic is gone; here it is dropped.
            _LOGGER.warning("dead-letter topic %s of %s does not exist; message dropped", topic_name, sub.name)
            return
        forwarded = type(pending.message)()
        forwarded.data = pending.message.data
        forwarded.ordering_key = pending.message.ordering_key
        forwarded.attributes.update(pending.message.attributes)
        project = sub.name.split("/")[1]
        publish_time = pending.message.publish_time
        forwarded.attributes.update(
            {
                "CloudPubSubDeadLetterSourceDeliveryCount": str(pending.attempts),
                "CloudPubSubDeadLetterSourceSubscription": sub.name.rsplit("/", 1)[-1],
                "CloudPubSubDeadLetterSourceSubscriptionProject": project,
                "CloudPubSubDeadLetterSourceTopicPublishTime": publish_time.ToJsonString(),
            }
        )
        self.publish(topic_name, [forwarded])

    # -- timers ------------------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def unacked_report(self, sub: Subscription) -> list[dict[str, Any]]:
        """Every unacked message of the subscription, oldest first: message id, attempts, leased, and
        its last events (seconds before now, what)."""
        leased = {lease.pending.seq for lease in sub.leases.values()}
        now = self._now()
        return [
            {
                "message_id": p.message.message_id,
                "delivery_attempt": p.attempts,
                "leased": p.seq in leased,
                "history": [f"-{now - when:.3f}s {what}" for when, what in p.history],
            }
            for p in sub.unacked.values()
        ]

    def finished_report(self, sub: Subscription) -> list[dict[str, Any]]:
        """The last acked or dead-lettered messages (``FINISHED_MESSAGES_KEPT``), oldest first: message
        id, outcome, attempts, and their last events as in :meth:`unacked_report`."""
        now = self._now()
        return [
            {
                "message_id": f.message_id,
                "outcome": f.outcome,
                "delivery_attempt": f.attempts,
                "history": [f"-{now - when:.3f}s {what}" for when, what in f.history],
            }
            for f in sub.finished
        ]

    def stream_report(self, sub: Subscription) -> list[dict[str, Any]]:
        """The subscription's open streams, oldest first: number, client id, flow control and the
        leases not yet written, and for how long its current write has waited (a stream whose client
        stopped reading keeps both)."""
        now = self._now()
        return [
            {
                "stream": s.number,
                "client_id": s.client_id,
                "routing": s.routing,
                "heartbeats": s.heartbeats,
                "deadline_seconds": s.deadline_seconds,
                "max_outstanding_messages": s.max_messages,
                "max_outstanding_bytes": s.max_bytes,
                "outstanding_messages": s.outstanding_messages,
                "outstanding_bytes": s.outstanding_bytes,
                "unwritten": sum(lease.active for lease in s.outbox),
                "write_blocked_seconds": 0.0 if s.writing_since is None else round(now - s.writing_since, 3),
            }
            for s in sub.streams
        ]

    def lease_report(self, sub: Subscription) -> list[dict[str, Any]]:
        """The subscription's live leases: message id, attempt, seconds left, modacks so far, and who
        holds it (a stream, or a Pull) and whether it was written to that stream yet."""
        now = self._now()
        unwritten = {id(lease) for stream in sub.streams for lease in stream.outbox}
        return [
            {
                "ack_id": lease.ack_id,
                "message_id": lease.pending.message.message_id,
                "delivery_attempt": lease.pending.attempts,
                "seconds_left": round(lease.deadline - now, 3),
                "extensions": lease.extensions,
                "holder": "a Pull" if lease.stream is None else lease.stream.label,
                "written": id(lease) not in unwritten,
            }
            for lease in sub.leases.values()
        ]

    def _push_release(self, sub: Subscription, pending: Pending, delay_seconds: float) -> None:
        pending.release_token += 1
        self._push(self._now() + delay_seconds, _RELEASE, (sub, pending, pending.release_token))

    def _push(self, when: float, kind: int, obj: Any) -> None:
        self._timers.push(when, kind, obj)

    def _on_due(self, when: float, kind: int, obj: Any) -> None:
        if kind == _LEASE:
            lease: Lease = obj
            if lease.active and lease.deadline == when:  # else acked, nacked or extended since
                self._expire(lease)
            return
        sub, pending, token = obj
        # Skipped when the subscription is gone, the message was acked or expunged since, or a
        # Seek rebuilt the backlog (a new Pending) or re-armed the release.
        if not sub.deleted and sub.unacked.get(pending.seq) is pending and pending.release_token == token:
            pending.release_token += 1
            if pending.attempts == 0:
                sub.available.append(pending)  # a delayed new message: dispatch holds its key if busy
            else:
                self._put_back(sub, pending, front=False)  # after a backoff: frees its key
            self.notify(sub)

    def _expire(self, lease: Lease) -> None:
        sub = lease.subscription
        if sub.leases.pop(lease.ack_id, None) is None:
            return
        self._end_lease(lease)
        lease.pending.history.append((self._now(), f"lease {lease.ack_id} expired"))
        self._redeliver(sub, lease.pending)

    def close(self) -> None:
        self._timers.close()
        if self._dispatch_handle is not None:
            self._dispatch_handle.cancel()
            self._dispatch_handle = None

    # -- monitoring ------------------------------------------------------------------------------

    def backlogs(self) -> dict[str, Backlog]:
        """Subscriptions with unacked messages -> oldest publish time and count (empty ones omitted)."""
        result: dict[str, Backlog] = {}
        for name, sub in self.subscriptions.items():
            if sub.unacked:
                oldest = next(iter(sub.unacked.values()))
                result[name] = Backlog(oldest.publish_time_ns, len(sub.unacked))
        return result


def _load(stream: StreamState) -> int:
    return stream.outstanding_messages
