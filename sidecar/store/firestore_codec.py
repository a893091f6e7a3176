"""Our plain values and queries as Firestore's raw protobufs, and back. Google-free.

``sidecar.store.firestore`` (the one module that imports google-cloud-firestore) hands these
functions the raw protobuf messages and classes; this module imports nothing of Google's and
works on whatever it is given, through the protobuf message interface only.

Rules:

- **In place, no copies.** A value is written into the target protobuf field by field (large bytes
  are not copied twice), and read back straight from the raw message: the official client's
  decoder costs ~250 us per document, too slow to load 100,000 pending messages.
- **One mapping each way**: ``set_value`` (None, bool, int, str, bytes, datetime, list/tuple, dict,
  ``Reference``) and ``get_value`` (the same; a timestamp comes back as an aware UTC datetime). A
  Python type with no Firestore value is a ``TypeError``, never a guess.
- **Queries** are the store's: equality and range filters joined by AND (``add_filters``), ordered
  by one field then ``__name__``, resumed after a cursor of the same fields (``build_query``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.store import documents as docs


@dataclass(frozen=True, slots=True)
class Reference:
    """A document name as a query cursor value (``reference_value``)."""

    name: str


def set_value(target: Any, value: Any) -> None:
    """Fill a raw ``Value`` protobuf in place (no copy of large bytes)."""
    if isinstance(value, Reference):
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
    elif isinstance(value, list | tuple):
        array = target.array_value
        array.SetInParent()
        for item in value:
            set_value(array.values.add(), item)
    elif isinstance(value, dict):
        mapped = target.map_value
        mapped.SetInParent()
        for name, item in value.items():
            set_value(mapped.fields[name], item)
    else:
        raise TypeError(f"store: cannot encode {type(value).__name__}")


def get_value(value: Any) -> Any:
    """A raw ``Value`` protobuf as a Python value (the client's decoder is 10x slower at load)."""
    kind = value.WhichOneof("value_type")
    if kind == "array_value":
        return [get_value(item) for item in value.array_value.values]
    if kind == "map_value":
        return {name: get_value(item) for name, item in value.map_value.fields.items()}
    if kind == "timestamp_value":
        return value.timestamp_value.ToDatetime(tzinfo=datetime.UTC)
    if kind == "null_value" or kind is None:
        return None
    return getattr(value, kind)


def fields_of(document: Any) -> docs.Fields:
    """A raw ``Document`` protobuf's fields as Python values."""
    return {name: get_value(value) for name, value in document.fields.items()}


def micros_of(timestamp: Any) -> int:
    """A raw ``Timestamp`` protobuf in microseconds."""
    return int(timestamp.seconds) * 1_000_000 + int(timestamp.nanos) // 1000


def encode_write(write: docs.Write, name: str, write_type: Any, document_type: Any) -> Any:
    """``write`` as a raw ``Write`` protobuf (``write_type``, ``document_type``: the raw classes) on
    the document named ``name``: a delete, or an update with its mask, and its precondition."""
    if write.fields is None:
        raw = write_type(delete=name)
    else:
        doc = document_type(name=name)
        for field_name, value in write.fields.items():
            set_value(doc.fields[field_name], value)
        raw = write_type(update=doc)
        if write.mask is not None:
            raw.update_mask.field_paths.extend(write.mask)
    if write.exists is not None:
        raw.current_document.exists = write.exists
    elif write.update_time_us is not None:
        raw.current_document.update_time.FromMicroseconds(write.update_time_us)
    return raw


_OPERATORS = {"EQUAL": "EQUAL", "GREATER_THAN_OR_EQUAL": "GREATER_THAN_OR_EQUAL", "LESS_THAN": "LESS_THAN"}


def add_filters(query: Any, filters: list[docs.Filter]) -> None:
    """``filters`` (all must hold) as the raw StructuredQuery's ``where``."""
    query_type = type(query)
    if len(filters) > 1:
        composite = query.where.composite_filter
        composite.op = query_type.CompositeFilter.Operator.Value("AND")
        targets = [composite.filters.add().field_filter for _ in filters]
    else:
        targets = [query.where.field_filter for _ in filters]
    for condition, wanted in zip(targets, filters, strict=True):
        condition.field.field_path = wanted.field
        condition.op = query_type.FieldFilter.Operator.Value(_OPERATORS[wanted.op])
        set_value(condition.value, wanted.value)


def build_query(
    query_type: Any,
    collection: str,
    where: docs.Filter | Sequence[docs.Filter] | None,
    order_by: str | None,
    after: object | None,
    limit: int,
) -> Any:
    """A raw StructuredQuery (``query_type``: its class) of ``collection``: ``where``, ordered by
    ``order_by`` then ``__name__``, starting after the cursor ``after``, at most ``limit``."""
    query = query_type()
    query.from_.add(collection_id=collection)
    add_filters(query, docs.filters_of(where))
    for path in ([order_by] if order_by else []) + ["__name__"]:
        query.order_by.add(direction=query_type.Direction.Value("ASCENDING")).field.field_path = path
    if after is not None:
        query.start_at.before = False
        for value in after:  # type: ignore[attr-defined]
            set_value(query.start_at.values.add(), value)
    query.limit.value = limit
    return query


def cursor_after(document: Any, fields: docs.Fields, order_by: str | None) -> list[Any]:
    """The cursor that resumes a query of ``order_by`` after the raw ``document`` (fields decoded)."""
    return ([fields.get(order_by)] if order_by else []) + [Reference(document.name)]
