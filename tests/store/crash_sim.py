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

Checked on every delivery (``_check_delivery``) and at the end (``check_end`` after ``drain``):
G1 every valid message is confirmed or dead-lettered with a reason (or held durably behind a key
blocked by its own in-order dead letter); G2 per key nothing is delivered before every earlier
message was acked, dead-lettered or skipped by policy (or is in flight within the key's window);
G3 nothing is delivered after its ack was confirmed; liveness: no key waits for a position that is
already finished, and no key is blocked except by an in-order dead letter under ``block`` that no
operator passed (an unblock survives every crash after it was recorded).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sidecar.engine import DeadLetter, Deliver, DropDuplicate, Engine, EngineConfig, Hold, UnknownDelivery
from sidecar.engine.types import AckIntent, EngineSnapshot, Message
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import layout, reader
from sidecar.store.api import (
    DEAD_LETTERED,
    DEAD_LETTERED_ASIDE,
    DROPPED,
    IncomingMessage,
    PayloadBudget,
    PersistOutcome,
    ShardLost,
    StoreError,
    SubscriptionStoreConfig,
)
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

_T = TypeVar("_T")
SUB = "s"
Identity = tuple[str, int]


class Crash(BaseException):
    """The process died here (a BaseException: no store code may catch it)."""


@dataclass(frozen=True)
class Published:
    """One published copy: the message plus which variant of its content (conflicts differ)."""

    key: str
    seq: int
    variant: int = 0
    malformed: bool = False

    @property
    def identity(self) -> Identity:
        return (self.key, self.seq)

    def incoming(self, to_owner: bool = False) -> IncomingMessage:
        data = f"{self.key}/{self.seq}/{self.variant}".encode()
        return IncomingMessage(
            key=self.key,
            dedup_id=f"{self.key}#{self.seq}#{self.variant}",
            message_id=f"m-{self.key}-{self.seq}-{self.variant}",
            data=data,
            attributes={"v": str(self.variant)},
            ordering_key="",
            publish_time_ms=1_000,
            known_fingerprint=hashlib.sha256(data).digest(),
            sequence=self.seq,
            to_owner=to_owner,
        )


@dataclass
class SimConfig:
    keys: int = 2
    per_key: int = 4
    max_in_flight: int = 1
    max_attempts: int = 3
    on_dead_letter: str = "block"
    gap_timeout_ms: int | None = None
    on_gap_timeout: str = "hold"
    on_late: str = "dead_letter"
    unpublished: frozenset[Identity] = frozenset()
    """Sequences never published (gaps that never fill: need ``on_gap_timeout: skip``)."""
    conflicts: frozenset[Identity] = frozenset()
    """Identities also published with other content (a conflict)."""
    malformed: int = 0
    dedup_ttl_ms: int = 60_000
    ack_deadline_ms: int = 5_000
    tombstones_per_commit: int = 2
    max_held_bytes: int | None = None
    """Payload bytes of held messages kept in memory (the runtime's budget); past it they are stripped."""
    max_idle_keys: int = 10_000
    """Idle keys the engine keeps; past it they are forgotten and rebuilt from the store's cursor."""
    fast_path: bool = False
    """The in-order fast path: a message exactly at its key's next position, at the owner, with
    nothing of its key held, goes to the engine unstored; its Pub/Sub ack waits for its durable ack."""
    pods: int = 1
    shards: int = 1
    """S: with 3 keys and S = 2 or 3, keys share shards or have their own."""
    paged: bool = False
    """Recover as the runtime does (``_load_shard``): each shard's state first (``load(...,
    pending=False)``, ``Engine.restore(..., loading=True)``), then its pending messages page by page
    (``pending_pages``), one page per ``page`` operation, anything else in between."""
    page_size: int = 2
    """Documents per query page while ``paged`` (the Firestore reader's ``_PAGE_SIZE``, 2,000 in
    production): small, so that a shard's pending messages span several pages."""
    epoch_rule: bool = True
    """The runtime's rule: every decision goes to the store with the epoch of the engine that made
    it (``epochs=``), every load with the epoch it is made under, and an ack of an engine dropped
    since is refused before it is sent. False plays the code before that rule (writes fenced with
    whatever the pod believes when they are sent), for the test that the simulation finds it."""

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            mode="sequence",
            gap_timeout_ms=self.gap_timeout_ms,
            on_gap_timeout=self.on_gap_timeout,  # type: ignore[arg-type]
            on_late=self.on_late,  # type: ignore[arg-type]
            dedup_ttl_ms=self.dedup_ttl_ms,
            max_in_flight_per_key=self.max_in_flight,
            ack_deadline_ms=self.ack_deadline_ms,
            max_delivery_attempts=self.max_attempts,
            backoff_initial_ms=100,
            backoff_maximum_ms=1_000,
            on_dead_letter=self.on_dead_letter,  # type: ignore[arg-type]
            max_idle_keys=self.max_idle_keys,
        )

    def store_config(self) -> SubscriptionStoreConfig:
        return SubscriptionStoreConfig(
            mode="sequence",
            dedup_ttl_ms=self.dedup_ttl_ms,
            on_dead_letter=self.on_dead_letter,  # type: ignore[arg-type]
            shards=self.shards,
        )


