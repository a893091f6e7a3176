"""An outbox relay's documents (DESIGN §12): the app's outbox entries, the relay's per-shard counters
and its waiting room, over the ``documents`` seam (Firestore, or ``MemoryDocuments`` in the crash
simulation).

Layout (in the outbox's database; ``relay_root`` is ``{root}/relay:{name}``, a document path no
subscription's can be, since ``:`` is not allowed in a name):

- ``{collection}/{id}``: the app's entries (random ids). The relay only reads and deletes them.
- ``{relay_root}/leases/{shard:04d}``: the shard leases (``sidecar.cluster.leases``).
- ``{relay_root}/counters/{shard:04d}``: the shard's counters (``Counter``): ``keys``, ``last``,
  ``at_us``, ``at_id`` (parallel arrays: the key, its last published number, the update time and id
  of the entry settled with it), ``v``. Arrays, not a map: a key is any string, and map keys would
  meet Firestore's field-name rules (``__x__`` is reserved). A key never leaves it (its next entry
  goes on from its number); about 15,000 keys of 30 bytes fit one shard's document.
- ``at_us``/``at_id`` make a stale view harmless: an entry at or before them in commit order was
  settled already (a key settles in commit order), so a pod whose Listen has not yet seen its
  delete skips it instead of numbering it again.
- ``{relay_root}/waiting/{id}``: an entry in the waiting room that the relay gave up on (``state:
  waiting``: a publish failed for good; its key waits), or an operator's discard (``state:
  discarded``, with the note): ``key``, ``reason``, ``at``, ``note``. A retry deletes it. Entries
  unpublishable as written need no document: every pod reads the same verdict from the entry.

Rules:

- **One fenced Commit settles a batch** (``settle``): the published entries' deletes and the
  shard's counter document, checked against the shard's lease. Before it, nothing of the batch is
  settled and the same entries get the same numbers again (the counters did not move); after it,
  they are gone and the counters say so. Nothing in between.
- **The counters are read once per held shard** (``read_counters``) and kept by the caller while it
  holds the lease with the same epoch and every Commit answered: a Commit that failed with an
  unknown outcome (``Unavailable``) may have applied, so the caller reads them again.
- A counter document this relay cannot read (a newer ``v``, ill-typed fields) is ``CorruptCounters``:
  the shard waits (an operator must look), the other shards go on.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sidecar.store import documents as docs
from sidecar.store.api import StoreError

COUNTERS_VERSION = 1


class CorruptCounters(StoreError):
    """A counter document that cannot be read as one: the shard waits, its document untouched."""


def relay_root(root: str, name: str) -> str:
    return f"{root}/relay:{name}"


def counters_path(relay: str, shard: int) -> str:
    return f"{relay}/counters/{shard:04d}"


def waiting_path(relay: str, entry_id: str) -> str:
    return f"{relay}/waiting/{entry_id}"


def entry_path(collection: str, entry_id: str) -> str:
    return f"{collection}/{entry_id}"


@dataclass(frozen=True, slots=True)
class Counter:
    """A key's counter: its last published number and the last entry settled with it."""

    last: int
    """The last sequence number published and settled."""
    at_us: int
    """The settled entry's update time (microseconds)."""
    at_id: str
    """The settled entry's document id."""


