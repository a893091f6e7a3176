"""StructuredQuery evaluation over the store, with production's semantics.

- Filters: a missing field matches nothing, ``!=`` and ``not-in`` included. ``<``, ``<=``, ``>``,
  ``>=`` match only values of the operand's type class (int and double together). ``!=`` matches
  any present value not equal to the operand (null included); ``not-in`` also excludes null, and
  matches nothing when its list holds null. ``in``/``not-in``/``array-contains-any`` take a
  non-empty array of at most 30 values. IS_NAN / IS_NULL and their NOT forms need the field;
  IS_NOT_NAN (``!= NaN``) matches neither NaN nor null, as production does.
- Order: the explicit order_by, then inequality fields not already ordered (by field path), then
  ``__name__`` in the direction of the last order. A document lacking an ordered field is left
  out. Cursors compare a prefix of that order; ``before`` means start_at / end_before.
- Offset applies after cursors, limit after offset. ``select`` projects fields (``__name__`` alone
  means no fields).
- A query looks only at the collections it names: one collection, or for ``all_descendants`` the
  collections with that id below the parent (found through the store's collection-id index).
  Ordered by ``__name__`` only, a single-collection query walks the sorted ids and stops at the
  limit, so paging through a large collection stays linear overall.
- A kindless query (empty collection id, what ``recursive()`` and ``recursive_delete`` send) reads
  every collection directly under the parent, or with ``all_descendants`` every collection below
  it at any depth. ``recursive()`` bounds it with ``__name__`` cursors such as
  ``coll/__id-9223372036854775808__`` and ``coll\0/__id-...__``: an ``__id<n>__`` segment is
  production's numeric id, which sorts before every string id (no stored id can be one: ids of that
  form are reserved), and ``\0`` sorts right after ``coll``. Collections wholly outside the cursors
  are skipped, so such a query costs the size of the subtree, not of the database.
- An aggregation's ``sum``/``avg`` fields act as implicit existence filters (documents lacking one
  are left out of the whole aggregation, ``count`` included) ordered like inequality fields, so a
  limit picks the first documents by the explicit orders, then by those fields (production reads
  them from the field's index: ``limit(12).sum("f")`` adds the 12 smallest values of ``f``).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sidecar.emulators.firestore import limits
from sidecar.emulators.firestore.documents import DocumentStore, Record
from sidecar.emulators.firestore.equality_index import indexable_key
from sidecar.emulators.firestore.errors import invalid, unimplemented
from sidecar.emulators.firestore.paths import NAME_PATH, FieldPath, format_field_path, parse_field_path
from sidecar.emulators.firestore.protos import COMPOSITE_OP, DIRECTION, OP, UNARY_OP
from sidecar.emulators.firestore.values import (
    RANK_NULL,
    RANK_REFERENCE,
    Key,
    get_field,
    is_nan,
    is_null,
    type_rank,
    value_key,
)

Predicate = Callable[[Any], bool]
"""A test on a Document message."""

_LT, _LE, _GT, _GE = (
    OP.Value("LESS_THAN"),
    OP.Value("LESS_THAN_OR_EQUAL"),
    OP.Value("GREATER_THAN"),
    OP.Value("GREATER_THAN_OR_EQUAL"),
)
_EQ, _NE = OP.Value("EQUAL"), OP.Value("NOT_EQUAL")
_ARRAY_CONTAINS, _IN = OP.Value("ARRAY_CONTAINS"), OP.Value("IN")
_ARRAY_CONTAINS_ANY, _NOT_IN = OP.Value("ARRAY_CONTAINS_ANY"), OP.Value("NOT_IN")
_INEQUALITIES = {_LT, _LE, _GT, _GE, _NE, _NOT_IN}
_IS_NAN, _IS_NULL = UNARY_OP.Value("IS_NAN"), UNARY_OP.Value("IS_NULL")
_IS_NOT_NAN, _IS_NOT_NULL = UNARY_OP.Value("IS_NOT_NAN"), UNARY_OP.Value("IS_NOT_NULL")
_AND, _OR = COMPOSITE_OP.Value("AND"), COMPOSITE_OP.Value("OR")
_DESCENDING = DIRECTION.Value("DESCENDING")
_NUMERIC_ID = re.compile(r"__id-?\d+__\Z")
"""Production's spelling of a numeric document id inside a reference (only ever in a cursor here)."""


