"""Reading a subscription's documents back: paged queries, pending messages within a memory budget
page by page, chunked data reassembled, stripped payloads read back. Used by ``DocumentStore``
(load, pending_pages, read_payloads).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sidecar.backoff import backoff_seconds
from sidecar.engine.payloads import HELD_MESSAGE_OVERHEAD_BYTES
from sidecar.engine.types import Message
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import PayloadBudget, StoreRejected, StoreUnavailable
from sidecar.store.layout import message_path

_LOGGER = logging.getLogger(__name__)

_T = TypeVar("_T")

_PAGE_SIZE = 2_000
"""Documents per query page at load: big enough to amortise round trips, small enough to stream."""

_PAGE_ATTEMPTS = 3
"""Tries per query page at load: one blip should not restart a load of 100,000 documents."""

_RETRY_INITIAL_SECONDS = 0.1
_RETRY_MAX_SECONDS = 5.0
"""Cap of the wait between tries of a page: a store that is back is read again within seconds, and
an unbounded retry (``pending_pages``) still reports its outage well inside the 120 s that the
caller's liveness allows without progress."""

Progress = Callable[[int], None]
"""Called with the number of documents read by a call (a liveness signal during recovery)."""


async def retrying(
    read: Callable[[], Awaitable[_T]], what: str, attempts: int | None, slots: asyncio.Semaphore | None = None
) -> _T:
    """``read()``, tried again after a StoreUnavailable with a capped, jittered backoff, ``attempts``
    times in all (None: until it succeeds; a warning per failed try); each try under one of ``slots``."""
    failures = 0
    while True:
        try:
            if slots is None:
                return await read()
            async with slots:
                return await read()
        except StoreUnavailable as exc:
            failures += 1
            if attempts is not None and failures >= attempts:
                raise
            delay = backoff_seconds(failures - 1, _RETRY_INITIAL_SECONDS, _RETRY_MAX_SECONDS)
            _LOGGER.warning("store: reading %s failed (try %d), again in %.1f s: %s", what, failures, delay, exc)
            await asyncio.sleep(delay)


