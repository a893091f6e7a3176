"""A model of pods running the real lease planner against one model of the lease documents.

Time is one integer (milliseconds, the database's clock). The documents keep Firestore's rules that
leases rely on: every write is a compare-and-set on the update time read (a create when missing),
update times grow strictly, a read has one read time. An operator may delete a lease document,
write a corrupt one, or repair one by hand with any epoch up to its update time (an old copy).
Each pod has its own monotonic clock (an
offset and a rate within 5 % of the database's) and runs rounds in steps that other pods' steps
and the passing of time may come between: read and plan, send (a hand-over is given up locally
first), apply at the database, answer (a renewal or take holds until ``sent + 0.8 * lease``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sidecar.cluster.leases.layout import lease_fields, read_lease
from sidecar.cluster.leases.planner import GIVING_UP, Action, LeaseWrite, Mode, plan
from sidecar.store import documents as docs

MOVES_EPOCH = frozenset({Action.ACQUIRE, Action.HAND_OVER, Action.RELEASE})
"""Changes of owner, each a compare-and-set over a version read: their epochs are held."""

LEASE_MS = 1_000
SAFETY = 0.8


class Phase(enum.Enum):
    IDLE = "idle"
    PLANNED = "planned"
    SENT = "sent"
    APPLIED = "applied"


@dataclass
class Database:
    shard_count: int
    docs: dict[int, tuple[dict[str, object], int]] = field(default_factory=dict)
    now_ms: int = 0
    last_us: int = 0
    highest: dict[int, int] = field(default_factory=dict)
    """Per shard, the highest epoch a pod ever wrote, whatever became of the document since."""
    by_hand: set[int] = field(default_factory=set)
    """Shards whose document an operator deleted or rewrote (``check_one_holder`` below)."""

    def read(self) -> tuple[int, dict[int, docs.Versioned]]:
        read_us = max(self.now_ms * 1000, self.last_us)
        return read_us, {
            s: docs.Versioned(dict(self.docs[s][0]), self.docs[s][1]) if s in self.docs else docs.Versioned(None, None)
            for s in range(self.shard_count)
        }

    def apply(self, write: LeaseWrite) -> bool:
        current = self.docs.get(write.shard)
        if write.update_time_us is None:
            if current is not None:
                return False
        elif current is None or current[1] != write.update_time_us:
            return False
        if current is not None:
            problem = read_lease("l", write.shard, self.shard_count, 0, docs.Versioned(*current)).problem
            assert not problem, f"a bad lease document was overwritten: {problem}"
        previous = self.highest.get(write.shard, 0)
        if write.action in MOVES_EPOCH:
            assert write.epoch > previous, f"epoch of shard {write.shard} repeated: {write.epoch} after {previous}"
        elif write.action is Action.CREATE:
            # Maybe planned before a deletion and applied after it (its precondition, "missing",
            # cannot tell): then its epoch is an old one, which is why nobody holds a create's epoch.
            assert write.owner == "", "a create names an owner"
        else:
            assert current is not None and write.epoch == current[0]["epoch"], "a write kept no epoch it read"
        self.highest[write.shard] = max(previous, write.epoch)
        self._tick()
        # What keeps epochs unique after a deletion: no epoch a pod writes is above its own update time.
        assert write.epoch <= self.last_us, f"epoch {write.epoch} above its update time {self.last_us}"
        fields = lease_fields(self.shard_count, write.owner, write.epoch, write.beat, write.lease_ms, write.wanted_by)
        self.docs[write.shard] = (fields, self.last_us)
        return True

    def delete_by_hand(self, shard: int) -> None:
        self._tick()
        self.docs.pop(shard, None)
        self.by_hand.add(shard)

    def corrupt_by_hand(self, shard: int, change: dict[str, object]) -> None:
        fields = lease_fields(self.shard_count, "someone", 3, 1, LEASE_MS, "")
        self.docs[shard] = ({**fields, **change}, self._tick())
        self.by_hand.add(shard)

    def repair_by_hand(self, shard: int, epoch_share: float) -> None:
        """A valid free lease whose epoch is any up to now (copied from an old backup, or 0)."""
        update_us = self._tick()
        fields = lease_fields(self.shard_count, "", int(update_us * epoch_share), 0, LEASE_MS, "")
        self.docs[shard] = (fields, update_us)
        self.by_hand.add(shard)

    def is_bad(self, shard: int) -> bool:
        current = self.docs.get(shard)
        return current is not None and bool(
            read_lease("l", shard, self.shard_count, 0, docs.Versioned(*current)).problem
        )

    def _tick(self) -> int:
        self.last_us = max(self.now_ms * 1000, self.last_us + 1)
        return self.last_us


@dataclass(eq=False)
class Pod:
    name: str
    offset_ms: int
    rate: float
    mode: Mode = Mode.RUN
    held: dict[int, tuple[int, int]] = field(default_factory=dict)
    """shard -> (epoch, deadline on this pod's clock)"""
    phase: Phase = Phase.IDLE
    writes: tuple[LeaseWrite, ...] = ()
    results: list[bool] = field(default_factory=list)
    sent_ms: int = 0
    leaving: bool = False

    def clock(self, now_ms: int) -> int:
        return self.offset_ms + int(now_ms * self.rate)

    def believes(self, now_ms: int) -> dict[int, int]:
        local = self.clock(now_ms)
        return {s: epoch for s, (epoch, deadline) in self.held.items() if local < deadline}

    def step(self, db: Database) -> None:
        """One step of this pod's current round."""
        if self.phase is Phase.IDLE:
            self._expire(db.now_ms)
            read_us, versions = db.read()
            views = [read_lease(f"l/{s}", s, db.shard_count, read_us, versions[s]) for s in range(db.shard_count)]
            self._expire(db.now_ms)
            decided = plan(views, self.name, {s: e for s, (e, _) in self.held.items()}, LEASE_MS, self.mode)
            for shard in decided.lost:
                del self.held[shard]
            self.writes = decided.writes
            self.phase = Phase.PLANNED
        elif self.phase is Phase.PLANNED:
            for write in self.writes:
                if write.action in GIVING_UP or self.mode is Mode.LEAVE:
                    self.held.pop(write.shard, None)
            if self.mode is Mode.LEAVE:
                self.held.clear()
            self.sent_ms = self.clock(db.now_ms)
            self.phase = Phase.SENT
        elif self.phase is Phase.SENT:
            self.results = [db.apply(write) for write in self.writes]
            self.phase = Phase.APPLIED
        else:
            for write, ok in zip(self.writes, self.results, strict=True):
                if not ok:
                    continue
                deadline = self.sent_ms + int(LEASE_MS * SAFETY)
                if write.action is Action.RENEW and self.held.get(write.shard, (None, 0))[0] == write.epoch:
                    self.held[write.shard] = (write.epoch, deadline)
                elif write.action is Action.ACQUIRE and self.mode is Mode.RUN:
                    self.held[write.shard] = (write.epoch, deadline)
            self.writes, self.results = (), []
            self.phase = Phase.IDLE
            if self.mode is Mode.LEAVE:
                self.leaving = True
            elif self.mode is Mode.DRAIN:
                self.mode = Mode.LEAVE

    def round(self, db: Database) -> None:
        """Finish the current round, then run one whole round with no other step in between."""
        while self.phase is not Phase.IDLE:
            self.step(db)
        for _ in range(4):
            self.step(db)

    def _expire(self, now_ms: int) -> None:
        local = self.clock(now_ms)
        for shard, (_, deadline) in list(self.held.items()):
            if local >= deadline:
                del self.held[shard]


def check_one_holder(db: Database, pods: list[Pod]) -> None:
    """Never two pods that each believe they hold one shard at one instant, nor one epoch held twice.

    A document deleted or rewritten by hand is the exception to the first: its holder believes it
    until its next round or margin while another pod takes the shard. The second still holds there:
    the epochs differ, so Firestore's fence (and an app fencing by epoch) tells the two apart."""
    holders: dict[int, tuple[str, int]] = {}
    for pod in pods:
        for shard, epoch in pod.believes(db.now_ms).items():
            if shard in holders:
                other, other_epoch = holders[shard]
                assert shard in db.by_hand, f"shard {shard} held by {other} and {pod.name} at {db.now_ms} ms"
                assert epoch != other_epoch, f"shard {shard} held by {other} and {pod.name} at one epoch {epoch}"
            holders[shard] = (pod.name, epoch)
