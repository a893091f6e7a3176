"""The durable store on Firestore (google-cloud-firestore's AsyncClient): the one module that talks to it.

Model, under the root collection (default ``pubsub-sidecar``), per subscription ``{root}/{name}``:

- ``{root}/{name}``: the subscription document: ``mode`` (a subscription stored in one ordering mode
  is refused in another) and ``clean_ms``, the checkpoint of the cursor documents (below).
- ``{root}/{name}/messages/{id}``: one document per message, ``id`` = hash(key, sequence) in sequence
  mode, else hash(dedup id) (``sidecar.store_codec``). ``state`` is ``pending`` until the message is
  acked, dead-lettered or dropped; it then becomes a *tombstone*: data and attributes are removed,
  identity and fingerprint stay (so a late redelivery is still a duplicate) and ``expire_at`` =
  now + dedup TTL is set for a Firestore TTL policy on ``expire_at``. Pending documents never carry
  ``expire_at``: TTL never deletes an undelivered message. Data over ~1 MB lives in
  ``messages/{id}/chunks/{nnn}``, written in the same atomic Commit as the main document.
- ``{root}/{name}/keys/{hash(key)}``: the key's cursor (next sequence, or last acked position, and
  the highest dead-lettered position), with ``expire_at`` = last write + dedup TTL.

Writes, and why:

- ``persist`` creates documents with an ``exists=false`` precondition through **BatchWrite**, which
  reports a status per write: a duplicate is a refused create, decided by Firestore, and it does not
  fail its neighbours as it would in an atomic Commit. The async client has no BulkWriter, so the
  store calls the BatchWrite RPC of the client's own GAPIC client (``AsyncClient._firestore_api``,
  with the client's channel, credentials and emulator handling, and its request metadata): the two
  private attributes are read in one place (``_RawFirestore``). Chunked messages use Commit.
  ``load`` runs its queries the same way and decodes the raw protobufs itself (the client's
  snapshot decoding cost ~250 us per document, too slow for 100,000 pending messages).
  ALREADY_EXISTS is a DUPLICATE; in sequence mode the existing documents are read in one batched get
  and a different fingerprint is a CONFLICT. When a write RPC failed without an answer (it may have
  applied), each document's writer token is remembered: a later ALREADY_EXISTS whose stored token
  matches was our own create, and is STORED (the engine has not seen it yet).
- ``commit_acks``/``mark_done`` write tombstones in atomic Commits and return only once they are
  durable. Cursor documents are coalesced (``sidecar.store_cursors``): a key's cursor is written in
  the same Commit as its tombstones only if its previous write is at least a second old, otherwise
  it stays dirty and a later Commit or the background flush writes it. The checkpoint ``clean_ms``
  says up to when all cursors are written; ``load`` folds in the cursors recorded on tombstones
  finished since then, so an ack confirmed before a crash is never lost to a lagging cursor.

Cost per delivered message in steady state: 1 write (create) + 1 write (tombstone) + at most one
cursor write per key per second (about 0.1 per message at 10 messages/s per key), and no reads.
Extra: +1 read per duplicate in sequence mode, +2 x chunks for a chunked message (create and
delete), and at ``load`` one read per document returned.

Errors from Google's libraries are translated here, once: ``_RETRYABLE`` -> ``StoreUnavailable``;
``_INPUT_ERRORS`` (the request itself was refused) -> ``StoreRejected``; anything else (permission,
missing database or index) is a configuration problem: ``StoreRejected`` from ``load``/acks (loud),
but ``StoreUnavailable`` from ``persist``, so that a misconfiguration never dead-letters data.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.api_core import exceptions as core_exceptions
from google.api_core import retry_async
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.types import (
    BatchWriteRequest,
    CommitRequest,
    Document,
    RunQueryRequest,
    StructuredQuery,
    Value,
    Write,
)

from sidecar import store_codec as codec
from sidecar.engine.types import AckIntent, DeadLetterPolicy, EngineSnapshot, Message, Mode
from sidecar.store_api import (
    IncomingMessage,
    PersistOutcome,
    PersistResult,
    StoreError,
    StoreRejected,
    StoreUnavailable,
)
from sidecar.store_cursors import (
    CursorBook,
    KeyState,
    cursor_fields,
    key_cursor,
    merge_tombstone,
    state_from_cursor_doc,
    step_dead_letter,
)

_LOGGER = logging.getLogger(__name__)

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

_RETRYABLE_CODES = frozenset({1, 2, 4, 8, 10, 13, 14})
"""Per-write statuses of BatchWrite that are transient (CANCELLED .. UNAVAILABLE)."""
_INPUT_CODES = frozenset({3, 11})
_ALREADY_EXISTS = 6

_MAX_WRITES = 500
"""Writes per Commit/BatchWrite request (Firestore's long-standing bound)."""

_TOMBSTONES_PER_COMMIT = 400
"""Leaves 100 writes of each ack Commit for piggybacked cursor documents and the checkpoint."""

_PAGE_SIZE = 2_000
"""Documents per query page at load: big enough to amortise round trips, small enough to stream."""

_PAGE_ATTEMPTS = 3
"""Tries per query page at load: one blip should not restart a load of 100,000 documents."""

_CHECKPOINT_MARGIN_MS = 5_000
"""``load`` reads tombstones finished this long before the checkpoint too: absorbs wall-clock steps."""

_MAX_UNCONFIRMED = 100_000
"""Bound on remembered ambiguous creates; past it the oldest is forgotten (it is then seen as a
DUPLICATE, and the message reaches the engine at the next ``load``)."""

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
retry with their own backoff, and ambiguity is resolved by writer tokens)."""


@dataclass(frozen=True, slots=True)
class SubscriptionStoreConfig:
    """What the store needs to know about one subscription."""

    mode: Mode
    dedup_ttl_ms: int = 7 * 24 * 3600 * 1000
    on_dead_letter: DeadLetterPolicy = "block"
    sequence_start: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("sequence", "watermark", "none"):
            raise ValueError(f"mode: must be sequence, watermark or none, got {self.mode!r}")
        if self.dedup_ttl_ms <= 0:
            raise ValueError(f"dedup_ttl_ms: must be positive, got {self.dedup_ttl_ms}")
        if self.on_dead_letter not in ("block", "skip"):
            raise ValueError(f"on_dead_letter: must be block or skip, got {self.on_dead_letter!r}")


@dataclass(slots=True)
class _Subscription:
    name: str
    config: SubscriptionStoreConfig
    path: str
    """Relative path of the subscription document."""
    book: CursorBook
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    checkpoint_ms: int | None = None
    checkpoint_written_ms: int | None = None
    checkpoint_stale: bool = False
    """A Commit changed tombstones or cursors after the last checkpoint write."""


@dataclass(slots=True)
class _Plan:
    """One message's create: where, what, and how it went."""

    index: int
    incoming: IncomingMessage
    doc_id: str
    fields: dict[str, Any]
    chunks: list[bytes]
    token: str
    size: int
    status: str = ""
    """"stored", "exists", or "" (failed: see ``error``)."""
    error: StoreError | None = None


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
    elif isinstance(value, list):
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


