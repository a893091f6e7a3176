"""Firestore behind ``sidecar.store.documents``: the one module of ours that imports google-cloud-firestore.

``FirestoreDocuments`` turns the store's plain writes into raw Firestore protobufs and sends them
through the official ``AsyncClient``'s own GAPIC client (``AsyncClient._firestore_api``, with the
client's channel, credentials, emulator handling and request metadata): the async client has no
BulkWriter, and its snapshot decoding costs ~250 us per document, too slow to load 100,000 pending
messages. The two private attributes are read in one place and checked at construction, so that a
library change fails at start, not mid-run. ``FIRESTORE_EMULATOR_HOST`` is honoured by the client.

Errors from Google's libraries are translated here, once: ``_RETRYABLE`` -> ``documents.Unavailable``
(for a write: it may have applied); ``_INPUT_ERRORS`` -> ``documents.RequestRejected``; ALREADY_EXISTS
from Commit -> ``documents.AlreadyExists``; FAILED_PRECONDITION from Commit (an ``update_time``
precondition) -> ``documents.PreconditionFailed``; anything else (permission, missing database or index) ->
``documents.Misconfigured``.

``listen`` is the exception to "raw protobufs through the async client": it runs the official sync
``Client``'s watch (``Query.on_snapshot``, ``google/cloud/firestore_v1/watch.py``: resume tokens,
reconnects with backoff, consistent snapshots), which only the sync client has. The watch calls back
on its own thread; ``_Listening`` hops each snapshot onto the caller's loop with
``call_soon_threadsafe``. It decodes documents into Python values itself (``to_dict``), so those are
normalised to what ``_get_value`` gives (plain UTC ``datetime``, reference names as strings).

**Fenced commits** (``commit(writes, fences)``) run as one read-write transaction: BeginTransaction,
BatchGetDocuments of the fence documents inside it, compare, then Commit with the transaction id
(or Rollback and ``documents.Fenced``). Sound with Firestore's primitives because read-write
transactions are serializable: a Commit that succeeds read each fence document at a version that no
later committed write preceded, so a lease that changed hands before the Commit fails the
transaction instead of letting the old owner write (``sidecar.store.fencing`` gives the whole
argument). Production holds pessimistic read locks until the Commit, so the lease write waits; our
emulator validates optimistically (``sidecar/emulators/firestore/transactions.py``: a Commit whose
read document changed is ABORTED). ABORTED (contention, lock timeout) retries the whole transaction
``_FENCE_ATTEMPTS`` times with backoff, passing ``retry_transaction`` so that it keeps its age, then
raises ``documents.Unavailable``. Without fences a Commit is the plain Commit it always was (no
transaction, no extra read).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.api_core import exceptions as core_exceptions
from google.api_core import retry_async
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_document import DocumentSnapshot
from google.cloud.firestore_v1.base_query import FieldFilter
from google.cloud.firestore_v1.document import DocumentReference
from google.cloud.firestore_v1.types import (
    BatchGetDocumentsRequest,
    BatchWriteRequest,
    BeginTransactionRequest,
    CommitRequest,
    Document,
    RollbackRequest,
    RunQueryRequest,
    StructuredQuery,
    TransactionOptions,
    Value,
    Write,
)
from google.cloud.firestore_v1.watch import ChangeType, Watch

from sidecar.store import documents as docs
from sidecar.store.api import StoreError, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore, wall_clock_ms
from sidecar.store.fencing import FenceSource

_RETRYABLE: tuple[type[BaseException], ...] = (
    core_exceptions.ServiceUnavailable,
    core_exceptions.DeadlineExceeded,
    core_exceptions.Aborted,
    core_exceptions.InternalServerError,
    core_exceptions.Unknown,
    core_exceptions.ResourceExhausted,
    core_exceptions.Cancelled,
    core_exceptions.RetryError,
    auth_exceptions.TransportError,
    grpc.aio.AioRpcError,
    TimeoutError,
    ConnectionError,
)
_INPUT_ERRORS: tuple[type[BaseException], ...] = (core_exceptions.InvalidArgument, core_exceptions.OutOfRange)
_TERMINAL: tuple[type[BaseException], ...] = (core_exceptions.GoogleAPICallError, auth_exceptions.GoogleAuthError)

_READ_RETRY = retry_async.AsyncRetry(
    initial=0.05,
    maximum=1.0,
    multiplier=2.0,
    timeout=10.0,
    predicate=retry_async.if_exception_type(
        core_exceptions.ServiceUnavailable,
        core_exceptions.DeadlineExceeded,
        core_exceptions.InternalServerError,
        core_exceptions.Aborted,
    ),
)
"""Reads are idempotent: a short retry absorbs blips. Writes are not retried here (the callers
retry with their own backoff, and an ambiguous create is resolved by reading it back)."""


_FENCE_ATTEMPTS = 5
"""Tries of a fenced commit's transaction on ABORTED, as the official client's transactions (5)."""


def _fence_backoff_seconds(attempt: int) -> float:
    """Before a fenced commit's next try: capped exponential with jitter (api_core's generator)."""
    sleeps = retry_async.exponential_sleep_generator(initial=0.05, maximum=1.0, multiplier=2.0)
    delay = 0.0
    for _ in range(attempt + 1):
        delay = next(sleeps)
    return delay


def _translate(exc: BaseException, what: str) -> StoreError:
    if isinstance(exc, core_exceptions.AlreadyExists):
        return docs.AlreadyExists(f"{what}: {exc}")
    if isinstance(exc, _INPUT_ERRORS):
        return docs.RequestRejected(f"{what}: Firestore refused the request: {exc}")
    if isinstance(exc, _RETRYABLE):
        return docs.Unavailable(f"{what}: Firestore unavailable: {exc}")
    return docs.Misconfigured(f"{what}: Firestore error (check permissions, database and indexes): {exc}")


@dataclass(frozen=True, slots=True)
class _Reference:
    """A document name as a query cursor value (``reference_value``)."""

    name: str


def _set_value(target: Any, value: Any) -> None:
    """Fill a raw ``Value`` protobuf in place (no copy of large bytes)."""
    if isinstance(value, _Reference):
        target.reference_value = value.name
    elif value is None:
        target.null_value = 0
    elif isinstance(value, bool):
        target.boolean_value = value
    elif isinstance(value, int):
        target.integer_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bytes):
        target.bytes_value = value
    elif isinstance(value, datetime.datetime):
        target.timestamp_value.FromDatetime(value)
    elif isinstance(value, list | tuple):
        array = target.array_value
        array.SetInParent()
        for item in value:
            _set_value(array.values.add(), item)
    else:
        raise TypeError(f"store: cannot encode {type(value).__name__}")


def _get_value(value: Any) -> Any:
    """A raw ``Value`` protobuf as a Python value (the client's decoder is 10x slower at load)."""
    kind = value.WhichOneof("value_type")
    if kind == "array_value":
        return [_get_value(item) for item in value.array_value.values]
    if kind == "map_value":
        return {name: _get_value(item) for name, item in value.map_value.fields.items()}
    if kind == "timestamp_value":
        return value.timestamp_value.ToDatetime(tzinfo=datetime.UTC)
    if kind == "null_value" or kind is None:
        return None
    return getattr(value, kind)


_OPERATORS = {"EQUAL": "EQUAL", "GREATER_THAN_OR_EQUAL": "GREATER_THAN_OR_EQUAL"}


class FirestoreDocuments:
    """``documents.Documents`` on the official async client, with raw protobufs."""

    _WRITE = Write.pb()
    _DOCUMENT = Document.pb()
    _VALUE = Value.pb()

    def __init__(self, project: str, database: str = "(default)", timeout_seconds: float = 30.0) -> None:
        # The client reads FIRESTORE_EMULATOR_HOST itself (insecure channel, anonymous credentials).
        self.client = firestore.AsyncClient(project=project, database=database)
        for attribute in ("_firestore_api", "_rpc_metadata"):
            if not hasattr(type(self.client), attribute):
                raise RuntimeError(f"google-cloud-firestore changed: AsyncClient.{attribute} is gone")
        self._database = f"projects/{project}/databases/{database}"
        self._documents = f"{self._database}/documents/"
        self._timeout = timeout_seconds

    def _name(self, relative_path: str) -> str:
        return self._documents + relative_path

    def _write(self, write: docs.Write) -> Any:
        if write.fields is None:
            raw = self._WRITE(delete=self._name(write.path))
        else:
            doc = self._DOCUMENT(name=self._name(write.path))
            for field_name, value in write.fields.items():
                _set_value(doc.fields[field_name], value)
            raw = self._WRITE(update=doc)
            if write.mask is not None:
                raw.update_mask.field_paths.extend(write.mask)
        if write.exists is not None:
            raw.current_document.exists = write.exists
        elif write.update_time_us is not None:
            raw.current_document.update_time.FromMicroseconds(write.update_time_us)
        return raw

    async def commit(self, writes: Sequence[docs.Write], fences: Sequence[docs.Fence] = ()) -> None:
        if fences:
            await self._fenced_commit(writes, fences)
            return
        request = CommitRequest.pb()(database=self._database, writes=[self._write(w) for w in writes])
        try:
            await self.client._firestore_api.commit(
                request=CommitRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=None,
                timeout=self._timeout,
            )
        except core_exceptions.FailedPrecondition as exc:
            # On a Commit (no query, so no missing index) this is an update_time precondition.
            raise docs.PreconditionFailed(f"commit: {exc}") from exc
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "commit") from exc

    async def _fenced_commit(self, writes: Sequence[docs.Write], fences: Sequence[docs.Fence]) -> None:
        """One read-write transaction: read the fences, compare, commit (module docstring)."""
        paths = list(dict.fromkeys(fence.path for fence in fences))
        retry_of = b""
        aborted: BaseException | None = None
        for attempt in range(_FENCE_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_fence_backoff_seconds(attempt - 1))
            transaction = await self._begin(retry_of)
            try:
                found = await self._batch_get(paths, transaction)
                failed = docs.failed_fences(fences, found)
                if failed:
                    await self._rollback(transaction)
                    raise docs.fenced_error("commit", failed)
                request = CommitRequest.pb()(
                    database=self._database, writes=[self._write(w) for w in writes], transaction=transaction
                )
                await self.client._firestore_api.commit(
                    request=CommitRequest.wrap(request),
                    metadata=self.client._rpc_metadata,
                    retry=None,
                    timeout=self._timeout,
                )
                return
            except core_exceptions.Aborted as exc:
                # Usually the server ended it already; a Rollback makes sure no read of it lingers
                # (an abandoned transaction holds its reads until it expires). The retry keeps its age.
                aborted, retry_of = exc, transaction
                await self._rollback(transaction)
            except (*_RETRYABLE, *_TERMINAL) as exc:
                await self._rollback(transaction)
                raise _translate(exc, "fenced commit") from exc
        raise docs.Unavailable(f"fenced commit: transaction aborted {_FENCE_ATTEMPTS} times: {aborted}")

    async def _begin(self, retry_of: bytes) -> bytes:
        options = TransactionOptions.pb()()
        options.read_write.SetInParent()
        if retry_of:
            options.read_write.retry_transaction = retry_of
        request = BeginTransactionRequest.pb()(database=self._database, options=options)
        try:
            response = await self.client._firestore_api.begin_transaction(
                request=BeginTransactionRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=_READ_RETRY,
                timeout=self._timeout,
            )
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "begin transaction") from exc
        return bytes(response.transaction)

    async def _rollback(self, transaction: bytes) -> None:
        """Best effort: an abandoned transaction also ends by itself when it expires."""
        request = RollbackRequest.pb()(database=self._database, transaction=transaction)
        try:
            await self.client._firestore_api.rollback(
                request=RollbackRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=None,
                timeout=self._timeout,
            )
        except (*_RETRYABLE, *_TERMINAL):
            pass

    async def batch_write(self, writes: Sequence[docs.Write]) -> list[tuple[int, str]]:
        request = BatchWriteRequest.pb()(database=self._database, writes=[self._write(w) for w in writes])
        try:
            response = await self.client._firestore_api.batch_write(
                request=BatchWriteRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=None,
                timeout=self._timeout,
            )
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "batch write") from exc
        return [(status.code, status.message) for status in response._pb.status]

    async def get_all(self, paths: Sequence[str]) -> dict[str, docs.Fields | None]:
        if not paths:
            return {}
        try:
            return await self._batch_get(paths, b"")
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "read") from exc

    async def _batch_get(self, paths: Sequence[str], transaction: bytes) -> dict[str, docs.Fields | None]:
        """BatchGetDocuments (inside ``transaction`` when given: not retried, its ABORTED ends it)."""
        names = {self._name(path): path for path in paths}
        request = BatchGetDocumentsRequest.pb()(database=self._database, documents=list(names))
        if transaction:
            request.transaction = transaction
        found: dict[str, docs.Fields | None] = {}
        stream = await self.client._firestore_api.batch_get_documents(
            request=BatchGetDocumentsRequest.wrap(request),
            metadata=self.client._rpc_metadata,
            retry=None if transaction else _READ_RETRY,
            timeout=self._timeout,
        )
        async for response in stream:
            raw = response._pb
            if raw.HasField("found"):
                fields = {name: _get_value(value) for name, value in raw.found.fields.items()}
                found[names[raw.found.name]] = fields
            elif raw.missing:
                found[names[raw.missing]] = None
        return found

    async def get_versioned(self, paths: Sequence[str]) -> tuple[int, dict[str, docs.Versioned]]:
        if not paths:
            raise ValueError("get_versioned: no paths (a read time needs at least one document)")
        names = {self._name(path): path for path in paths}
        request = BatchGetDocumentsRequest.pb()(database=self._database, documents=list(names))
        found: dict[str, docs.Versioned] = {}
        read_us = 0
        try:
            stream = await self.client._firestore_api.batch_get_documents(
                request=BatchGetDocumentsRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=_READ_RETRY,
                timeout=self._timeout,
            )
            async for response in stream:
                raw = response._pb
                # Every response of one BatchGetDocuments carries the same read time.
                read_us = max(read_us, raw.read_time.ToMicroseconds())
                if raw.HasField("found"):
                    fields = {name: _get_value(value) for name, value in raw.found.fields.items()}
                    found[names[raw.found.name]] = docs.Versioned(fields, raw.found.update_time.ToMicroseconds())
                elif raw.missing:
                    found[names[raw.missing]] = docs.Versioned(None, None)
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "read") from exc
        if not read_us:
            raise docs.Unavailable("read: Firestore answered a batch read without a read time")
        return read_us, found

    async def query(
        self,
        parent: str,
        collection: str,
        where: docs.Filter | Sequence[docs.Filter] | None,
        order_by: str | None,
        after: object | None,
        limit: int,
    ) -> docs.Page:
        query_type = StructuredQuery.pb()
        query = query_type()
        query.from_.add(collection_id=collection)
        filters = docs.filters_of(where)
        if len(filters) > 1:
            composite = query.where.composite_filter
            composite.op = query_type.CompositeFilter.Operator.Value("AND")
            targets = [composite.filters.add().field_filter for _ in filters]
        else:
            targets = [query.where.field_filter for _ in filters]
        for condition, wanted in zip(targets, filters, strict=True):
            condition.field.field_path = wanted.field
            condition.op = query_type.FieldFilter.Operator.Value(_OPERATORS[wanted.op])
            _set_value(condition.value, wanted.value)
        for path in ([order_by] if order_by else []) + ["__name__"]:
            query.order_by.add(direction=query_type.Direction.Value("ASCENDING")).field.field_path = path
        if after is not None:
            query.start_at.before = False
            for value in after:  # type: ignore[attr-defined]
                _set_value(query.start_at.values.add(), value)
        query.limit.value = limit
        request = RunQueryRequest.pb()(parent=self._name(parent), structured_query=query)
        page: list[tuple[str, docs.Fields]] = []
        cursor: list[Any] = []
        try:
            stream = await self.client._firestore_api.run_query(
                request=RunQueryRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=None,
                timeout=self._timeout,
            )
            async for response in stream:
                raw = response._pb
                if not raw.HasField("document"):
                    continue
                doc = raw.document
                fields = {name: _get_value(value) for name, value in doc.fields.items()}
                cursor = ([fields.get(order_by)] if order_by else []) + [_Reference(doc.name)]
                page.append((doc.name.rpartition("/")[2], fields))
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "query") from exc
        return docs.Page(page, cursor if len(page) >= limit else None)

    async def close(self) -> None:
        """Close the gRPC channel: ``AsyncClient.close()`` leaves the GAPIC transport open."""
        await self._close_listens()
        api = getattr(self.client, "_firestore_api_internal", None)
        if api is not None:
            await api.transport.close()

    # ---- listen (the sync client's watch) -------------------------------------------------------

    _watch_client: firestore.Client | None = None
    _listens: set[_Listening] | None = None

    def listen(
        self,
        parent: str,
        collection: str,
        where: Sequence[docs.Filter],
        on_change: Callable[[docs.Change], None],
        on_error: Callable[[StoreError], None],
    ) -> docs.Listening:
        if self._watch_client is None:
            # Created once, lazily: most sidecars never listen. Same project and database;
            # FIRESTORE_EMULATOR_HOST is honoured by the client itself.
            database = self._database.rpartition("/")[2]
            self._watch_client = firestore.Client(project=self.client.project, database=database)
            self._listens = set()
        assert self._listens is not None
        query: Any = self._watch_client.collection(f"{parent}/{collection}" if parent else collection)
        for condition in where:
            query = query.where(filter=FieldFilter(condition.field, _WATCH_OPERATORS[condition.op], condition.value))
        if not where:
            # A whole collection: the watch takes a Query, not a CollectionReference. ``_query()`` is
            # the collection's own plain query (what its public methods start from); an explicit
            # ``order_by(__name__)`` would change the target the watch resumes.
            query = query._query()
        listening = _Listening(asyncio.get_running_loop(), on_change, on_error, self._listens)
        listening.start(query)
        return listening

    async def _close_listens(self) -> None:
        for listening in list(self._listens or ()):
            await listening.close()
        if self._watch_client is not None:
            api = self._watch_client._firestore_api_internal
            if api is not None:
                api.transport.close()
            self._watch_client = None


