"""A shard's inbox: messages other pods stored for the shard's owner, delivered by a Listen.

A pod that stores a message whose key it does not deliver marks the document ``inbox = shard``
(``sidecar.store.layout``). The owner listens on ``messages where inbox == shard and state ==
"pending"``: Firestore pushes each such document once it is committed (one billed read), and again
never, since the owner's tombstone (a whole-document replace) drops ``inbox`` and takes the document
out of the result. Chunked payloads are read like recovery reads them.

Only ``upserts`` matter: a removal is the owner's own tombstone (or a TTL delete) and says nothing
new. The first snapshot (the whole inbox at that instant) is handed over like any change, then
reported through ``on_initial``; if ``InboxListening.skip_initial`` holds **when it arrives**, it
is only reported. The owner starts the Listen, waits a bounded time for that snapshot, clears
``skip_initial`` and only then loads the shard. A snapshot that arrived before was read before the
load's reads, which hold all of it (leaving it out spares the engine a duplicate of every inbox
message); one that arrives later (a late first snapshot: a large inbox, a slow stream) may hold
messages committed after the load's page reads, which nothing else would hand over, so it is
handed over whole. While the shard loads the runtime admits each record once
(``ShardEngine.admit``); after, a copy of a message the engine holds is dropped as a duplicate. A
snapshot may be older than the owner's own writes (a Listen lags a little); the runtime deals with
a copy it already finished (``EngineActions._finished_elsewhere`` in ``sidecar.pipeline.runtime_actions``).

A corrupt document is left out alone (logged; the next recovery refuses it): the others of its
snapshot are still handed over. A read that fails (a chunk read) ends the Listen through
``on_error``; the owner starts a new one, whose first snapshot, handed over, holds what was lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sidecar.engine.types import Message
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import StoreError
from sidecar.store.reader import Reader

_LOGGER = logging.getLogger(__name__)


class InboxListening:
    """A running inbox Listen; ``close`` stops it and whatever decoding is still in progress."""

    def __init__(self, skip_initial: bool) -> None:
        self.listening: docs.Listening | None = None
        self.decoding: set[asyncio.Task[None]] = set()
        self.closed = False
        self.skip_initial = skip_initial
        """Leave the first snapshot out if it arrives while this holds (the owner clears it when it
        starts loading the shard)."""

    async def close(self) -> None:
        self.closed = True
        for task in list(self.decoding):
            task.cancel()
        await asyncio.gather(*self.decoding, return_exceptions=True)
        if self.listening is not None:
            await self.listening.close()


def listen_inbox(
    documents: docs.Documents,
    reader: Reader,
    sub_path: str,
    shard: int,
    on_messages: Callable[[list[Message]], None],
    on_error: Callable[[StoreError], None],
    *,
    skip_initial: bool = False,
    on_initial: Callable[[], None] | None = None,
) -> InboxListening:
    """Start listening on ``shard``'s inbox under ``sub_path``; ``on_messages`` gets each batch, decoded.

    ``on_initial`` is called once the first snapshot is dealt with: left out, or handed over (after
    its ``on_messages``); not at all for a Listen that fails first (its successor's first snapshot
    holds the same)."""
    handle = InboxListening(skip_initial)

    async def decode_each(found: list[tuple[str, dict[str, Any]]]) -> list[Message]:
        """One by one, after a batch failed on a corrupt document: every other one is handed over."""
        messages: list[Message] = []
        for one in found:
            try:
                messages.extend(await reader.decode_pending(sub_path, [one]))
            except layout.CorruptDocument as exc:
                _LOGGER.error(
                    "inbox of shard %d under %s: %s (left for the next recovery to refuse)", shard, sub_path, exc
                )
        return messages

    async def decode(found: list[tuple[str, dict[str, Any]]], initial: bool) -> None:
        try:
            try:
                messages = await reader.decode_pending(sub_path, found)
            except layout.CorruptDocument:
                messages = await decode_each(found)
        except StoreError as exc:
            if not handle.closed:
                on_error(exc)
            return
        if handle.closed:
            return
        if messages:
            on_messages(messages)
        if initial and on_initial is not None:
            on_initial()

    def on_change(change: docs.Change) -> None:
        if handle.closed:
            return
        found = [(doc_id, fields) for doc_id, fields, _ in change.upserts if fields.get("state") == layout.PENDING]
        if change.initial and (handle.skip_initial or not found):
            if on_initial is not None:
                on_initial()
            return
        if not found:
            return
        task = asyncio.ensure_future(decode(found, change.initial))
        handle.decoding.add(task)
        task.add_done_callback(handle.decoding.discard)

    where = [docs.Filter(layout.INBOX, "EQUAL", shard), docs.Filter("state", "EQUAL", layout.PENDING)]
    handle.listening = documents.listen(sub_path, "messages", where, on_change, on_error)
    return handle
