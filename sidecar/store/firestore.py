"""Firestore behind ``sidecar.store.documents``: the one module of ours that imports google-cloud-firestore.

``FirestoreDocuments`` turns the store's plain writes into raw Firestore protobufs and sends them
through the official ``AsyncClient``'s own GAPIC client (``AsyncClient._firestore_api``, with the
client's channel, credentials, emulator handling and request metadata): the async client has no
BulkWriter, and its snapshot decoding costs ~250 us per document, too slow to load 100,000 pending
messages. The two private attributes are read in one place and checked at construction, so that a
library change fails at start, not mid-run. ``FIRESTORE_EMULATOR_HOST`` is honoured by the client.

What is Google-free lives beside it, and takes what this module gives it: the values, writes and
queries as raw protobufs (``sidecar.store.firestore_codec``), the Listen protocol's snapshots as
deltas (``sidecar.store.listen_protocol``; ``_Listening`` here keeps the stream open and resumes
it). Errors are translated once, by ``sidecar.store.firestore_errors`` (which imports api_core,
not this library); FAILED_PRECONDITION from a Commit (an ``update_time`` precondition) ->
``documents.PreconditionFailed``. ``check_deployment`` reads the admin API once at start.

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
import functools
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from google.api_core import exceptions as core_exceptions
from google.api_core import gapic_v1
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
from sidecar.store.firestore_codec import add_filters, build_query, cursor_after, encode_write, fields_of
from sidecar.store.firestore_errors import (
    BLIPS,
    CALL_ERRORS,
    READ_RETRY,
    RETRYABLE,
    TERMINAL,
    listen_failure,
    translate,
    translate_grpc,
)
from sidecar.store.listen_protocol import TARGET_ID, ListenRemoved, ListenSnapshots

_T = TypeVar("_T")

_TRANSACTION_STEP_ATTEMPTS = 3
"""Tries of a fenced commit's BeginTransaction, and of its read of the fences, on a blip: both are
idempotent (a Begin whose answer was lost leaves a transaction that holds nothing; a read again in
the same transaction reads the same), so under an error rate a fenced commit fails about as often
as its Commit alone, not as often as any of its three calls. ABORTED is not retried here: it ends
the transaction, and the caller begins another."""

_FENCE_ATTEMPTS = 5
"""Tries of a fenced commit's transaction on ABORTED, as the official client's transactions (5)."""

_ROLLBACK_ATTEMPTS = 6
"""Tries of a Rollback while Firestore is unavailable (about 2 s with ``_fence_backoff_seconds``)."""


async def _step(call: Callable[[], Awaitable[_T]]) -> _T:
    """``call()`` (an idempotent step of a fenced commit), tried again at once on a blip."""
    for attempt in range(_TRANSACTION_STEP_ATTEMPTS - 1):
        try:
            return await call()
        except BLIPS:
            await asyncio.sleep(_fence_backoff_seconds(attempt))
    return await call()


def _fence_backoff_seconds(attempt: int) -> float:
    """Before a fenced commit's next try: capped exponential with jitter, 50 ms to 1 s."""
    return backoff_seconds(attempt, 0.05, 1.0)


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

    def _call(self, method: str, request_type: Any, request: Any, retry: Any = None) -> Awaitable[Any]:
        """The client's GAPIC ``method`` on the raw ``request`` (wrapped as ``request_type``), with the
        client's metadata and our timeout; not retried unless ``retry`` says so."""
        call = getattr(self.client._firestore_api, method)
        return call(  # type: ignore[no-any-return]
            request=request_type.wrap(request), metadata=self.client._rpc_metadata, retry=retry, timeout=self._timeout
        )

    def _name(self, relative_path: str) -> str:
        return self._documents + relative_path

    def _write(self, write: docs.Write) -> Any:
        return encode_write(write, self._name(write.path), self._WRITE, self._DOCUMENT)

    async def commit(self, writes: Sequence[docs.Write], fences: Sequence[docs.Fence] = ()) -> None:
        if fences:
            await self._fenced_commit(writes, fences)
            return
        request = CommitRequest.pb()(database=self._database, writes=[self._write(w) for w in writes])
        try:
            await self._call("commit", CommitRequest, request)
        except core_exceptions.FailedPrecondition as exc:
            # On a Commit (no query, so no missing index) this is an update_time precondition.
            raise docs.PreconditionFailed(f"commit: {exc}") from exc
        except CALL_ERRORS as exc:
            raise translate(exc, "commit") from exc

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
            except CALL_ERRORS as exc:
                raise translate(exc, "fenced commit") from exc
            try:
                found = await _step(functools.partial(self._batch_get, paths, transaction))
                failed = docs.failed_fences(fences, found)
                if failed:
                    await self._rollback(transaction)
                    raise docs.fenced_error("commit", failed)
                request = CommitRequest.pb()(
                    database=self._database, writes=[self._write(w) for w in writes], transaction=transaction
                )
                await self._call("commit", CommitRequest, request)
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
            except CALL_ERRORS as exc:
                await self._rollback(transaction)
                raise translate(exc, "fenced commit") from exc
        raise docs.Unavailable(f"fenced commit: transaction aborted {_FENCE_ATTEMPTS} times: {aborted}")

    async def _begin(self, retry_of: bytes) -> bytes:
        """BeginTransaction (read-write; retrying ``retry_of`` keeps its age). Not retried here."""
        request = BeginTransactionRequest.pb()(database=self._database)
        request.options.read_write.SetInParent()
        if retry_of:
            request.options.read_write.retry_transaction = retry_of
        response = await self._call("begin_transaction", BeginTransactionRequest, request)
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
                await self._call("rollback", RollbackRequest, request)
                return
            except RETRYABLE:
                continue
            except TERMINAL:
                return  # unknown, expired or refused: nothing of it is held any more
        _LOGGER.warning(
            "firestore: a fenced commit's transaction could not be rolled back after %d tries; "
            "its locks lapse when it expires",
            _ROLLBACK_ATTEMPTS,
        )

    async def batch_write(self, writes: Sequence[docs.Write]) -> list[tuple[int, str]]:
        request = BatchWriteRequest.pb()(database=self._database, writes=[self._write(w) for w in writes])
        try:
            response = await self._call("batch_write", BatchWriteRequest, request)
        except CALL_ERRORS as exc:
            raise translate(exc, "batch write") from exc
        return [(status.code, status.message) for status in response._pb.status]

    async def get_all(self, paths: Sequence[str]) -> dict[str, docs.Fields | None]:
        if not paths:
            return {}
        try:
            return await self._batch_get(paths, b"")
        except CALL_ERRORS as exc:
            raise translate(exc, "read") from exc

    async def _batch_get(self, paths: Sequence[str], transaction: bytes) -> dict[str, docs.Fields | None]:
        """BatchGetDocuments (inside ``transaction`` when given: not retried here, its ABORTED ends it)."""
        names = {self._name(path): path for path in paths}
        request = BatchGetDocumentsRequest.pb()(database=self._database, documents=list(names))
        if transaction:
            request.transaction = transaction
        found: dict[str, docs.Fields | None] = {}
        stream = await self._call(
            "batch_get_documents", BatchGetDocumentsRequest, request, None if transaction else READ_RETRY
        )
        async for response in stream:
            raw = response._pb
            if raw.HasField("found"):
                found[names[raw.found.name]] = fields_of(raw.found)
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
            stream = await self._call("batch_get_documents", BatchGetDocumentsRequest, request, READ_RETRY)
            async for response in stream:
                raw = response._pb
                # Every response of one BatchGetDocuments carries the same read time.
                read_us = max(read_us, raw.read_time.ToMicroseconds())
                if raw.HasField("found"):
                    found[names[raw.found.name]] = docs.Versioned(
                        fields_of(raw.found), raw.found.update_time.ToMicroseconds()
                    )
                elif raw.missing:
                    found[names[raw.missing]] = docs.Versioned(None, None)
        except CALL_ERRORS as exc:
            raise translate(exc, "read") from exc
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
        query = build_query(StructuredQuery.pb(), collection, where, order_by, after, limit)
        request = RunQueryRequest.pb()(parent=self._name(parent), structured_query=query)
        page: list[tuple[str, docs.Fields]] = []
        cursor: list[Any] = []
        try:
            call = self._run_query()(request, metadata=self._query_metadata(request.parent), timeout=self._timeout)
            async for raw in call:
                if not raw.HasField("document"):
                    continue
                doc = raw.document
                fields = fields_of(doc)
                cursor = cursor_after(doc, fields, order_by)
                page.append((doc.name.rpartition("/")[2], fields))
        except grpc.aio.AioRpcError as exc:
            raise translate_grpc(exc, "query") from exc
        except CALL_ERRORS as exc:
            raise translate(exc, "query") from exc
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
        add_filters(query, list(where))
        target = Target.pb()(target_id=TARGET_ID)
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

