"""gRPC handlers of ``google.firestore.v1.Firestore``, registered on a ``grpc.aio`` server.

Registration uses generic handlers with the raw protobuf classes (no generated stubs). Handlers
run on the server's one asyncio loop; each request's state change happens between two awaits,
so commits are atomic and need no locks. The only await inside a commit is the transaction
lock wait, which comes before validation and before anything is staged.

Errors: domain code raises ``FirestoreError``; the wrappers here turn it into the gRPC status.
Any other exception is logged and reported as INTERNAL with its message, so a bug can never
become UNKNOWN (which some client methods retry for minutes) nor take the server down.
Listen is served by ``listen.ListenHub`` (its own module). Not served (UNIMPLEMENTED): Write
(streaming), PartitionQuery, ExecutePipeline, and queries with ``find_nearest`` (vector search) or
``explain_options``.
"""

from __future__ import annotations

import logging
import math
import secrets
import string
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sidecar.emulators.firestore import limits, names
from sidecar.emulators.firestore import protos as pb
from sidecar.emulators.firestore.aggregation import aggregate, parse_aggregations, required_fields
from sidecar.emulators.firestore.counters import Counters
from sidecar.emulators.firestore.documents import DocumentStore, Record
from sidecar.emulators.firestore.errors import FirestoreError, failed_precondition, invalid, not_found, unimplemented
from sidecar.emulators.firestore.index_plan import check_query
from sidecar.emulators.firestore.indexes import IndexConfig
from sidecar.emulators.firestore.listen import ListenHub
from sidecar.emulators.firestore.paths import parse_field_path
from sidecar.emulators.firestore.query import CompiledQuery, compile_query, execute
from sidecar.emulators.firestore.transactions import Transaction, TransactionManager
from sidecar.emulators.firestore.values import project
from sidecar.emulators.firestore.writes import apply_write, target_of

_LOGGER = logging.getLogger(__name__)

_AUTO_ID_ALPHABET = string.ascii_letters + string.digits
_DEFAULT_PAGE_SIZE = 300
"""Page size of ListDocuments / ListCollectionIds when the client asks for none."""
_READS_PER_AGGREGATION_READ = 1000
"""Production bills an aggregation one read per 1,000 index entries matched."""


def _auto_id() -> str:
    return "".join(secrets.choice(_AUTO_ID_ALPHABET) for _ in range(20))


def _micros_of(ts: Any) -> int:
    micros: int = ts.seconds * 1_000_000 + ts.nanos // 1000
    return micros


