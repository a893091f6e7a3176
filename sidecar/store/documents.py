"""The seam between the store's logic and a document database: plain writes in, plain fields out.

``sidecar.store.document_store`` decides *what* to write and read; an implementation of
``Documents`` does it: ``sidecar.store.firestore`` on Firestore (the one module that imports the
Firestore client), ``sidecar.store.memory_documents`` in memory (crash simulation and tests).
Keeping the seam this small is what lets the crash simulation run the store's real write planning
against an in-memory model with Firestore's semantics.

Semantics every implementation keeps (Firestore's own):

- Paths are relative to the database's ``documents/`` root, e.g. ``pubsub-sidecar/orders/keys/ab12``.
- Values are ``None``, ``bool``, ``int``, ``str``, ``bytes``, ``datetime`` (UTC) and lists of these.
- ``commit`` is atomic: every write applies, or none (one failed precondition fails all).
- ``batch_write`` is not atomic: one status per write, index-aligned (gRPC codes, 0 = OK).
- A write with ``mask`` updates only the named fields (a named field absent from ``fields`` is
  deleted); without a mask the document is replaced. ``exists=False`` is a create (ALREADY_EXISTS
  if present), ``exists=True`` requires the document (NOT_FOUND otherwise).
- ``update_time_us`` on a write is a compare-and-set: it applies only to the version read with
  that update time (FAILED_PRECONDITION otherwise). A write that leaves a document's fields as they
  were keeps its update time (Firestore's WriteResult rule); update times grow strictly per commit.
- Errors: ``Unavailable`` (transient; a write may or may not have applied), ``RequestRejected``
  (the request was refused as invalid, nothing applied), ``Misconfigured`` (permission, missing
  database or index: nothing a retry of the same call fixes soon), ``AlreadyExists`` (``commit``
  only: a create found its document), ``Fenced`` (``commit`` with fences: a fence did not hold,
  nothing applied), ``PreconditionFailed`` (``commit`` only: an ``update_time``
  precondition did not match).
- ``commit(writes, fences)``: every ``Fence`` names a document (a shard's lease) and field values it
  must still have when the writes apply. The check and the writes are one atomic step: no write to
  a fence document can come between them. Without fences a commit costs what it always did.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from sidecar.store.api import StoreError, StoreRejected, StoreUnavailable

Fields = dict[str, Any]
Operator = Literal["EQUAL", "GREATER_THAN_OR_EQUAL", "LESS_THAN"]

OK = 0
ALREADY_EXISTS = 6
FAILED_PRECONDITION = 9
"""A write's ``update_time`` precondition did not match the stored version (compare-and-set lost)."""
RETRYABLE_CODES = frozenset({1, 2, 4, 8, 10, 13, 14})
"""Per-write statuses of BatchWrite that are transient (CANCELLED .. UNAVAILABLE)."""
INPUT_CODES = frozenset({3, 11})
"""INVALID_ARGUMENT and OUT_OF_RANGE: the write itself was refused."""

MAX_WRITES = 500
"""Writes per Commit/BatchWrite request (Firestore's long-standing bound)."""


class Unavailable(StoreUnavailable):
    """Transient. For a write: it may have applied (the answer was lost)."""


class RequestRejected(StoreRejected):
    """The request was refused as invalid; nothing applied."""


class Misconfigured(StoreRejected):
    """Permission, database or index trouble: an operator must act."""


class AlreadyExists(StoreError):
    """``commit``: a create precondition found its document; nothing applied."""


class PreconditionFailed(StoreError):
    """``commit``: an ``update_time`` precondition did not match (the document changed); nothing applied."""


@dataclass(frozen=True, slots=True)
class Fence:
    """A condition a fenced ``commit`` checks atomically with its writes."""

    path: str
    """A lease document."""
    expected: Mapping[str, Any]
    """Field values it must still have, e.g. ``{"owner": "pod-a", "epoch": 7}``; a missing document fails."""