@dataclass
class _Load:
    """One shard's paged load under way (the runtime's ``_load_pending``): gone at a crash."""

    entry: ShardEngine
    """The runtime's own record of a loading shard: ``admit`` (its ``handed`` refs) is the rule that
    each stored record reaches the engine once, whether a page or the intake hands it over first."""
    pages: AsyncGenerator[list[Message], None]
    """``DocumentStore.pending_pages`` for the shard, suspended between pages."""


@dataclass
class _Life:
    """What one process holds in memory: gone at a crash."""

    store: DocumentStore
    engines: dict[int, Engine]
    """One per shard this pod delivers (loaded when it took the shard)."""
    believed: dict[int, int]
    """Shard -> the lease epoch this pod thinks it holds (its fences)."""
    to_ack: list[int] = field(default_factory=list)
    """Pub/Sub copies persisted, not yet acked (the ack is its own step)."""
    outstanding: dict[str, Deliver] = field(default_factory=dict)
    """Deliveries the app holds, by delivery id."""
    acks: list[AckIntent] = field(default_factory=list)
    """Acks the engine accepted, not yet committed."""
    dead_letters: list[DeadLetter] = field(default_factory=list)
    drops: list[Message] = field(default_factory=list)
    accepted: set[Identity] = field(default_factory=set)
    """Identities whose app ack the engine accepted in this life."""
    held_bytes: int = 0
    fast: dict[int, tuple[int, Message]] = field(default_factory=dict)
    """Fast-path messages by ``id``: (the Pub/Sub copy whose ack waits, the engine's message)."""
    ack_tasks: list[tuple[asyncio.Task[None], list[AckIntent]]] = field(default_factory=list)
    """``commit_acks`` calls under way: one with fast-path acks waits for its shards' checkpoint."""
    loads: dict[int, _Load] = field(default_factory=dict)
    """Shards whose pending messages are still being read (``SimConfig.paged``)."""
    budget: PayloadBudget | None = None
    """The payload budget shared by the loads under way (the runtime's ``_payload_budget``)."""
    seen: list[Message] = field(default_factory=list)
    """The last stored records handed to an engine: ``stale_copy`` hands one over again."""
    accepted_by: dict[str, tuple[int, Engine]] = field(default_factory=dict)
    """Delivery id -> (epoch, engine) that accepted its app ack: the runtime's delivery-id prefix."""

    @property
    def engine(self) -> Engine:
        """The engine of the lowest shard held (the only one with one shard): for scripted runs."""
        return self.engines[min(self.engines)]