class FirestoreStore(DocumentStore):
    """The ``Store`` the sidecar runs with: ``DocumentStore`` on Firestore."""

    def __init__(
        self,
        project: str,
        subscriptions: Mapping[str, SubscriptionStoreConfig],
        *,
        database: str = "(default)",
        root: str = "pubsub-sidecar",
        cursor_write_interval_ms: int = 1_000,
        rpc_timeout_seconds: float = 30.0,
        clock_ms: Callable[[], int] = wall_clock_ms,
        fences: FenceSource | None = None,
    ) -> None:
        self.project = project
        self.documents = FirestoreDocuments(project, database, rpc_timeout_seconds)
        super().__init__(
            self.documents,
            subscriptions,
            root=root,
            cursor_write_interval_ms=cursor_write_interval_ms,
            clock_ms=clock_ms,
            fences=fences,
        )


_LOGGER = logging.getLogger(__name__)
_WATCH_OPERATORS = {"EQUAL": "==", "GREATER_THAN_OR_EQUAL": ">="}
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MICROSECOND = datetime.timedelta(microseconds=1)


def _micros(moment: datetime.datetime) -> int:
    """Microseconds since the epoch, exactly (a float timestamp would round)."""
    return (moment - _EPOCH) // _MICROSECOND


def _from_client(value: Any) -> Any:
    """A value the client decoded, as ``_get_value`` decodes it (the types ``get_all`` returns)."""
    if isinstance(value, datetime.datetime):
        # DatetimeWithNanoseconds -> a plain datetime, as Timestamp.ToDatetime gives.
        return datetime.datetime(
            value.year, value.month, value.day, value.hour, value.minute, value.second, value.microsecond,
            tzinfo=datetime.UTC,
        )
    if isinstance(value, list):
        return [_from_client(item) for item in value]
    if isinstance(value, dict):
        return {name: _from_client(item) for name, item in value.items()}
    if isinstance(value, DocumentReference):
        return value._document_path
    return value


