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

``listen`` opens the Listen RPC through the same GAPIC client and keeps the protocol's state itself
(``_Listening``: consistent snapshots, resume tokens, reconnects with backoff), handing each snapshot
to the caller as a delta; the official sync client's ``Watch`` rebuilds its whole result set per
snapshot on a thread of its own, which a backlog in an inbox made the sidecar's main cost.

**Fenced commits** (``commit(writes, fences)``) run as one read-write transaction: BeginTransaction,
BatchGetDocuments of the fence documents in it, compare, then Commit with the transaction id
(or Rollback and ``documents.Fenced``). The transaction is begun on its own, before any read, so
that its id is known before it holds a lock: a read that began it (``new_transaction``) would save
a round trip, but when that read's answer is lost (UNAVAILABLE after the server applied it) the
transaction holds read locks on the lease documents that no one can roll back until it expires
(60 s idle), holding up lease renewals and every later fenced Commit of the shard. Every failure
after the begin rolls the transaction back, retried while Firestore is unavailable.

Sound with Firestore's primitives because read-write transactions are serializable: a Commit that
succeeds read each fence document at a version that no later committed write preceded, so a lease
that changed hands before the Commit fails the transaction instead of letting the old owner write
(``sidecar.store.fencing`` gives the whole argument). Production holds pessimistic read locks until
the Commit, so the lease write waits; our emulator validates optimistically
(``sidecar/emulators/firestore/transactions.py``: a Commit whose read document changed is ABORTED).
ABORTED (contention, lock timeout) retries the whole transaction
``_FENCE_ATTEMPTS`` times with backoff, passing ``retry_transaction`` so that it keeps its age, then
raises ``documents.Unavailable``. Without fences a Commit is the plain Commit it always was (no
transaction, no extra read).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.api_core import exceptions as core_exceptions
from google.api_core import gapic_v1, retry_async
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.types import (
    BatchGetDocumentsRequest,
    BatchWriteRequest,
    BeginTransactionRequest,
    CommitRequest,
    Document,
    ListenRequest,
    RollbackRequest,
    RunQueryRequest,
    RunQueryResponse,
    StructuredQuery,
    Target,
    Value,
    Write,
)

from sidecar.backoff import backoff_seconds
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

_T = TypeVar("_T")

_TRANSACTION_STEP_ATTEMPTS = 3
"""Tries of a fenced commit's BeginTransaction, and of its read of the fences, on a blip: both are
idempotent (a Begin whose answer was lost leaves a transaction that holds nothing; a read again in
the same transaction reads the same), so under an error rate a fenced commit fails about as often
as its Commit alone, not as often as any of its three calls. ABORTED is not retried here: it ends
the transaction, and the caller begins another."""

_BLIPS: tuple[type[BaseException], ...] = (
    core_exceptions.ServiceUnavailable,
    core_exceptions.DeadlineExceeded,
    core_exceptions.InternalServerError,
)


_FENCE_ATTEMPTS = 5
"""Tries of a fenced commit's transaction on ABORTED, as the official client's transactions (5)."""

_ROLLBACK_ATTEMPTS = 6
"""Tries of a Rollback while Firestore is unavailable (about 2 s with ``_fence_backoff_seconds``)."""


async def _step(call: Callable[[], Awaitable[_T]]) -> _T:
    """``call()`` (an idempotent step of a fenced commit), tried again at once on a blip."""
    for attempt in range(_TRANSACTION_STEP_ATTEMPTS - 1):
        try:
            return await call()
        except _BLIPS:
            await asyncio.sleep(_fence_backoff_seconds(attempt))
    return await call()


def _fence_backoff_seconds(attempt: int) -> float:
    """Before a fenced commit's next try: capped exponential with jitter, 50 ms to 1 s."""
    return backoff_seconds(attempt, 0.05, 1.0)


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
    elif isinstance(value, dict):
        mapped = target.map_value
        mapped.SetInParent()
        for name, item in value.items():
            _set_value(mapped.fields[name], item)
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