def name_key(name: str) -> Key:
    """The ordering key of a document name, as a reference value's key."""
    return (RANK_REFERENCE, tuple(name.split("/")))


def _field_value_key(doc: Any, path: FieldPath) -> Key | None:
    if path == NAME_PATH:
        return name_key(doc.name)
    value = get_field(doc.fields, path)
    return None if value is None else value_key(value)


@dataclass
class Cursor:
    keys: list[Key]
    before: bool


@dataclass
class CompiledQuery:
    """A validated StructuredQuery bound to its parent, ready to run any number of times."""

    parent: str
    collection_id: str
    all_descendants: bool
    predicate: Predicate | None
    orders: list[tuple[FieldPath, bool]]
    start: Cursor | None = None
    end: Cursor | None = None
    offset: int = 0
    limit: int | None = None
    projection: list[FieldPath] | None = None
    descending: list[bool] = field(default_factory=list)
    equalities: list[tuple[FieldPath, Key]] = field(default_factory=list)
    """``field == scalar`` conditions every result must meet (ANDed): served by equality indexes."""
    range_paths: list[FieldPath] = field(default_factory=list)
    """Fields with a ``<``/``<=``/``>``/``>=`` filter on a scalar that every result must meet
    (ANDed): a result holds a scalar there, so the field's equality index has every candidate."""

    def collections(self, store: DocumentStore, read_us: int | None) -> list[str]:
        prefix = self.parent + "/"
        if not self.collection_id:
            candidates: Any = [
                path
                for path in store.known_collection_paths(read_us, prefix)
                if (self.all_descendants or "/" not in path[len(prefix) :]) and self._may_hold(path)
            ]
        elif not self.all_descendants:
            return [f"{self.parent}/{self.collection_id}"]
        elif read_us is None:
            candidates = [p for p in store.by_collection_id.get(self.collection_id, ()) if p.startswith(prefix)]
        else:
            candidates = [
                p for p in store.known_collection_paths(read_us, prefix) if p.rpartition("/")[2] == self.collection_id
            ]
        # Collections are read at read_us by the caller, so ones empty then simply yield nothing.
        return sorted(candidates)

    def _may_hold(self, path: str) -> bool:
        """False when every document of the collection at ``path`` lies outside the ``__name__`` cursors."""
        if self.orders[0] != (NAME_PATH, False):
            return True
        segments = tuple(path.split("/"))
        count = len(segments)
        if self.start is not None and self.start.keys and segments < self.start.keys[0][1][:count]:
            return False
        return not (self.end is not None and self.end.keys and segments > self.end.keys[0][1][:count])


