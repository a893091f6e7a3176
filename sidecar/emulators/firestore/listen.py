"""``Listen``: Firestore's real-time stream, as production serves it to the official clients' watch.

Protocol (what ``google/cloud/firestore_v1/watch.py`` expects). For each ``add_target``:
TargetChange ADD, one DocumentChange per document in the result, TargetChange CURRENT (with a resume
token), then a TargetChange NO_CHANGE with empty ``target_ids``, a ``read_time`` and a resume token:
the global consistent snapshot on which the client calls back. Later commits bring DocumentChange
(added to or changed in the result), DocumentDelete (deleted) or DocumentRemove (still exists, no
longer matches), then again a global NO_CHANGE. ``remove_target`` is answered with TargetChange
REMOVE. A target with ``once`` is removed after its first consistent snapshot.

Event driven and consistent: ``DocumentStore.apply`` calls the hub synchronously inside every commit,
which marks the touched names on the targets concerned and wakes their streams; a stream builds its
responses in one synchronous step between two commits (``Session.drain``), so every snapshot is the
state after some commit, never a half-applied one, and streams see commits in commit order. Several
commits may fold into one snapshot when the client reads slower than the store commits, as in
production. The snapshot's read time is a fresh tick of the store's clock, so it lies strictly
between the last commit it includes and the next one. A quiet stream still gets a NO_CHANGE with a
fresh resume token every ``heartbeat_seconds`` (production does likewise), so its token stays
within the version retention.

Resume (a client reconnecting after a stream failure sends ``resume_token`` or ``read_time``): while
that time is within the store's version retention (60 s by default; production: 30 minutes) the
target gets only what changed since (every document touched since that was in the result at any
moment since, because the client may hold changes it received but never saw consistent), billed as
such. Further back, or across an emulator reset, it gets ADD, RESET and the full result set, billed
as a new listen: production does the same after 30 minutes. No ExistenceFilter is sent (its
mismatch only ever makes the client restart the stream). ``expected_count`` is ignored.

Billing (counted in ``Counters.reads``), production's rules from the Firestore billing page: "When
you listen to the results of a query, you are charged for a read each time a document in the result
set is added or updated. You are also charged for a read when a document is removed from the result
set because the document has changed. (In contrast, when a document is deleted, you are not charged
for a read.)", and "There is a minimum charge of one document read for each query that you perform,
even if the query returns no results": a new listen costs max(1, documents in its result).

Refused as production refuses: a malformed database name, a target outside the request's database,
a malformed query or document name (INVALID_ARGUMENT), a request with neither ``add_target`` nor
``remove_target``, a target id in use or negative, or removing an unknown one (INVALID_ARGUMENT);
``find_nearest`` (UNIMPLEMENTED). Faults: the interceptor's rules apply when a stream opens
(method "Listen"); ``break_streams`` (admin ``POST /streams/break {"service": "firestore"}``) ends
every open stream with a status code, so the client's reconnect and resume path can be tested.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sidecar.emulators.firestore import names
from sidecar.emulators.firestore import protos as pb
from sidecar.emulators.firestore.counters import Counters
from sidecar.emulators.firestore.documents import DocumentStore, Record
from sidecar.emulators.firestore.errors import FirestoreError, invalid
from sidecar.emulators.firestore.index_plan import check_query
from sidecar.emulators.firestore.indexes import IndexConfig
from sidecar.emulators.firestore.listen_targets import DocumentsTarget, QueryTarget, Target, resume_token
from sidecar.emulators.firestore.query import compile_query

_LOGGER = logging.getLogger(__name__)

_NO_CHANGE = pb.TARGET_CHANGE.Value("NO_CHANGE")
_REMOVE = pb.TARGET_CHANGE.Value("REMOVE")
_TOKEN_PREFIX = b"\x01"
_MAX_HEARTBEAT_SECONDS = 30.0
"""A fresh resume token at least this often; halved retention when that is shorter, so a token of a
quiet stream never falls out of the version history a resume diffs against."""


class ListenHub:
    """Every open Listen stream, indexed by the collections their targets watch."""

    def __init__(self, store: DocumentStore, counters: Counters, indexes: IndexConfig | None = None) -> None:
        self.store = store
        self.counters = counters
        self.indexes = indexes or IndexConfig.everything()
        self.sessions: set[Session] = set()
        self._by_collection: dict[str, dict[tuple[Session, Target], None]] = {}
        self._scanned: dict[tuple[Session, Target], None] = {}
        self._reset_us = 0
        self.heartbeat_seconds = min(_MAX_HEARTBEAT_SECONDS, store.retention_us / 2_000_000) or _MAX_HEARTBEAT_SECONDS
        store.observers.append(self.on_commit)

    # ---- targets ------------------------------------------------------------------------------

    def register(self, session: Session, target: Target) -> None:
        paths = target.collection_paths()
        if paths is None:
            self._scanned[(session, target)] = None
        for path in paths or ():
            self._by_collection.setdefault(path, {})[(session, target)] = None

    def unregister(self, session: Session, target: Target) -> None:
        self._scanned.pop((session, target), None)
        for path in target.collection_paths() or ():
            entries = self._by_collection.get(path)
            if entries is not None:
                entries.pop((session, target), None)
                if not entries:
                    del self._by_collection[path]

    def on_commit(self, changes: list[tuple[str, Record | None]], commit_us: int) -> None:
        """Called by the store inside every commit: note the changes on the targets they concern."""
        woken: set[Session] = set()
        for name, record in changes:
            parent = name.rpartition("/")[0]
            for session, target in self._by_collection.get(parent, ()):
                if target.concerns(name) and target.touch(name, record):
                    woken.add(session)
            for session, target in self._scanned:
                if target.concerns(name) and target.touch(name, record):
                    woken.add(session)
        for session in woken:
            session.wake.set()

    def can_resume_from(self, since_us: int) -> bool:
        now = self.store.clock.now()
        return max(self._reset_us, self.store.oldest_readable_us(now)) <= since_us <= now

    def reset(self) -> None:
        """The store was cleared: streams report their documents gone; older tokens cannot resume."""
        self._reset_us = self.store.clock.tick()
        for session in self.sessions:
            for target in session.targets.values():
                target.forget_all()
            session.wake.set()

    async def break_streams(self, code: grpc.StatusCode) -> int:
        sessions = list(self.sessions)
        for session in sessions:
            session.fail(FirestoreError(code, f"stream closed by the emulator ({code.name})"))
        return len(sessions)

    # ---- the RPC ------------------------------------------------------------------------------

    async def listen(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        session = Session(self)
        self.sessions.add(session)
        reader = asyncio.create_task(session.read(requests))
        try:
            while True:
                try:
                    await asyncio.wait_for(session.wake.wait(), self.heartbeat_seconds)
                except TimeoutError:
                    session.heartbeat_due = True
                session.wake.clear()
                if session.error is not None:
                    raise session.error
                for response in session.drain():
                    yield response
                if session.ended:
                    return
        finally:
            reader.cancel()
            session.close()
            self.sessions.discard(session)


class Session:
    """One Listen stream: its targets and the responses queued for it."""

    def __init__(self, hub: ListenHub) -> None:
        self.hub = hub
        self.database: str | None = None
        self.targets: dict[int, Target] = {}
        self.wake = asyncio.Event()
        self.error: FirestoreError | None = None
        self.ended = False
        self.heartbeat_due = False
        self._outbox: list[Any] = []
        self._snapshot_due = False
        self._next_id = 1

    def fail(self, error: FirestoreError) -> None:
        if self.error is None:
            self.error = error
        self.wake.set()

    def close(self) -> None:
        for target in self.targets.values():
            self.hub.unregister(self, target)
        self.targets.clear()

    async def read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                self.handle(request)
                self.wake.set()
            self.ended = True  # the client half-closed: send what is due, then end the stream
            self.wake.set()
        except FirestoreError as exc:
            self.fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _LOGGER.exception("firestore emulator: Listen request failed")
            self.fail(FirestoreError(grpc.StatusCode.INTERNAL, f"emulator error: {type(exc).__name__}: {exc}"))

    def handle(self, request: Any) -> None:
        database = names.check_database(request.database)
        if self.database is None:
            self.database = database
        elif database != self.database:
            raise invalid(f"Listen: database {database!r} differs from the stream's {self.database!r}.")
        kind = request.WhichOneof("target_change")
        if kind == "add_target":
            self._add(request.add_target)
        elif kind == "remove_target":
            target = self.targets.pop(request.remove_target, None)
            if target is None:
                raise invalid(f"Listen: no target with id {request.remove_target} on this stream.")
            self.hub.unregister(self, target)
            self._outbox.append(_target_change(_REMOVE, request.remove_target))
        else:
            raise invalid("A ListenRequest must set add_target or remove_target.")

    def _add(self, spec: Any) -> None:
        target_id = spec.target_id
        if target_id < 0:
            raise invalid(f"Listen: target_id must not be negative (got {target_id}).")
        if target_id == 0:
            while self._next_id in self.targets:
                self._next_id += 1
            target_id = self._next_id
        if target_id in self.targets:
            raise invalid(f"Listen: target id {target_id} is already in use on this stream.")
        target = self._build(spec, target_id)
        if isinstance(target, QueryTarget):
            try:
                check_query(self.hub.indexes, target.query.parent, spec.query.structured_query)
            except FirestoreError as exc:
                # Production refuses such a target alone (a REMOVE carrying the cause); the stream stays.
                removed = _target_change(_REMOVE, target_id)
                removed.target_change.cause.code = exc.code.value[0]
                removed.target_change.cause.message = exc.message
                self._outbox.append(removed)
                return
        since = _since(spec)
        store = self.hub.store
        read_us = store.clock.tick()
        if since is None:
            reads = target.initial(store, self._outbox, read_us)
        elif self.hub.can_resume_from(since):
            reads = target.resume(store, self._outbox, since, read_us)
        else:
            reads = target.reset(store, self._outbox, read_us)
        self.hub.counters.reads += reads
        self.targets[target_id] = target
        self.hub.register(self, target)
        self._snapshot_due = True

    def _build(self, spec: Any, target_id: int) -> Target:
        assert self.database is not None
        kind = spec.WhichOneof("target_type")
        if kind == "query":
            if spec.query.WhichOneof("query_type") != "structured_query":
                raise invalid("A query target needs a structured_query.")
            parent = names.parent_name(spec.query.parent)
            if parent != self.database + "/documents" and not parent.startswith(self.database + "/documents/"):
                raise invalid(f"Parent {parent!r} is not in database {self.database!r}.")
            return QueryTarget(target_id, spec.once, compile_query(parent, spec.query.structured_query))
        if kind == "documents":
            documents = list(spec.documents.documents)
            if not documents:
                raise invalid("A documents target needs at least one document name.")
            for name in documents:
                names.document_name(name, self.database)
            return DocumentsTarget(target_id, spec.once, documents)
        raise invalid("A target must set query or documents.")

    def drain(self) -> list[Any]:
        """Everything due on this stream, ending in a consistent snapshot when anything changed."""
        out, self._outbox = self._outbox, []
        store = self.hub.store
        read_us = store.clock.tick()
        reads = 0
        for target in self.targets.values():
            reads += target.flush(store, out, read_us)
        self.hub.counters.reads += reads
        if out or self._snapshot_due or (self.heartbeat_due and self.targets):
            change = pb.TargetChange(
                target_change_type=_NO_CHANGE,
                resume_token=resume_token(read_us),
                read_time=pb.timestamp_from_micros(read_us),
            )
            out.append(pb.ListenResponse(target_change=change))
            for target_id in [t.target_id for t in self.targets.values() if t.once]:
                self.hub.unregister(self, self.targets.pop(target_id))
                out.append(_target_change(_REMOVE, target_id))
        self._snapshot_due = self.heartbeat_due = False
        return out


def _since(spec: Any) -> int | None:
    """The snapshot time a re-added target resumes from (None: a fresh listen)."""
    kind = spec.WhichOneof("resume_type")
    if kind == "resume_token":
        token = spec.resume_token
        if not token:
            return None
        if len(token) != 9 or not token.startswith(_TOKEN_PREFIX):
            raise invalid("Listen: the resume token is not one this database issued.")
        return int.from_bytes(token[1:], "big")
    if kind == "read_time":
        return pb.nanos_of(spec.read_time) // 1000
    return None


def _target_change(kind: int, target_id: int) -> Any:
    return pb.ListenResponse(target_change=pb.TargetChange(target_change_type=kind, target_ids=[target_id]))