class FirestoreService:
    """The servicer: request decoding, consistency selection, commit staging, billing."""

    def __init__(
        self,
        store: DocumentStore,
        transactions: TransactionManager,
        counters: Counters,
        listens: ListenHub,
        indexes: IndexConfig | None = None,
        after_commit: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.transactions = transactions
        self.counters = counters
        self.listens = listens
        self.indexes = indexes or IndexConfig.everything()
        self.after_commit = after_commit
        """Called after every applied commit or batch write (the TTL sweep when its interval is 0)."""

    # ---- registration -------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Awaitable[Any]], req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                _unary(fn), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
            )

        def stream(fn: Callable[..., AsyncIterator[Any]], req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_stream_rpc_method_handler(
                _stream(fn), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
            )

        def bidi(fn: Callable[..., AsyncIterator[Any]], req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.stream_stream_rpc_method_handler(
                _stream(fn), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            pb.SERVICE_NAME,
            {
                "GetDocument": unary(self.get_document, pb.GetDocumentRequest, pb.Document),
                "ListDocuments": unary(self.list_documents, pb.ListDocumentsRequest, pb.ListDocumentsResponse),
                "CreateDocument": unary(self.create_document, pb.CreateDocumentRequest, pb.Document),
                "UpdateDocument": unary(self.update_document, pb.UpdateDocumentRequest, pb.Document),
                "DeleteDocument": unary(self.delete_document, pb.DeleteDocumentRequest, pb.Empty),
                "BeginTransaction": unary(
                    self.begin_transaction, pb.BeginTransactionRequest, pb.BeginTransactionResponse
                ),
                "Commit": unary(self.commit, pb.CommitRequest, pb.CommitResponse),
                "Rollback": unary(self.rollback, pb.RollbackRequest, pb.Empty),
                "BatchWrite": unary(self.batch_write, pb.BatchWriteRequest, pb.BatchWriteResponse),
                "ListCollectionIds": unary(
                    self.list_collection_ids, pb.ListCollectionIdsRequest, pb.ListCollectionIdsResponse
                ),
                "BatchGetDocuments": stream(
                    self.batch_get_documents, pb.BatchGetDocumentsRequest, pb.BatchGetDocumentsResponse
                ),
                "RunQuery": stream(self.run_query, pb.RunQueryRequest, pb.RunQueryResponse),
                "Listen": bidi(self.listens.listen, pb.ListenRequest, pb.ListenResponse),
                "RunAggregationQuery": stream(
                    self.run_aggregation_query, pb.RunAggregationQueryRequest, pb.RunAggregationQueryResponse
                ),
            },
        )

    # ---- consistency ----------------------------------------------------------------------------

    def _begin(self, options: Any) -> Transaction:
        kind = options.WhichOneof("mode")
        if kind == "read_only":
            read_us = self.store.clock.now()
            if options.read_only.HasField("read_time"):
                read_us = self._check_read_time(_micros_of(options.read_only.read_time)) or read_us
            return self.transactions.begin(True, read_us)
        return self.transactions.begin(False, None, options.read_write.retry_transaction)

    def _check_read_time(self, read_us: int) -> int | None:
        """A past read time to read at, or None for "now"; refuses times older than retention."""
        now = self.store.clock.now()
        if read_us >= now:
            return None
        if read_us < now - self.store.retention_us:
            raise failed_precondition(
                f"read_time is older than the emulator's version retention ({self.store.retention_us // 1_000_000} s)."
            )
        return read_us

    def _consistency(self, request: Any) -> tuple[Transaction | None, int | None, bool]:
        """(transaction, read time, whether the transaction is new) for a read request."""
        kind = request.WhichOneof("consistency_selector")
        if kind == "transaction":
            tx = self.transactions.get(request.transaction)
            return tx, tx.read_us, False
        if kind == "new_transaction":
            tx = self._begin(request.new_transaction)
            return tx, tx.read_us, True
        if kind == "read_time":
            return None, self._check_read_time(_micros_of(request.read_time)), False
        return None, None, False

    async def _lock_for_read(self, tx: Transaction | None, wanted: list[str]) -> None:
        """A read-write transaction's read waits for older transactions holding those documents."""
        if tx is None or tx.read_only:
            return
        await self.transactions.wait_turn(tx, wanted, to_write=False)
        if self.transactions.find(tx.id) is None:
            raise invalid("The referenced transaction has expired or is no longer valid.")

    def _read_time_of(self, read_us: int | None) -> Any:
        return pb.timestamp_from_micros(self.store.clock.now() if read_us is None else read_us)

    def _check_snapshot(self, tx: Transaction | None) -> None:
        if tx is not None and tx.read_us is not None:
            self._check_read_time(tx.read_us)

    # ---- reads ----------------------------------------------------------------------------------

    async def get_document(self, request: Any, context: Any) -> Any:
        names.document_name(request.name)
        tx, read_us, _ = self._consistency(request)
        self._check_snapshot(tx)
        await self._lock_for_read(tx, [request.name])
        record = self.store.get_at(request.name, read_us)
        if tx is not None:
            self.transactions.record_read(tx, request.name, record)
        self.counters.reads += 1
        if record is None:
            raise not_found(f'Document "{request.name}" not found.')
        return _masked(record.doc, request.mask if request.HasField("mask") else None)

    async def batch_get_documents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        database = names.check_database(request.database)
        wanted = list(request.documents)
        for name in wanted:
            names.document_name(name, database)
        mask = request.mask if request.HasField("mask") else None
        tx, read_us, is_new = self._consistency(request)
        self._check_snapshot(tx)
        await self._lock_for_read(tx, wanted)
        read_time = self._read_time_of(read_us)
        responses = []
        # Every response carries found or missing (the client raises on anything else); a new
        # transaction's id rides on the first one.
        for index, name in enumerate(wanted):
            record = self.store.get_at(name, read_us)
            if tx is not None:
                self.transactions.record_read(tx, name, record)
            response = pb.BatchGetDocumentsResponse(read_time=read_time)
            if record is None:
                response.missing = name
            else:
                response.found.CopyFrom(_masked(record.doc, mask))
            if index == 0 and is_new and tx is not None:
                response.transaction = tx.id
            responses.append(response)
        if not wanted and is_new and tx is not None:
            responses.append(pb.BatchGetDocumentsResponse(transaction=tx.id, read_time=read_time))
        self.counters.reads += len(wanted)
        for response in responses:
            yield response

    def _query(self, parent: str, structured_query: Any, required_fields: list[Any] | None = None) -> CompiledQuery:
        names.parent_name(parent)
        query = compile_query(parent, structured_query, required_fields or ())
        check_query(self.indexes, parent, structured_query, required_fields or ())
        return query

    async def run_query(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if request.WhichOneof("query_type") != "structured_query":
            raise invalid("RunQuery needs a structured_query.")
        _refuse_explain(request)
        query = self._query(request.parent, request.structured_query)
        tx, read_us, is_new = self._consistency(request)
        self._check_snapshot(tx)
        records = execute(self.store, query, read_us)
        if tx is not None:
            self.transactions.record_query(tx, query, records)
        read_time = self._read_time_of(read_us)
        self.counters.reads += max(1, len(records))
        responses = []
        for record in records:
            response = pb.RunQueryResponse(read_time=read_time)
            response.document.CopyFrom(_projected(record.doc, query.projection))
            responses.append(response)
        if not responses:
            responses.append(pb.RunQueryResponse(read_time=read_time))
        if is_new and tx is not None:
            responses[0].transaction = tx.id
        for response in responses:
            yield response

    async def run_aggregation_query(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if request.WhichOneof("query_type") != "structured_aggregation_query":
            raise invalid("RunAggregationQuery needs a structured_aggregation_query.")
        _refuse_explain(request)
        structured = request.structured_aggregation_query
        aggregations = parse_aggregations(structured.aggregations)
        query = self._query(request.parent, structured.structured_query, required_fields(aggregations))
        tx, read_us, is_new = self._consistency(request)
        self._check_snapshot(tx)
        records = execute(self.store, query, read_us)
        if tx is not None:
            self.transactions.record_query(tx, query, records)
        response = pb.RunAggregationQueryResponse(read_time=self._read_time_of(read_us))
        response.result.SetInParent()
        for aggregation in aggregations:
            response.result.aggregate_fields[aggregation.alias].CopyFrom(aggregate(aggregation, records))
        if is_new and tx is not None:
            response.transaction = tx.id
        self.counters.reads += max(1, math.ceil(len(records) / _READS_PER_AGGREGATION_READ))
        yield response

    async def list_documents(self, request: Any, context: Any) -> Any:
        names.parent_name(request.parent)
        if not request.collection_id:
            raise invalid("ListDocuments needs a collection_id.")
        limits.check_id(request.collection_id, "Collection id", request.parent)
        if request.page_size < 0:
            raise invalid("page_size must not be negative.")
        tx, read_us, _ = self._consistency(request)
        self._check_snapshot(tx)
        path = f"{request.parent}/{request.collection_id}"
        ids = {n.rpartition("/")[2] for n in self.store.names_in(path, read_us)}
        missing = self.store.child_collection_ids(path, read_us) if request.show_missing else set()
        after = request.page_token
        page_size = request.page_size or _DEFAULT_PAGE_SIZE
        response = pb.ListDocumentsResponse()
        mask = request.mask if request.HasField("mask") else None
        for doc_id in sorted(i for i in ids | missing if i > after):
            name = f"{path}/{doc_id}"
            record = self.store.get_at(name, read_us) if doc_id in ids else None
            if record is not None:
                if tx is not None:
                    self.transactions.record_read(tx, name, record)
                response.documents.append(_masked(record.doc, mask))
            elif doc_id in missing:
                response.documents.add(name=name)
            else:
                continue
            if len(response.documents) == page_size:
                response.next_page_token = doc_id
                break
        self.counters.reads += max(1, len(response.documents))
        return response

    async def list_collection_ids(self, request: Any, context: Any) -> Any:
        parent = names.parent_name(request.parent)
        if request.page_size < 0:
            raise invalid("page_size must not be negative.")
        read_us = (
            self._check_read_time(_micros_of(request.read_time))
            if request.WhichOneof("consistency_selector") == "read_time"
            else None
        )
        ids = self.store.child_collection_ids(parent, read_us)
        page_size = request.page_size or _DEFAULT_PAGE_SIZE
        page = sorted(i for i in ids if i > request.page_token)
        response = pb.ListCollectionIdsResponse(collection_ids=page[:page_size])
        if len(page) > page_size:
            response.next_page_token = page[page_size - 1]
        self.counters.reads += 1
        return response

    # ---- transactions ---------------------------------------------------------------------------

    async def begin_transaction(self, request: Any, context: Any) -> Any:
        names.check_database(request.database)
        tx = self._begin(request.options)
        return pb.BeginTransactionResponse(transaction=tx.id)

    async def rollback(self, request: Any, context: Any) -> Any:
        names.check_database(request.database)
        tx = self.transactions.find(request.transaction)
        if tx is not None:
            self.transactions.end(tx)
        return pb.Empty()

    # ---- writes ---------------------------------------------------------------------------------

    async def commit(self, request: Any, context: Any) -> Any:
        database = names.check_database(request.database)
        limits.check_request_size(request)
        limits.check_write_count(len(request.writes))
        targets = [self._target(write, database) for write in request.writes]
        tx = None
        if request.transaction:
            tx = self.transactions.get(request.transaction)
            if tx.read_only:
                self.transactions.end(tx)
                if request.writes:
                    raise invalid("Cannot modify entities in a read-only transaction.")
                return pb.CommitResponse(commit_time=self._read_time_of(None))
            await self.transactions.wait_turn(tx, [name for name, _ in targets], to_write=True)
            # The client may have rolled back, or the transaction expired, while we waited.
            if self.transactions.find(tx.id) is None:
                raise invalid("The referenced transaction has expired or is no longer valid.")
            self.transactions.validate(tx, self.store)
        try:
            return self._commit_now(request.writes, targets)
        finally:
            if tx is not None:
                self.transactions.end(tx)

    def _target(self, write: Any, database: str) -> tuple[str, str]:
        name = target_of(write)
        return name, names.document_name(name, database)

    def _commit_now(self, writes: Any, targets: list[tuple[str, str]]) -> Any:
        """Stage every write in order over the current state, then apply all or nothing."""
        commit_us = self.store.clock.tick()
        commit_ts = pb.timestamp_from_micros(commit_us)
        staged: dict[str, Record | None] = {}
        response = pb.CommitResponse(commit_time=commit_ts)
        deletes = 0
        for write, (name, relative) in zip(writes, targets, strict=True):
            current = staged[name] if name in staged else self.store.get(name)
            record, result = apply_write(write, name, relative, current, commit_us, commit_ts)
            staged[name] = record
            response.write_results.append(result)
            deletes += write.WhichOneof("operation") == "delete"
        self.store.apply(staged, commit_us)
        self.counters.deletes += deletes
        self.counters.writes += len(targets) - deletes
        if self.after_commit is not None:
            self.after_commit()
        return response

    async def batch_write(self, request: Any, context: Any) -> Any:
        database = names.check_database(request.database)
        limits.check_request_size(request)
        limits.check_write_count(len(request.writes))
        response = pb.BatchWriteResponse()
        seen: set[str] = set()
        store = self.store
        counters = self.counters
        for write in request.writes:
            try:
                name, relative = self._target(write, database)
                if name in seen:
                    raise invalid(f"BatchWrite cannot write the same document twice: {name}")
                seen.add(name)
                commit_us = store.clock.tick()
                record, result = apply_write(
                    write, name, relative, store.get(name), commit_us, pb.timestamp_from_micros(commit_us)
                )
                store.apply({name: record}, commit_us)
            except FirestoreError as exc:
                response.write_results.add()
                response.status.add(code=exc.code.value[0], message=exc.message)
                continue
            if write.WhichOneof("operation") == "delete":
                counters.deletes += 1
            else:
                counters.writes += 1
            response.write_results.append(result)
            response.status.add()
        if self.after_commit is not None:
            self.after_commit()
        return response

    async def create_document(self, request: Any, context: Any) -> Any:
        parent = names.parent_name(request.parent)
        limits.check_id(request.collection_id, "Collection id", parent)
        doc_id = request.document_id or _auto_id()
        write = pb.Write()
        write.update.CopyFrom(request.document)
        write.update.name = f"{parent}/{request.collection_id}/{doc_id}"
        write.current_document.exists = False
        return self._single(write, request.mask if request.HasField("mask") else None)

    async def update_document(self, request: Any, context: Any) -> Any:
        write = pb.Write()
        write.update.CopyFrom(request.document)
        if request.HasField("update_mask"):
            write.update_mask.CopyFrom(request.update_mask)
        if request.HasField("current_document"):
            write.current_document.CopyFrom(request.current_document)
        return self._single(write, request.mask if request.HasField("mask") else None)

    async def delete_document(self, request: Any, context: Any) -> Any:
        write = pb.Write(delete=request.name)
        if request.HasField("current_document"):
            write.current_document.CopyFrom(request.current_document)
        self._single(write, None)
        return pb.Empty()

    def _single(self, write: Any, mask: Any) -> Any:
        name = target_of(write)
        target = (name, names.document_name(name, names.database_of(name)))
        self._commit_now([write], [target])
        record = self.store.get(name)
        return pb.Document() if record is None else _masked(record.doc, mask)


def _refuse_explain(request: Any) -> None:
    if request.HasField("explain_options"):
        raise unimplemented("Query explain (explain_options) is not supported by this emulator.")


def _masked(doc: Any, mask: Any) -> Any:
    if mask is None:
        return doc
    return _projected(doc, [parse_field_path(p) for p in mask.field_paths])


def _projected(doc: Any, paths: list[Any] | None) -> Any:
    if paths is None:
        return doc
    out = pb.Document(name=doc.name, create_time=doc.create_time, update_time=doc.update_time)
    project(doc.fields, paths, out.fields)
    return out


def _unary(fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except FirestoreError as exc:
            error: tuple[grpc.StatusCode, str] = (exc.code, exc.message)
        except Exception as exc:
            _LOGGER.exception("firestore emulator: %s failed", fn.__name__)
            error = (grpc.StatusCode.INTERNAL, f"emulator error: {type(exc).__name__}: {exc}")
        await context.abort(*error)

    return handle


def _stream(fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
            return
        except FirestoreError as exc:
            error: tuple[grpc.StatusCode, str] = (exc.code, exc.message)
        except Exception as exc:
            _LOGGER.exception("firestore emulator: %s failed", fn.__name__)
            error = (grpc.StatusCode.INTERNAL, f"emulator error: {type(exc).__name__}: {exc}")
        await context.abort(*error)

    return handle
