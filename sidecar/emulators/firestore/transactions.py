"""Transactions: optimistic validation at commit, with production's "older transaction wins" order.

Choice (documented in docs/emulators-firestore.md): production's lock order, checked
optimistically. Age = begin order, inherited through ``retry_transaction`` as production does,
so a retried transaction keeps its place in line.

1. A read-write transaction's document read (get, batch get) waits while an *older* live
   read-write transaction holds a read on that document and is at work (used within
   ``READ_GATE_IDLE_SECONDS``); an older one never waits for a younger one (wound-wait: no
   cycles, no deadlock). So documents pass from older to younger transactions, as under
   production's pessimistic locks, and 8 clients incrementing one counter all finish within the
   official client's 5 attempts. Production's read locks are shared (a read never waits for
   another read): this wait is only the emulator's way to that order, so an older transaction
   idle that long (a live client's read-to-commit gap is milliseconds; one abandoned by a
   killed process stays idle until it expires) stops holding back younger reads, which then
   rely on the check at Commit alone. Reads never abort.
2. At Commit, wait likewise for older readers of every written document (an older transaction may
   have read after this one did), idle or not, as a write waits for production's read locks, then
   validate: any recorded version (``update_us``, None for missing) that changed, or any recorded
   query whose result changed (phantoms included), fails the commit with ABORTED, and the client
   retries.
A wait is bounded by ``lock_timeout_seconds`` and ends in ABORTED ("Transaction lock timeout"), as
the official emulator does; an abandoned transaction stops blocking commits when it expires (the
wait wakes then, not at its own timeout). Non-transactional writes never wait and never fail for
transactions: they always win.

Read-only transactions read a snapshot at their begin time (or the requested ``read_time``) and
reject writes with INVALID_ARGUMENT. A transaction expires 270 s after it began or 60 s after
its last use; an unknown or expired id gets INVALID_ARGUMENT, except Rollback, which is OK (an
error there would replace the client's original exception).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sidecar.emulators.firestore.documents import DocumentStore, Record
from sidecar.emulators.firestore.errors import aborted, invalid
from sidecar.emulators.firestore.query import CompiledQuery, execute

MAX_AGE_SECONDS = 270.0
MAX_IDLE_SECONDS = 60.0
READ_GATE_IDLE_SECONDS = 5.0
"""An older transaction idle this long no longer makes younger reads of its documents wait (rule 1)."""
_REMEMBERED_PRIORITIES = 10_000
"""Ended transactions whose age a retry may still inherit (a retry follows within milliseconds)."""
_SWEEP_EVERY = 256
"""Begins between sweeps of expired transactions, so abandoned ones cannot pile up."""

Signature = list[tuple[str, int]]

_LOGGER = logging.getLogger(__name__)
_SLOW_WAIT_SECONDS = 1.0
"""A lock wait at least this long is logged (which documents, behind which transactions): a client
held back by a transaction abandoned by a killed process shows up in the emulator's output."""


@dataclass
class Transaction:
    id: bytes
    read_only: bool
    priority: int
    started: float
    last_used: float
    read_us: int | None = None
    """Snapshot time of a read-only transaction; None for read-write (they read the latest)."""
    reads: dict[str, int | None] = field(default_factory=dict)
    queries: list[tuple[CompiledQuery, Signature]] = field(default_factory=list)


def signature(records: Iterable[Record]) -> Signature:
    return [(r.doc.name, r.update_us) for r in records]