def compile_query(parent: str, sq: Any, required_fields: Iterable[FieldPath] = ()) -> CompiledQuery:
    """Validate ``sq`` (a StructuredQuery) under ``parent``; raises INVALID_ARGUMENT naming the problem.

    ``required_fields`` (an aggregation's sum/avg fields) must exist in every result and order it
    after the explicit orders, like inequality fields (see the module docstring).
    """
    if sq.HasField("find_nearest"):
        raise unimplemented("Vector search (find_nearest) is not supported by this emulator.")
    if len(sq.from_) != 1:
        raise invalid("A query must select exactly one collection (from).")
    selector = sq.from_[0]
    if selector.collection_id:
        limits.check_id(selector.collection_id, "Collection id", parent)
    inequality_paths: list[FieldPath] = []
    predicate = _compile_filter(sq.where, inequality_paths) if sq.HasField("where") else None
    for path in required_fields:
        inequality_paths.append(path)
        predicate = _and_exists(predicate, path)
    orders: list[tuple[FieldPath, bool]] = []
    for order in sq.order_by:
        path = parse_field_path(order.field.field_path)
        if any(path == p for p, _ in orders):
            raise invalid(f"order_by: field {order.field.field_path!r} is ordered twice.")
        orders.append((path, order.direction == _DESCENDING))
    ordered = {p for p, _ in orders}
    for path in sorted(set(inequality_paths) - ordered, key=format_field_path):
        if path != NAME_PATH:
            orders.append((path, False))
    if NAME_PATH not in {p for p, _ in orders}:
        orders.append((NAME_PATH, orders[-1][1] if orders else False))
    query = CompiledQuery(
        parent=parent,
        collection_id=selector.collection_id,
        all_descendants=selector.all_descendants,
        predicate=predicate,
        orders=orders,
        descending=[d for _, d in orders],
        equalities=_equalities(sq.where) if sq.HasField("where") else [],
        range_paths=_range_paths(sq.where) if sq.HasField("where") else [],
    )
    if sq.HasField("start_at"):
        query.start = _cursor(sq.start_at, orders, "start_at")
    if sq.HasField("end_at"):
        query.end = _cursor(sq.end_at, orders, "end_at")
    if sq.offset < 0:
        raise invalid("offset must not be negative.")
    query.offset = sq.offset
    if sq.HasField("limit"):
        if sq.limit.value < 0:
            raise invalid("limit must not be negative.")
        query.limit = sq.limit.value
    if sq.HasField("select"):
        query.projection = [p for p in (parse_field_path(f.field_path) for f in sq.select.fields) if p != NAME_PATH]
    return query


def _equalities(f: Any) -> list[tuple[FieldPath, Key]]:
    """The ``field == scalar`` filters that every match must meet: the filter itself, or those
    ANDed at any depth (none under an OR). The predicate still checks every filter."""
    kind = f.WhichOneof("filter_type")
    if kind == "composite_filter" and f.composite_filter.op == _AND:
        return [found for sub in f.composite_filter.filters for found in _equalities(sub)]
    if kind != "field_filter" or f.field_filter.op != _EQ:
        return []
    path = parse_field_path(f.field_filter.field.field_path)
    key = indexable_key(f.field_filter.value) if f.field_filter.value.WhichOneof("value_type") else None
    return [] if path == NAME_PATH or key is None else [(path, key)]


def _range_paths(f: Any) -> list[FieldPath]:
    """The fields of ``<``/``<=``/``>``/``>=`` filters on a scalar that every match must meet, as
    ``_equalities`` finds its filters."""
    kind = f.WhichOneof("filter_type")
    if kind == "composite_filter" and f.composite_filter.op == _AND:
        return [found for sub in f.composite_filter.filters for found in _range_paths(sub)]
    if kind != "field_filter" or f.field_filter.op not in (_LT, _LE, _GT, _GE):
        return []
    path = parse_field_path(f.field_filter.field.field_path)
    scalar = f.field_filter.value.WhichOneof("value_type") and indexable_key(f.field_filter.value) is not None
    return [] if path == NAME_PATH or not scalar else [path]


def _and_exists(predicate: Predicate | None, path: FieldPath) -> Predicate:
    if predicate is None:
        return lambda doc: get_field(doc.fields, path) is not None
    return lambda doc: get_field(doc.fields, path) is not None and predicate(doc)


