"""Production's limits, enforced so the sidecar cannot come to depend on anything Firestore refuses.

- Document and collection ids: not empty, no ``/``, not ``.`` or ``..``, not ``__.*__``, at most
  1,500 bytes of UTF-8.
- A document is at most 1 MiB by Firestore's storage-size formula: name size (each path segment's
  UTF-8 bytes + 1, plus 16) + 32 + for each field (name bytes + 1) + value size, where null and
  boolean count 1, integer, double and timestamp 8, geo point 16, string bytes + 1, bytes their
  length, reference its document-name size, arrays and maps the sum of their contents.
- Field names: not ``__.*__``, at most 1,500 bytes; maps and arrays nest at most 20 levels (a
  top-level field is level 1); an array may not directly contain an array.
- A vector (the client's ``Vector``: a map ``{"__type__": "__vector__", "value": [doubles]}``, the
  one map whose ``__type__`` key is not refused as reserved) has exactly those two keys and 1 to
  2,048 double elements, none NaN; refusals use the official emulator's messages.
- A request is at most 10 MiB; a Commit or BatchWrite carries at most 500 writes (production's
  long-standing per-request bound; stricter than today's Commit, never looser).
"""

from __future__ import annotations

import re
from typing import Any

from sidecar.emulators.firestore.errors import invalid
from sidecar.emulators.firestore.values import VECTOR_TYPE_KEY, VECTOR_VALUES_KEY, is_vector

MAX_ID_BYTES = 1500
MAX_FIELD_NAME_BYTES = 1500
MAX_DEPTH = 20
MAX_DOCUMENT_BYTES = 1_048_576
MAX_REQUEST_BYTES = 10 * 1_048_576
MAX_WRITES_PER_REQUEST = 500
MAX_DISJUNCTION_VALUES = 30
MAX_VECTOR_DIMENSIONS = 2048
"""Values allowed in an ``in``/``not-in``/``array-contains-any`` filter."""

_RESERVED = re.compile(r"__.*__\Z", re.DOTALL)
_SHORT_NAME = MAX_FIELD_NAME_BYTES // 4
"""A name of at most this many characters is within the byte limit whatever its encoding."""
_SIZE_BOUND_FACTOR = 8
"""Firestore's size of a Value is at most 8x its protobuf encoding (an empty geo point: 2 bytes
encoded, 16 counted); a document whose encoding x 8 fits the limit needs no exact sizing."""


def check_id(segment: str, what: str, path: str) -> None:
    """Validate one document or collection id; raises INVALID_ARGUMENT naming it."""
    if not segment:
        raise invalid(f"{what} in {path!r} is empty.")
    if segment in (".", ".."):
        raise invalid(f"{what} {segment!r} in {path!r} is not allowed: ids cannot be '.' or '..'.")
    if segment.startswith("__") and segment.endswith("__") and len(segment) >= 4:
        raise invalid(f"{what} {segment!r} in {path!r} is reserved: ids cannot match __.*__.")
    if len(segment) * 4 > MAX_ID_BYTES and len(segment.encode()) > MAX_ID_BYTES:
        raise invalid(f"{what} in {path!r} is longer than {MAX_ID_BYTES} bytes.")


def check_request_size(request: Any) -> None:
    size = request.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise invalid(f"Request payload size exceeds the limit: {MAX_REQUEST_BYTES} bytes (got {size}).")


def check_write_count(count: int) -> None:
    if count > MAX_WRITES_PER_REQUEST:
        raise invalid(f"maximum {MAX_WRITES_PER_REQUEST} writes allowed per request (got {count}).")


def name_size(relative_path: str) -> int:
    """Firestore's size of a document name given its path below ``/documents/``."""
    return len(relative_path.encode()) + 1 + 16