_LISTEN_RETRY_INITIAL_SECONDS = 0.1
_LISTEN_RETRY_MAXIMUM_SECONDS = 10.0


class _Listening:
    """One ``FirestoreDocuments.listen``: a Listen stream kept open, its responses handed to a
    ``ListenSnapshots`` (``sidecar.store.listen_protocol``: the protocol's state and rules), each
    snapshot it completes handed to ``on_change`` on the caller's event loop.

    A stream that fails with a transient status is reopened with the resume token of the last
    snapshot handed over (capped backoff with jitter). A permanent status (``firestore_errors.LISTEN_PERMANENT``) or
    a REMOVE with a cause ends it through ``on_error``.
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
        self._snapshots = ListenSnapshots()
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
            except CALL_ERRORS as exc:
                failure = listen_failure(exc)
                if failure is not None:
                    self._fail(failure)
                    return
                _LOGGER.info("listen stream ended (%s); resuming", exc)
            except ListenRemoved as exc:
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
        resume_token = self._snapshots.new_stream()
        if resume_token:
            target.resume_token = resume_token
        request = ListenRequest.pb()(database=self._owner._database, add_target=target)
        stop = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield ListenRequest.wrap(request)
            await stop.wait()  # keep the stream open: Listen ends when the client half-closes

        try:
            stream = await self._owner._listen_stream(requests())
            async for response in stream:
                batch = self._snapshots.receive(response._pb)
                if batch is not None and not self.closed:
                    self._on_change(batch)
        finally:
            stop.set()
        return self._snapshots.delivered


async def check_deployment(project: str, database: str, log: logging.Logger, timeout_seconds: float = 10.0) -> None:
    """Log one summary warning of the missing index exemptions and TTL policy (``sidecar.store.deployment``);
    never raises.

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
