"""A model of pods running the real lease planner against one model of the lease documents.

Time is one integer (milliseconds, the database's clock). The documents keep Firestore's rules that
leases rely on: every write is a compare-and-set on the update time read (a create when missing),
update times grow strictly, a read has one read time. Each pod has its own monotonic clock (an
offset and a rate within 5 % of the database's) and runs rounds in steps that other pods' steps
and the passing of time may come between: read and plan, send (a hand-over is given up locally
first), apply at the database, answer (a renewal or take holds until ``sent + 0.8 * lease``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sidecar.leases.layout import lease_fields, read_lease
from sidecar.leases.planner import GIVING_UP, Action, LeaseWrite, Mode, plan
from sidecar.store import documents as docs

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
    epochs_seen: dict[int, int] = field(default_factory=dict)

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
        previous = self.epochs_seen.get(write.shard, 0)
        assert write.epoch >= previous, f"epoch of shard {write.shard} went down: {previous} -> {write.epoch}"
        self.epochs_seen[write.shard] = write.epoch
        self.last_us = max(self.now_ms * 1000, self.last_us + 1)
        fields = lease_fields(self.shard_count, write.owner, write.epoch, write.beat, write.lease_ms, write.wanted_by)
        self.docs[write.shard] = (fields, self.last_us)
        return True


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
    """Never two pods that each believe they hold one shard at one instant."""
    holders: dict[int, str] = {}
    for pod in pods:
        for shard in pod.believes(db.now_ms):
            assert shard not in holders, f"shard {shard} held by {holders[shard]} and {pod.name} at {db.now_ms} ms"
            holders[shard] = pod.name