class Reader:
    def __init__(self, documents: docs.Documents) -> None:
        self._documents = documents

    async def query_all(
        self,
        sub_path: str,
        collection: str,
        where: docs.Filter | Sequence[docs.Filter] | None,
        order_by: str | None,
        progress: Progress,
    ) -> list[tuple[str, dict[str, Any]]]:
        """Every (document id, fields) of a query, page by page; a failed page is retried a few times."""
        out: list[tuple[str, dict[str, Any]]] = []
        after: object | None = None
        while True:
            read = functools.partial(self._documents.query, sub_path, collection, where, order_by, after, _PAGE_SIZE)
            page = await retrying(read, f"{sub_path}/{collection}", _PAGE_ATTEMPTS, None)
            out += page.documents
            progress(len(page.documents))
            if page.after is None:
                return out
            after = page.after

    async def query_shards(
        self, sub_path: str, collection: str, shards: frozenset[int] | None, progress: Progress
    ) -> list[tuple[str, dict[str, Any]]]:
        """Every document of ``collection`` in ``shards`` (``where shard == X``, one query per
        shard: equality filters need no composite index); None: the whole collection."""
        if shards is None:
            return await self.query_all(sub_path, collection, None, None, progress)
        out: list[tuple[str, dict[str, Any]]] = []
        for shard in sorted(shards):
            out += await self.query_all(sub_path, collection, docs.Filter(layout.SHARD, "EQUAL", shard), None, progress)
        return out

    async def load_pending(
        self,
        sub_path: str,
        budget: int | PayloadBudget | None,
        progress: Progress,
        shards: frozenset[int] | None = None,
    ) -> list[Message]:
        """Every pending message (of ``shards``, None: all): ``pending_pages`` collected, a page
        retried a few times at most (the whole load is the caller's to retry)."""
        out: list[Message] = []
        async with contextlib.aclosing(self.pending_pages(sub_path, budget, progress, shards)) as pages:
            async for page in pages:
                out += page
        return out

    async def pending_pages(
        self,
        sub_path: str,
        budget: int | PayloadBudget | None,
        progress: Progress,
        shards: frozenset[int] | None = None,
        *,
        attempts: int | None = _PAGE_ATTEMPTS,
        slots: asyncio.Semaphore | None = None,
    ) -> AsyncGenerator[list[Message], None]:
        """Every pending message (of ``shards``, None: all), one query page at a time, each decoded
        before it is yielded so that only one page of payloads is ever in memory beyond the budget;
        past ``budget`` payload bytes (shared with the loads running at once when a
        ``PayloadBudget``) a message is kept stripped. Empty pages are not yielded.

        A page that fails with StoreUnavailable is read again from the same cursor, ``attempts``
        times in all (None: for as long as it fails), so nothing is yielded twice or skipped.
        ``slots``: held for each page's read and decoding, never while suspended at ``yield``.
        ``progress`` gets each page's document count once the page is decoded."""
        if isinstance(budget, int):
            budget = PayloadBudget(budget)
        pending_filter = docs.Filter("state", "EQUAL", layout.PENDING)
        queries: list[list[docs.Filter]] = (
            [[pending_filter]]
            if shards is None
            else [[docs.Filter(layout.SHARD, "EQUAL", shard), pending_filter] for shard in sorted(shards)]
        )
        for where in queries:
            after: object | None = None
            while True:
                read = functools.partial(self._pending_page, sub_path, where, after, budget)
                page, messages = await retrying(read, f"{sub_path}/messages (pending)", attempts, slots)
                progress(len(page.documents))
                after = page.after
                # The raw documents must not outlive their decoding: every load's generator waits
                # suspended at ``yield``, and 16 raw pages of 2,000 documents weigh ~50 MB.
                del page, read
                if messages:
                    yield messages
                    del messages
                if after is None:
                    break

    async def _pending_page(
        self, sub_path: str, where: list[docs.Filter], after: object | None, budget: PayloadBudget | None
    ) -> tuple[docs.Page, list[Message]]:
        page = await self._documents.query(sub_path, "messages", where, None, after, _PAGE_SIZE)
        return page, await self._decode_page(sub_path, page.documents, budget)

    async def _decode_page(
        self, sub_path: str, documents: list[tuple[str, dict[str, Any]]], budget: PayloadBudget | None
    ) -> list[Message]:
        """One page of pending messages, each kept whole while the budget lasts, else stripped. A page
        that fails (its chunks unreadable, or cancelled) gives back what it took of the budget: it
        will be read again, or never kept."""
        out: list[Message] = []
        chunked: list[tuple[str, dict[str, Any]]] = []
        spent = 0
        try:
            for doc_id, fields in documents:
                layout.require_v2(f"message document {doc_id}", fields)
                keep = True
                if budget is not None:
                    chunks = fields.get("chunks")
                    size = len(fields.get("data") or b"") if not chunks else layout.CHUNK_BYTES
                    size += 33 + 110 * (len(fields.get("attrs") or ()) // 2)
                    budget.charge(HELD_MESSAGE_OVERHEAD_BYTES)  # every message's bookkeeping counts, stripped or not
                    spent += HELD_MESSAGE_OVERHEAD_BYTES
                    keep = budget.take(size)
                    spent += size if keep else 0
                if not keep:
                    out.append(layout.message_from_fields(doc_id, fields, stripped=True))
                elif fields.get("chunks"):
                    chunked.append((doc_id, fields))
                else:
                    out.append(layout.message_from_fields(doc_id, fields))
            if chunked:
                out += await self.decode_pending(sub_path, chunked)
        except BaseException:
            if budget is not None:
                budget.refund(spent)
            raise
        return out

    async def read_payloads(self, sub_path: str, messages: Sequence[Message]) -> list[Message]:
        """The pending ``messages`` with their payloads, in order; StoreRejected if one is not pending."""
        targets = []
        for message in messages:
            target = layout.doc_id_of(message)
            if target is None:
                raise StoreRejected(f"read_payloads: message {message.dedup_id!r} was never stored (no ref)")
            targets.append(target[0])
        paths = [message_path(sub_path, doc_id) for doc_id in targets]
        found = await self._documents.get_all(paths)
        docs_found: list[tuple[str, dict[str, Any]]] = []
        for doc_id, path in zip(targets, paths, strict=True):
            fields = found.get(path)
            if fields is None or fields.get("state") != layout.PENDING:
                raise StoreRejected(
                    f"read_payloads: message document {path} is "
                    f"{'gone' if fields is None else repr(fields.get('state'))}, not pending: its payload is lost"
                )
            docs_found.append((doc_id, fields))
        try:
            return await self.decode_pending(sub_path, docs_found)
        except layout.CorruptDocument as exc:
            raise StoreRejected(f"read_payloads: {exc}") from exc

    async def decode_pending(self, sub_path: str, found: list[tuple[str, dict[str, Any]]]) -> list[Message]:
        """Pending messages, chunked data reassembled (one batched get for all chunks)."""
        chunked = {doc_id: int(fields.get("chunks") or 0) for doc_id, fields in found if fields.get("chunks")}
        paths = [
            f"{message_path(sub_path, doc_id)}/chunks/{layout.chunk_doc_id(i)}"
            for doc_id, count in chunked.items()
            for i in range(count)
        ]
        parts = await self._documents.get_all(paths) if paths else {}
        out: list[Message] = []
        for doc_id, fields in found:
            data: bytes | None = None
            if doc_id in chunked:
                pieces = [
                    parts.get(f"{message_path(sub_path, doc_id)}/chunks/{layout.chunk_doc_id(i)}")
                    for i in range(chunked[doc_id])
                ]
                if any(piece is None or not isinstance(piece.get("d"), bytes) for piece in pieces):
                    raise layout.CorruptDocument(f"message document {doc_id}: a chunk document is missing")
                data = b"".join(piece["d"] for piece in pieces if piece is not None)
            out.append(layout.message_from_fields(doc_id, fields, data))
        return out
