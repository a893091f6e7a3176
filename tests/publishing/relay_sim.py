"""Crash-point simulation of the outbox relay: ``ShardRelay``'s real steps over Firestore semantics in
memory (``MemoryDocuments``), a recording Pub/Sub, and an app writing entries, deterministically.

One ``RelaySim`` plays, step by step from a seed:

- **The app** writes outbox entries, each in its own Commit (a transaction), keys interleaved; some
  entries name another topic. Each key's expected order is its entries' commit order (update
  time, then id), as the relay's contract says.
- **The relay**: one ``ShardRelay`` per shard, made afresh at every (re)start with the shard's lease
  taken at a new epoch (a restarted process is a new owner), fed the outbox as a snapshot: the
  current one, or (``stale``) an older one still showing entries settled since, as a lagging Listen
  does. A **zombie** (``zombie``): the lease moves to a new owner while the old owner is publishing;
  its settle must fail its fence, and it goes on stepping with its stale belief: its ``holds``
  (the lease's safety margin, which runs out before another pod can take the lease) stops its
  publishes, the fence its writes.
- **Pub/Sub** records every publish (a republish included); it may fail a publish transiently.
- **Firestore** may lose the answer of a relay Commit that applied (``lost_reply_rate``).
- **Faults**: a crash before or after the n-th relay write (a settle Commit) or the n-th publish
  (``CrashPoint``): everything in memory is thrown away, the documents and Pub/Sub's record stay.

Checked at the end (``check``): every entry was published; per key the numbers are start..start+n-1
with no gap, in commit order; every publish of one (key, number) is the same message (a republish
is identical, so the subscriber drops it); the outbox is empty; the counters say n per key.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from sidecar.publishing.entries import Entry, Message, Rules, Unpublishable, read_entry
from sidecar.publishing.publisher import PublishFailure
from sidecar.publishing.shard_relay import ShardRelay
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import outbox
from sidecar.store.api import ShardLost, StoreError
from sidecar.store.memory_documents import MemoryDocuments

COLLECTION = "outbox"
RELAY = outbox.relay_root("pubsub-sidecar", "orders-out")
RULES = Rules("demo", "projects/demo/topics/orders", "order_id", "seq", ordering_key=False)
OTHER_TOPIC = "projects/demo/topics/audit"


class Crash(Exception):
    """The relay's process dies here."""


@dataclass(frozen=True, slots=True)
class CrashPoint:
    kind: str
    """"write" (a relay Commit) or "publish"."""
    when: str
    """"before" or "after"."""
    index: int
    """The n-th of its kind since the start (0-based)."""


@dataclass(slots=True)
class SimConfig:
    seed: int
    keys: int = 4
    entries: int = 24
    shards: int = 2
    start: int = 1
    limit: int = 3
    crash: CrashPoint | None = None
    transient_rate: float = 0.15
    lost_reply_rate: float = 0.15
    """Of the relay's Commits: applied, but the answer is lost (``Unavailable``, outcome unknown)."""
    stale: bool = True
    zombie: bool = False