_OPERATORS = {"EQUAL": "EQUAL", "GREATER_THAN_OR_EQUAL": "GREATER_THAN_OR_EQUAL", "LESS_THAN": "LESS_THAN"}


def _add_filters(query: Any, filters: list[docs.Filter]) -> None:
    """``filters`` (all must hold) as the raw StructuredQuery's ``where``."""
    query_type = type(query)
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
        self._run_query_call: Any = None

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
        """One read-write transaction: begin, read the fences, compare, commit (module docstring)."""
        paths = list(dict.fromkeys(fence.path for fence in fences))
        retry_of = b""
        aborted: BaseException | None = None
        for attempt in range(_FENCE_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_fence_backoff_seconds(attempt - 1))
            try:
                # Before any read: a lost answer here leaves a transaction that holds no lock.
                transaction = await _step(functools.partial(self._begin, retry_of))
            except (*_RETRYABLE, *_TERMINAL) as exc:
                raise _translate(exc, "fenced commit") from exc
            try:
                found = await _step(functools.partial(self._batch_get, paths, transaction))
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
                # Usually the server ended it already; the Rollback makes sure no read of it lingers.
                # The retry keeps its age.
                aborted, retry_of = exc, transaction
                await self._rollback(transaction)
            except core_exceptions.FailedPrecondition as exc:
                # The Commit's (no query, so no missing index): an update_time precondition.
                await self._rollback(transaction)
                raise docs.PreconditionFailed(f"fenced commit: {exc}") from exc
            except (*_RETRYABLE, *_TERMINAL) as exc:
                await self._rollback(transaction)
                raise _translate(exc, "fenced commit") from exc
        raise docs.Unavailable(f"fenced commit: transaction aborted {_FENCE_ATTEMPTS} times: {aborted}")

    async def _begin(self, retry_of: bytes) -> bytes:
        """BeginTransaction (read-write; retrying ``retry_of`` keeps its age). Not retried here."""
        request = BeginTransactionRequest.pb()(database=self._database)
        request.options.read_write.SetInParent()
        if retry_of:
            request.options.read_write.retry_transaction = retry_of
        response = await self.client._firestore_api.begin_transaction(
            request=BeginTransactionRequest.wrap(request),
            metadata=self.client._rpc_metadata,
            retry=None,
            timeout=self._timeout,
        )
        return bytes(response._pb.transaction)

    async def _rollback(self, transaction: bytes) -> None:
        """Roll ``transaction`` back, retried while Firestore is unavailable (``_ROLLBACK_ATTEMPTS``):
        an abandoned read-write transaction keeps its locks on the fence documents until it expires
        (60 s idle), and those locks hold up the lease renewals and every later fenced Commit. An
        answer that the transaction is unknown or expired means it is over: done."""
        for attempt in range(_ROLLBACK_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_fence_backoff_seconds(attempt - 1))
            request = RollbackRequest.pb()(database=self._database, transaction=transaction)
            try:
                await self.client._firestore_api.rollback(
                    request=RollbackRequest.wrap(request),
                    metadata=self.client._rpc_metadata,
                    retry=None,
                    timeout=self._timeout,
                )
                return
            except _RETRYABLE:
                continue
            except _TERMINAL:
                return  # unknown, expired or refused: nothing of it is held any more
        _LOGGER.warning(
            "firestore: a fenced commit's transaction could not be rolled back after %d tries; "
            "its locks lapse when it expires",
            _ROLLBACK_ATTEMPTS,
        )

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
        """BatchGetDocuments (inside ``transaction`` when given: not retried here, its ABORTED ends it)."""
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
        _add_filters(query, docs.filters_of(where))
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
            call = self._run_query()(request, metadata=self._query_metadata(request.parent), timeout=self._timeout)
            async for raw in call:
                if not raw.HasField("document"):
                    continue
                doc = raw.document
                fields = {name: _get_value(value) for name, value in doc.fields.items()}
                cursor = ([fields.get(order_by)] if order_by else []) + [_Reference(doc.name)]
                page.append((doc.name.rpartition("/")[2], fields))
        except grpc.aio.AioRpcError as exc:
            raise _translate(core_exceptions.from_grpc_error(exc), "query") from exc  # type: ignore[no-untyped-call]
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "query") from exc
        return docs.Page(page, cursor if len(page) >= limit else None)

    def _run_query(self) -> Any:
        """RunQuery on the client's own channel (credentials, emulator host), answering raw
        protobufs: the GAPIC method wraps every streamed document in a proto-plus message first,
        about a sixth of a load's CPU at 100,000 documents, for nothing we use."""
        if self._run_query_call is None:
            channel = self.client._firestore_api.transport.grpc_channel
            self._run_query_call = channel.unary_stream(
                "/google.firestore.v1.Firestore/RunQuery",
                request_serializer=RunQueryRequest.pb().SerializeToString,
                response_deserializer=RunQueryResponse.pb().FromString,
            )
        return self._run_query_call

    def _query_metadata(self, parent: str) -> list[tuple[str, str]]:
        """What the GAPIC method sends: the client's metadata and the routing header."""
        routing = gapic_v1.routing_header.to_grpc_metadata((("parent", parent),))  # type: ignore[no-untyped-call]
        return [*self.client._rpc_metadata, routing]

    async def close(self) -> None:
        """Close the gRPC channel: ``AsyncClient.close()`` leaves the GAPIC transport open."""
        await self._close_listens()
        api = getattr(self.client, "_firestore_api_internal", None)
        if api is not None:
            await api.transport.close()

    # ---- listen (the Listen RPC, deltas only) -----------------------------------------------------

    _listens: set[_Listening] | None = None

    def listen(
        self,
        parent: str,
        collection: str,
        where: Sequence[docs.Filter],
        on_change: Callable[[docs.Change], None],
        on_error: Callable[[StoreError], None],
    ) -> docs.Listening:
        if self._listens is None:
            self._listens = set()
        query = StructuredQuery.pb()()
        query.from_.add(collection_id=collection)
        _add_filters(query, list(where))
        target = Target.pb()(target_id=_TARGET_ID)
        target.query.parent = self._name(parent) if parent else self._documents.rstrip("/")
        target.query.structured_query.CopyFrom(query)
        listening = _Listening(self, target, on_change, on_error, self._listens)
        listening.start()
        return listening

    def _listen_stream(self, requests: AsyncIterator[Any]) -> Awaitable[AsyncIterable[Any]]:
        return self.client._firestore_api.listen(  # type: ignore[no-any-return]
            requests=requests, metadata=self.client._rpc_metadata
        )

    async def _close_listens(self) -> None:
        for listening in list(self._listens or ()):
            await listening.close()


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