def _cursor(cursor: Any, orders: list[tuple[FieldPath, bool]], what: str) -> Cursor:
    if len(cursor.values) > len(orders):
        raise invalid(f"{what}: too many cursor values ({len(cursor.values)}) for {len(orders)} orderings.")
    keys = []
    for value, (path, _) in zip(cursor.values, orders, strict=False):
        if path == NAME_PATH:
            if value.WhichOneof("value_type") != "reference_value":
                raise invalid(f"{what}: a cursor value for __name__ must be a reference.")
            keys.append(_name_cursor_key(value.reference_value))
        else:
            keys.append(value_key(value))
    return Cursor(keys, cursor.before)


def _name_cursor_key(reference: str) -> Key:
    """A ``__name__`` cursor's key; a numeric id ``__id<n>__`` sorts before every string id ("")."""
    segments = reference.split("/")
    return (RANK_REFERENCE, tuple("" if _NUMERIC_ID.match(s) else s for s in segments))


def _disjunction(value: Any, op_name: str, path_text: str) -> list[Any]:
    if value.WhichOneof("value_type") != "array_value" or not value.array_value.values:
        raise invalid(f"A {op_name} filter on {path_text!r} needs a non-empty array value.")
    if len(value.array_value.values) > limits.MAX_DISJUNCTION_VALUES:
        raise invalid(f"A {op_name} filter on {path_text!r} allows at most {limits.MAX_DISJUNCTION_VALUES} values.")
    return list(value.array_value.values)


def _compile_filter(f: Any, inequality_paths: list[FieldPath]) -> Predicate:
    kind = f.WhichOneof("filter_type")
    if kind == "composite_filter":
        parts = [_compile_filter(sub, inequality_paths) for sub in f.composite_filter.filters]
        if not parts:
            raise invalid("A composite filter needs at least one filter.")
        if f.composite_filter.op == _AND:
            return lambda doc: all(p(doc) for p in parts)
        if f.composite_filter.op == _OR:
            return lambda doc: any(p(doc) for p in parts)
        raise invalid("A composite filter needs op AND or OR.")
    if kind == "field_filter":
        return _compile_field_filter(f.field_filter, inequality_paths)
    if kind == "unary_filter":
        return _compile_unary(f.unary_filter, inequality_paths)
    raise invalid("A filter must set one of composite_filter, field_filter, unary_filter.")


def _compile_unary(f: Any, inequality_paths: list[FieldPath]) -> Predicate:
    path = parse_field_path(f.field.field_path)
    op = f.op

    def value_of(doc: Any) -> Any:
        return get_field(doc.fields, path)

    if op == _IS_NAN:
        return lambda doc: (v := value_of(doc)) is not None and is_nan(v)
    if op == _IS_NULL:
        return lambda doc: (v := value_of(doc)) is not None and is_null(v)
    if op in (_IS_NOT_NAN, _IS_NOT_NULL):
        inequality_paths.append(path)
        if op == _IS_NOT_NAN:
            return lambda doc: (v := value_of(doc)) is not None and not is_nan(v) and not is_null(v)
        return lambda doc: (v := value_of(doc)) is not None and not is_null(v)
    raise invalid(f"Unary filter on {f.field.field_path!r} has no valid operator.")