class _RawFirestore:
    """Writes as raw protobufs through the client's own GAPIC client (the async client has no BulkWriter).

    ``_firestore_api`` and ``_rpc_metadata`` are private to google-cloud-firestore; they are read
    here only, and checked at construction so that a library change fails at start, not mid-run.
    """

    _WRITE = Write.pb()
    _DOCUMENT = Document.pb()
    _VALUE = Value.pb()

    def __init__(self, client: firestore.AsyncClient, database_path: str, timeout_seconds: float) -> None:
        for attribute in ("_firestore_api", "_rpc_metadata"):
            if not hasattr(type(client), attribute):
                raise RuntimeError(f"google-cloud-firestore changed: AsyncClient.{attribute} is gone")
        self._client = client
        self._database = database_path
        self._documents = f"{database_path}/documents/"
        self._timeout = timeout_seconds

    def name(self, relative_path: str) -> str:
        return self._documents + relative_path

    def document(self, relative_path: str, fields: Mapping[str, Any]) -> Any:
        doc = self._DOCUMENT(name=self.name(relative_path))
        for field_name, value in fields.items():
            _set_value(doc.fields[field_name], value)
        return doc

    def create(self, relative_path: str, fields: Mapping[str, Any]) -> Any:
        write = self._WRITE(update=self.document(relative_path, fields))
        write.current_document.exists = False
        return write

    def set(self, relative_path: str, fields: Mapping[str, Any]) -> Any:
        return self._WRITE(update=self.document(relative_path, fields))

    def merge(self, relative_path: str, fields: Mapping[str, Any], mask: Iterable[str]) -> Any:
        write = self._WRITE(update=self.document(relative_path, fields))
        write.update_mask.field_paths.extend(mask)
        return write

    def delete(self, relative_path: str) -> Any:
        return self._WRITE(delete=self.name(relative_path))

    async def batch_write(self, writes: list[Any]) -> list[tuple[int, str]]:
        """(code, message) per write, index-aligned; raises the RPC's own error."""
        request = BatchWriteRequest.wrap(BatchWriteRequest.pb()(database=self._database, writes=writes))
        response = await self._client._firestore_api.batch_write(
            request=request, metadata=self._client._rpc_metadata, retry=None, timeout=self._timeout
        )
        return [(status.code, status.message) for status in response._pb.status]

    async def query_page(
        self,
        parent: str,
        collection: str,
        where: tuple[str, str, Any] | None,
        order_by: str | None,
        after: list[Any] | None,
        limit: int,
    ) -> list[tuple[str, list[Any], dict[str, Any]]]:
        """One page of a query ordered by (``order_by``, name): (document id, cursor values, fields) each.

        ``where`` is (field, operator name, value), e.g. ("state", "EQUAL", "pending"); ``after``
        the cursor values of the last document of the previous page.
        """
        query_type = StructuredQuery.pb()
        query = query_type()
        query.from_.add(collection_id=collection)
        if where is not None:
            field_name, op, value = where
            condition = query.where.field_filter
            condition.field.field_path = field_name
            condition.op = query_type.FieldFilter.Operator.Value(op)
            _set_value(condition.value, value)
        for path in ([order_by] if order_by else []) + ["__name__"]:
            query.order_by.add(direction=query_type.Direction.Value("ASCENDING")).field.field_path = path
        if after is not None:
            query.start_at.before = False
            for value in after:
                _set_value(query.start_at.values.add(), value)
        query.limit.value = limit
        request = RunQueryRequest.pb()(parent=self.name(parent), structured_query=query)
        page: list[tuple[str, list[Any], dict[str, Any]]] = []
        stream = await self._client._firestore_api.run_query(
            request=RunQueryRequest.wrap(request),
            metadata=self._client._rpc_metadata,
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
            page.append((doc.name.rpartition("/")[2], cursor, fields))
        return page

    async def close(self) -> None:
        """Close the gRPC channel: ``AsyncClient.close()`` leaves the GAPIC transport open."""
        api = getattr(self._client, "_firestore_api_internal", None)
        if api is not None:
            await api.transport.close()

    async def commit(self, writes: list[Any]) -> None:
        request = CommitRequest.wrap(CommitRequest.pb()(database=self._database, writes=writes))
        await self._client._firestore_api.commit(
            request=request, metadata=self._client._rpc_metadata, retry=None, timeout=self._timeout
        )


def _translate(exc: BaseException, what: str) -> StoreError:
    if isinstance(exc, _RETRYABLE):
        return StoreUnavailable(f"{what}: Firestore unavailable: {exc}")
    if isinstance(exc, _INPUT_ERRORS):
        return StoreRejected(f"{what}: Firestore refused the request: {exc}")
    return StoreRejected(f"{what}: Firestore error (check permissions, database and indexes): {exc}")


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class FirestoreStore:
    """``Store`` on Firestore. Use one instance per process; it owns its client unless given one."""

    def __init__(
        self,
        project: str,
        subscriptions: Mapping[str, SubscriptionStoreConfig],
        *,
        database: str = "(default)",
        root: str = "pubsub-sidecar",
        cursor_write_interval_ms: int = 1_000,
        rpc_timeout_seconds: float = 30.0,
        clock_ms: Callable[[], int] = _wall_clock_ms,
    ) -> None:
        for what, segment in [("root", root), *(("subscription name", name) for name in subscriptions)]:
            if (
                not segment
                or "/" in segment
                or segment in (".", "..")
                or len(segment.encode()) > 1500
                or (segment.startswith("__") and segment.endswith("__"))
            ):
                raise ValueError(f"{what} {segment!r} is not a valid Firestore id (no '/', not __x__, <= 1500 bytes)")
        if cursor_write_interval_ms <= 0:
            raise ValueError(f"cursor_write_interval_ms: must be positive, got {cursor_write_interval_ms}")
        # The client reads FIRESTORE_EMULATOR_HOST itself (insecure channel, anonymous credentials).
        self._client = firestore.AsyncClient(project=project, database=database)
        self._raw = _RawFirestore(self._client, f"projects/{project}/databases/{database}", rpc_timeout_seconds)
        self._timeout = rpc_timeout_seconds
        self._clock_ms = clock_ms
        self._root = root
        self._interval_ms = cursor_write_interval_ms
        self._subscriptions = {
            name: _Subscription(name, config, f"{root}/{name}", CursorBook(cursor_write_interval_ms))
            for name, config in subscriptions.items()
        }
        self._unconfirmed: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        self._token_prefix = secrets.token_hex(6)
        self._token_counter = 0
        self._flush_wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self.skipped_documents = 0
        """Documents ``load`` could not decode (logged at ERROR): a sign of hand edits or corruption."""

    # ---- helpers --------------------------------------------------------------------------------

    def _sub(self, name: str) -> _Subscription:
        sub = self._subscriptions.get(name)
        if sub is None:
            raise StoreRejected(f"unknown subscription {name!r}; configured: {sorted(self._subscriptions)}")
        return sub

    def _token(self) -> str:
        self._token_counter += 1
        return f"{self._token_prefix}.{self._token_counter}"

    def _remember_unconfirmed(self, plan: _Plan) -> None:
        self._unconfirmed.setdefault(plan.doc_id, set()).add(plan.token)
        self._unconfirmed.move_to_end(plan.doc_id)
        while len(self._unconfirmed) > _MAX_UNCONFIRMED:
            self._unconfirmed.popitem(last=False)

    def _message_path(self, sub: _Subscription, doc_id: str) -> str:
        return f"{sub.path}/messages/{doc_id}"

    def _document(self, relative_path: str) -> Any:
        return self._client.document(relative_path)

    async def _get_all(self, paths: Sequence[str], what: str) -> dict[str, dict[str, Any] | None]:
        """Fields by relative path (None when missing), in one batched get."""
        refs = [self._document(path) for path in paths]
        found: dict[str, dict[str, Any] | None] = {}
        try:
            async for snapshot in self._client.get_all(refs, retry=_READ_RETRY, timeout=self._timeout):
                found[snapshot.reference.path] = snapshot.to_dict() if snapshot.exists else None
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, what) from exc
        return found

    async def _commit(self, writes: list[Any], what: str) -> None:
        try:
            await self._raw.commit(writes)
        except (*_RETRYABLE, *_TERMINAL) as exc:
            raise _translate(exc, what) from exc

    async def ping(self) -> None:
        """One cheap read (1 document read), for readiness; raises StoreError if Firestore does not answer."""
        await self._get_all([f"{self._root}/ping"], "ping")

    # ---- persist --------------------------------------------------------------------------------

    async def persist(self, subscription: str, batch: Sequence[IncomingMessage], now_ms: int) -> list[PersistResult]:
        sub = self._sub(subscription)
        results: list[PersistResult | None] = [None] * len(batch)
        first: dict[str, _Plan] = {}
        repeats: list[_Plan] = []
        for index, incoming in enumerate(batch):
            plan = self._plan(sub, index, incoming, now_ms)
            if plan.error is not None:
                results[index] = PersistResult(PersistOutcome.FAILED, self._message(plan, now_ms), plan.error)
            elif plan.doc_id in first:
                repeats.append(plan)  # one BatchWrite may not write a document twice
            else:
                first[plan.doc_id] = plan
        plans = list(first.values())
        inline = [plan for plan in plans if not plan.chunks]
        await asyncio.gather(
            *(self._batch_write(sub, group) for group in self._groups(inline)),
            *(self._commit_chunked(sub, plan) for plan in plans if plan.chunks),
        )
        existing = await self._read_existing(sub, plans)
        for plan in plans:
            results[plan.index] = self._outcome(sub, plan, existing, now_ms)
        for plan in repeats:
            results[plan.index] = self._repeat_outcome(sub, plan, first[plan.doc_id], existing, results, now_ms)
        return [result for result in results if result is not None]

    def _plan(self, sub: _Subscription, index: int, incoming: IncomingMessage, now_ms: int) -> _Plan:
        doc_id = codec.message_doc_id(incoming.key, incoming.dedup_id, incoming.sequence)
        token = self._token()
        path = self._message_path(sub, doc_id)
        fields = codec.message_fields(incoming, token, now_ms, chunks=0)
        size = codec.document_size(path, fields)
        chunks: list[bytes] = []
        if size > codec.INLINE_LIMIT_BYTES:
            chunks = codec.split_data(incoming.data)
            fields = codec.message_fields(incoming, token, now_ms, chunks=len(chunks))
            size = codec.document_size(path, fields)
        plan = _Plan(index, incoming, doc_id, fields, chunks, token, size)
        if len(chunks) > codec.MAX_CHUNKS or size > codec.INLINE_LIMIT_BYTES:
            plan.error = StoreRejected(
                f"message {incoming.message_id!r} of key {incoming.key[:100]!r} is too large to store: "
                f"{len(incoming.data):,} data bytes (limit {codec.MAX_CHUNKS * codec.CHUNK_BYTES:,}), "
                f"{size:,} bytes besides the data (limit {codec.INLINE_LIMIT_BYTES:,})"
            )
        return plan

    @staticmethod
    def _groups(plans: list[_Plan]) -> list[list[_Plan]]:
        groups: list[list[_Plan]] = []
        size = 0
        for plan in plans:
            if not groups or len(groups[-1]) >= _MAX_WRITES or size + plan.size > codec.MAX_REQUEST_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(plan)
            size += plan.size
        return groups

    async def _batch_write(self, sub: _Subscription, group: list[_Plan]) -> None:
        writes = [self._raw.create(self._message_path(sub, plan.doc_id), plan.fields) for plan in group]
        try:
            statuses = await self._raw.batch_write(writes)
        except _INPUT_ERRORS as exc:
            if len(group) > 1:
                # The request as a whole was refused: split it so that only the culprit fails.
                middle = len(group) // 2
                await self._batch_write(sub, group[:middle])
                await self._batch_write(sub, group[middle:])
                return
            self._fail(group, exc, ambiguous=False)
            return
        except (*_RETRYABLE, *_TERMINAL) as exc:
            self._fail(group, exc, ambiguous=True)
            return
        for plan, (code, message) in zip(group, statuses, strict=True):
            if code == 0:
                plan.status = "stored"
            elif code == _ALREADY_EXISTS:
                plan.status = "exists"
            elif code in _INPUT_CODES:
                plan.error = StoreRejected(f"Firestore refused message {plan.incoming.message_id!r}: {message}")
            else:
                # Per-write failures are definite (not applied): no token to remember.
                kind = "unavailable" if code in _RETRYABLE_CODES else f"error {code}"
                plan.error = StoreUnavailable(f"Firestore {kind} for message {plan.incoming.message_id!r}: {message}")

    def _fail(self, group: list[_Plan], exc: BaseException, *, ambiguous: bool) -> None:
        error = _translate(exc, "persist")
        if not isinstance(exc, _INPUT_ERRORS):
            # Permissions or a missing database are not the message's fault: keep it in Pub/Sub.
            error = StoreUnavailable(str(error))
        for plan in group:
            plan.error = error
            if ambiguous:
                self._remember_unconfirmed(plan)

    async def _commit_chunked(self, sub: _Subscription, plan: _Plan) -> None:
        """Main document (exists=false) and its chunks in one atomic Commit."""
        path = self._message_path(sub, plan.doc_id)
        writes = [self._raw.create(path, plan.fields)]
        writes += [
            self._raw.set(f"{path}/chunks/{codec.chunk_doc_id(i)}", {"d": chunk}) for i, chunk in enumerate(plan.chunks)
        ]
        try:
            await self._raw.commit(writes)
        except core_exceptions.AlreadyExists:
            plan.status = "exists"
            return
        except (*_RETRYABLE, *_TERMINAL) as exc:
            self._fail([plan], exc, ambiguous=not isinstance(exc, _INPUT_ERRORS))
            return
        plan.status = "stored"

    async def _read_existing(self, sub: _Subscription, plans: list[_Plan]) -> dict[str, dict[str, Any] | None]:
        """Stored documents of refused creates that need a look: sequence mode, or our own maybe-write."""
        wanted = [
            plan
            for plan in plans
            if plan.status == "exists" and (sub.config.mode == "sequence" or plan.doc_id in self._unconfirmed)
        ]
        if not wanted:
            return {}
        try:
            found = await self._get_all([self._message_path(sub, plan.doc_id) for plan in wanted], "persist")
        except StoreError as exc:
            for plan in wanted:
                plan.status, plan.error = "", StoreUnavailable(str(exc))
            return {}
        return {plan.doc_id: found.get(self._message_path(sub, plan.doc_id)) for plan in wanted}

    def _message(self, plan: _Plan, now_ms: int, *, stored: bool = True) -> Message:
        ref = codec.ref_for(plan.doc_id, len(plan.chunks)) if stored else ""
        return codec.message_from_incoming(plan.incoming, now_ms, ref)

    def _outcome(
        self, sub: _Subscription, plan: _Plan, existing: dict[str, dict[str, Any] | None], now_ms: int
    ) -> PersistResult:
        if plan.status == "stored":
            self._unconfirmed.pop(plan.doc_id, None)
            return PersistResult(PersistOutcome.STORED, self._message(plan, now_ms))
        if plan.status != "exists":
            assert plan.error is not None
            return PersistResult(PersistOutcome.FAILED, self._message(plan, now_ms), plan.error)
        if plan.doc_id not in existing:
            return PersistResult(PersistOutcome.DUPLICATE, self._message(plan, now_ms))
        stored = existing[plan.doc_id]
        if stored is None:
            # Gone between the create and the read (TTL): the next attempt creates it.
            error = StoreUnavailable(f"message document {plan.doc_id} vanished while checking a duplicate")
            return PersistResult(PersistOutcome.FAILED, self._message(plan, now_ms), error)
        tokens = self._unconfirmed.get(plan.doc_id)
        if tokens is not None and stored.get("w") in tokens:
            # Our earlier create applied although its RPC failed: new to the engine.
            del self._unconfirmed[plan.doc_id]
            message = codec.message_from_incoming(
                plan.incoming,
                int(stored.get("stored_ms", now_ms)),
                codec.ref_for(plan.doc_id, int(stored.get("chunks") or 0)),
            )
            return PersistResult(PersistOutcome.STORED, message)
        if sub.config.mode == "sequence" and stored.get("fp") != plan.incoming.fingerprint:
            return PersistResult(PersistOutcome.CONFLICT, self._message(plan, now_ms, stored=False))
        return PersistResult(PersistOutcome.DUPLICATE, self._message(plan, now_ms))

    def _repeat_outcome(
        self,
        sub: _Subscription,
        plan: _Plan,
        original: _Plan,
        existing: dict[str, dict[str, Any] | None],
        results: list[PersistResult | None],
        now_ms: int,
    ) -> PersistResult:
        """A second copy in the same batch: decided by the first copy's fate."""
        first = results[original.index]
        assert first is not None
        if first.outcome is PersistOutcome.FAILED:
            return PersistResult(PersistOutcome.FAILED, self._message(plan, now_ms), first.error)
        if sub.config.mode == "sequence":
            stored = existing.get(original.doc_id)
            fingerprint = original.incoming.fingerprint if stored is None else stored.get("fp")
            if first.outcome is not PersistOutcome.CONFLICT and fingerprint != plan.incoming.fingerprint:
                return PersistResult(PersistOutcome.CONFLICT, self._message(plan, now_ms, stored=False))
            if (
                first.outcome is PersistOutcome.CONFLICT
                and stored is not None
                and stored.get("fp") != plan.incoming.fingerprint
            ):
                return PersistResult(PersistOutcome.CONFLICT, self._message(plan, now_ms, stored=False))
        return PersistResult(PersistOutcome.DUPLICATE, self._message(plan, now_ms))

    # ---- acks, terminal states, cursors -------------------------------------------------------

    async def commit_acks(self, subscription: str, acks: Sequence[AckIntent], now_ms: int) -> None:
        sub = self._sub(subscription)
        items = []
        for ack in acks:
            target = codec.doc_id_of(ack.message)
            if target is None:
                raise StoreRejected(f"commit_acks: message {ack.message.dedup_id!r} was never stored (no ref)")
            items.append((target, codec.ACKED, ack.cursor))
        await self._finish(sub, items, acks, [], now_ms, "commit_acks")

    async def mark_done(self, subscription: str, messages: Sequence[Message], state: str, now_ms: int) -> None:
        if state not in (codec.DEAD_LETTERED, codec.DROPPED):
            raise ValueError(f"mark_done: state must be 'dead_lettered' or 'dropped', got {state!r}")
        sub = self._sub(subscription)
        # A CONFLICT's copy has no ref: its document holds the other payload, which stays pending.
        stored = [(m, codec.doc_id_of(m)) for m in messages]
        items = [(target, state, None) for _, target in stored if target is not None]
        dead = [m for m, target in stored if target is not None] if state == codec.DEAD_LETTERED else []
        await self._finish(sub, items, [], dead, now_ms, "mark_done")

    async def _finish(
        self,
        sub: _Subscription,
        items: list[tuple[tuple[str, int], str, int | tuple[int, str] | None]],
        acks: Sequence[AckIntent],
        dead_letters: Sequence[Message],
        now_ms: int,
        what: str,
    ) -> None:
        """Tombstones in Commits of <= 500 writes, each carrying the cursors it makes due."""
        if not items:
            return
        ttl = sub.config.dedup_ttl_ms
        async with sub.lock:
            start = 0
            while start < len(items):
                writes: list[Any] = []
                end = start
                while end < len(items) and (
                    end == start or len(writes) + 1 + items[end][0][1] <= _TOMBSTONES_PER_COMMIT
                ):
                    (doc_id, chunks), state, cursor = items[end]
                    path = self._message_path(sub, doc_id)
                    fields = codec.tombstone_fields(state, now_ms, ttl, cursor)
                    fields["chunks"] = 0
                    writes.append(self._raw.merge(path, fields, codec.TOMBSTONE_MASK))
                    writes += [self._raw.delete(f"{path}/chunks/{codec.chunk_doc_id(i)}") for i in range(chunks)]
                    end += 1
                # ``acks``/``dead_letters`` align with ``items``; cursors only book what this Commit makes durable.
                proposed = sub.book.propose(acks[start:end], dead_letters[start:end], now_ms)
                await self._commit_cursors(sub, writes, proposed, now_ms, what)
                start = end
        self._maybe_wake_flusher(sub)

    async def _commit_cursors(
        self, sub: _Subscription, writes: list[Any], proposed: dict[str, KeyState], now_ms: int, what: str
    ) -> None:
        """Commit ``writes`` plus the cursor documents now due (and the checkpoint), then book them."""
        due = sub.book.due(now_ms, proposed, _MAX_WRITES - len(writes) - 1)
        for state in due:
            fields = cursor_fields(state)
            fields["written_ms"] = now_ms
            fields["expire_at"] = codec.expire_at(now_ms, sub.config.dedup_ttl_ms)
            writes.append(self._raw.set(f"{sub.path}/keys/{codec.key_doc_id(state.key)}", fields))
        written = {state.key for state in due}
        remaining = [s.dirty_since_ms for s in sub.book.dirty_states(proposed) if s.key not in written]
        clean_ms = min((ms for ms in remaining if ms is not None), default=now_ms)
        write_checkpoint = (
            (writes or due or sub.checkpoint_stale)
            and clean_ms != sub.checkpoint_ms
            and (sub.checkpoint_written_ms is None or now_ms - sub.checkpoint_written_ms >= self._interval_ms)
        )
        if write_checkpoint:
            # Name and mode too: a store that acks before any load() must not leave a mode-less document.
            checkpoint = {"name": sub.name, "mode": sub.config.mode, "clean_ms": clean_ms}
            writes.append(self._raw.merge(sub.path, checkpoint, list(checkpoint)))
        if not writes:
            return
        await self._commit(writes, what)
        sub.book.accept(proposed, due, now_ms)
        if write_checkpoint:
            sub.checkpoint_ms, sub.checkpoint_written_ms = clean_ms, now_ms
        sub.checkpoint_stale = not write_checkpoint

    def _start_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="store-cursor-flush")

    def _maybe_wake_flusher(self, sub: _Subscription) -> None:
        if sub.book.has_dirty() or sub.checkpoint_stale:
            self._start_flusher()
            self._flush_wake.set()

    async def _flush_loop(self) -> None:
        """Writes cursors left dirty (their key was written < interval ago) once they are due."""
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            await asyncio.sleep(self._interval_ms / 1000)
            for sub in self._subscriptions.values():
                try:
                    await self.flush(sub.name)
                except StoreError as exc:
                    _LOGGER.warning("store: cursor flush of %s failed, will retry: %s", sub.name, exc)
                    self._flush_wake.set()
                    continue
                self._maybe_wake_flusher(sub)

    async def flush(self, subscription: str) -> None:
        """Write every due dirty cursor and the checkpoint now (the background task calls this)."""
        sub = self._sub(subscription)
        async with sub.lock:
            await self._commit_cursors(sub, [], {}, self._clock_ms(), "cursor flush")

    # ---- load -----------------------------------------------------------------------------------

    async def _query_all(
        self, sub: _Subscription, collection: str, where: tuple[str, str, Any] | None, order_by: str | None
    ) -> list[tuple[str, dict[str, Any]]]:
        """Every (document id, fields) of a query, page by page; a failed page is retried a few times."""
        out: list[tuple[str, dict[str, Any]]] = []
        after: list[Any] | None = None
        while True:
            for attempt in range(_PAGE_ATTEMPTS):
                try:
                    page = await self._raw.query_page(sub.path, collection, where, order_by, after, _PAGE_SIZE)
                    break
                except _RETRYABLE as exc:
                    if attempt + 1 == _PAGE_ATTEMPTS:
                        raise _translate(exc, "load") from exc
                    await asyncio.sleep(0.1 * 2**attempt)
                except _TERMINAL as exc:
                    raise _translate(exc, "load") from exc
            out += [(doc_id, fields) for doc_id, _, fields in page]
            if len(page) < _PAGE_SIZE:
                return out
            after = page[-1][1]

    async def _subscription_doc(self, sub: _Subscription, now_ms: int) -> int | None:
        """Check the stored mode, create the document on first use; returns the checkpoint."""
        found = (await self._get_all([sub.path], "load")).get(sub.path)
        if found is None:
            fields = {"name": sub.name, "mode": sub.config.mode, "created_ms": now_ms, "clean_ms": now_ms}
            await self._commit([self._raw.create(sub.path, fields)], "load")
            return now_ms
        if found.get("mode") != sub.config.mode:
            raise StoreRejected(
                f"subscription {sub.name!r} is stored in mode {found.get('mode')!r} at {sub.path!r} but configured "
                f"as {sub.config.mode!r}: use a new subscription name, or delete that document tree"
            )
        clean = found.get("clean_ms")
        return None if clean is None else int(clean)

    async def load(self, subscription: str, now_ms: int) -> EngineSnapshot:
        sub = self._sub(subscription)
        async with sub.lock:
            checkpoint = await self._subscription_doc(sub, now_ms)
            cursor_docs = await self._query_all(sub, "keys", None, None)
            pending_docs = await self._query_all(sub, "messages", ("state", "EQUAL", codec.PENDING), None)
            since = 0 if checkpoint is None else checkpoint - _CHECKPOINT_MARGIN_MS
            recent_docs = await self._query_all(sub, "messages", ("done_ms", "GREATER_THAN_OR_EQUAL", since), "done_ms")
            states: dict[str, KeyState] = {}
            stored: dict[str, dict[str, Any]] = {}
            for _, fields in cursor_docs:
                if isinstance(fields.get("key"), str):
                    states[fields["key"]] = state_from_cursor_doc(fields)
                    stored[fields["key"]] = cursor_fields(states[fields["key"]])
            for _, fields in recent_docs:
                merge_tombstone(states, fields)
            pending = await self._decode_pending(sub, pending_docs)
            blocked = await self._reconcile(sub, states, pending)
            for state in states.values():
                state.written_ms = None
                state.dirty_since_ms = 0 if cursor_fields(state) != stored.get(state.key) else None
            sub.book.restore(states, dirty_since_ms=since)
            sub.checkpoint_ms = checkpoint
        self._maybe_wake_flusher(sub)
        cursors = [key_cursor(state, sub.config.mode, state.key in blocked) for state in states.values()]
        # Stored order, then key order: the engine gets each key's messages in position order.
        pending.sort(key=lambda m: (m.stored_at_ms, m.key, m.sequence or 0, m.timestamp_ms or 0, m.dedup_id))
        return EngineSnapshot(cursors=tuple(c for c in cursors if c is not None), pending=tuple(pending))

    async def _decode_pending(self, sub: _Subscription, docs: list[tuple[str, dict[str, Any]]]) -> list[Message]:
        """Pending messages, chunked data reassembled (one batched get for all chunks)."""
        chunked: dict[str, int] = {}
        for doc_id, fields in docs:
            chunks = int(fields.get("chunks") or 0)
            if chunks:
                chunked[doc_id] = chunks
        paths = [
            f"{self._message_path(sub, doc_id)}/chunks/{codec.chunk_doc_id(i)}"
            for doc_id, count in chunked.items()
            for i in range(count)
        ]
        found = await self._get_all(paths, "load") if paths else {}
        out: list[Message] = []
        for doc_id, fields in docs:
            data: bytes | None = None
            try:
                if doc_id in chunked:
                    parts = [
                        found.get(f"{self._message_path(sub, doc_id)}/chunks/{codec.chunk_doc_id(i)}")
                        for i in range(chunked[doc_id])
                    ]
                    if any(part is None or not isinstance(part.get("d"), bytes) for part in parts):
                        raise codec.CorruptDocument(f"message document {doc_id}: a chunk document is missing")
                    data = b"".join(part["d"] for part in parts if part is not None)
                out.append(codec.message_from_fields(doc_id, fields, data))
            except codec.CorruptDocument:
                self.skipped_documents += 1
                _LOGGER.exception("store: skipping undecodable document in %s", sub.path)
        return out

    async def _reconcile(self, sub: _Subscription, states: dict[str, KeyState], pending: list[Message]) -> set[str]:
        """Advance sequence cursors over finished messages at the cursor; apply dead letters. -> blocked keys."""
        mode, policy = sub.config.mode, sub.config.on_dead_letter
        blocked: set[str] = set()
        for state in states.values():
            if mode == "sequence" and state.next_sequence is None and state.dead_letter == sub.config.sequence_start:
                state.next_sequence = sub.config.sequence_start
            if step_dead_letter(state, mode, policy):
                blocked.add(state.key)
        if mode != "sequence":
            return blocked
        lowest: dict[str, int] = {}
        for message in pending:
            if message.sequence is not None:
                lowest[message.key] = min(lowest.get(message.key, message.sequence), message.sequence)
        # Walk only keys whose cursor is behind their first pending message: a dead letter skipped
        # or a duplicate dropped there leaves no ack cursor behind it.
        walking = [
            states[key]
            for key, low in lowest.items()
            if key in states
            and key not in blocked
            and states[key].next_sequence is not None
            and states[key].next_sequence < low  # type: ignore[operator]
        ]
        while walking:
            paths = {s.key: self._message_path(sub, codec.message_doc_id(s.key, "", s.next_sequence)) for s in walking}
            found = await self._get_all(list(paths.values()), "load")
            still: list[KeyState] = []
            for state in walking:
                fields = found.get(paths[state.key])
                if fields is None or fields.get("state") not in codec.DONE_STATES:
                    continue
                assert state.next_sequence is not None
                if fields["state"] == codec.DEAD_LETTERED:
                    state.dead_letter = max(state.dead_letter or 0, state.next_sequence)  # type: ignore[type-var]
                    if step_dead_letter(state, mode, policy):
                        blocked.add(state.key)
                        continue
                else:
                    state.next_sequence += 1
                if state.next_sequence < lowest[state.key]:
                    still.append(state)
            walking = still
        return blocked

    async def close(self) -> None:
        """Stop the flush task, write what is dirty (best effort), close the client; idempotent."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        for sub in self._subscriptions.values():
            if sub.book.has_dirty():
                try:
                    await self.flush(sub.name)
                except StoreError as exc:
                    # Harmless: load() recovers the cursors from the tombstones.
                    _LOGGER.warning("store: final cursor flush of %s failed: %s", sub.name, exc)
        await self._raw.close()