def check_document(relative_path: str, document: Any) -> None:
    """Validate field names, nesting depth and total size of a document about to be stored."""
    fields = document.fields
    _check_structure(fields, 1, relative_path)
    if document.ByteSize() * _SIZE_BOUND_FACTOR + name_size(relative_path) + 32 <= MAX_DOCUMENT_BYTES:
        return
    total = _fields_size(fields) + name_size(relative_path) + 32
    if total > MAX_DOCUMENT_BYTES:
        raise invalid(
            f"Document {relative_path!r} cannot be written because its size ({total:,} bytes) exceeds "
            f"the maximum allowed size of {MAX_DOCUMENT_BYTES:,} bytes."
        )


def _check_structure(fields: Any, depth: int, where: str) -> None:
    """Field names and nesting; the hot path of every write, so scalars cost one WhichOneof."""
    if depth > MAX_DEPTH:
        raise invalid(f"Document {where!r}: fields nest deeper than {MAX_DEPTH} levels.")
    for name in fields:
        if (name[:2] == "__" and name[-2:] == "__" and len(name) >= 4) or len(name) > _SHORT_NAME:
            _check_name(name, where)
        value = fields[name]
        kind = value.WhichOneof("value_type")
        if kind == "map_value":
            nested = value.map_value
            # Inlined rather than a helper call: this loop is the hot path of every write.
            if VECTOR_TYPE_KEY in nested.fields and is_vector(nested):
                _check_vector(nested, where)
            else:
                _check_structure(nested.fields, depth + 1, where)
        elif kind == "array_value":
            _check_array(value.array_value.values, depth + 1, where)


def _check_vector(map_value: Any, where: str) -> None:
    """A vector's shape, checked in the official emulator's order with its messages."""
    fields = map_value.fields
    values = fields.get(VECTOR_VALUES_KEY)
    if values is None:
        raise invalid("Vector map is missing key 'value'.")
    if values.WhichOneof("value_type") != "array_value":
        raise invalid("Vector value type must be an array.")
    if len(fields) > 2:
        raise invalid("Vector value map has extraneous entries.")
    elements = values.array_value.values
    if not elements:
        raise invalid("Cannot have a zero length vector.")
    if len(elements) > MAX_VECTOR_DIMENSIONS:
        raise invalid(f"Vectors must be at most {MAX_VECTOR_DIMENSIONS} dimensions.")
    for element in elements:
        if element.WhichOneof("value_type") != "double_value":
            raise invalid("Vector must only contain values of type 'double'")
        if element.double_value != element.double_value:
            raise invalid("Vector cannot contain NaN values.")


def _check_array(values: Any, depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise invalid(f"Document {where!r}: fields nest deeper than {MAX_DEPTH} levels.")
    for element in values:
        kind = element.WhichOneof("value_type")
        if kind == "array_value":
            raise invalid(f"Document {where!r}: an array cannot directly contain another array.")
        if kind == "map_value":
            nested = element.map_value
            if VECTOR_TYPE_KEY in nested.fields and is_vector(nested):
                _check_vector(nested, where)
            else:
                _check_structure(nested.fields, depth + 1, where)


def _check_name(name: str, where: str) -> None:
    if _RESERVED.match(name):
        raise invalid(f"Document {where!r}: field name {name!r} is reserved (matches __.*__).")
    if len(name.encode()) > MAX_FIELD_NAME_BYTES:
        raise invalid(f"Document {where!r}: field name longer than {MAX_FIELD_NAME_BYTES} bytes.")


def _fields_size(fields: Any) -> int:
    return sum(len(name.encode()) + 1 + _value_size(fields[name]) for name in fields)


def _value_size(value: Any) -> int:
    kind = value.WhichOneof("value_type")
    if kind == "string_value":
        return len(value.string_value.encode()) + 1
    if kind in ("integer_value", "double_value", "timestamp_value"):
        return 8
    if kind in ("null_value", "boolean_value", None):
        return 1
    if kind == "bytes_value":
        return len(value.bytes_value)
    if kind == "reference_value":
        ref = value.reference_value
        _, sep, rest = ref.partition("/documents/")
        return name_size(rest if sep else ref)
    if kind == "geo_point_value":
        return 16
    if kind == "map_value":
        return _fields_size(value.map_value.fields)
    return sum(_value_size(element) for element in value.array_value.values)