def _compile_field_filter(f: Any, inequality_paths: list[FieldPath]) -> Predicate:
    text = f.field.field_path
    path = parse_field_path(text)
    op = f.op
    operand = f.value
    if op in _INEQUALITIES:
        inequality_paths.append(path)
    is_name = path == NAME_PATH

    def key_of(doc: Any) -> Key | None:
        if is_name:
            return name_key(doc.name)
        value = get_field(doc.fields, path)
        return None if value is None else value_key(value)

    if op in (_IN, _NOT_IN, _ARRAY_CONTAINS_ANY):
        members = _disjunction(operand, OP.Name(op).lower(), text)
        keys = {value_key(v) for v in members}
        if op == _IN:
            return lambda doc: key_of(doc) in keys
        if op == _NOT_IN:
            if any(is_null(v) for v in members):
                return lambda doc: False

            def not_in(doc: Any) -> bool:
                k = key_of(doc)
                return k is not None and k[0] != RANK_NULL and k not in keys

            return not_in

        def contains_any(doc: Any) -> bool:
            value = None if is_name else get_field(doc.fields, path)
            if value is None or value.WhichOneof("value_type") != "array_value":
                return False
            return any(value_key(e) in keys for e in value.array_value.values)

        return contains_any
    if operand.WhichOneof("value_type") is None:
        raise invalid(f"Filter on {text!r} has no value.")
    target = value_key(operand)
    if op == _EQ:
        return lambda doc: key_of(doc) == target
    if op == _NE:
        return lambda doc: (k := key_of(doc)) is not None and k != target
    if op == _ARRAY_CONTAINS:

        def contains(doc: Any) -> bool:
            value = None if is_name else get_field(doc.fields, path)
            if value is None or value.WhichOneof("value_type") != "array_value":
                return False
            return any(value_key(e) == target for e in value.array_value.values)

        return contains
    compare: dict[int, Callable[[Key], bool]] = {
        _LT: lambda k: k < target,
        _LE: lambda k: k <= target,
        _GT: lambda k: k > target,
        _GE: lambda k: k >= target,
    }
    if op not in compare:
        raise invalid(f"Filter on {text!r} has no valid operator.")
    test = compare[op]
    rank = type_rank(operand)
    return lambda doc: (k := key_of(doc)) is not None and k[0] == rank and test(k)


def _compare(keys: list[Key], cursor: list[Key], descending: list[bool]) -> int:
    for a, b, desc in zip(keys, cursor, descending, strict=False):
        if a != b:
            result = -1 if a < b else 1
            return -result if desc else result
    return 0


def _within_cursors(query: CompiledQuery, keys: list[Key]) -> bool:
    if query.start is not None:
        c = _compare(keys, query.start.keys, query.descending)
        if c < 0 or (c == 0 and not query.start.before):
            return False
    if query.end is not None:
        c = _compare(keys, query.end.keys, query.descending)
        if c > 0 or (c == 0 and query.end.before):
            return False
    return True


def execute(store: DocumentStore, query: CompiledQuery, read_us: int | None) -> list[Record]:
    """The records the query returns, in order (offset and limit applied)."""
    wanted = None if query.limit is None else query.offset + query.limit
    if wanted == 0:
        return []
    if len(query.orders) == 1 and query.collection_id and not query.all_descendants and read_us is None:
        picked = list(_by_name(store, query, wanted))
    elif query.range_paths and query.collection_id and not query.all_descendants and read_us is None:
        picked = _sort(query, _indexed(store, query))
    else:
        picked = _scan_and_sort(store, query, read_us)
    picked = picked[query.offset :]
    return picked if query.limit is None else picked[: query.limit]


def _by_name(store: DocumentStore, query: CompiledQuery, wanted: int | None) -> Iterator[Record]:
    collection_path = f"{query.parent}/{query.collection_id}"
    collection = store.collections.get(collection_path)
    if collection is None:
        return
    descending = query.descending[0]
    start_id = None
    if query.start is not None and query.start.keys:
        segments = query.start.keys[0][1]
        if "/".join(segments[:-1]) == collection_path:
            start_id = segments[-1]
    count = 0
    predicate = query.predicate
    ids: Iterable[str]
    if query.equalities:
        # The fewest candidates of any equality the results must meet, in name order.
        candidates = min(
            (store.equality.lookup(collection_path, collection.docs, path, key) for path, key in query.equalities),
            key=len,
        )
        ids = _ordered_from(sorted(candidates), start_id, descending)
    else:
        ids = collection.iter_ids(start_id, descending)
    for doc_id in ids:
        record = collection.docs[doc_id]
        doc = record.doc
        if predicate is not None and not predicate(doc):
            continue
        keys = [name_key(doc.name)]
        if not _within_cursors(query, keys):
            if query.end is not None and _compare(keys, query.end.keys, query.descending) >= 0:
                return
            continue
        yield record
        count += 1
        if wanted is not None and count >= wanted:
            return