def counters_of(path: str, fields: docs.Fields | None) -> dict[str, Counter]:
    """A counter document's fields as key -> counter; ``CorruptCounters`` if they are not one."""
    if fields is None:
        return {}
    version = fields.get("v")
    if type(version) is not int or version > COUNTERS_VERSION:
        raise CorruptCounters(f"{path}: layout version {version!r} is not one this relay reads")
    columns = [fields.get(name) for name in _COLUMNS]
    if not all(isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:  # type: ignore[arg-type]
        raise CorruptCounters(f"{path}: {', '.join(_COLUMNS)} must be arrays of one length")
    counters: dict[str, Counter] = {}
    for key, last, at_us, at_id in zip(*columns, strict=True):
        if (
            not isinstance(key, str)
            or key in counters
            or any(type(n) is not int or n < 0 for n in (last, at_us))
            or not isinstance(at_id, str)
        ):
            raise CorruptCounters(f"{path}: an entry is not a distinct string key with numbers >= 0 and an id")
        counters[key] = Counter(last, at_us, at_id)
    return counters


_COLUMNS = ("keys", "last", "at_us", "at_id")


def counter_fields(counters: Mapping[str, Counter]) -> docs.Fields:
    keys = sorted(counters)
    rows = [counters[k] for k in keys]
    return {
        "v": COUNTERS_VERSION,
        "keys": keys,
        "last": [c.last for c in rows],
        "at_us": [c.at_us for c in rows],
        "at_id": [c.at_id for c in rows],
    }


async def read_counters(documents: docs.Documents, relay: str, shard: int) -> dict[str, Counter]:
    path = counters_path(relay, shard)
    found = await documents.get_all([path])
    return counters_of(path, found.get(path))


async def settle(
    documents: docs.Documents,
    collection: str,
    relay: str,
    shard: int,
    entry_ids: Sequence[str],
    counters: Mapping[str, Counter],
    fence: docs.Fence,
) -> None:
    """Delete the published entries and write the shard's counters, in one Commit fenced by ``fence``.
    Raises what ``Documents.commit`` raises (``Fenced``: the lease moved on, nothing applied)."""
    writes = [docs.delete(entry_path(collection, entry_id)) for entry_id in entry_ids]
    writes.append(docs.replace(counters_path(relay, shard), counter_fields(counters)))
    await documents.commit(writes, [fence])


def listen_outbox(
    documents: docs.Documents,
    collection: str,
    on_change: Callable[[docs.Change], None],
    on_error: Callable[[StoreError], None],
) -> docs.Listening:
    """Every entry of the outbox ``collection`` (a top-level collection), as consistent snapshots."""
    return documents.listen("", collection, [], on_change, on_error)


async def write_entry(documents: docs.Documents, collection: str, entry_id: str, fields: docs.Fields) -> None:
    """An entry written by the sidecar itself (the ``Publish`` RPC): a create, durable on return."""
    await documents.commit([docs.create(entry_path(collection, entry_id), fields)])


# ---- the waiting room ------------------------------------------------------------------------

WAITING = "waiting"
"""A waiting document's state: the relay gave up on the entry; its key waits for an operator."""
DISCARDED = "discarded"
"""A waiting document's state: an operator discarded the entry (deleted from the outbox) with a note."""


def waiting_fields(key: str | None, reason: str, state: str, at: datetime.datetime, note: str = "") -> docs.Fields:
    return {"v": COUNTERS_VERSION, "key": key, "reason": reason, "state": state, "at": at, "note": note}


async def give_up(documents: docs.Documents, relay: str, entry_id: str, key: str, reason: str) -> None:
    """Record that the relay gave up on an entry (a publish failed for good): its key waits."""
    fields = waiting_fields(key, reason, WAITING, datetime.datetime.now(datetime.UTC))
    await documents.commit([docs.replace(waiting_path(relay, entry_id), fields)])


async def retry(documents: docs.Documents, relay: str, entry_id: str) -> None:
    """An operator's retry: the relay publishes the entry again (with the key's next number)."""
    await documents.commit([docs.delete(waiting_path(relay, entry_id))])


async def discard(
    documents: docs.Documents, collection: str, relay: str, entry_id: str, key: str | None, reason: str, note: str
) -> None:
    """An operator's discard, in one Commit: the entry leaves the outbox (its key flows on: no number
    was used) and its waiting document records the decision with the note."""
    fields = waiting_fields(key, reason, DISCARDED, datetime.datetime.now(datetime.UTC), note)
    await documents.commit(
        [docs.delete(entry_path(collection, entry_id)), docs.replace(waiting_path(relay, entry_id), fields)]
    )


def listen_waiting(
    documents: docs.Documents,
    relay: str,
    on_change: Callable[[docs.Change], None],
    on_error: Callable[[StoreError], None],
) -> docs.Listening:
    """The entries the relay gave up on (state ``waiting``), as consistent snapshots."""
    return documents.listen(relay, "waiting", [docs.Filter("state", "EQUAL", WAITING)], on_change, on_error)


async def snapshot(
    documents: docs.Documents, parent: str, collection: str, where: Sequence[docs.Filter] = ()
) -> list[tuple[str, docs.Fields, int]]:
    """One consistent snapshot of a collection (id, fields, update time), read with a Listen that is
    closed at once (the operator's commands; works for a top-level collection, ``parent`` empty)."""
    first: asyncio.Future[list[tuple[str, docs.Fields, int]]] = asyncio.get_running_loop().create_future()

    def on_change(change: docs.Change) -> None:
        if change.initial and not first.done():
            first.set_result(change.upserts)

    def on_error(error: StoreError) -> None:
        if not first.done():
            first.set_exception(error)

    listening = documents.listen(parent, collection, list(where), on_change, on_error)
    try:
        return await first
    finally:
        await listening.close()
