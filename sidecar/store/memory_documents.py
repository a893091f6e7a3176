"""``documents.Documents`` in memory, with Firestore's semantics: for the crash simulation and tests.

NOT DURABLE by itself: it lives as long as the object. What makes it useful is that it keeps the
rules the store relies on, exactly: atomic Commits (all writes or none; one failed precondition
fails all), per-write BatchWrite statuses, masks that delete the named fields they do not set,
``exists`` preconditions, queries ordered by (field, name) with documents that lack the field
excluded, and TTL: ``expire(now_ms)`` deletes every document whose ``expire_at`` is in the past,
as a TTL policy on ``expire_at`` does (production deletes within about a day; a test calls it when
it wants the deletes to have happened).

Fenced commits check their fences and apply their writes in one step (``docs.Fenced`` when a
fence fails, nothing applied), and count one read per fence document, as Firestore's read-write
transaction does.

Versions: every document keeps an update time in microseconds from ``clock_us`` (injectable; wall
time by default), strictly increasing from one commit to the next (one BatchWrite write is one
commit), and a write that leaves the fields unchanged keeps the previous one, as Firestore's
WriteResult does. ``update_time_us`` preconditions compare with it exactly; ``get_versioned``
answers with a read time no earlier than any update time handed out.

Faults for the simulation: ``before_write`` is called with ("commit" | "batch_write", writes) before
anything applies (fences included) and may raise (the write did not happen); ``after_write`` is called after the
writes applied and may raise (the write happened, the caller never hears so: an ambiguous failure).
Counters: ``reads``, ``writes``, ``deletes`` (TTL deletes included), as Firestore bills them.

``listen`` keeps production's Listen semantics in memory: after each ``commit``, ``batch_write`` or
``expire`` that changes a listen's result, ``on_change`` is scheduled with ``loop.call_soon`` (never
called inside the write), with the first snapshot (``initial``) holding the full result. Update and
read times come from ``_ListenClock``: strictly increasing microseconds, a new update time for every
written document (a write that leaves the fields as they were gets one too, where Firestore keeps
the old; a listen reports no change for it either way).
Listen reads are billed as production bills them (see ``sidecar.emulators.firestore.listen``).
``listen_gate`` (tests): when set, a new listen reads its result and sends its first snapshot only
once the awaitable the gate returns for it is done, so that snapshot comes late and holds every
commit made meanwhile, as production's first snapshot of a large result or a slow stream does.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sidecar.store import documents as docs
from sidecar.store.api import StoreError

WriteHook = Callable[[str, Sequence[docs.Write]], None]
ListenGate = Callable[[str, str, Sequence[docs.Filter]], Awaitable[None]]
"""(parent, collection, filters) of a listen starting -> what its first snapshot waits for."""


def _wall_clock_us() -> int:
    return time.time_ns() // 1000


class MemoryDocuments:
    def __init__(self, clock_us: Callable[[], int] = _wall_clock_us) -> None:
        self.docs: dict[str, docs.Fields] = {}
        self.update_times: dict[str, int] = {}
        """Path -> update time (microseconds) of the stored version."""
        self._clock_us = clock_us
        self._last_us = 0
        self.before_write: WriteHook | None = None
        self.after_write: WriteHook | None = None
        self.listen_gate: ListenGate | None = None
        self.reads = 0
        self.writes = 0
        self.deletes = 0
        self.closed = False

    # ---- Documents --------------------------------------------------------------------------

    async def commit(self, writes: Sequence[docs.Write], fences: Sequence[docs.Fence] = ()) -> None:
        self._check(writes)
        if self.before_write is not None:
            self.before_write("commit", writes)
        if fences:
            # One step with the writes below (nothing awaits in between): Firestore's read-write
            # transaction, which reads each fence document once.
            self.reads += len({fence.path for fence in fences})
            failed = docs.failed_fences(fences, self.docs)
            if failed:
                raise docs.fenced_error("commit", failed)
        staged = dict(self.docs)
        times = dict(self.update_times)
        commit_us = self._tick()
        for write in writes:
            code, message = self._apply(staged, times, write, commit_us)
            if code == docs.ALREADY_EXISTS:
                raise docs.AlreadyExists(f"commit: {message}")
            if code == docs.FAILED_PRECONDITION:
                raise docs.PreconditionFailed(f"commit: {message}")
            if code != docs.OK:
                raise docs.RequestRejected(f"commit: {message}")
        self.docs = staged
        self.update_times = times
        self._count(writes)
        self._notify_listens([write.path for write in writes])
        if self.after_write is not None:
            self.after_write("commit", writes)

    async def batch_write(self, writes: Sequence[docs.Write]) -> list[tuple[int, str]]:
        self._check(writes)
        if len({write.path for write in writes}) != len(writes):
            raise docs.RequestRejected("batch write: a document is written twice in one request")
        if self.before_write is not None:
            self.before_write("batch_write", writes)
        statuses = []
        applied = []
        for write in writes:
            status = self._apply(self.docs, self.update_times, write, self._tick())
            statuses.append(status)
            if status[0] == docs.OK:
                applied.append(write)
        self._count(applied)
        self._notify_listens([write.path for write in applied])
        if self.after_write is not None:
            self.after_write("batch_write", writes)
        return statuses

    async def get_all(self, paths: Sequence[str]) -> dict[str, docs.Fields | None]:
        self._check_open()
        self.reads += max(1, len(paths)) if paths else 0
        return {path: copy.deepcopy(self.docs.get(path)) for path in paths}

    async def get_versioned(self, paths: Sequence[str]) -> tuple[int, dict[str, docs.Versioned]]:
        if not paths:
            raise ValueError("get_versioned: no paths (a read time needs at least one document)")
        self._check_open()
        self.reads += len(paths)
        read_us = self.listen_tick()
        return read_us, {
            path: docs.Versioned(copy.deepcopy(self.docs.get(path)), self.update_times.get(path)) for path in paths
        }

    async def query(
        self,
        parent: str,
        collection: str,
        where: docs.Filter | Sequence[docs.Filter] | None,
        order_by: str | None,
        after: object | None,
        limit: int,
    ) -> docs.Page:
        self._check_open()
        filters = docs.filters_of(where)
        prefix = f"{parent}/{collection}/"
        rows: list[tuple[Any, str, docs.Fields]] = []
        for path, fields in self.docs.items():
            if not path.startswith(prefix) or "/" in path[len(prefix) :]:
                continue
            if not all(_matches(fields, condition) for condition in filters):
                continue
            if order_by is not None and order_by not in fields:
                continue
            rows.append((fields.get(order_by) if order_by else None, path, fields))
        rows.sort(key=lambda row: (_sortable(row[0]), row[1]))
        if after is not None:
            cursor: tuple[Any, str] = after  # type: ignore[assignment]  # our own Page.after
            rows = [row for row in rows if (_sortable(row[0]), row[1]) > cursor]
        page = rows[:limit]
        self.reads += max(1, len(page))
        documents = [(path.rpartition("/")[2], copy.deepcopy(fields)) for _, path, fields in page]
        next_after = (_sortable(page[-1][0]), page[-1][1]) if len(page) >= limit else None
        return docs.Page(documents, next_after)

    async def close(self) -> None:
        self.closed = True

    def listen(
        self,
        parent: str,
        collection: str,
        where: Sequence[docs.Filter],
        on_change: Callable[[docs.Change], None],
        on_error: Callable[[StoreError], None],
    ) -> docs.Listening:
        self._check_open()
        listening = _MemoryListening(self, f"{parent}/{collection}/" if parent else f"{collection}/", tuple(where))
        if self.listen_gate is None:
            listening.start(asyncio.get_running_loop(), on_change)
        else:
            listening.start_after(self.listen_gate(parent, collection, tuple(where)), on_change)
        return listening

    _listens: list[_MemoryListening] | None = None

    def update_time_us(self, path: str) -> int:
        """A stored document's update time (0 if it was never written through us)."""
        return self.update_times.get(path, 0)

    def listen_tick(self) -> int:
        """A snapshot's read time: no earlier than any update time handed out (as ``get_versioned``)."""
        return max(self._clock_us(), self._last_us)

    def _notify_listens(self, paths: Sequence[str]) -> None:
        """After a write applied: every listen looks at the written documents."""
        for listening in list(self._listens or ()):
            listening.changed(paths)

    def _register_listen(self, listening: _MemoryListening, register: bool) -> None:
        if self._listens is None:
            self._listens = []
        if register:
            self._listens.append(listening)
        elif listening in self._listens:
            self._listens.remove(listening)

    # ---- TTL and inspection -------------------------------------------------------------------

    def expire(self, now_ms: int, field: str = "expire_at") -> int:
        """Delete every document whose ``field`` is a time before ``now_ms`` (a TTL policy's sweep)."""
        now = docs.utc_from_ms(now_ms)
        gone = [
            path
            for path, fields in self.docs.items()
            if isinstance(fields.get(field), datetime.datetime) and fields[field] < now
        ]
        for path in gone:
            del self.docs[path]
            self.update_times.pop(path, None)
        self.deletes += len(gone)
        self._notify_listens(gone)
        return len(gone)

    def snapshot(self) -> dict[str, docs.Fields]:
        return copy.deepcopy(self.docs)

    # ---- internals ------------------------------------------------------------------------------

    def _tick(self) -> int:
        """A commit time: the clock, but always later than the previous one (one version per time)."""
        now = self._clock_us()
        self._last_us = now if now > self._last_us else self._last_us + 1
        return self._last_us

    def _check_open(self) -> None:
        if self.closed:
            raise docs.Unavailable("memory documents: closed")

    def _check(self, writes: Sequence[docs.Write]) -> None:
        self._check_open()
        if len(writes) > docs.MAX_WRITES:
            raise docs.RequestRejected(f"{len(writes)} writes in one request (maximum {docs.MAX_WRITES})")

    def _count(self, writes: Sequence[docs.Write]) -> None:
        for write in writes:
            if write.is_delete:
                self.deletes += 1
            else:
                self.writes += 1

    @staticmethod
    def _apply(
        target: dict[str, docs.Fields], times: dict[str, int], write: docs.Write, commit_us: int
    ) -> tuple[int, str]:
        current = target.get(write.path)
        if write.exists is False and current is not None:
            return docs.ALREADY_EXISTS, f"document already exists: {write.path}"
        if write.exists is True and current is None:
            return 5, f"no document to update: {write.path}"
        if write.update_time_us is not None:
            stored_us = times.get(write.path, 0) if current is not None else 0
            if current is None or stored_us != write.update_time_us:
                return docs.FAILED_PRECONDITION, (
                    f"the stored version ({stored_us}) does not match the required base version "
                    f"({write.update_time_us}): {write.path}"
                )
        if write.fields is None:
            target.pop(write.path, None)
            times.pop(write.path, None)
            return docs.OK, ""
        if write.mask is None:
            updated = copy.deepcopy(dict(write.fields))
        else:
            updated = dict(current or {})
            for name in write.mask:
                if name in write.fields:
                    updated[name] = copy.deepcopy(write.fields[name])
                else:
                    updated.pop(name, None)
        if current is not None and _same(updated, current):
            return docs.OK, ""  # unchanged: the stored version and its update time stay
        target[write.path] = updated
        times[write.path] = commit_us
        return docs.OK, ""


