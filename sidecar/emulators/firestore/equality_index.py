"""Equality indexes: a query with ``field == value`` reads the matching documents, not the collection;
one with ``field < value`` (or ``<=``, ``>``, ``>=``) reads the documents holding a scalar there.

Production serves every query from indexes, so its cost follows the size of the result, not of the
collection (Firestore's documented query performance). A scan of the collection per query made the
emulator's cost grow with the collection instead: a sidecar's 16 per-shard loads (``shard == X``)
and inbox Listens (``inbox == X``) each walked every message document, blocking the emulator's one
event loop for seconds, long enough for lease renewals queued behind them to miss their margin.

An index per (collection, field path) maps a value's key (``values.value_key``: equal keys for
equal values, ints and doubles alike) to the ids of the current documents holding it. It is built
on the first query that asks for it (one scan) and then kept by ``DocumentStore.apply``, inside the
commit's synchronous step, so it always agrees with the current documents. Only scalar values are
indexed (null, NaN, arrays and maps fall back to the scan; their equality rules differ). Queries at
a read time (transactions, ``read_time``) still scan that time's versions.
"""

from __future__ import annotations

import math
from typing import Any

from sidecar.emulators.firestore.paths import FieldPath
from sidecar.emulators.firestore.values import Key, get_field, value_key

_SCALARS = frozenset(
    {"boolean_value", "integer_value", "double_value", "timestamp_value"}
    | {"string_value", "bytes_value", "reference_value"}
)


def indexable_key(value: Any) -> Key | None:
    """The key to look ``value`` up by, or None when it is not a scalar this index serves."""
    kind = value.WhichOneof("value_type")
    if kind not in _SCALARS or (kind == "double_value" and math.isnan(value.double_value)):
        return None
    return value_key(value)


class EqualityIndexes:
    """Per (collection path, field path): value key -> ids of the current documents with that value."""

    def __init__(self) -> None:
        self._by_collection: dict[str, dict[FieldPath, dict[Key, set[str]]]] = {}

    def clear(self) -> None:
        self._by_collection.clear()

    def lookup(self, collection_path: str, docs: dict[str, Any], path: FieldPath, key: Key) -> set[str]:
        """Ids in the collection whose field ``path`` equals the value of ``key``; ``docs`` (id ->
        Record) builds the index on first use."""
        indexes = self._by_collection.setdefault(collection_path, {})
        index = indexes.get(path)
        if index is None:
            index = indexes[path] = {}
            for doc_id, record in docs.items():
                _add(index, record.doc, path, doc_id)
        return index.get(key, _EMPTY)

    def holding(self, collection_path: str, docs: dict[str, Any], path: FieldPath) -> set[str]:
        """Ids in the collection whose field ``path`` holds a scalar this index serves (what a
        range filter on a scalar can match: ``<`` and friends compare within one type)."""
        self.lookup(collection_path, docs, path, _NO_KEY)  # builds the index on first use
        index = self._by_collection[collection_path][path]
        return set().union(*index.values()) if index else set()

    def on_write(self, collection_path: str, doc_id: str, old: Any | None, new: Any | None) -> None:
        """A document changed (``old``/``new``: Document messages, None when absent)."""
        indexes = self._by_collection.get(collection_path)
        if not indexes:
            return
        for path, index in indexes.items():
            if old is not None:
                _discard(index, old, path, doc_id)
            if new is not None:
                _add(index, new, path, doc_id)

    def drop_collection(self, collection_path: str) -> None:
        self._by_collection.pop(collection_path, None)


_EMPTY: set[str] = set()
_NO_KEY: Key = (-1,)
"""Looked up only to build an index: no value has it."""


def _key_of(doc: Any, path: FieldPath) -> Key | None:
    value = get_field(doc.fields, path)
    return None if value is None else indexable_key(value)


def _add(index: dict[Key, set[str]], doc: Any, path: FieldPath, doc_id: str) -> None:
    key = _key_of(doc, path)
    if key is not None:
        index.setdefault(key, set()).add(doc_id)


def _discard(index: dict[Key, set[str]], doc: Any, path: FieldPath, doc_id: str) -> None:
    key = _key_of(doc, path)
    if key is None:
        return
    ids = index.get(key)
    if ids is not None:
        ids.discard(doc_id)
        if not ids:
            del index[key]