class TransactionManager:
    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        lock_timeout_seconds: float = 20.0,
        read_gate_idle_seconds: float = READ_GATE_IDLE_SECONDS,
    ) -> None:
        self._monotonic = monotonic
        self._lock_timeout = lock_timeout_seconds
        self._read_gate_idle = read_gate_idle_seconds
        self._live: dict[bytes, Transaction] = {}
        self._readers: dict[str, set[bytes]] = {}
        self._priorities: OrderedDict[bytes, int] = OrderedDict()
        self._order = itertools.count(1)
        self._begins = 0
        self._changed = asyncio.Event()

    def clear(self) -> None:
        for tx in list(self._live.values()):
            self.end(tx)
        self._priorities.clear()

    def begin(self, read_only: bool, read_us: int | None, retry_of: bytes = b"") -> Transaction:
        self._begins += 1
        if self._begins % _SWEEP_EVERY == 0:
            self._sweep()
        priority = None
        if retry_of:
            old = self._live.get(retry_of)
            priority = old.priority if old is not None else self._priorities.get(retry_of)
        if priority is None:
            priority = next(self._order)
        now = self._monotonic()
        tx = Transaction(os.urandom(16), read_only, priority, now, now, read_us)
        self._live[tx.id] = tx
        return tx

    def get(self, tx_id: bytes) -> Transaction:
        """The live transaction ``tx_id``, marked used; INVALID_ARGUMENT if unknown or expired."""
        tx = self._live.get(tx_id)
        if tx is None or self._expired(tx):
            if tx is not None:
                self.end(tx)
            raise invalid("The referenced transaction has expired or is no longer valid.")
        tx.last_used = self._monotonic()
        return tx

    def find(self, tx_id: bytes) -> Transaction | None:
        return self._live.get(tx_id)

    def _expired(self, tx: Transaction) -> bool:
        now = self._monotonic()
        return now - tx.started > MAX_AGE_SECONDS or now - tx.last_used > MAX_IDLE_SECONDS

    def _sweep(self) -> None:
        for tx in [t for t in self._live.values() if self._expired(t)]:
            self.end(tx)

    def record_read(self, tx: Transaction, name: str, record: Record | None) -> None:
        if tx.read_only or name in tx.reads:
            return
        tx.reads[name] = None if record is None else record.update_us
        self._readers.setdefault(name, set()).add(tx.id)

    def record_query(self, tx: Transaction, query: CompiledQuery, records: list[Record]) -> None:
        if tx.read_only:
            return
        tx.queries.append((query, signature(records)))
        for record in records:
            self.record_read(tx, record.doc.name, record)

    def end(self, tx: Transaction) -> None:
        """Forget a transaction (commit, rollback, abort, expiry) and wake waiting commits."""
        if self._live.pop(tx.id, None) is None:
            return
        for name in tx.reads:
            readers = self._readers.get(name)
            if readers is not None:
                readers.discard(tx.id)
                if not readers:
                    del self._readers[name]
        self._priorities[tx.id] = tx.priority
        while len(self._priorities) > _REMEMBERED_PRIORITIES:
            self._priorities.popitem(last=False)
        self._changed.set()
        self._changed = asyncio.Event()

    def _older_readers(self, tx: Transaction, names: Iterable[str], idle_limit: float) -> list[Transaction]:
        """Live older transactions holding a read on ``names`` and used within ``idle_limit``
        seconds; expired ones found on the way are ended."""
        blockers = []
        now = self._monotonic()
        for name in names:
            for reader_id in list(self._readers.get(name, ())):  # end() below may shrink the set
                reader = self._live.get(reader_id)
                if reader is None or reader is tx or reader.priority >= tx.priority:
                    continue
                if self._expired(reader):
                    self.end(reader)
                    continue
                if now - reader.last_used <= idle_limit:
                    blockers.append(reader)
        return blockers

    async def wait_turn(self, tx: Transaction, names: list[str], *, to_write: bool) -> None:
        """Wait until no older transaction holds a read on ``names`` (for a read: none at work,
        rule 1; for a Commit's writes: none live, rule 2); ABORTED after the lock timeout."""
        idle_limit = MAX_IDLE_SECONDS if to_write else self._read_gate_idle
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self._lock_timeout
        seen: dict[bytes, Transaction] = {}
        try:
            while blockers := self._older_readers(tx, names, idle_limit):
                seen.update((blocker.id, blocker) for blocker in blockers)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.end(tx)
                    raise aborted("Transaction lock timeout.")
                # Wake when a blocker ends, or when the first of them stops counting (idle past the
                # limit, or expired) without anyone ending it: an abandoned one is ended by nobody.
                lapses = min(blocker.last_used for blocker in blockers) + idle_limit - self._monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, min(remaining, lapses)) + 0.001)
                tx.last_used = self._monotonic()  # waiting inside an RPC is being used
        finally:
            waited = loop.time() - began
            if waited >= _SLOW_WAIT_SECONDS:
                now = self._monotonic()
                _LOGGER.warning(
                    "transaction %s waited %.1f s to %s %s behind older transactions %s",
                    tx.id.hex()[:12],
                    waited,
                    "write" if to_write else "read",
                    ", ".join(sorted(names)[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else ""),
                    ", ".join(
                        f"{b.id.hex()[:12]} (begun {now - b.started:.1f} s, used {now - b.last_used:.1f} s ago)"
                        for b in seen.values()
                    ),
                )

    def validate(self, tx: Transaction, store: DocumentStore) -> None:
        """ABORTED (and the transaction ended) if anything it read has changed since."""
        for name, version in tx.reads.items():
            current = store.get(name)
            if (None if current is None else current.update_us) != version:
                self.end(tx)
                raise aborted(f"Transaction aborted: {name} was modified after the transaction read it.")
        for query, seen in tx.queries:
            if signature(execute(store, query, None)) != seen:
                self.end(tx)
                raise aborted("Transaction aborted: the result of a query it ran has changed.")
