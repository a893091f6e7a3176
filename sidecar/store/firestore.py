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
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.api_core import exceptions as core_exceptions
from google.api_core import retry_async
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.types import (
    BatchGetDocumentsRequest,
    BatchWriteRequest,
    CommitRequest,
    Document,
    RunQueryRequest,
    StructuredQuery,
    Value,
    Write,
)

from sidecar.store import documents as docs
from sidecar.store.api import StoreError, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore, wall_clock_ms

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

    async def commit(self, writes: Sequence[docs.Write]) -> None:
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
        names = {self._name(path): path for path in paths}
        request = BatchGetDocumentsRequest.pb()(database=self._database, documents=list(names))
        found: dict[str, docs.Fields | None] = {}
        try:
            stream = await self.client._firestore_api.batch_get_documents(
                request=BatchGetDocumentsRequest.wrap(request),
                metadata=self.client._rpc_metadata,
                retry=_READ_RETRY,
                timeout=self._timeout,
            )
            async for response in stream:
                raw = response._pb
                if raw.HasField("found"):
                    fields = {name: _get_value(value) for name, value in raw.found.fields.items()}
                    found[names[raw.found.name]] = fields
                elif raw.missing:
                    found[names[raw.missing]] = None
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, "read") from exc
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
        where: docs.Filter | None,
        order_by: str | None,
        after: object | None,
        limit: int,
    ) -> docs.Page:
        query_type = StructuredQuery.pb()
        query = query_type()
        query.from_.add(collection_id=collection)
        if where is not None:
            condition = query.where.field_filter
            condition.field.field_path = where.field
            condition.op = query_type.FieldFilter.Operator.Value(_OPERATORS[where.op])
            _set_value(condition.value, where.value)
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
        api = getattr(self.client, "_firestore_api_internal", None)
        if api is not None:
            await api.transport.close()


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
    ) -> None:
        self.project = project
        self.documents = FirestoreDocuments(project, database, rpc_timeout_seconds)
        super().__init__(
            self.documents,
            subscriptions,
            root=root,
            cursor_write_interval_ms=cursor_write_interval_ms,
            clock_ms=clock_ms,
        )
