"""The document store: current versions indexed by collection, plus recent history for read_time.

Invariants:
- A stored ``Record.doc`` is never mutated after it is stored; a write stores a new message. So
  readers may hand it out without copying, and a version is identified by ``update_us``.
- Update times come from ``Clock``: strictly increasing microseconds, so an ``update_time``
  precondition names exactly one version, and no two commits share a commit time.
- ``apply`` changes every document of one commit with no ``await`` in between: the servicer runs on
  one asyncio loop, so a commit is atomic to every other request.
- Documents are indexed by their parent collection (full path), each collection keeping its ids
  sorted lazily: a write is O(1) (a dict insert plus a pending-list append); the sort cost is paid
  by the next name-ordered read, and is near linear because the list is already mostly sorted.
  Queries look only at the collections they name, never at the whole database.
- History keeps, for ``retention_us``, each version that was overwritten or deleted, with the commit
  time that ended it; a read at time T takes the first version ending after T, else the current
  one, and a version whose ``update_us`` is later than T reads as missing.
  Collections are listed at T only if they held a document at T (``collection_paths``).
- ``observers`` are called after every ``apply`` that changed something, with the changed names
  and their new records (None: deleted), still inside the commit's synchronous step: so a
  listener (``listen``) sees every commit, whole, in commit order.
- ``write_observers`` are called once per changed document inside ``apply``, with the name, the
  old record and the new one (None: absent), before ``observers``: index bookkeeping (TTL expiry,
  hotspots) needs the old version, which is gone once the commit is applied.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sidecar.emulators.firestore.equality_index import EqualityIndexes

_INSORT_MAX = 32
"""Pending ids merged one by one with bisect below this; above, append and re-sort (timsort merges runs)."""


class Clock:
    """Strictly increasing wall-clock microseconds (commit and update times)."""

    def __init__(self) -> None:
        self._last = 0

    def tick(self) -> int:
        now = time.time_ns() // 1000
        self._last = now if now > self._last else self._last + 1
        return self._last

    def now(self) -> int:
        """The current time without consuming a tick (a read time)."""
        return max(time.time_ns() // 1000, self._last)


@dataclass(slots=True)
class Record:
    doc: Any
    """A Document message with name, fields, create_time and update_time set; never mutated."""
    create_us: int
    update_us: int


class Collection:
    """The documents directly inside one collection, with their ids kept lazily sorted."""

    __slots__ = ("_pending", "_sorted", "_tombstones", "docs")

    def __init__(self) -> None:
        self.docs: dict[str, Record] = {}
        self._sorted: list[str] = []
        self._pending: dict[str, None] = {}
        self._tombstones: set[str] = set()

    def put(self, doc_id: str, record: Record) -> None:
        if doc_id not in self.docs:
            if doc_id in self._tombstones:
                self._tombstones.discard(doc_id)
            else:
                self._pending[doc_id] = None
        self.docs[doc_id] = record

    def remove(self, doc_id: str) -> None:
        del self.docs[doc_id]
        if doc_id in self._pending:
            del self._pending[doc_id]
        else:
            self._tombstones.add(doc_id)

    def sorted_ids(self) -> list[str]:
        """All current ids in order (may contain deleted ids: callers check ``docs``)."""
        if self._pending:
            if len(self._pending) <= _INSORT_MAX:
                for doc_id in self._pending:
                    bisect.insort(self._sorted, doc_id)
            else:
                self._sorted.extend(self._pending)
                self._sorted.sort()
            self._pending.clear()
        if len(self._tombstones) > len(self._sorted) // 4 + 64:
            dead = self._tombstones
            self._sorted = [i for i in self._sorted if i not in dead]
            self._tombstones = set()
        return self._sorted

    def iter_ids(self, start: str | None = None, reverse: bool = False) -> Iterator[str]:
        """Live ids in order, from ``start`` (inclusive) when given."""
        ids = self.sorted_ids()
        docs = self.docs
        if not reverse:
            begin = 0 if start is None else bisect.bisect_left(ids, start)
            for i in range(begin, len(ids)):
                if ids[i] in docs:
                    yield ids[i]
        else:
            end = len(ids) if start is None else bisect.bisect_right(ids, start)
            for i in range(end - 1, -1, -1):
                if ids[i] in docs:
                    yield ids[i]


@dataclass
class DocumentStore:
    """All documents of all databases, keyed by full document name."""

    retention_us: int = 60_000_000
    clock: Clock = field(default_factory=Clock)
    collections: dict[str, Collection] = field(default_factory=dict)
    by_collection_id: dict[str, set[str]] = field(default_factory=dict)
    """collection id -> full paths of collections with that id (collection-group queries)."""
    _history: dict[str, list[tuple[int, Record]]] = field(default_factory=dict)
    _history_order: deque[tuple[int, str]] = field(default_factory=deque)
    _history_by_collection: dict[str, dict[str, None]] = field(default_factory=dict)
    observers: list[Callable[[list[tuple[str, Record | None]], int], None]] = field(default_factory=list)
    write_observers: list[Callable[[str, Record | None, Record | None], None]] = field(default_factory=list)
    equality: EqualityIndexes = field(default_factory=EqualityIndexes)
    """Equality indexes of the current documents, kept by ``apply`` (``equality_index``)."""

    def clear(self) -> None:
        self.equality.clear()
        self.collections.clear()
        self.by_collection_id.clear()
        self._history.clear()
        self._history_order.clear()
        self._history_by_collection.clear()

    def get(self, name: str) -> Record | None:
        parent, _, doc_id = name.rpartition("/")
        collection = self.collections.get(parent)
        return None if collection is None else collection.docs.get(doc_id)

    def get_at(self, name: str, read_us: int | None) -> Record | None:
        """The version of ``name`` visible at ``read_us`` (None: the latest)."""
        current = self.get(name)
        if read_us is None:
            return current
        version = current
        for end_us, old in self._history.get(name, ()):
            if end_us > read_us:
                version = old
                break
        if version is not None and version.update_us > read_us:
            return None
        return version

    def names_in(self, collection_path: str, read_us: int | None) -> Iterator[str]:
        """Every name that may hold a document of the collection at ``read_us`` (unordered)."""
        collection = self.collections.get(collection_path)
        if collection is not None:
            for doc_id in collection.docs:
                yield f"{collection_path}/{doc_id}"
        if read_us is not None:
            live = collection.docs if collection is not None else {}
            for name in self._history_by_collection.get(collection_path, ()):
                if name.rpartition("/")[2] not in live:
                    yield name

    def collection_paths(self, read_us: int | None, prefix: str = "") -> Iterator[str]:
        """Full paths of the collections below ``prefix`` holding a document at ``read_us`` (None: now).

        A collection exists while it holds a document, so one created after ``read_us``, or whose
        documents were all created after it or deleted before it, is not listed.
        """
        for path in self.known_collection_paths(read_us, prefix):
            if read_us is None or self.holds_documents_at(path, read_us):
                yield path

    def known_collection_paths(self, read_us: int | None, prefix: str = "") -> Iterator[str]:
        """Paths below ``prefix`` that hold documents now or held some in the remembered history."""
        for path in self.collections:
            if path.startswith(prefix):
                yield path
        if read_us is not None:
            for path in self._history_by_collection:
                if path not in self.collections and path.startswith(prefix):
                    yield path

    def holds_documents_at(self, path: str, read_us: int) -> bool:
        return any(self.get_at(name, read_us) is not None for name in self.names_in(path, read_us))

    def child_collection_ids(self, parent: str, read_us: int | None) -> set[str]:
        """Ids of the collections directly under ``parent`` with a document at any depth at ``read_us``."""
        prefix = parent + "/"
        return {path[len(prefix) :].split("/", 1)[0] for path in self.collection_paths(read_us, prefix)}

    def apply(self, changes: dict[str, Record | None], commit_us: int) -> None:
        """Store new versions (None deletes) of several documents at once; see the module docstring."""
        changed: list[tuple[str, Record | None]] = []
        for name, record in changes.items():
            parent, _, doc_id = name.rpartition("/")
            collection = self.collections.get(parent)
            old = None if collection is None else collection.docs.get(doc_id)
            if old is record:
                continue
            changed.append((name, record))
            for write_observer in self.write_observers:
                write_observer(name, old, record)
            old_doc = None if old is None else old.doc
            self.equality.on_write(parent, doc_id, old_doc, None if record is None else record.doc)
            if old is not None:
                self._remember(name, parent, old, commit_us)
            if record is None:
                if old is not None:
                    assert collection is not None
                    collection.remove(doc_id)
                    if not collection.docs:
                        self._drop_collection(parent)
                continue
            if collection is None:
                collection = self.collections[parent] = Collection()
                cid = parent.rpartition("/")[2]
                self.by_collection_id.setdefault(cid, set()).add(parent)
            collection.put(doc_id, record)
        self._expire_history(commit_us)
        if changed:
            for observer in self.observers:
                observer(changed, commit_us)

    def _drop_collection(self, path: str) -> None:
        del self.collections[path]
        self.equality.drop_collection(path)
        cid = path.rpartition("/")[2]
        paths = self.by_collection_id.get(cid)
        if paths is not None:
            paths.discard(path)
            if not paths:
                del self.by_collection_id[cid]

    def _remember(self, name: str, parent: str, old: Record, end_us: int) -> None:
        if self.retention_us <= 0:
            return
        self._history.setdefault(name, []).append((end_us, old))
        self._history_order.append((end_us, name))
        self._history_by_collection.setdefault(parent, {})[name] = None

    def _expire_history(self, now_us: int) -> None:
        horizon = now_us - self.retention_us
        order = self._history_order
        while order and order[0][0] < horizon:
            _, name = order.popleft()
            versions = self._history.get(name)
            if not versions:
                continue
            versions.pop(0)
            if not versions:
                del self._history[name]
                parent = name.rpartition("/")[0]
                names = self._history_by_collection.get(parent)
                if names is not None:
                    names.pop(name, None)
                    if not names:
                        del self._history_by_collection[parent]

    def oldest_readable_us(self, now_us: int) -> int:
        return now_us - self.retention_us

    def changed_after(self, name: str, since_us: int) -> bool:
        """Whether any commit after ``since_us`` wrote or deleted ``name`` (needs ``since_us`` within retention)."""
        current = self.get(name)
        if current is not None and current.update_us > since_us:
            return True
        return any(end_us > since_us for end_us, _ in self._history.get(name, ()))

    def versions_after(self, name: str, since_us: int) -> list[Record]:
        """Every version of ``name`` current at some moment after ``since_us``, oldest first."""
        versions = [old for end_us, old in self._history.get(name, ()) if end_us > since_us]
        current = self.get(name)
        if current is not None:
            versions.append(current)
        return versions
