"""Crash-point simulation: the engine and the store's real write planning over Firestore semantics in memory.

One ``Simulation`` plays everything around the store, step by step, deterministically:

- **Pub/Sub**: published copies stay outstanding until acked; any outstanding copy may be (re)delivered
  at any time, in any order, any number of times (at-least-once, no order).
- **The sidecar**: ``DocumentStore`` over ``MemoryDocuments`` plus ``Engine``, glued by the same rules
  as ``sidecar.pipeline.ingest`` and ``sidecar.pipeline.runtime``: ack Pub/Sub only after persist said durable (the ack
  itself is a separate step, so a crash can fall between them); an app ack counts once
  ``commit_acks`` returned; a dead letter is published, then ``mark_done``, then ``dead_letter_done``.
- **The app**: takes deliveries, acks (in any order, with ``max_in_flight_per_key`` > 1), nacks,
  asks for dead letters, closes its stream.
- **An operator** unblocks a key blocked at a dead letter (``pubsub-sidecar unblock``): the store
  records it (``Store.unblock``), then the engine passes the dead letter, as the runtime does.
- **Faults**: a crash before or after the n-th next document write (a Commit or BatchWrite: between
  the Commits of one ack batch, between a persist and its Pub/Sub ack, anywhere), an answer lost
  after a write applied, TTL expiry of tombstones, time passing (ack deadlines, backoffs, gap timeouts).

A crash throws away the engine, the store object and every queued action, keeps the documents, and
recovers with ``load`` + ``Engine.restore``, exactly as a restarted process does.

**Recovery by pages** (``SimConfig.paged``), as the runtime's ``_load_shard`` / ``_load_pending`` do:
every recovery (start and ``take_over``) loads a shard's state only (``load(..., pending=False)``),
restores a loading engine (``Engine.restore(..., loading=True)``), and keeps the shard's
``pending_pages`` generator open (the reader's page size patched small while store code runs, so a
shard's pending messages span several pages). The ``page`` operation reads and restores the next page
through the runtime's own ``ShardEngine.admit`` (each record reaches the engine once, from a page or
from the intake, whichever comes first), or, after the last page, ends the load (``finish_loading``,
its actions executed like any). Every other operation may run between two pages; ``drain`` finishes
every load first.

**Several owners** (``SimConfig.pods``, ``SimConfig.shards``): pods ``p0``, ``p1``, ... share the
documents; each key's shard has a lease document (``owner``, ``epoch``) that the pods' stores fence
their advancing writes with (``DocumentStore(fences=...)``, from what the pod *believes* it holds).
Each pod runs one engine per shard it owns (a handover is a recovery of that shard). Operations act
on the pod in focus (``focus``). ``lose_lease`` gives a shard to another pod (epoch + 1) behind the
old owner's back: the old pod keeps running with its belief, like a paused pod that wakes, and
learns of the loss only when a fenced write fails (``ShardLost``: it drops the shard's engine and
everything it queued for it). Its *deliveries* stop at once: the runtime stops delivering a shard
when its lease's safety margin runs out, which by the lease timing comes before another pod can
take the lease; the store's fencing is what must stop its *writes*. ``take_over`` has the new owner
load the shard (``load(shards=...)``) and deliver from there. Intake: any pod persists any message;
one that does not own the key's shard writes it ``to_owner`` (``inbox``), and the owner's ``listen``
(Firestore Listen on ``inbox == shard``) hands it over. The after-write hook checks that no write
advancing a key (tombstone, cursor, checkpoint) applies unless its writer holds the shard's lease at
the epoch it believes.

Checked on every delivery (``sim_checks.check_delivery``) and at the end (``check_end`` after ``drain``):
G1 every valid message is confirmed or dead-lettered with a reason (or held durably behind a key
blocked by its own in-order dead letter); G2 per key nothing is delivered before every earlier
message was acked, dead-lettered or skipped by policy (or is in flight within the key's window);
G3 nothing is delivered after its ack was confirmed; liveness: no key waits for a position that is
already finished, and no key is blocked except by an in-order dead letter under ``block`` that no
operator passed (an unblock survives every crash after it was recorded).

The simulation by job: ``sim_world`` (what Pub/Sub holds, the configuration, a life, the
documents' records), ``sim_pods`` (each pod's process: start, crash and restart, leases and
fences, paged loads, the engines' glue), ``sim_sidecar`` (the data path, as the runtime runs it),
``sim_checks`` (G1-G3 and liveness) and this module: ``Simulation``, the world acting on the
sidecar (Pub/Sub, the app, an operator, faults, time, lease changes), the scripted steps of the
explicit examples, and whole runs (``run``: play, ``drain``, ``check_end``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim_checks import check_end
from sim_sidecar import SimulatedSidecar
from sim_world import Crash, Identity, identity_of, lease_path

from sidecar.engine import Deliver, UnknownDelivery
from sidecar.store.api import DEAD_LETTERED


@dataclass
class Simulation(SimulatedSidecar):
    """The world acting on the simulated sidecar, one operation at a time (module docstring)."""

    def run(self, operations: Sequence[tuple[str, int]]) -> None:
        """Play ``operations``, settle, check G1 and liveness, and close: one whole run."""
        try:
            for op, arg in operations:
                self.step(op, arg)
            self.drain()
            self.check_end()
        finally:
            self.close()

    def op_arm_crash(self, arg: int) -> None:
        """Crash before (even ``arg``) or after (odd) the (arg // 2 % 4)-th next document write."""
        self._writes_until_crash = arg // 2 % 4
        self._crash_after_apply = bool(arg % 2)

    def op_lose_answer(self, arg: int) -> None:
        self._lose_next_answer = True

    def op_crash(self, arg: int) -> None:
        raise Crash("kill -9")

    def op_brownout(self, arg: int) -> None:
        """Firestore is unavailable for the next few writes: they fail before they apply, and every
        caller retries (the runtime for as long as they fail), so a retry can outlive the lease it
        was decided under, across a ``lose_lease`` (to this very pod too) and a ``take_over``."""
        self._unavailable_writes = 1 + arg % 6

    def op_focus(self, arg: int) -> None:
        """The next operations act on another pod."""
        self.active = arg % self.config.pods

    def op_lose_lease(self, arg: int) -> None:
        """Another pod (or this one, re-acquiring) takes a shard: epoch + 1. The old owner is not told."""
        shard = arg % self.config.shards
        lease = self._leases()[shard]
        owner = (int(lease["owner"][1:]) + 1 + arg // self.config.shards) % self.config.pods
        self.documents.docs[lease_path(shard)] = {"owner": f"p{owner}", "epoch": lease["epoch"] + 1}

    def op_redeliver(self, arg: int) -> None:
        """A publisher retry or a Pub/Sub redelivery of an already-acked copy."""
        if self.published:
            message = self.published[arg % len(self.published)]
            self._copy_counter += 1
            self.pubsub[self._copy_counter] = message

    def op_take(self, arg: int) -> None:
        self.take(f"c{arg % 2}", 1 + arg % 3)

    def _pick(self, arg: int) -> Deliver | None:
        outstanding = self.life.outstanding
        if not outstanding:
            return None
        ids = sorted(outstanding)
        return outstanding[ids[arg % len(ids)]]

    def op_app_ack(self, arg: int) -> None:
        delivery = self._pick(arg)
        if delivery is None:
            return
        del self.life.outstanding[delivery.delivery_id]
        engine = self._engine_of(delivery.message.key)
        if engine is None:
            return  # the pod dropped the shard: the ack goes nowhere
        try:
            intent = engine.ack(delivery.consumer, delivery.delivery_id, self.now_ms)
        except UnknownDelivery:
            return  # expired or the stream closed meanwhile
        self.life.accepted_by[delivery.delivery_id] = (self.life.believed[self._shard(delivery.message.key)], engine)
        self.life.acks.append(intent)
        self.life.accepted.add(identity_of(delivery.message))
        self.app_acked.add(identity_of(delivery.message))

    def op_app_nack(self, arg: int) -> None:
        delivery = self._pick(arg)
        if delivery is None:
            return
        del self.life.outstanding[delivery.delivery_id]
        engine = self._engine_of(delivery.message.key)
        if engine is None:
            return
        try:
            actions = engine.nack(delivery.consumer, delivery.delivery_id, self.now_ms, dead_letter=arg % 5 == 0)
        except UnknownDelivery:
            return
        self._apply(actions)

    def op_close_stream(self, arg: int) -> None:
        consumer = f"c{arg % 2}"
        for engine in self.life.engines.values():
            engine.consumer_closed(consumer, self.now_ms)
        for delivery_id in [d for d, x in self.life.outstanding.items() if x.consumer == consumer]:
            del self.life.outstanding[delivery_id]

    def op_unblock(self, arg: int) -> None:
        """An operator skips the dead letter a blocked key stopped at: durable first, then the engine."""
        blocked = sorted(key for key in (f"k{i}" for i in range(self.config.keys)) if self._is_blocked(key))
        if not blocked:
            return
        self._unblock(blocked[arg % len(blocked)])

    def op_retry_unblocks(self, arg: int) -> None:
        """The operator runs again each unblock that answered UNAVAILABLE (it may have applied)."""
        for key in sorted(self.unblock_retries):
            if not self.owns(self._shard(key)):
                continue  # the operator's command reaches the shard's owner
            if self._is_blocked(key):
                self._unblock(key)
            else:
                self.unblock_retries.discard(key)  # a restart found it recorded

    def op_tick(self, arg: int) -> None:
        self.now_ms += [10, 200, 1_100, 6_000][arg % 4]
        self._tick_all()

    def op_expire(self, arg: int) -> None:
        """Time passes beyond the dedup TTL and the TTL policy deletes expired tombstones. So much
        time also means the runtime's retries (ack commits, dead letters, drops) and the store's
        background flush have run meanwhile."""
        focus = self.active
        for pod in range(self.config.pods):  # every pod's runtime and store
            self.active = pod
            for _ in range(5):  # retried until they succeed, as the runtime does long before a TTL runs out
                for op in ("commit_acks", "drops", "dead_letter", "retry_unblocks"):
                    getattr(self, f"op_{op}")(arg)
        for shard in range(self.config.shards):  # a lease's owner loads its shard long before a TTL runs out
            self.op_take_over(shard)
        self.now_ms += 1_100  # the background flush runs a cursor interval after the last commit
        for pod in range(self.config.pods):
            self.active = pod
            self.op_flush(arg)
        self.active = focus
        self.now_ms += self.config.dedup_ttl_ms + 1
        self.expired_tombstones |= self.records.finished_documents()
        self.expired_contents |= self.records.finished_contents()
        self.expired_in_order_dead_letters |= self.records.documents_in((DEAD_LETTERED,))
        self.documents.expire(self.now_ms)
        self._tick_all()

    OPS = (
        "ingest",
        "ingest",
        "pubsub_ack",
        "take",
        "take",
        "app_ack",
        "app_ack",
        "app_nack",
        "commit_acks",
        "commit_acks",
        "dead_letter",
        "drops",
        "flush",
        "tick",
        "tick",
        "close_stream",
        "redeliver",
        "expire",
        "crash",
        "arm_crash",
        "arm_crash",
        "lose_answer",
        "unblock",
        "focus",
        "lose_lease",
        "take_over",
        "listen",
        "page",
        "page",
        "stale_copy",
        "brownout",
    )

    def ingest_all(self) -> None:
        """Pub/Sub hands over every outstanding copy (oldest first); the sidecar acks what is safe."""
        while self.pubsub:
            before = dict(self.pubsub)
            self.step("ingest", 0)
            self.step("pubsub_ack", 0)
            if self.pubsub == before:
                return  # nothing could be persisted now

    def delivery_of(self, key: str, seq: int) -> Deliver:
        (delivery,) = [d for d in self.life.outstanding.values() if identity_of(d.message) == (key, seq)]
        return delivery

    def ack(self, key: str, seq: int) -> None:
        ids = sorted(self.life.outstanding)
        self.step("app_ack", ids.index(self.delivery_of(key, seq).delivery_id))

    def nack(self, key: str, seq: int, *, dead_letter: bool = False) -> None:
        delivery = self.delivery_of(key, seq)
        del self.life.outstanding[delivery.delivery_id]
        engine = self._engine_of(key)
        assert engine is not None
        actions = engine.nack(delivery.consumer, delivery.delivery_id, self.now_ms, dead_letter=dead_letter)
        self._apply(actions)

    def dead_letter_all(self) -> None:
        while self.life.dead_letters:
            before = len(self.life.dead_letters)
            self.step("dead_letter", 0)
            if len(self.life.dead_letters) == before:
                return

    def settle(self) -> None:
        """Commit acks, dead letters and drops, and flush cursors."""
        for op in ("commit_acks", "drops", "flush"):
            self.step(op, 0)
        self.dead_letter_all()

    def drain(self, rounds: int = 60) -> None:
        """No more faults: let everything settle (the app acks all it gets, time passes). Every pod
        first learns the truth about its leases (its margin ran out) and every lease owner loads
        its shards."""
        self._writes_until_crash = None
        self._lose_next_answer = False
        self._unavailable_writes = 0
        for pod in range(self.config.pods):
            self.active = pod
            self._lose(frozenset(shard for shard in list(self.life.engines) if not self.owns(shard)))
        for shard in range(self.config.shards):
            self.step("take_over", shard)
        self.finish_loads()
        for _ in range(rounds):
            for pod in range(self.config.pods):
                self.active = pod
                for op in (
                    "ingest",
                    "ingest",
                    "ingest",
                    "pubsub_ack",
                    "listen",
                    "take",
                    "take",
                    "app_ack",
                    "app_ack",
                    "app_ack",
                    "commit_acks",
                    "dead_letter",
                    "dead_letter",
                    "drops",
                    "flush",
                    "retry_unblocks",
                ):
                    self.step(op, len(self.pubsub) + len(self.life.outstanding))
            self.step("tick", 2)
            self.step("tick", 3)

    def check_end(self) -> None:
        """G1 and liveness after ``drain`` (``sim_checks.check_end``)."""
        check_end(self)

    def snapshot_of_messages(self) -> dict[str, dict[str, Any]]:
        return self.records.snapshot_of_messages()

    def pending_documents(self) -> set[Identity]:
        return self.records.pending_documents()

    def finished_documents(self) -> set[Identity]:
        return self.records.finished_documents()