_TARGET_ID = 1
"""One target per Listen stream: each ``listen`` call is its own stream."""

_LISTEN_RETRY_INITIAL_SECONDS = 0.1
_LISTEN_RETRY_MAXIMUM_SECONDS = 10.0
_LISTEN_PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Listen failures that a reconnect does not cure: reported through ``on_error``."""


def _micros_of(timestamp: Any) -> int:
    return int(timestamp.seconds) * 1_000_000 + int(timestamp.nanos) // 1000


class _Listening:
    """One ``FirestoreDocuments.listen``: a Listen stream kept open (resumed after failures), turned
    into ``docs.Change`` deltas on the caller's event loop.

    The official client's ``Watch`` (sync client) rebuilds and re-sorts its whole result set on every
    snapshot, on a thread of its own; an inbox holding a backlog of N pending documents then costs
    O(N log N) Python work per change, with the GIL taken from the event loop. Here a change costs
    O(1): the protocol is the one ``watch.py`` follows (and our emulator serves), processed as deltas.

    - Changes (DocumentChange, DocumentDelete, DocumentRemove) accumulate until a TargetChange
      NO_CHANGE with no target ids and a read time marks a consistent snapshot, once the target is
      CURRENT; then one ``Change`` goes out. RESET forgets what was sent: the server resends the set.
    - The resume token of the last CURRENT/NO_CHANGE is kept once the snapshot it precedes was
      handed over (the official watch keeps it at ``push`` alike); a stream that fails with a
      transient status is reopened with it (capped backoff with jitter), so only changes since are
      resent. A token taken earlier would let a stream that fails between a CURRENT and its snapshot
      resume past changes never handed over (a first snapshot's whole result set among them).
      A permanent status (``_LISTEN_PERMANENT``) or a REMOVE with a cause ends it through ``on_error``.
    - ``initial`` is True for the first snapshot of a stream opened without a resume token (the full
      result set), False for every later one, resumed streams included.
    """

    def __init__(
        self,
        owner: FirestoreDocuments,
        target: Any,
        on_change: Callable[[docs.Change], None],
        on_error: Callable[[StoreError], None],
        registry: set[_Listening],
    ) -> None:
        self._owner = owner
        self._target = target
        self._on_change = on_change
        self._on_error = on_error
        self._registry = registry
        self._task: asyncio.Task[None] | None = None
        self._resume_token = b""
        self._in_result: set[str] = set()
        self.closed = False

    def start(self) -> None:
        self._registry.add(self)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="firestore-listen")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._registry.discard(self)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        attempt = 0
        while not self.closed:
            try:
                if await self._one_stream():
                    attempt = 0
            except asyncio.CancelledError:
                raise
            except (*_RETRYABLE, *_TERMINAL) as exc:
                code = exc.grpc_status_code if isinstance(exc, core_exceptions.GoogleAPICallError) else None
                if isinstance(exc, grpc.aio.AioRpcError):
                    code = exc.code()
                if code in _LISTEN_PERMANENT or isinstance(exc, auth_exceptions.GoogleAuthError):
                    self._fail(_translate(exc, "listen"))
                    return
                _LOGGER.info("listen stream ended (%s); resuming", exc)
            except _ListenRemoved as exc:
                self._fail(exc.error)
                return
            await asyncio.sleep(backoff_seconds(attempt, _LISTEN_RETRY_INITIAL_SECONDS, _LISTEN_RETRY_MAXIMUM_SECONDS))
            attempt += 1

    def _fail(self, error: StoreError) -> None:
        if not self.closed:
            self.closed = True
            self._registry.discard(self)
            self._on_error(error)

    async def _one_stream(self) -> bool:
        """One Listen stream until it ends; True if it delivered at least one snapshot."""
        target = type(self._target)()
        target.CopyFrom(self._target)
        resumed = bool(self._resume_token)
        if resumed:
            target.resume_token = self._resume_token
        request = ListenRequest.pb()(database=self._owner._database, add_target=target)
        stop = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield ListenRequest.wrap(request)
            await stop.wait()  # keep the stream open: Listen ends when the client half-closes

        delivered = False
        initial = not resumed
        current = False
        upserts: dict[str, tuple[docs.Fields, int]] = {}
        removals: set[str] = set()
        token = b""  # the latest resume token, kept once the changes it covers are handed over
        try:
            stream = await self._owner._listen_stream(requests())
            async for response in stream:
                raw = response._pb
                kind = raw.WhichOneof("response_type")
                if kind == "document_change":
                    change = raw.document_change
                    doc_id = change.document.name.rpartition("/")[2]
                    if _TARGET_ID in change.target_ids:
                        fields = {name: _get_value(value) for name, value in change.document.fields.items()}
                        upserts[doc_id] = (fields, _micros_of(change.document.update_time))
                        removals.discard(doc_id)
                    elif _TARGET_ID in change.removed_target_ids:
                        upserts.pop(doc_id, None)
                        removals.add(doc_id)
                elif kind in ("document_delete", "document_remove"):
                    doc_id = getattr(raw, kind).document.rpartition("/")[2]
                    upserts.pop(doc_id, None)
                    removals.add(doc_id)
                elif kind == "target_change":
                    change = raw.target_change
                    change_type = change.target_change_type
                    if change_type == change.TargetChangeType.REMOVE:
                        raise _ListenRemoved(change.cause.code, change.cause.message)
                    if change_type == change.TargetChangeType.RESET:
                        upserts.clear()
                        removals = set(self._in_result)
                        token = b""
                        continue
                    if change_type == change.TargetChangeType.CURRENT:
                        current = True
                    if change.resume_token and (change_type != change.TargetChangeType.NO_CHANGE or current):
                        token = bytes(change.resume_token)
                    global_snapshot = change_type == change.TargetChangeType.NO_CHANGE and not change.target_ids
                    if global_snapshot and current and change.HasField("read_time"):
                        removals -= set(upserts)
                        gone = [doc_id for doc_id in removals if doc_id in self._in_result]
                        if upserts or gone or initial:
                            self._in_result.difference_update(gone)
                            self._in_result.update(upserts)
                            batch = docs.Change(
                                [(doc_id, f, t) for doc_id, (f, t) in upserts.items()],
                                gone,
                                _micros_of(change.read_time),
                                initial,
                            )
                            if not self.closed:
                                self._on_change(batch)
                        delivered = True
                        initial = False
                        upserts, removals = {}, set()
                        if token:
                            self._resume_token, token = token, b""
        finally:
            stop.set()
        return delivered


class _ListenRemoved(Exception):
    """The server removed the target (a TargetChange REMOVE): the cause becomes ``on_error``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.error: StoreError = docs.Misconfigured(f"listen: target removed by the server ({code}): {message}")


async def check_deployment(project: str, database: str, log: logging.Logger, timeout_seconds: float = 10.0) -> None:
    """Log a warning per missing index exemption or TTL policy (``sidecar.store.deployment``); never raises.

    Reads each field through the FirestoreAdmin API (the emulator's when ``FIRESTORE_EMULATOR_HOST``
    is set). A refused or unreachable admin API gives one warning saying so and which role grants it.
    """
    # Imported here: only this start-up check uses the admin client, and this keeps it in one place.
    from google.cloud.firestore_admin_v1.services.firestore_admin import FirestoreAdminAsyncClient
    from google.cloud.firestore_admin_v1.services.firestore_admin.transports import FirestoreAdminGrpcAsyncIOTransport
    from google.cloud.firestore_admin_v1.types import Field

    from sidecar.store import deployment

    pairs = deployment.fields_to_check()
    answers: list[Any] = []
    emulator = os.environ.get("FIRESTORE_EMULATOR_HOST")
    channel = grpc.aio.insecure_channel(emulator) if emulator else None
    try:
        if channel is not None:
            admin = FirestoreAdminAsyncClient(transport=FirestoreAdminGrpcAsyncIOTransport(channel=channel))
        else:
            admin = FirestoreAdminAsyncClient()
        groups = f"projects/{project}/databases/{database}/collectionGroups"
        answers = await asyncio.gather(
            *(admin.get_field(name=f"{groups}/{g}/fields/{f}", retry=None, timeout=timeout_seconds) for g, f in pairs),
            return_exceptions=True,
        )
    except Exception as exc:  # credentials missing, bad endpoint: the check is best effort
        answers = [exc]
    finally:
        if channel is not None:
            await channel.close()
    failure = next((a for a in answers if isinstance(a, BaseException)), None)
    if isinstance(failure, asyncio.CancelledError):
        raise failure
    if failure is not None:
        log.warning(deployment.unverifiable_warning(database, f"{type(failure).__name__}: {failure}"))
        return
    states = {
        pair: deployment.FieldState(
            exempted=not field.index_config.uses_ancestor_config and not field.index_config.indexes,
            ttl_active=field.ttl_config.state == Field.TtlConfig.State.ACTIVE,
        )
        for pair, field in zip(pairs, answers, strict=True)
    }
    for warning in deployment.deployment_warnings(states, database):
        log.warning(warning)