@dataclass
class Simulation:
    config: SimConfig
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    now_ms: int = 1_000_000
    documents: MemoryDocuments = field(default_factory=MemoryDocuments)
    pubsub: dict[int, Published] = field(default_factory=dict)
    """Outstanding Pub/Sub copies by copy number."""
    published: list[Published] = field(default_factory=list)
    confirmed: set[Identity] = field(default_factory=set)
    resolved_contents: set[tuple[str, int, bytes]] = field(default_factory=set)
    """(key, seq, fingerprint) of every copy confirmed or dead-lettered through the engine."""
    dead_letter_topic: list[tuple[Published | Message, str]] = field(default_factory=list)
    dead_lettered: set[Identity] = field(default_factory=set)
    in_order_dead_letters: set[Identity] = field(default_factory=set)
    skipped: set[Identity] = field(default_factory=set)
    expired_tombstones: set[Identity] = field(default_factory=set)
    """Finished messages whose tombstone the TTL policy deleted."""
    expired_in_order_dead_letters: set[Identity] = field(default_factory=set)
    expired_contents: set[tuple[str, int, bytes]] = field(default_factory=set)
    confirmed_unblocks: set[Identity] = field(default_factory=set)
    unblock_retries: set[str] = field(default_factory=set)
    """Keys whose unblock answered UNAVAILABLE: the operator runs it again (``drain`` does)."""
    crashes: int = 0
    crash_points: int = 0
    """Crashes that struck inside a store write (between two document writes)."""
    _copy_counter: int = 0
    _writes_until_crash: int | None = None
    _crash_after_apply: bool = False
    _lose_next_answer: bool = False
    _unavailable_writes: int = 0
    """Writes still to fail before they apply (``brownout``): Firestore unavailable."""
    unavailable: int = 0
    """Writes a brownout refused."""
    stale_acks: int = 0
    """Acks of an engine dropped since, refused before they were sent (``epoch_rule``)."""
    app_acked: set[Identity] = field(default_factory=set)
    """Identities an app acked and an engine accepted, in any life."""
    lives: list[_Life] = field(init=False)
    active: int = 0
    """The pod in focus: the operations act on it."""
    handovers: int = 0
    fenced_writes: int = 0
    """Writes refused because the writer's lease had changed (``ShardLost``)."""
    pages_restored: int = 0
    loads_finished: int = 0
    left_out: int = 0
    """Records ``admit`` refused (a page's record handed over already, or the reverse)."""

    @property
    def life(self) -> _Life:
        return self.lives[self.active]

    def __post_init__(self) -> None:
        self.documents.before_write = self._before_write
        self.documents.after_write = self._after_write
        for key_index in range(self.config.keys):
            key = f"k{key_index}"
            for seq in range(1, self.config.per_key + 1):
                if (key, seq) in self.config.unpublished:
                    continue
                self.publish(Published(key, seq))
                if (key, seq) in self.config.conflicts:
                    self.publish(Published(key, seq, variant=1))
        for i in range(self.config.malformed):
            self.publish(Published("", -i - 1, malformed=True))
        for shard in range(self.config.shards):  # the lease manager's documents: p0 holds every shard
            self.documents.docs[_lease_path(shard)] = {"owner": "p0", "epoch": 1}
        self.lives = []
        for pod in range(self.config.pods):
            self.active = pod
            self.lives.append(self._start())
        self.active = 0

    # ---- plumbing ---------------------------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if not self.config.paged:
            return self.loop.run_until_complete(coroutine)
        # Every store call runs in here (background ack tasks too), so the reader's page size is
        # patched exactly while store code runs, and other tests never see it.
        saved = reader._PAGE_SIZE
        reader._PAGE_SIZE = self.config.page_size
        try:
            return self.loop.run_until_complete(coroutine)
        finally:
            reader._PAGE_SIZE = saved

    def _start(self) -> _Life:
        """The pod in focus starts: it loads the shards whose lease names it (all of them: load all)."""
        pod = self.active
        store = DocumentStore(
            self.documents,
            {SUB: self.config.store_config()},
            clock_ms=lambda: self.now_ms,
            background_flush=False,
            tombstones_per_commit=self.config.tombstones_per_commit,
            fences=lambda subscription, shard: self._fence(pod, shard),
        )
        held = {shard: lease["epoch"] for shard, lease in self._leases().items() if lease["owner"] == f"p{pod}"}
        life = _Life(store, {}, dict(held))
        if held and self.config.paged:
            for shard in sorted(held):  # the runtime's ``_start``: one ``_load_shard`` per shard
                self._load_state(life, shard)
        elif held:
            for epoch in sorted(set(held.values())):
                group = frozenset(shard for shard, at in held.items() if at == epoch)
                shards = None if len(group) == self.config.shards else group
                snapshot = self._run(
                    store.load(SUB, self.now_ms, None, self.config.max_held_bytes, shards, epoch=self._epoch(epoch))
                )
                for shard in group:
                    self._restore_engine(life, shard, snapshot)
        return life

    def _epoch(self, epoch: int) -> int | None:
        """What a load passes as its epoch: the runtime's (None before the epoch rule)."""
        return epoch if self.config.epoch_rule else None

    def _epochs(self, keys: Sequence[str]) -> dict[int, int] | None:
        """``epochs=`` for a write of the pod in focus deciding about ``keys`` (its engines' epochs)."""
        if not self.config.epoch_rule:
            return None
        believed = self.life.believed
        return {shard: believed[shard] for shard in {self._shard(key) for key in keys} if shard in believed}

    def _load_state(self, life: _Life, shard: int) -> None:
        """A paged load's first phase (the runtime's ``_load_shard``): the shard's cursors, a loading
        engine that delivers from them at once, and its pending messages' pages opened, not read."""
        shards = None if self.config.shards == 1 else frozenset({shard})
        if life.budget is None and self.config.max_held_bytes is not None:
            life.budget = PayloadBudget(self.config.max_held_bytes - life.held_bytes)
        snapshot = self._run(
            life.store.load(
                SUB, self.now_ms, None, life.budget, shards, pending=False, epoch=self._epoch(life.believed[shard])
            )
        )
        assert not snapshot.pending, "load(pending=False) returned pending messages"
        self._restore_engine(life, shard, snapshot, loading=True)
        entry = ShardEngine(shard, life.believed[shard], life.engines[shard])
        entry.handed = set()
        life.loads[shard] = _Load(entry, life.store.pending_pages(SUB, shards, life.budget, None))

    def _restore_engine(self, life: _Life, shard: int, snapshot: EngineSnapshot, loading: bool = False) -> None:
        """An engine for ``shard`` from the part of ``snapshot`` that is its."""
        mine = EngineSnapshot(
            cursors=tuple(c for c in snapshot.cursors if self._shard(c.key) == shard),
            pending=tuple(m for m in snapshot.pending if self._shard(m.key) == shard),
        )
        cursors = {cursor.key: cursor for cursor in mine.cursors}
        for key, seq in sorted(self.confirmed - self.expired_tombstones):
            # A confirmed ack is durable: the recovered cursor passes it, or keeps it finished above.
            # (Otherwise the key waits for a sequence that is no longer pending: for good.) Past the
            # TTL only the cursor record knows, and the model's sweep may outrun a pending flush.
            cursor = cursors.get(key)
            assert self._shard(key) != shard or (
                cursor is not None
                and cursor.next_sequence is not None
                and (seq < cursor.next_sequence or seq in cursor.acked_above)
            ), f"recovery: the ack of {(key, seq)} was confirmed, the recovered cursor {cursor} does not pass it"
        store = life.store
        life.engines[shard] = Engine.restore(
            self.config.engine_config(),
            mine,
            self.now_ms,
            id_prefix=f"p{self.active}-life{self.crashes}-h{self.handovers}-s{shard}-",
            cursor_source=lambda key: store.cursor(SUB, key),
            loading=loading,
        )
        life.held_bytes += sum(len(m.payload.data) for m in mine.pending if m.payload is not None)

    # ---- leases ------------------------------------------------------------------------------------

    def _shard(self, key: str) -> int:
        return shard_of(key, self.config.shards)

    def _leases(self) -> dict[int, dict[str, Any]]:
        return {shard: self.documents.docs[_lease_path(shard)] for shard in range(self.config.shards)}

    def _fence(self, pod: int, shard: int) -> docs.Fence:
        """The pod's FenceSource: from its belief, never from the truth."""
        epoch = self.lives[pod].believed.get(shard)
        if epoch is None:
            raise ShardLost(SUB, {shard})
        return docs.Fence(_lease_path(shard), {"owner": f"p{pod}", "epoch": epoch})

    def owns(self, shard: int) -> bool:
        """The pod in focus may deliver ``shard``: its lease (the truth) names it at the epoch it
        believes, and it has loaded the shard (the runtime's lease check, margin included)."""
        life = self.life
        lease = self._leases()[shard]
        return shard in life.engines and lease == {"owner": f"p{self.active}", "epoch": life.believed.get(shard)}

    def _engine_of(self, key: str) -> Engine | None:
        return self.life.engines.get(self._shard(key))

    def _lose(self, shards: frozenset[int]) -> None:
        """The pod in focus learned it lost ``shards``: it stops delivering them and drops what it
        queued for them (its app's acks are never confirmed: the new owner delivers them again)."""
        life = self.life
        for shard in shards:
            life.engines.pop(shard, None)
            life.believed.pop(shard, None)
            load = life.loads.pop(shard, None)
            if load is not None:  # the runtime's ``drop_shard`` cancels the load: nothing more restored
                self._run(load.pages.aclose())
        if not life.loads:
            life.budget = None
        life.store.release(SUB, shards)

        def kept(message: Message) -> bool:
            return self._shard(message.key) not in shards

        life.outstanding = {d: x for d, x in life.outstanding.items() if kept(x.message)}
        # Accepted acks stay queued, as in the runtime, which retries them as long as the store
        # fails: the store (and, with the epoch rule, the runtime first) must refuse them now.
        life.dead_letters = [a for a in life.dead_letters if kept(a.message)]
        life.drops = [m for m in life.drops if kept(m)]
        life.fast = {k: (n, m) for k, (n, m) in life.fast.items() if kept(m)}  # Pub/Sub keeps the rest

    def _check_fenced_write(self, writes: Sequence[docs.Write]) -> None:
        """No write that advances a key applies unless its writer holds the shard's lease as it believes."""
        for write in writes:
            fields = write.fields
            if fields is None or not (
                "/keys/" in write.path
                or "/checkpoints/" in write.path
                or ("/messages/" in write.path and fields.get("state") in layout.DONE_STATES)
            ):
                continue
            shard = fields["shard"]
            lease = self._leases()[shard]
            assert lease == {"owner": f"p{self.active}", "epoch": self.life.believed.get(shard)}, (
                f"fencing: p{self.active} advanced shard {shard} ({write.path}) after its lease changed to {lease}"
            )

    def _before_write(self, kind: str, writes: Sequence[docs.Write]) -> None:
        if self._unavailable_writes:
            self._unavailable_writes -= 1
            self.unavailable += 1
            raise docs.Unavailable(f"{kind}: Firestore unavailable (brownout)")
        if self._writes_until_crash is None:
            return
        if self._writes_until_crash > 0:
            self._writes_until_crash -= 1
            return
        if not self._crash_after_apply:
            self._writes_until_crash = None
            self.crash_points += 1
            raise Crash(f"before {kind}")

    def _after_write(self, kind: str, writes: Sequence[docs.Write]) -> None:
        self._check_fenced_write(writes)
        if self._writes_until_crash == 0 and self._crash_after_apply:
            self._writes_until_crash = None
            self.crash_points += 1
            raise Crash(f"after {kind}")
        if self._lose_next_answer:
            self._lose_next_answer = False
            raise docs.Unavailable(f"{kind}: the answer was lost (the write applied)")

    def publish(self, message: Published) -> None:
        self.published.append(message)
        self._copy_counter += 1
        self.pubsub[self._copy_counter] = message

    def crash(self) -> None:
        """kill -9: memory is gone, the documents stay; recover as a restarted process does."""
        self.crashes += 1
        self._writes_until_crash = None
        self._lose_next_answer = False
        for task, _batch in self.life.ack_tasks:
            task.cancel()
        if self.life.ack_tasks:
            self.loop.run_until_complete(asyncio.gather(*(t for t, _ in self.life.ack_tasks), return_exceptions=True))
        self._close_loads(self.life)
        self.lives[self.active] = self._start()

    def _close_loads(self, life: _Life) -> None:
        """The reads of a life that ended (they write nothing: closing them only frees them)."""
        for load in life.loads.values():
            self._run(load.pages.aclose())
        life.loads.clear()

    def run(self, operations: Sequence[tuple[str, int]]) -> None:
        """Play ``operations``, settle, check G1 and liveness, and close: one whole run."""
        try:
            for op, arg in operations:
                self.step(op, arg)
            self.drain()
            self.check_end()
        finally:
            self.close()

    def step(self, op: str, arg: int) -> None:
        """Run one operation; a crash inside it recovers at once."""
        try:
            getattr(self, f"op_{op}")(arg)
        except Crash:
            self.crash()

    # ---- operations ---------------------------------------------------------------------------------

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
        self.documents.docs[_lease_path(shard)] = {"owner": f"p{owner}", "epoch": lease["epoch"] + 1}

    def op_take_over(self, arg: int) -> None:
        """The lease's owner loads the shard (``load(shards=...)``) and delivers from there."""
        shard = arg % self.config.shards
        lease = self._leases()[shard]
        self.active = int(lease["owner"][1:])
        life = self.life
        if shard in life.engines and life.believed.get(shard) == lease["epoch"]:
            return
        self._lose(frozenset({shard}))  # whatever it held of an earlier epoch is stale
        life.believed[shard] = lease["epoch"]
        self.handovers += 1
        if self.config.paged:
            self._load_state(life, shard)
            return
        snapshot = self._run(
            life.store.load(
                SUB,
                self.now_ms,
                None,
                self.config.max_held_bytes,
                frozenset({shard}),
                epoch=self._epoch(lease["epoch"]),
            )
        )
        self._restore_engine(life, shard, snapshot)

    def op_page(self, arg: int) -> None:
        """A loading shard of the pod in focus reads and restores its next page of pending messages,
        or, when there is none left, finishes loading (the runtime's ``_load_pending``)."""
        loads = self.life.loads
        if loads:
            self._page(sorted(loads)[arg % len(loads)])

    def _page(self, shard: int) -> None:
        life = self.life
        load = life.loads[shard]
        page = self._run(_next_page(load.pages))
        engine = load.entry.engine
        if page is None:
            del life.loads[shard]
            if not life.loads:
                life.budget = None  # the next load starts from what the engines hold then
            load.entry.handed = None
            self.loads_finished += 1
            actions = engine.finish_loading(self.now_ms)
            dropped = [a.message for a in actions if isinstance(a, DropDuplicate | DeadLetter)]
            life.held_bytes -= _kept_bytes(dropped)
            self._apply(actions)
            return
        fresh = [message for message in page if load.entry.admit(message)]
        self.pages_restored += 1
        self.left_out += len(page) - len(fresh)
        engine.restore_pending(fresh, self.now_ms)
        life.held_bytes += _kept_bytes(fresh)

    def finish_loads(self) -> None:
        """Every pod reads its remaining pages and finishes its loads."""
        focus = self.active
        for pod in range(self.config.pods):
            self.active = pod
            while self.life.loads:
                self._page(min(self.life.loads))
        self.active = focus

    def op_stale_copy(self, arg: int) -> None:
        """A stored record handed over again from an old read: a persist's read-back that raced the
        owner's ack of it, or a Listen snapshot older than the owner's own writes."""
        seen = self.life.seen
        if seen:
            message = seen[arg % len(seen)]
            if self.owns(self._shard(message.key)):
                self._on_stored(message)

    def op_listen(self, arg: int) -> None:
        """The owner's Listen on ``inbox == shard and state == pending`` hands over other pods' intake."""
        for path, fields in sorted(self.documents.docs.items()):
            if "/messages/" not in path or "/chunks/" in path or fields.get("state") != layout.PENDING:
                continue
            shard = fields.get(layout.INBOX)
            if shard is not None and self.owns(shard):
                self._on_stored(layout.message_from_fields(path.rpartition("/")[2], fields))

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
        self.life.accepted.add(_identity(delivery.message))
        self.app_acked.add(_identity(delivery.message))

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
            self.confirmed.update(_identity(intent.message) for intent in batch)
            self.resolved_contents.update(_content(intent.message) for intent in batch)
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
        self.resolved_contents.add(_content(message))
        if action.reason != "conflict":
            self.dead_lettered.add(_identity(message))
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
            self.in_order_dead_letters.add(_identity(message))
        engine = self._engine_of(message.key)
        assert engine is not None
        self._apply(engine.dead_letter_done(message, self.now_ms))
        self._settle_fast(message)

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
        self.expired_tombstones |= self.finished_documents()
        self.expired_contents |= self.finished_contents()
        self.expired_in_order_dead_letters |= self._documents_in((DEAD_LETTERED,))
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

    def _tick_all(self) -> None:
        """Time passes for every pod's engines (their own queued actions)."""
        focus = self.active
        try:
            for pod in range(self.config.pods):
                self.active = pod
                for engine in list(self.life.engines.values()):
                    self._apply(engine.tick(self.now_ms))
        finally:
            self.active = focus

    def _is_blocked(self, key: str) -> bool:
        engine = self._engine_of(key)
        return engine is not None and engine.is_blocked(key)

    # ---- scripted steps, for the explicit examples ----------------------------------------------------

    def ingest_all(self) -> None:
        """Pub/Sub hands over every outstanding copy (oldest first); the sidecar acks what is safe."""
        while self.pubsub:
            before = dict(self.pubsub)
            self.step("ingest", 0)
            self.step("pubsub_ack", 0)
            if self.pubsub == before:
                return  # nothing could be persisted now

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
            self._check_delivery(delivery)
            life.outstanding[delivery.delivery_id] = delivery
            out.append(delivery)
        return out

    def delivery_of(self, key: str, seq: int) -> Deliver:
        (delivery,) = [d for d in self.life.outstanding.values() if _identity(d.message) == (key, seq)]
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

    # ---- engine glue ------------------------------------------------------------------------------

    def _on_stored(self, message: Message) -> None:
        life = self.life
        engine = self._engine_of(message.key)
        assert engine is not None, f"{message.key} handed to p{self.active}, which does not deliver its shard"
        load = life.loads.get(self._shard(message.key))
        if load is not None and not load.entry.admit(message):
            self.left_out += 1
            return  # its record was restored from a page already: the engine has it
        actions = engine.on_stored(message, self.now_ms)
        if message.payload is not None and message.payload.ref:
            life.seen = [*life.seen[-15:], message]
        budget = self.config.max_held_bytes
        if message.payload is not None and (not actions or isinstance(actions[0], Hold)):
            size = len(message.payload.data)
            if actions and budget is not None and life.held_bytes + size > budget:
                if engine.strip_payload(message):
                    size = 0
            life.held_bytes += size
        self._apply(actions)

    def _apply(self, actions: Sequence[Any]) -> None:
        for action in actions:
            if isinstance(action, DeadLetter):
                # Late means a gap timeout skipped it: with no skip policy nothing can be (issue 27, A).
                assert action.reason != "late" or self.config.on_gap_timeout == "skip", (
                    f"{_identity(action.message)} dead-lettered as late, but nothing was ever skipped"
                )
                self.life.dead_letters.append(action)
            elif isinstance(action, DropDuplicate):
                if action.finish_record:
                    self.life.drops.append(action.message)
            else:
                assert isinstance(action, Hold), action

    # ---- the guarantees ----------------------------------------------------------------------------

    def _check_delivery(self, delivery: Deliver) -> None:
        message = delivery.message
        ident = _identity(message)
        assert ident not in self.confirmed, f"G3: {ident} delivered again after its ack was confirmed"
        assert message.payload is not None and not message.payload.stripped, f"{ident} delivered without its data"
        expected = Published(message.key, message.sequence or 0, int(message.payload.attributes["v"])).incoming()
        assert (message.payload.data, message.fingerprint) == (expected.data, expected.fingerprint), (
            f"{ident} delivered with other data than was published"
        )
        for skipped in delivery.skipped:
            self.skipped.update((message.key, seq) for seq in range(skipped.first, skipped.last + 1))
        if delivery.late:
            return  # flagged: the app is told it is out of order
        engine = self._engine_of(message.key)
        assert engine is not None
        in_flight = {
            _identity(d.message)
            for d in self.life.outstanding.values()
            if d.message.key == message.key and engine.is_in_flight(d.delivery_id)
        }
        # An app-acked message holds no slot (G2 waits for the app's ack, not for its durability).
        assert len(in_flight) < self.config.max_in_flight, (
            f"G2: {ident} delivered with {sorted(in_flight)} still in flight (window {self.config.max_in_flight})"
        )
        assert message.sequence is not None
        finished = self.finished_documents() | self.expired_tombstones | self.cursor_passed(message.key)
        for seq in range(1, message.sequence):
            before = (message.key, seq)
            resolved = (
                before in finished  # acked durably (confirmed or not), or dead-lettered
                or before in self.confirmed
                or before in self.life.accepted
                or before in in_flight
                or before in self.dead_lettered
                or before in self.skipped
            )
            assert resolved, f"G2: {ident} delivered before {before} was acked, dead-lettered or skipped"

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
        """G1 and liveness after ``drain``."""
        blocked = self.blocked_keys()
        pending = self.pending_documents()
        # Acked by the app durably (an ack made durable just before a crash may never be confirmed;
        # G3 allows that, and it is never delivered again) or dead-lettered durably.
        finished = self.finished_contents() | self.expired_contents
        for message in self.published:
            if message.malformed:
                assert any(m is message or m == message for m, _ in self.dead_letter_topic), "G1: malformed lost"
                continue
            ident = message.identity
            incoming = message.incoming()
            if (message.key, message.seq, incoming.fingerprint) in self.resolved_contents:
                continue
            if (message.key, message.seq, incoming.fingerprint) in finished:
                continue
            if any(isinstance(m, Published) and m == message for m, reason in self.dead_letter_topic):
                continue  # a conflicting copy, dead-lettered at ingest
            if ident in self.expired_tombstones:
                # Another content of this identity finished and its tombstone expired: past the dedup
                # TTL a conflicting copy can no longer be told from a duplicate (documented).
                continue
            if ident in self.dead_lettered and ident in self.confirmed:
                continue  # a copy of a finished message whose tombstone expired, dead-lettered below the cursor
            if ident in self.app_acked and ident in self.cursor_passed(message.key) and ident not in self.skipped:
                # A fast-path message's ack made durable by a checkpoint (written by another Commit of
                # its shard: a dead letter's, a drop's) just before a crash: never confirmed, never
                # delivered again (G3 allows it); the cursor is its only record.
                continue
            if self.config.fast_path and ident in self.confirmed and ident in self.config.conflicts:
                # Another content of this identity went through the fast path and was acked: no record
                # of its content is left to tell this copy from a duplicate (docs/store.md, documented).
                continue
            assert message.key in blocked and ident in pending, (
                f"G1: {ident} neither confirmed nor dead-lettered (key blocked: {message.key in blocked}, "
                f"pending: {ident in pending})"
            )
        keys = [
            key_status
            for life in self.lives
            for engine in life.engines.values()
            for key_status in engine.status(self.now_ms, max_keys=1_000)[1]
        ]
        for key_status in keys:
            if key_status.state == "blocked_dead_letter":
                assert key_status.key in blocked, f"liveness: {key_status.key} blocked without a dead letter"
            assert key_status.state != "waiting_sequence" or (
                (key_status.key, key_status.missing_sequence) in self.config.unpublished
                and self.config.on_gap_timeout == "hold"
            ), f"liveness: {key_status.key} waits for {key_status.waiting_for}, already finished or skipped"
        assert not blocked or self.config.on_dead_letter == "block"

    def blocked_keys(self) -> set[str]:
        """Keys stopped by an in-order dead letter of their own under ``block`` (made durable, even
        if a crash came before the process learned that it was)."""
        if self.config.on_dead_letter != "block":
            return set()
        durable = self._documents_in((DEAD_LETTERED,)) | self.expired_in_order_dead_letters
        return {key for key, seq in self.in_order_dead_letters | durable if (key, seq) not in self.unblocked()}

    def unblocked(self) -> set[Identity]:
        """Dead letters an operator passed: those this run saw confirmed, and those the cursor
        documents record (an unblock that applied just before a crash)."""
        recorded = {(fields["key"], seq) for fields in self._cursor_records() for seq in fields.get("unb_seq") or []}
        return self.confirmed_unblocks | recorded

    def cursor_passed(self, key: str) -> set[Identity]:
        """Positions of ``key`` its durable cursor record passed or finished (a fast-path message's
        ack leaves nothing else: no document)."""
        record = next((fields for fields in self._cursor_records() if fields.get("key") == key), None)
        if record is None:
            return set()
        passed = {(key, seq) for seq in range(1, int(record.get("next_seq") or 1))}
        return passed | {(key, seq) for seq in record.get("above_seq") or []}

    def _cursor_records(self) -> list[dict[str, Any]]:
        """Every key's cursor as written: checkpoint overlay entries first (recovery prefers them),
        then cursor documents."""
        overlays = [
            entry
            for path, fields in self.documents.docs.items()
            if "/checkpoints/" in path
            for entry in (fields.get(layout.OVERLAY) or {}).values()
        ]
        return overlays + [fields for path, fields in self.documents.docs.items() if "/keys/" in path]

    def snapshot_of_messages(self) -> dict[str, dict[str, Any]]:
        """Every message document as it is now (to show that a refused Commit changed nothing)."""
        return {path: dict(fields) for path, fields in self.documents.docs.items() if "/messages/" in path}

    def pending_documents(self) -> set[Identity]:
        return self._documents_in(("pending",))

    def finished_documents(self) -> set[Identity]:
        return {(key, seq) for key, seq, _ in self.finished_contents()}

    def finished_contents(self) -> set[tuple[str, int, bytes]]:
        """(key, seq, fingerprint) of every message acked or dead-lettered durably."""
        return {
            (fields["key"], fields["seq"], fields["fp"])
            for fields in self._message_documents(("acked", DEAD_LETTERED, DEAD_LETTERED_ASIDE))
        }

    def _documents_in(self, states: tuple[str, ...]) -> set[Identity]:
        return {(fields["key"], fields["seq"]) for fields in self._message_documents(states)}

    def _message_documents(self, states: tuple[str, ...]) -> list[dict[str, Any]]:
        return [
            fields
            for path, fields in self.documents.docs.items()
            if "/messages/" in path and "/chunks/" not in path and fields.get("state") in states
        ]

    def close(self) -> None:
        for life in self.lives:
            self._close_loads(life)
        self.loop.close()


async def _next_page(pages: AsyncGenerator[list[Message], None]) -> list[Message] | None:
    """The next page, None after the last."""
    try:
        return await anext(pages)
    except StopAsyncIteration:
        return None


def _kept_bytes(messages: Sequence[Message]) -> int:
    """Payload bytes of ``messages`` kept in memory (the sim's ``held_bytes`` counts no bookkeeping)."""
    return sum(len(m.payload.data) for m in messages if m.payload is not None and not m.payload.stripped)


def _lease_path(shard: int) -> str:
    return f"pubsub-sidecar/{SUB}/leases/{shard:04d}"


def _content(message: Message) -> tuple[str, int, bytes]:
    assert message.sequence is not None
    return (message.key, message.sequence, message.fingerprint)


def _identity(message: Message) -> Identity:
    assert message.sequence is not None
    return (message.key, message.sequence)
