"""Firestore ``Value`` semantics: ordering, equality and field access inside documents.

Cross-type order (production's): null < boolean < number < timestamp < string < bytes <
reference < geo point < array < vector < map. Integers and doubles form one "number" class and
compare by numeric value (3 == 3.0); NaN sorts before every other number and equals itself for
ordering purposes. Strings compare by UTF-8 bytes, which equals Python's code-point order. References
compare segment by segment; arrays element-wise, then by length; vectors (a map
``{"__type__": "__vector__", "value": [doubles]}``, the client's ``Vector``) by dimension, then
element-wise; maps by their entries sorted by key (key, then value), then by size.

``value_key`` turns a Value into a plain tuple whose Python ordering is exactly that order, so
sorting and comparing never go back to protobuf. Stored documents are never mutated: writers
build new messages, which is what makes a document version safe to hand to readers as is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sidecar.emulators.firestore.paths import FieldPath
from sidecar.emulators.firestore.protos import Value

Key = tuple[Any, ...]
Fields = Any
"""A protobuf ``map<string, Value>`` (the ``fields`` of a Document or MapValue)."""

RANK_NULL, RANK_BOOL, RANK_NUMBER, RANK_TIMESTAMP, RANK_STRING = 0, 1, 2, 3, 4
RANK_BYTES, RANK_REFERENCE, RANK_GEO, RANK_ARRAY, RANK_VECTOR, RANK_MAP = 5, 6, 7, 8, 9, 10

VECTOR_TYPE_KEY = "__type__"
VECTOR_TYPE = "__vector__"
VECTOR_VALUES_KEY = "value"

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _double_key(v: Any) -> Key:
    d = v.double_value
    if math.isnan(d):
        return (RANK_NUMBER, 0)
    return (RANK_NUMBER, 1, d)


def _array_key(v: Any) -> Key:
    return (RANK_ARRAY, tuple(value_key(e) for e in v.array_value.values))


def is_vector(map_value: Any) -> bool:
    """Whether a MapValue spells a vector (its ``__type__`` is ``__vector__``)."""
    kind = map_value.fields.get(VECTOR_TYPE_KEY)
    return kind is not None and kind.WhichOneof("value_type") == "string_value" and kind.string_value == VECTOR_TYPE


def _map_key(v: Any) -> Key:
    fields = v.map_value.fields
    if VECTOR_TYPE_KEY in fields and is_vector(v.map_value):
        elements = fields[VECTOR_VALUES_KEY].array_value.values if VECTOR_VALUES_KEY in fields else ()
        return (RANK_VECTOR, len(elements), tuple(value_key(e) for e in elements))
    return (RANK_MAP, tuple((k, value_key(fields[k])) for k in sorted(fields)))


_KEYS: dict[str | None, Callable[[Any], Key]] = {
    "null_value": lambda v: (RANK_NULL,),
    "boolean_value": lambda v: (RANK_BOOL, v.boolean_value),
    "integer_value": lambda v: (RANK_NUMBER, 1, v.integer_value),
    "double_value": _double_key,
    "timestamp_value": lambda v: (RANK_TIMESTAMP, v.timestamp_value.seconds, v.timestamp_value.nanos),
    "string_value": lambda v: (RANK_STRING, v.string_value),
    "bytes_value": lambda v: (RANK_BYTES, v.bytes_value),
    "reference_value": lambda v: (RANK_REFERENCE, tuple(v.reference_value.split("/"))),
    "geo_point_value": lambda v: (RANK_GEO, v.geo_point_value.latitude, v.geo_point_value.longitude),
    "array_value": _array_key,
    "map_value": _map_key,
    # A Value with no kind set is read as null, as production does.
    None: lambda v: (RANK_NULL,),
}


def value_key(v: Any) -> Key:
    """A tuple ordered exactly as Firestore orders Values (see the module docstring)."""
    return _KEYS[v.WhichOneof("value_type")](v)


_RANKS = {
    "null_value": RANK_NULL, "boolean_value": RANK_BOOL, "integer_value": RANK_NUMBER,
    "double_value": RANK_NUMBER, "timestamp_value": RANK_TIMESTAMP, "string_value": RANK_STRING,
    "bytes_value": RANK_BYTES, "reference_value": RANK_REFERENCE, "geo_point_value": RANK_GEO,
    "array_value": RANK_ARRAY, "map_value": RANK_MAP, None: RANK_NULL,
}  # fmt: skip


def type_rank(v: Any) -> int:
    """The type class of a Value (RANK_* constant)."""
    kind = v.WhichOneof("value_type")
    if kind == "map_value" and is_vector(v.map_value):
        return RANK_VECTOR
    return _RANKS[kind]


def is_nan(v: Any) -> bool:
    return v.WhichOneof("value_type") == "double_value" and math.isnan(v.double_value)


def is_null(v: Any) -> bool:
    return v.WhichOneof("value_type") in ("null_value", None)


def number_of(v: Any) -> int | float | None:
    """The numeric content of an integer or double Value, else None."""
    kind = v.WhichOneof("value_type")
    if kind == "integer_value":
        return int(v.integer_value)
    if kind == "double_value":
        return float(v.double_value)
    return None


def number_value(n: int | float) -> Any:
    """A Value for a Python number: ints saturate to int64, as Firestore's increment does."""
    if isinstance(n, int):
        return Value(integer_value=max(INT64_MIN, min(INT64_MAX, n)))
    return Value(double_value=n)


def get_field(fields: Fields, path: FieldPath) -> Any | None:
    """The Value at ``path`` inside a fields map, or None when absent (or crossing a non-map)."""
    current = fields
    last = len(path) - 1
    for i, segment in enumerate(path):
        value = current.get(segment)
        if value is None:
            return None
        if i == last:
            return value
        if value.WhichOneof("value_type") != "map_value":
            return None
        current = value.map_value.fields
    return None


def set_field(fields: Fields, path: FieldPath, value: Any) -> None:
    """Set ``path`` to a copy of ``value``, turning non-map intermediates into maps."""
    current = fields
    for segment in path[:-1]:
        node = current.get(segment)
        if node is None or node.WhichOneof("value_type") != "map_value":
            current[segment].map_value.SetInParent()
            node = current[segment]
            node.map_value.fields.clear()
        current = node.map_value.fields
    current[path[-1]].CopyFrom(value)


def delete_field(fields: Fields, path: FieldPath) -> None:
    """Remove ``path`` if present; a missing path is not an error (Firestore's mask semantics)."""
    current = fields
    for segment in path[:-1]:
        node = current.get(segment)
        if node is None or node.WhichOneof("value_type") != "map_value":
            return
        current = node.map_value.fields
    if path[-1] in current:
        del current[path[-1]]


def project(fields: Fields, paths: list[FieldPath], out: Fields) -> None:
    """Copy only ``paths`` from ``fields`` into ``out`` (a select / mask projection)."""
    for path in paths:
        value = get_field(fields, path)
        if value is not None:
            set_field(out, path, value)
