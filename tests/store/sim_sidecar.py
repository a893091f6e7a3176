"""The crash simulation's sidecar data path: intake, delivery, acks, dead letters, drops and flushes,
glued to the store and the engines by the same rules as ``sidecar.pipeline.ingest`` and
``sidecar.pipeline.runtime``.

Rules (each the runtime's):

- **Pub/Sub is acked only after persist said durable** (``op_ingest`` queues the ack; the ack is a
  step of its own, ``op_pubsub_ack``, so a crash can fall between them). A fast-path message is
  not stored: its Pub/Sub ack waits for its ack to be durable (``_settle_fast``).
- **An app ack is confirmed only once ``commit_acks`` returned**; with the epoch rule an ack of an
  engine dropped since is refused before it is sent, and every write carries the epochs of the
  engines that decided it.
- **A dead letter is published, then ``mark_done``, then ``dead_letter_done``.** An unblock is
  durable first (``Store.unblock``), then the engine passes the dead letter.
- **A ``ShardLost`` drops the shard** (``_lose``): what was decided under the lost epoch is never
  confirmed; any other ``StoreError`` leaves the work queued, retried later.
- ``take`` hands out only shards the pod owns now, and reads stripped payloads back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from sim_checks import check_delivery
from sim_pods import SimulatedPods
from sim_world import SUB, Crash, content_of, identity_of

from sidecar.engine import Deliver, Engine
from sidecar.engine.types import AckIntent, Message
from sidecar.store import layout
from sidecar.store.api import DEAD_LETTERED, DEAD_LETTERED_ASIDE, DROPPED, PersistOutcome, ShardLost, StoreError


@dataclass
class SimulatedSidecar(SimulatedPods):
    """The pods plus the sidecar's data path, one operation or call at a time (module docstring)."""

    def op_ingest(self, arg: int) -> None:
        """Pub/Sub delivers up to 3 outstanding copies (one persist call), any of them."""
        if not self.pubsub:
            return
        copies = sorted(self.pubsub)
        chosen = [copies[(arg + i * 7) % len(copies)] for i in range(1 + arg % 3)]
        chosen = list(dict.fromkeys(chosen))
        valid = []
        for number in chosen:
            message = self.pubsub[number]
            if message.malformed:
                # Ingest's classify: dead-lettered with a reason, then acked.
                self.dead_letter_topic.append((message, "malformed"))
                del self.pubsub[number]
            else:
                valid.append(number)
        if not valid:
            return
        life = self.life
        # Intake anywhere: a copy of a shard this pod does not deliver goes to its owner's inbox.
        mine = {n: self.owns(self._shard(self.pubsub[n].key)) for n in valid}
        if self.config.fast_path:
            stored = []
            for number in valid:
                engine = self._engine_of(self.pubsub[number].key) if mine[number] else None
                message = self.pubsub[number].incoming().to_message(self.now_ms, "", volatile=True)
                if engine is not None and engine.fast_path(message):
                    life.fast[id(message)] = (number, message)
                    self._on_stored(message)  # nothing written; the Pub/Sub ack waits
                else:
                    stored.append(number)
            valid = stored
            if not valid:
                return
        batch = [self.pubsub[n].incoming(to_owner=not mine[n]) for n in valid]
        try:
            results = self._run(life.store.persist(SUB, batch, self.now_ms))
        except StoreError:
            return  # nothing acked: Pub/Sub redelivers
        for number, result in zip(valid, results, strict=True):
            if result.outcome is PersistOutcome.STORED:
                if mine[number]:
                    self._on_stored(result.message)
                life.to_ack.append(number)
            elif result.outcome is PersistOutcome.DUPLICATE:
                if result.pending is not None and mine[number]:
                    self._on_stored(result.pending)
                life.to_ack.append(number)
            elif result.outcome is PersistOutcome.CONFLICT:
                if result.pending is not None and mine[number]:
                    self._on_stored(result.pending)
                self.dead_letter_topic.append((self.pubsub[number], "conflict"))
                life.to_ack.append(number)
            # FAILED: not acked, Pub/Sub redelivers.

    def op_pubsub_ack(self, arg: int) -> None:
        for number in self.life.to_ack:
            self.pubsub.pop(number, None)
        self.life.to_ack.clear()

    def op_listen(self, arg: int) -> None:
        """The owner's Listen on ``inbox == shard and state == pending`` hands over other pods' intake."""
        for path, fields in sorted(self.documents.docs.items()):
            if "/messages/" not in path or "/chunks/" in path or fields.get("state") != layout.PENDING:
                continue
            shard = fields.get(layout.INBOX)
            if shard is not None and self.owns(shard):
                self._on_stored(layout.message_from_fields(path.rpartition("/")[2], fields))

    def op_stale_copy(self, arg: int) -> None:
        """A stored record handed over again from an old read: a persist's read-back that raced the
        owner's ack of it, or a Listen snapshot older than the owner's own writes."""
        seen = self.life.seen
        if seen:
            message = seen[arg % len(seen)]
            if self.owns(self._shard(message.key)):
                self._on_stored(message)

    def take(self, consumer: str = "c0", count: int = 10) -> list[Deliver]:
        """The runtime's take: hand out, then read stripped payloads back (a store read that may fail)."""
        life = self.life
        # Only the shards it owns now: the runtime stops delivering a shard once its lease's margin
        # runs out, before another pod can take it.
        deliveries = [
            delivery
            for shard, engine in sorted(life.engines.items())
            if self.owns(shard)
            for delivery in engine.take(consumer, count, self.now_ms)
        ]
        stripped = [d.message for d in deliveries if d.message.payload is not None and d.message.payload.stripped]
        loaded: dict[str, Message] = {}
        if stripped:
            try:
                loaded = {m.payload.ref: m for m in self._run(life.store.read_payloads(SUB, stripped, self.now_ms))}
            except StoreError:
                for engine in life.engines.values():
                    engine.consumer_closed(consumer, self.now_ms)  # given back; the app never saw them
                return []
        out = []
        for delivery in deliveries:
            payload = delivery.message.payload
            if payload is not None and payload.stripped:
                delivery = replace(delivery, message=loaded[payload.ref])
            elif delivery.attempt == 1 and payload is not None:
                life.held_bytes -= len(payload.data)
            check_delivery(self, delivery)
            life.outstanding[delivery.delivery_id] = delivery
            out.append(delivery)
        return out

    def op_commit_acks(self, arg: int) -> None:
        life = self.life
        if life.acks:
            batch, life.acks = life.acks, []
            epochs: dict[int, int] | None = None
            if self.config.epoch_rule:
                # The runtime's ``_commit_acks``: an ack of an engine dropped since is refused at once.
                current = [
                    i for i in batch if self._accepting_engine(i) is life.engines.get(self._shard(i.message.key))
                ]
                self.stale_acks += len(batch) - len(current)
                batch = current
                epochs = {self._shard(i.message.key): life.accepted_by[i.delivery_id][0] for i in batch}
            if batch:
                task = self.loop.create_task(life.store.commit_acks(SUB, batch, self.now_ms, epochs=epochs))
                life.ack_tasks.append((task, batch))
        self._finish_ack_tasks()

    def _accepting_engine(self, intent: AckIntent) -> Engine | None:
        accepted = self.life.accepted_by.get(intent.delivery_id)
        return None if accepted is None else accepted[1]

    def _lost_now(self, error: ShardLost) -> frozenset[int]:
        """The shards of ``error`` that the pod in focus holds at the epoch lost (not those it holds
        again at a later epoch: only what was decided under the old one was refused)."""
        believed = self.life.believed
        return frozenset(s for s in error.shards if s in believed and error.lost_at(s, believed[s]))

    def _finish_ack_tasks(self) -> None:
        """Let the ``commit_acks`` calls under way run; handle those that returned (a call with
        fast-path acks returns only once a flush wrote their shards' checkpoints)."""
        life = self.life
        for _ in range(5):
            self._run(asyncio.sleep(0))
        for task, batch in [(t, b) for t, b in life.ack_tasks if t.done()]:
            life.ack_tasks.remove((task, batch))
            error = task.exception()
            if isinstance(error, Crash):
                raise error
            if isinstance(error, ShardLost):
                # The rest of the batch is durable; acks of the shards named, at their epochs, are not.
                self.fenced_writes += 1
                refused = error
                batch = [
                    i
                    for i in batch
                    if not refused.lost_at(self._shard(i.message.key), life.accepted_by[i.delivery_id][0])
                ]
                self._lose(self._lost_now(error))
            elif error is not None:
                assert isinstance(error, StoreError), error
                life.acks = batch + life.acks  # the runtime retries
                continue
            for shard, engine in life.engines.items():
                ids = [
                    i.delivery_id
                    for i in batch
                    if self._shard(i.message.key) == shard and self._accepting_engine(i) is engine
                ]
                self._apply(engine.ack_durable(ids, self.now_ms))
            # Confirmed to the app: never to be delivered again (G3).
            self.confirmed.update(identity_of(intent.message) for intent in batch)
            self.resolved_contents.update(content_of(intent.message) for intent in batch)
            for intent in batch:
                self._settle_fast(intent.message)

    def _settle_fast(self, message: Message) -> None:
        """A fast-path message is safe (ack durable, or dead letter recorded): its Pub/Sub ack may go."""
        settled = self.life.fast.pop(id(message), None)
        if settled is not None:
            self.life.to_ack.append(settled[0])

    def op_dead_letter(self, arg: int) -> None:
        life = self.life
        if not life.dead_letters:
            return
        action = life.dead_letters[arg % len(life.dead_letters)]
        message = action.message
        self.dead_letter_topic.append((message, action.reason))  # published: the topic has it (G1)
        self.resolved_contents.add(content_of(message))
        if action.reason != "conflict":
            self.dead_lettered.add(identity_of(message))
        state = DEAD_LETTERED if action.in_order else DEAD_LETTERED_ASIDE
        try:
            self._run(life.store.mark_done(SUB, [message], state, self.now_ms, epochs=self._epochs([message.key])))
        except ShardLost as exc:
            self.fenced_writes += 1
            self._lose(self._lost_now(exc))  # the new owner delivers it again (the topic has a copy: allowed)
            return
        except StoreError:
            return  # retried later; the topic may get it twice (allowed)
        life.dead_letters.remove(action)
        if action.in_order:
            self.in_order_dead_letters.add(identity_of(message))
        engine = self._engine_of(message.key)
        assert engine is not None
        self._apply(engine.dead_letter_done(message, self.now_ms))
        self._settle_fast(message)

    def _unblock(self, key: str) -> None:
        life = self.life
        try:
            position = self._run(life.store.unblock(SUB, key, self.now_ms, epochs=self._epochs([key])))
        except ShardLost as exc:
            self.fenced_writes += 1
            self._lose(self._lost_now(exc))  # the operator asks the new owner (drain retries it there)
            self.unblock_retries.add(key)
            return
        except StoreError:
            self.unblock_retries.add(key)  # UNAVAILABLE: the operator retries
            return
        self.unblock_retries.discard(key)
        if isinstance(position, int):
            self.confirmed_unblocks.add((key, position))
        engine = self._engine_of(key)
        assert engine is not None
        _message, actions = engine.unblock(key, position, self.now_ms)
        self._apply(actions)

    def op_drops(self, arg: int) -> None:
        life = self.life
        if not life.drops:
            return
        batch, life.drops = life.drops, []
        try:
            self._run(
                life.store.mark_done(SUB, batch, DROPPED, self.now_ms, epochs=self._epochs([m.key for m in batch]))
            )
        except ShardLost as exc:
            self.fenced_writes += 1
            self._lose(self._lost_now(exc))
        except StoreError:
            life.drops = batch + life.drops

    def op_flush(self, arg: int) -> None:
        try:
            self._run(self.life.store.flush(SUB))
        except ShardLost as exc:
            self.fenced_writes += 1
            self._lose(self._lost_now(exc))
        except StoreError:
            pass
        self._finish_ack_tasks()
