"""One Listen target's result set: what the client was told, and the changes that bring it up to date.

A target is a query (``QueryTarget``) or a list of documents (``DocumentsTarget``). It remembers the
result set it last sent (``sent``: name -> update time) and which names commits touched since
(``dirty``); ``flush`` turns that into DocumentChange / DocumentDelete / DocumentRemove responses and
returns the reads they cost (see ``listen`` for the billing rules). Everything here is synchronous and
runs between two commits, so a flush always describes a state some commit produced.

Queries whose membership is a property of each document alone (``query.is_incremental``: no limit,
offset or kindless scope) are kept up to date document by document. Others (``limit``, ``offset``,
kindless) re-run the query on every relevant commit and compare: correct for every query, at the
price of a scan; the sidecar only listens with equality filters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from sidecar.emulators.firestore import protos as pb
from sidecar.emulators.firestore.documents import DocumentStore, Record
from sidecar.emulators.firestore.query import CompiledQuery, execute, in_scope, is_incremental, matches

_CURRENT = pb.TARGET_CHANGE.Value("CURRENT")


class Target(ABC):
    """Common state: the id on the stream, the sent result set and the names touched since."""

    def __init__(self, target_id: int, once: bool) -> None:
        self.target_id = target_id
        self.once = once
        self.sent: dict[str, int] = {}
        self.dirty: dict[str, None] = {}
        self.rescan = False
        """Set by a relevant commit for targets that re-run their query instead of tracking names."""

    # ---- what a subclass defines --------------------------------------------------------------

    @property
    def tracks_names(self) -> bool:
        return True

    @abstractmethod
    def admits(self, record: Record) -> bool: ...

    @abstractmethod
    def candidates_after(self, store: DocumentStore, since_us: int) -> Iterator[str]:
        """Names that may have been in the result at some moment since ``since_us``."""
        ...

    @abstractmethod
    def current(self, store: DocumentStore) -> list[Record]: ...

    @abstractmethod
    def collection_paths(self) -> list[str] | None:
        """Collections whose documents can matter (the hub's index), or None: check ``concerns``."""
        ...

    @abstractmethod
    def concerns(self, name: str) -> bool: ...

    # ---- commits ------------------------------------------------------------------------------

    def touch(self, name: str, record: Record | None) -> bool:
        """Note a commit's change of ``name``; True if it may change what the client sees."""
        if not self.tracks_names:
            self.rescan = True
            return True
        if name in self.sent or (record is not None and self.admits(record)):
            self.dirty.pop(name, None)  # re-insert: flush in the order of the latest commits
            self.dirty[name] = None
            return True
        return False

    # ---- responses ----------------------------------------------------------------------------

    def initial(self, store: DocumentStore, out: list[Any], read_us: int) -> int:
        """ADD, the whole result set, CURRENT; the reads a fresh listen costs (at least one)."""
        out.append(_target_change("ADD", self.target_id))
        return self._fill(store, out, read_us)

    def reset(self, store: DocumentStore, out: list[Any], read_us: int) -> int:
        """A resume from too far back: ADD, RESET (the client forgets its set), the whole set, CURRENT."""
        out.append(_target_change("ADD", self.target_id))
        out.append(_target_change("RESET", self.target_id))
        return self._fill(store, out, read_us)

    def _fill(self, store: DocumentStore, out: list[Any], read_us: int) -> int:
        records = self.current(store)
        for record in records:
            out.append(_change(record, self.target_id))
            self.sent[record.doc.name] = record.update_us
        out.append(_current(self.target_id, read_us))
        return max(1, len(records))

    def resume(self, store: DocumentStore, out: list[Any], since_us: int, read_us: int) -> int:
        """ADD, what changed since ``since_us`` (within retention), CURRENT; the reads the changes cost.

        The client may hold changes it received after ``since_us`` but never saw consistent (the
        stream broke before the next snapshot), so every name touched since then that was in the
        result at any moment since is sent again: its current version, or a delete/remove.
        """
        if not self.tracks_names:
            return self.reset(store, out, read_us)
        out.append(_target_change("ADD", self.target_id))
        reads = 0
        for name in self.candidates_after(store, since_us):
            record = store.get(name)
            is_in = record is not None and self.admits(record)
            if not store.changed_after(name, since_us):
                if is_in:
                    assert record is not None
                    self.sent[name] = record.update_us
                continue
            if is_in:
                assert record is not None
                out.append(_change(record, self.target_id))
                self.sent[name] = record.update_us
                reads += 1
            elif any(self.admits(v) for v in store.versions_after(name, since_us)):
                out.append(_gone(name, record, self.target_id, read_us))
                before = store.get_at(name, since_us)
                reads += record is not None and before is not None and self.admits(before)
        out.append(_current(self.target_id, read_us))
        return reads

    def flush(self, store: DocumentStore, out: list[Any], read_us: int) -> int:
        """Responses that bring the client from ``sent`` to the current state; the reads they cost."""
        if not self.tracks_names:
            if not self.rescan:
                return 0
            self.rescan = False
            now = {record.doc.name: record for record in self.current(store)}
            names = [n for n in self.sent if n not in now] + list(now)
        else:
            names = list(self.dirty)
            now = None
        self.dirty.clear()
        reads = 0
        for name in names:
            record = store.get(name)
            if now is not None:
                is_in = name in now
            else:
                is_in = record is not None and self.admits(record)
            if is_in:
                assert record is not None
                if self.sent.get(name) != record.update_us:
                    out.append(_change(record, self.target_id))
                    self.sent[name] = record.update_us
                    reads += 1
            elif name in self.sent:
                del self.sent[name]
                out.append(_gone(name, record, self.target_id, read_us))
                # Production bills a document that left the result because it changed, not a delete.
                reads += record is not None
        return reads

    def forget_all(self) -> None:
        """The store was cleared: everything sent is gone (the next flush says so)."""
        if self.tracks_names:
            for name in self.sent:
                self.dirty[name] = None
        else:
            self.rescan = True


class QueryTarget(Target):
    def __init__(self, target_id: int, once: bool, query: CompiledQuery) -> None:
        super().__init__(target_id, once)
        self.query = query
        self._incremental = is_incremental(query)

    @property
    def tracks_names(self) -> bool:
        return self._incremental

    def admits(self, record: Record) -> bool:
        return matches(self.query, record.doc)

    def candidates_after(self, store: DocumentStore, since_us: int) -> Iterator[str]:
        for path in self.query.collections(store, since_us):
            yield from store.names_in(path, since_us)

    def current(self, store: DocumentStore) -> list[Record]:
        return execute(store, self.query, None)

    def collection_paths(self) -> list[str] | None:
        if self._incremental and not self.query.all_descendants:
            return [f"{self.query.parent}/{self.query.collection_id}"]
        return None

    def concerns(self, name: str) -> bool:
        parent = name.rpartition("/")[0]
        if self.query.collection_id:
            return in_scope(self.query, parent)
        return parent.startswith(self.query.parent + "/")


class DocumentsTarget(Target):
    def __init__(self, target_id: int, once: bool, names: list[str]) -> None:
        super().__init__(target_id, once)
        self.names = dict.fromkeys(names)

    def admits(self, record: Record) -> bool:
        return record.doc.name in self.names

    def candidates_after(self, store: DocumentStore, since_us: int) -> Iterator[str]:
        return iter(self.names)

    def current(self, store: DocumentStore) -> list[Record]:
        return [record for record in map(store.get, self.names) if record is not None]

    def collection_paths(self) -> list[str] | None:
        return sorted({name.rpartition("/")[0] for name in self.names})

    def concerns(self, name: str) -> bool:
        return name in self.names


def _target_change(kind: str, *target_ids: int) -> Any:
    return pb.ListenResponse(
        target_change=pb.TargetChange(target_change_type=pb.TARGET_CHANGE.Value(kind), target_ids=target_ids)
    )


def resume_token(read_us: int) -> bytes:
    """An opaque token naming a consistent snapshot: its read time (production's are opaque bytes too)."""
    return b"\x01" + read_us.to_bytes(8, "big")


def _current(target_id: int, read_us: int) -> Any:
    change = pb.TargetChange(
        target_change_type=_CURRENT,
        target_ids=[target_id],
        resume_token=resume_token(read_us),
        read_time=pb.timestamp_from_micros(read_us),
    )
    return pb.ListenResponse(target_change=change)


def _change(record: Record, target_id: int) -> Any:
    response = pb.ListenResponse()
    response.document_change.document.CopyFrom(record.doc)
    response.document_change.target_ids.append(target_id)
    return response


def _gone(name: str, record: Record | None, target_id: int, read_us: int) -> Any:
    """DocumentDelete if the document no longer exists, else DocumentRemove (it stopped matching)."""
    response = pb.ListenResponse()
    gone = response.document_delete if record is None else response.document_remove
    gone.document = name
    gone.removed_target_ids.append(target_id)
    gone.read_time.CopyFrom(pb.timestamp_from_micros(read_us))
    return response