def _upsert(snapshot: Any) -> tuple[str, docs.Fields, int]:
    fields = {name: _from_client(value) for name, value in (snapshot.to_dict() or {}).items()}
    return snapshot.id, fields, _micros(snapshot.update_time)


class _Watch(Watch):
    """The official watch, also telling its ``_Listening`` when it gives up for good.

    The client only logs a final failure: ``_on_rpc_done`` closes the watch in a thread of its own
    by raising the error there (an unhandled-exception traceback). Here the error goes to
    ``on_error`` instead and the watch is closed quietly. Transient failures never get here: the
    client recovers from them itself, resuming from its last resume token.
    """

    def _on_rpc_done(self, future: Any) -> None:
        owner = getattr(self._snapshot_callback, "__self__", None)
        if not isinstance(owner, _Listening) or future is None:
            super()._on_rpc_done(future)  # type: ignore[no-untyped-call]  # the client's watch is untyped
            return
        owner.failed(future)
        threading.Thread(name="firestore-watch-close", target=self.close, daemon=True).start()


class _Listening:
    """One ``FirestoreDocuments.listen``: the watch, and the hop from its thread onto the loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[docs.Change], None],
        on_error: Callable[[StoreError], None],
        registry: set[_Listening],
    ) -> None:
        self._loop = loop
        self._on_change = on_change
        self._on_error = on_error
        self._registry = registry
        self._watch: Watch | None = None
        self._pushed = False
        self._closed = threading.Event()

    def start(self, query: Any) -> None:
        self._registry.add(self)
        self._watch = _Watch.for_query(query, self.snapshot, DocumentSnapshot)  # type: ignore[no-untyped-call]

    def snapshot(self, documents: list[Any], changes: list[Any], read_time: datetime.datetime) -> None:
        """The watch's callback, on its consumer thread: decode here, deliver on the loop."""
        if self._closed.is_set():
            return
        if not self._pushed:
            change = docs.Change([_upsert(d) for d in documents], [], _micros(read_time), True)
            self._pushed = True
        else:
            upserts = [_upsert(c.document) for c in changes if c.type != ChangeType.REMOVED]
            removals = [c.document.id for c in changes if c.type == ChangeType.REMOVED]
            change = docs.Change(upserts, removals, _micros(read_time), False)
        self._hop(self._deliver, change)

    def failed(self, error: Any) -> None:
        """The watch gave up (a non-retryable status): tell ``on_error`` on the loop."""
        if isinstance(error, grpc.RpcError):
            error = core_exceptions.from_grpc_error(error)  # type: ignore[no-untyped-call]
        if isinstance(error, BaseException):
            translated = _translate(error, "listen")
        else:
            translated = docs.Unavailable(f"listen: the watch ended: {error!r}")
        self._hop(self._fail, translated)

    def _hop(self, callback: Callable[[Any], None], argument: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, argument)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            _LOGGER.debug("listen: dropped a snapshot after the event loop closed")

    def _deliver(self, change: docs.Change) -> None:
        if not self._closed.is_set():
            self._on_change(change)

    def _fail(self, error: StoreError) -> None:
        if not self._closed.is_set():
            self._on_error(error)

    async def close(self) -> None:
        """Unsubscribe and wait for the watch's threads to end; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._registry.discard(self)
        watch, self._watch = self._watch, None
        if watch is not None:
            # Joins the consumer thread (up to a second): off the loop.
            await asyncio.to_thread(watch.close)
