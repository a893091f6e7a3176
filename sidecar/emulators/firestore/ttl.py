"""TTL policies: delete documents whose TTL field holds a timestamp in the past, as production does.

A policy is one (collection group, field path); production allows one TTL field per group. A
document of the group whose field is a timestamp at or before the sweep's clock is deleted; a field
that is missing or not a timestamp is ignored (the document stays forever). Production deletes
within about 24 h of expiry; the emulator sweeps every ``interval_seconds`` (default 60), or, with
0, after every commit, so tests and benchmarks see the deletions at once.

Each deletion is a real delete: one commit (one ``Clock`` tick) per sweep through
``DocumentStore.apply``, so history and ``read_time`` reads, Listen targets (whose removal of a
deleted document costs no read) and transactions see it like any other delete. It is billed as a
delete and also counted in ``ttl_deletes``.

Cost: a ``write_observers`` hook pushes (expiry, name, update time) onto a heap for each written
document carrying a TTL timestamp (O(log n)); a sweep pops the expired entries and deletes those
whose document is still that version (a rewritten or deleted document left a stale entry: skipped).
So a sweep costs the expired entries, never a scan of the group.
"""

from __future__ import annotations

import asyncio
import heapq
import logging

from sidecar.emulators.firestore.counters import Counters
from sidecar.emulators.firestore.documents import DocumentStore, Record
from sidecar.emulators.firestore.paths import FieldPath
from sidecar.emulators.firestore.values import get_field

_LOGGER = logging.getLogger(__name__)


class TtlSweeper:
    """The TTL policies of the emulator and their sweep (call everything on the server's loop)."""

    def __init__(self, store: DocumentStore, counters: Counters, interval_seconds: float = 60.0) -> None:
        if interval_seconds < 0:
            raise ValueError(f"TTL sweep interval must be >= 0 seconds, got {interval_seconds}")
        self.store = store
        self.counters = counters
        self.interval_seconds = interval_seconds
        self.policies: dict[str, FieldPath] = {}
        """collection group -> its TTL field."""
        self._due: list[tuple[int, str, int]] = []
        """Heap of (expiry in microseconds, document name, update_us of the version that set it)."""
        self._task: asyncio.Task[None] | None = None
        store.write_observers.append(self._on_write)

    def add_policy(self, group: str, path: FieldPath) -> None:
        """Make ``path`` the TTL field of ``group`` (replacing any other) and index existing documents."""
        self.policies[group] = path
        for collection_path in self.store.by_collection_id.get(group, ()):
            collection = self.store.collections[collection_path]
            for doc_id, record in collection.docs.items():
                self._on_write(f"{collection_path}/{doc_id}", None, record)

    def clear(self) -> None:
        """The store was cleared: forget the pending expiries (the policies stay)."""
        self._due.clear()

    def _on_write(self, name: str, old: Record | None, record: Record | None) -> None:
        if record is None or not self.policies:
            return
        parent = name.rpartition("/")[0]
        path = self.policies.get(parent.rpartition("/")[2])
        if path is None:
            return
        value = get_field(record.doc.fields, path)
        if value is None or value.WhichOneof("value_type") != "timestamp_value":
            return
        ts = value.timestamp_value
        heapq.heappush(self._due, (ts.seconds * 1_000_000 + ts.nanos // 1000, name, record.update_us))

    def sweep(self, as_of_us: int | None = None) -> int:
        """Delete every document expired at ``as_of_us`` (default: now) in one commit; returns how many."""
        now_us = self.store.clock.now() if as_of_us is None else as_of_us
        due = self._due
        expired: dict[str, Record | None] = {}
        while due and due[0][0] <= now_us:
            _, name, update_us = heapq.heappop(due)
            current = self.store.get(name)
            if current is not None and current.update_us == update_us:
                expired[name] = None
        if expired:
            self.store.apply(expired, self.store.clock.tick())
            self.counters.deletes += len(expired)
            self.counters.ttl_deletes += len(expired)
        return len(expired)

    def after_commit(self) -> None:
        """The service's post-commit hook: sweep now when the interval is 0."""
        if self.interval_seconds == 0 and self._due:
            self.sweep()

    def start(self) -> None:
        """Start the periodic sweep on the running loop (no task when the interval is 0)."""
        if self.interval_seconds > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="firestore-ttl-sweep")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_seconds)
            try:
                self.sweep()
            except Exception:  # a sweep bug must not end the sweeps, nor the emulator
                _LOGGER.exception("firestore emulator: TTL sweep failed")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