class RecordingPubsub:
    """Pub/Sub as the relay's ``Publisher``: keeps every message it took, fails some on purpose."""

    def __init__(self, sim: RelaySim) -> None:
        self._sim = sim
        self.taken: list[Message] = []
        self.calls = 0

    async def publish(self, messages: Sequence[Message]) -> list[PublishFailure | None]:
        sim = self._sim
        sim.maybe_crash("publish", "before", self.calls)
        index = self.calls
        self.calls += 1
        outcomes: list[PublishFailure | None] = []
        failing_topics = {t for t in {m.topic for m in messages} if sim.rng.random() < sim.config.transient_rate}
        for m in messages:
            if m.topic in failing_topics:
                outcomes.append(PublishFailure("UNAVAILABLE (simulated)", permanent=False))
            else:
                self.taken.append(m)
                outcomes.append(None)
        sim.maybe_crash("publish", "after", index)
        if sim.config.zombie and sim.rng.random() < 0.3:
            sim.zombie = sim.pod
            sim.start_pod()  # the lease moved on while this publish was under way
        return outcomes

    async def can_publish(self, topic: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


@dataclass(slots=True)
class Pod:
    name: str
    relays: dict[int, ShardRelay] = field(default_factory=dict)


class RelaySim:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.documents = MemoryDocuments(clock_us=self._clock)
        self._now_us = 1_000_000
        self.pubsub = RecordingPubsub(self)
        self.writes = 0
        self.crashed = False
        self.crashes = 0
        self.fenced = 0
        self.expected: dict[str, list[str]] = {}
        """Key -> its entry ids in commit order."""
        self.snapshots: list[list[tuple[str, docs.Fields, int]]] = []
        self.pod: Pod | None = None
        self.zombie: Pod | None = None
        self._pods = 0
        self._epoch = 0
        self.documents.before_write = self._before_write
        self.documents.after_write = self._after_write

    def _clock(self) -> int:
        self._now_us += 1
        return self._now_us

    # ---- faults ------------------------------------------------------------------------------

    def maybe_crash(self, kind: str, when: str, index: int) -> None:
        crash = self.config.crash
        if crash is not None and not self.crashed and (crash.kind, crash.when, crash.index) == (kind, when, index):
            self.crashed = True
            raise Crash(f"{when} {kind} {index}")

    def _relay_write(self, writes: Sequence[docs.Write]) -> bool:
        return any(w.path.startswith(RELAY + "/counters/") for w in writes)

    def _before_write(self, method: str, writes: Sequence[docs.Write]) -> None:
        if self._relay_write(writes):
            self.maybe_crash("write", "before", self.writes)

    def _after_write(self, method: str, writes: Sequence[docs.Write]) -> None:
        if self._relay_write(writes):
            index = self.writes
            self.writes += 1
            self.maybe_crash("write", "after", index)
            if self.rng.random() < self.config.lost_reply_rate:
                raise docs.Unavailable("commit: the answer was lost (simulated); it applied")

    # ---- the app -----------------------------------------------------------------------------

    async def app_writes_one(self, number: int) -> None:
        key = f"order-{self.rng.randrange(self.config.keys)}"
        entry_id = f"{self.rng.getrandbits(64):016x}"
        fields: docs.Fields = {"key": key, "data": f"{key} event {number}".encode(), "attributes": {"n": str(number)}}
        if self.rng.random() < 0.2:
            fields["topic"] = OTHER_TOPIC
        path = outbox.entry_path(COLLECTION, entry_id)
        await self.documents.commit([docs.create(path, fields)])
        self.expected.setdefault(key, []).append(entry_id)
        self._snapshot()

    def _snapshot(self) -> None:
        prefix = COLLECTION + "/"
        self.snapshots.append(
            [
                (path[len(prefix) :], dict(fields), self.documents.update_time_us(path))
                for path, fields in self.documents.docs.items()
                if path.startswith(prefix)
            ]
        )

    # ---- the relay's pods ----------------------------------------------------------------------

    def start_pod(self) -> Pod:
        """A (re)started relay process: a new owner of every shard, at a new epoch."""
        self._pods += 1
        pod = Pod(f"pod-{self._pods}")
        self._epoch += 1
        for shard in range(self.config.shards):
            lease = f"{RELAY}/leases/{shard:04d}"
            self.documents.docs[lease] = {"owner": pod.name, "epoch": self._epoch}
            pod.relays[shard] = self._shard_relay(pod, shard, self._epoch)
        self.pod = pod
        return pod

    def _shard_relay(self, pod: Pod, shard: int, epoch: int) -> ShardRelay:
        lease = f"{RELAY}/leases/{shard:04d}"
        belief = {"owner": pod.name, "epoch": epoch}
        fence = docs.Fence(lease, belief)
        return ShardRelay(
            RELAY, COLLECTION, shard, epoch, self.documents, self.pubsub, RULES, self.config.start, self.config.limit,
            lambda: fence, lambda: self.documents.docs.get(lease) == belief,
        )  # fmt: skip

    def entries_of(self, shard: int, stale: bool) -> list[Entry | Unpublishable]:
        if stale and self.snapshots and self.rng.random() < 0.5:
            seen = self.rng.choice(self.snapshots[-4:])
        else:
            self._snapshot()
            seen = self.snapshots[-1]
        read = [read_entry(i, f, t, RULES) for i, f, t in seen]
        return [e for e in read if shard_of(e.key or e.id, self.config.shards) == shard]

    async def relay_step(self, pod: Pod, shard: int) -> None:
        relay = pod.relays.get(shard)
        if relay is None:
            return
        try:
            await relay.step(self.entries_of(shard, self.config.stale))
        except Crash:
            raise
        except ShardLost:
            self.fenced += 1
            del pod.relays[shard]
        except StoreError:
            pass

    async def crash_and_restart(self) -> None:
        self.crashes += 1
        self.start_pod()

    # ---- a run ---------------------------------------------------------------------------------

    async def run(self) -> None:
        self.start_pod()
        written = 0
        while written < self.config.entries:
            action = self.rng.random()
            try:
                if action < 0.45:
                    await self.app_writes_one(written)
                    written += 1
                elif self.zombie is not None and action < 0.6:
                    await self.relay_step(self.zombie, self.rng.randrange(self.config.shards))
                else:
                    assert self.pod is not None
                    await self.relay_step(self.pod, self.rng.randrange(self.config.shards))
            except Crash:
                await self.crash_and_restart()
        await self.drain()

    async def drain(self) -> None:
        """No more faults or staleness: step every shard until the outbox is empty."""
        self.config.transient_rate = 0.0
        self.config.lost_reply_rate = 0.0
        self.config.zombie = False
        for _ in range(10_000):
            try:
                if not any(p.startswith(COLLECTION + "/") for p in self.documents.docs):
                    return
                assert self.pod is not None
                for shard in range(self.config.shards):
                    relay = self.pod.relays.get(shard)
                    if relay is not None:
                        await relay.step(self.entries_of(shard, stale=False))
            except Crash:
                await self.crash_and_restart()
        raise AssertionError("the outbox did not drain")

    # ---- the checks ----------------------------------------------------------------------------

    def check(self) -> None:
        assert not [p for p in self.documents.docs if p.startswith(COLLECTION + "/")], "the outbox is not empty"
        by_number: dict[tuple[str, int], Message] = {}
        for m in self.pubsub.taken:
            first = by_number.setdefault((m.key, m.sequence), m)
            assert first == m, f"{m.key} #{m.sequence} published as two different messages"
        for key, ids in self.expected.items():
            numbers = sorted(n for k, n in by_number if k == key)
            start = self.config.start
            assert numbers == list(range(start, start + len(ids))), f"{key}: numbers {numbers} for {len(ids)} entries"
            in_order = [by_number[(key, n)].entry_id for n in numbers]
            assert in_order == ids, f"{key}: published out of commit order"
        counters: dict[str, outbox.Counter] = {}
        for shard in range(self.config.shards):
            path = outbox.counters_path(RELAY, shard)
            counters.update(outbox.counters_of(path, self.documents.docs.get(path)))
        assert {k: c.last for k, c in counters.items()} == {
            k: self.config.start + len(ids) - 1 for k, ids in self.expected.items()
        }


def run_sim(config: SimConfig) -> RelaySim:
    sim = RelaySim(config)
    asyncio.run(sim.run())
    sim.check()
    return sim