def _ordered_from(ids: list[str], start: str | None, reverse: bool) -> Iterator[str]:
    """``ids`` (sorted) from ``start`` (inclusive) on, as ``Collection.iter_ids`` walks them."""
    if not reverse:
        yield from ids[0 if start is None else bisect.bisect_left(ids, start) :]
    else:
        yield from reversed(ids[: len(ids) if start is None else bisect.bisect_right(ids, start)])


def _candidates(store: DocumentStore, query: CompiledQuery, read_us: int | None) -> Iterator[Record]:
    for path in query.collections(store, read_us):
        if read_us is None:
            collection = store.collections.get(path)
            if collection is not None:
                yield from collection.docs.values()
            continue
        for name in store.names_in(path, read_us):
            record = store.get_at(name, read_us)
            if record is not None:
                yield record


def _indexed(store: DocumentStore, query: CompiledQuery) -> Iterator[Record]:
    """A range query's candidates: the documents holding a scalar in its range field (or matching
    an equality), the fewest of them, from the indexes: the collection is not walked."""
    collection_path = f"{query.parent}/{query.collection_id}"
    collection = store.collections.get(collection_path)
    if collection is None:
        return iter(())
    sets = [store.equality.lookup(collection_path, collection.docs, path, key) for path, key in query.equalities]
    sets += [store.equality.holding(collection_path, collection.docs, path) for path in query.range_paths]
    smallest = min(sets, key=len)
    docs = collection.docs
    return (docs[doc_id] for doc_id in list(smallest))


def _scan_and_sort(store: DocumentStore, query: CompiledQuery, read_us: int | None) -> list[Record]:
    return _sort(query, _candidates(store, query, read_us))


def _sort(query: CompiledQuery, candidates: Iterable[Record]) -> list[Record]:
    """The candidates that match, within the cursors, in the query's order."""
    predicate = query.predicate
    paths = [p for p, _ in query.orders]
    rows: list[tuple[list[Key], Record]] = []
    for record in candidates:
        doc = record.doc
        if predicate is not None and not predicate(doc):
            continue
        keys = []
        for path in paths:
            key = _field_value_key(doc, path)
            if key is None:
                break
            keys.append(key)
        else:
            if _within_cursors(query, keys):
                rows.append((keys, record))
    # Stable sorts from the last ordering to the first give a multi-key sort with mixed directions.
    for index in range(len(paths) - 1, -1, -1):
        rows.sort(key=_nth_key(index), reverse=query.descending[index])
    return [record for _, record in rows]


def _nth_key(index: int) -> Callable[[tuple[list[Key], Record]], Key]:
    def key(row: tuple[list[Key], Record]) -> Key:
        return row[0][index]

    return key


def is_incremental(query: CompiledQuery) -> bool:
    """Whether membership in the result is a property of each document alone (no limit, offset or kindless scope)."""
    return query.limit is None and query.offset == 0 and bool(query.collection_id)


def in_scope(query: CompiledQuery, collection_path: str) -> bool:
    """Whether documents directly in ``collection_path`` are candidates of a query with a collection id."""
    if not query.all_descendants:
        return collection_path == f"{query.parent}/{query.collection_id}"
    return collection_path.startswith(query.parent + "/") and collection_path.rpartition("/")[2] == query.collection_id


def matches(query: CompiledQuery, doc: Any) -> bool:
    """Whether ``doc`` is in the result of an ``is_incremental`` query: the same test ``execute`` applies."""
    if not in_scope(query, doc.name.rpartition("/")[0]):
        return False
    if query.predicate is not None and not query.predicate(doc):
        return False
    keys = []
    for path, _ in query.orders:
        key = _field_value_key(doc, path)
        if key is None:
            return False
        keys.append(key)
    return _within_cursors(query, keys)