class Fenced(StoreError):
    """A fence of a ``commit`` did not hold (the lease changed hands): nothing of the commit applied."""

    def __init__(self, paths: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.paths: tuple[str, ...] = tuple(paths)
        """The fence documents whose fields differed (or that were missing)."""


def failed_fences(fences: Sequence[Fence], found: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """Paths of the fences that ``found`` (path -> fields, None when missing) does not satisfy."""
    failed = []
    for fence in fences:
        fields = found.get(fence.path)
        if fields is None or any(
            name not in fields or fields[name] != value or type(fields[name]) is not type(value)
            for name, value in fence.expected.items()
        ):
            failed.append(fence.path)
    return failed


def fenced_error(what: str, paths: Sequence[str]) -> Fenced:
    return Fenced(paths, f"{what}: fence not held (the lease changed): {', '.join(paths)}")


@dataclass(frozen=True, slots=True)
class Write:
    """One document write. Build with ``create``, ``replace``, ``merge`` or ``delete``."""

    path: str
    fields: Mapping[str, Any] | None = None
    """None for a delete."""
    mask: tuple[str, ...] | None = None
    """Field paths to update (absent from ``fields``: deleted); None replaces the document."""
    exists: bool | None = None
    """Precondition: False = must not exist (create), True = must exist, None = none."""
    update_time_us: int | None = None
    """Precondition: the stored version's update time must be exactly this (compare-and-set);
    FAILED_PRECONDITION otherwise, a missing document included. Excludes ``exists``."""

    def __post_init__(self) -> None:
        if self.update_time_us is not None and self.exists is not None:
            # One precondition per write in Firestore (``current_document`` is a oneof).
            raise ValueError(f"write to {self.path}: exists and update_time_us preconditions exclude each other")

    @property
    def is_delete(self) -> bool:
        return self.fields is None


def create(path: str, fields: Mapping[str, Any]) -> Write:
    return Write(path, fields, None, False)


def replace(path: str, fields: Mapping[str, Any]) -> Write:
    return Write(path, fields)


def merge(path: str, fields: Mapping[str, Any], mask: Sequence[str]) -> Write:
    return Write(path, fields, tuple(mask))


def delete(path: str) -> Write:
    return Write(path)


@dataclass(frozen=True, slots=True)
class Filter:
    field: str
    op: Operator
    value: Any


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a query: (document id, fields) in (``order_by``, name) order, and where to go on."""

    documents: list[tuple[str, Fields]]
    after: object | None
    """Opaque cursor for the next page; None when this page was the last."""


class Documents(Protocol):
    async def commit(self, writes: Sequence[Write], fences: Sequence[Fence] = ()) -> None:
        """Apply all writes atomically if every fence holds, or raise (``Fenced`` when one does not)."""
        ...

    async def batch_write(self, writes: Sequence[Write]) -> list[tuple[int, str]]:
        """Apply each write on its own: (gRPC code, message) per write. Raises only for the whole call."""
        ...

    async def get_all(self, paths: Sequence[str]) -> dict[str, Fields | None]:
        """Fields by path, None for a missing document, in one batched read."""
        ...

    async def query(
        self,
        parent: str,
        collection: str,
        where: Filter | Sequence[Filter] | None,
        order_by: str | None,
        after: object | None,
        limit: int,
    ) -> Page:
        """Documents of ``parent/collection`` matching ``where`` (a list: all of them), ordered by
        (``order_by``, name). Equality filters on several fields need no composite index."""
        ...

    async def get_versioned(self, paths: Sequence[str]) -> tuple[int, dict[str, Versioned]]:
        """One batched read: its read time (the database's clock, microseconds) and every document
        with its update time (``Versioned(None, None)`` for a missing one)."""
        ...

    async def close(self) -> None: ...

    def listen(
        self,
        parent: str,
        collection: str,
        where: Sequence[Filter],
        on_change: Callable[[Change], None],
        on_error: Callable[[StoreError], None],
    ) -> Listening:
        """Watch ``parent/collection`` documents matching every filter (equalities). ``on_change`` is called
        on the calling event loop (never on a client thread), once per consistent snapshot, in order."""
        ...


def filters_of(where: Filter | Sequence[Filter] | None) -> list[Filter]:
    """``query``'s ``where`` as a list (empty: no filter)."""
    if where is None:
        return []
    if isinstance(where, Filter):
        return [where]
    return list(where)


def utc_from_ms(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)


@dataclass(frozen=True, slots=True)
class Change:
    """One consistent snapshot of a listen's result set, as a change from the previous one."""

    upserts: list[tuple[str, Fields, int]]
    """(document id, fields, update_time_us) added to or changed in the result."""
    removals: list[str]
    """Document ids that left the result (deleted or no longer matching)."""
    read_time_us: int
    """The snapshot's read time (Firestore's clock)."""
    initial: bool
    """True for the first snapshot after (re)start: ``upserts`` is then the full result set."""


class Listening(Protocol):
    """A running ``Documents.listen``; ``close`` stops it (no ``on_change`` after it returns)."""

    async def close(self) -> None: ...


# ---- versioned reads and compare-and-set (shard leases) ----------------------------------------


@dataclass(frozen=True, slots=True)
class Versioned:
    """A document as one read saw it: fields and update time, both None when it was missing."""

    fields: Fields | None
    update_time_us: int | None


def compare_and_set(path: str, fields: Mapping[str, Any], update_time_us: int | None) -> Write:
    """Replace ``path`` only if it is still the version read with ``update_time_us``; None: create it
    (the read found it missing). Either way a concurrent writer makes this write fail, not win."""
    if update_time_us is None:
        return create(path, fields)
    return Write(path, fields, None, None, update_time_us)
