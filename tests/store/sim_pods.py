"""The crash simulation's pods: each a process with its store and its engines, started, crashed and
restarted over the shared documents.

``SimulatedPods`` holds the whole simulation's state (its fields) and what a process does for
itself; ``sim_sidecar.SimulatedSidecar`` adds the data path, ``crash_sim.Simulation`` the world
around it. Rules:

- **A crash keeps the documents only**: ``crash`` throws the life away (its engines, store object,
  queued actions and loads) and starts the pod again with ``load`` + ``Engine.restore``, as a
  restarted process does; a recovered cursor must pass every ack confirmed before.
- **Every store call runs through ``_run``**, on the simulation's one loop (with ``paged``, the
  reader's page size patched small exactly while store code runs).
- **Fences come from belief, never from the truth** (``_fence``): a pod writes with the epochs it
  believes it holds; it may deliver a shard only when the lease (the truth) names it at that epoch
  and it has loaded the shard (``owns``). A pod that learns of a loss drops the shard's engine and
  what it queued for it (``_lose``).
- **Paged recovery** as the runtime's ``_load_shard`` / ``_load_pending``: the state first, then
  one page per ``page``; each stored record reaches the engine once (``ShardEngine.admit``).
- **Faults strike at writes**: the documents' hooks crash before or after the n-th next write,
  lose an answer after a write applied, or refuse writes (a brownout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sim_checks import check_fenced_write
from sim_world import (
    SUB,
    Crash,
    DocumentRecords,
    Identity,
    Life,
    Published,
    ShardLoad,
    SimConfig,
    identity_of,
    kept_bytes,
    lease_path,
    next_page,
)

from sidecar.engine import DeadLetter, DropDuplicate, Engine, Hold
from sidecar.engine.types import EngineSnapshot, Message
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import reader
from sidecar.store.api import PayloadBudget, ShardLost
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

_T = TypeVar("_T")


@dataclass
class SimulatedPods:
    """The simulation's state, and each pod's process over the shared documents (module docstring)."""

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
    lives: list[Life] = field(init=False)
    active: int = 0
    """The pod in focus: the operations act on it."""
    handovers: int = 0
    fenced_writes: int = 0
    """Writes refused because the writer's lease had changed (``ShardLost``)."""
    pages_restored: int = 0
    loads_finished: int = 0
    left_out: int = 0
    """Records ``admit`` refused (a page's record handed over already, or the reverse)."""
    records: DocumentRecords = field(init=False)
    """What the documents hold now (the checks read it)."""

    @property
    def life(self) -> Life:
        return self.lives[self.active]

    def __post_init__(self) -> None:
        self.records = DocumentRecords(self.documents)
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
            self.documents.docs[lease_path(shard)] = {"owner": "p0", "epoch": 1}
        self.lives = []
        for pod in range(self.config.pods):
            self.active = pod
            self.lives.append(self._start())
        self.active = 0

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

    def _start(self) -> Life:
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
        life = Life(store, {}, dict(held))
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

    def _load_state(self, life: Life, shard: int) -> None:
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
        life.loads[shard] = ShardLoad(entry, life.store.pending_pages(SUB, shards, life.budget, None))

    def _restore_engine(self, life: Life, shard: int, snapshot: EngineSnapshot, loading: bool = False) -> None:
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

    def _shard(self, key: str) -> int:
        return shard_of(key, self.config.shards)

    def _leases(self) -> dict[int, dict[str, Any]]:
        return {shard: self.documents.docs[lease_path(shard)] for shard in range(self.config.shards)}

    def _fence(self, pod: int, shard: int) -> docs.Fence:
        """The pod's FenceSource: from its belief, never from the truth."""
        epoch = self.lives[pod].believed.get(shard)
        if epoch is None:
            raise ShardLost(SUB, {shard})
        return docs.Fence(lease_path(shard), {"owner": f"p{pod}", "epoch": epoch})

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
        check_fenced_write(self, writes)
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

    def _close_loads(self, life: Life) -> None:
        """The reads of a life that ended (they write nothing: closing them only frees them)."""
        for load in life.loads.values():
            self._run(load.pages.aclose())
        life.loads.clear()

    def step(self, op: str, arg: int) -> None:
        """Run one operation; a crash inside it recovers at once."""
        try:
            getattr(self, f"op_{op}")(arg)
        except Crash:
            self.crash()

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
        page = self._run(next_page(load.pages))
        engine = load.entry.engine
        if page is None:
            del life.loads[shard]
            if not life.loads:
                life.budget = None  # the next load starts from what the engines hold then
            load.entry.handed = None
            self.loads_finished += 1
            actions = engine.finish_loading(self.now_ms)
            dropped = [a.message for a in actions if isinstance(a, DropDuplicate | DeadLetter)]
            life.held_bytes -= kept_bytes(dropped)
            self._apply(actions)
            return
        fresh = [message for message in page if load.entry.admit(message)]
        self.pages_restored += 1
        self.left_out += len(page) - len(fresh)
        engine.restore_pending(fresh, self.now_ms)
        life.held_bytes += kept_bytes(fresh)

    def finish_loads(self) -> None:
        """Every pod reads its remaining pages and finishes its loads."""
        focus = self.active
        for pod in range(self.config.pods):
            self.active = pod
            while self.life.loads:
                self._page(min(self.life.loads))
        self.active = focus

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
                    f"{identity_of(action.message)} dead-lettered as late, but nothing was ever skipped"
                )
                self.life.dead_letters.append(action)
            elif isinstance(action, DropDuplicate):
                if action.finish_record:
                    self.life.drops.append(action.message)
            else:
                assert isinstance(action, Hold), action

    def close(self) -> None:
        for life in self.lives:
            self._close_loads(life)
        self.loop.close()