def _same(a: Any, b: Any) -> bool:
    """Equal as Firestore compares stored values: types count (``True`` is not ``1``), and a list
    and a tuple are both arrays."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[name], b[name]) for name in a)
    return bool(a == b)


def _sortable(value: Any) -> Any:
    """Order values of mixed types as Firestore does for the ones the store uses (null < number < string)."""
    if value is None:
        return (0, 0)
    if isinstance(value, bool):
        return (1, value)
    if isinstance(value, int | float):
        return (2, value)
    if isinstance(value, datetime.datetime):
        return (3, value.timestamp())
    if isinstance(value, str):
        return (4, value)
    return (5, repr(value))


def _matches(fields: docs.Fields, where: docs.Filter) -> bool:
    if where.field not in fields:
        return False
    value = fields[where.field]
    if where.op == "EQUAL":
        return bool(value == where.value)
    a, b = _sortable(value), _sortable(where.value)
    if where.op == "LESS_THAN":
        return bool(a[0] == b[0] and a < b)
    return bool(a[0] == b[0] and a >= b)


class _MemoryListening:
    """One ``MemoryDocuments.listen``: the result set it reported, and the changes since."""

    def __init__(self, owner: MemoryDocuments, prefix: str, where: tuple[docs.Filter, ...]) -> None:
        self._owner = owner
        self._prefix = prefix
        self._where = where
        self._sent: dict[str, docs.Fields] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: Callable[[docs.Change], None] | None = None
        self._gated: asyncio.Task[None] | None = None
        self.closed = False

    def start(self, loop: asyncio.AbstractEventLoop, on_change: Callable[[docs.Change], None]) -> None:
        self._loop = loop
        self._on_change = on_change
        owner = self._owner
        upserts = []
        for path, fields in owner.docs.items():
            if self.admits(path, fields):
                self._sent[path] = copy.deepcopy(fields)
                upserts.append((path.rpartition("/")[2], copy.deepcopy(fields), owner.update_time_us(path)))
        owner.reads += max(1, len(upserts))
        owner._register_listen(self, True)
        loop.call_soon(self._deliver, docs.Change(upserts, [], owner.listen_tick(), True))

    def start_after(self, gate: Awaitable[None], on_change: Callable[[docs.Change], None]) -> None:
        """``start`` once ``gate`` is done: the first snapshot is read then (``MemoryDocuments.listen_gate``)."""

        async def start() -> None:
            await gate
            if not self.closed:
                self.start(asyncio.get_running_loop(), on_change)

        self._gated = asyncio.ensure_future(start())

    def admits(self, path: str, fields: docs.Fields | None) -> bool:
        if fields is None or not path.startswith(self._prefix) or "/" in path[len(self._prefix) :]:
            return False
        return all(_matches(fields, condition) for condition in self._where)

    def changed(self, paths: Sequence[str]) -> None:
        """Called after a write applied: schedule a Change if the result moved."""
        owner = self._owner
        upserts: list[tuple[str, docs.Fields, int]] = []
        removals: list[str] = []
        for path in dict.fromkeys(paths):
            fields = owner.docs.get(path)
            if self.admits(path, fields):
                assert fields is not None
                if self._sent.get(path) == fields:
                    continue  # a write that changed nothing: Firestore keeps the version, sends nothing
                self._sent[path] = copy.deepcopy(fields)
                upserts.append((path.rpartition("/")[2], copy.deepcopy(fields), owner.update_time_us(path)))
                owner.reads += 1
            elif path in self._sent:
                del self._sent[path]
                removals.append(path.rpartition("/")[2])
                owner.reads += fields is not None  # removed because it changed; a delete is free
        if (upserts or removals) and self._loop is not None:
            change = docs.Change(upserts, removals, owner.listen_tick(), False)
            self._loop.call_soon(self._deliver, change)

    def _deliver(self, change: docs.Change) -> None:
        if not self.closed and self._on_change is not None:
            self._on_change(change)

    async def close(self) -> None:
        self.closed = True
        if self._gated is not None:
            self._gated.cancel()
        self._owner._register_listen(self, False)
