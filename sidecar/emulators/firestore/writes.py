"""One ``Write`` applied to one document version: preconditions, masks, transforms.

Rules (production's, as the official client encodes them):
- ``current_document.exists=false`` on an existing document -> ALREADY_EXISTS (a create);
  ``exists=true`` on a missing one -> NOT_FOUND (an update); ``update_time`` must equal the stored
  update time exactly, else FAILED_PRECONDITION with production's "stored version ... does not
  match the required base version" (microseconds); an ``update_time`` later than the commit time is
  INVALID_ARGUMENT (production's code, as the official clients' system tests expect).
- ``update`` without ``update_mask`` replaces the document. With a mask (present, even if empty:
  tested with HasField), each masked path is copied from the request if the request has it, and
  deleted otherwise; paths outside the mask keep their stored values.
- ``update_transforms`` run after the update, in order: server time = the commit time;
  increment/maximum/minimum on a non-number or missing field set the operand, int with int stays
  int (saturating), any double makes a double; array union appends missing elements, array
  remove drops every equal element (3 == 3.0 in both). One ``transform_results`` entry each.
- A write that leaves the fields unchanged keeps the stored version and its update time.
- ``delete`` of a missing document succeeds. The result of a delete has no update time.
Nothing here touches the store: the caller stages results and applies a whole commit at once.
"""

from __future__ import annotations

import math
from typing import Any

from sidecar.emulators.firestore import limits
from sidecar.emulators.firestore.documents import Record
from sidecar.emulators.firestore.errors import already_exists, failed_precondition, invalid, not_found
from sidecar.emulators.firestore.paths import parse_field_path
from sidecar.emulators.firestore.protos import SERVER_VALUE, Document, Value, WriteResult, nanos_of
from sidecar.emulators.firestore.values import (
    INT64_MAX,
    INT64_MIN,
    delete_field,
    get_field,
    number_of,
    number_value,
    set_field,
    value_key,
)

_REQUEST_TIME = SERVER_VALUE.Value("REQUEST_TIME")
_MIN_SECONDS, _MAX_SECONDS = -62_135_596_800, 253_402_300_799
"""A Timestamp's valid range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z."""


def target_of(write: Any) -> str:
    """The document name a write addresses; raises INVALID_ARGUMENT for an empty write."""
    op = write.WhichOneof("operation")
    if op == "update":
        return str(write.update.name)
    if op == "delete":
        return str(write.delete)
    if op == "transform":
        return str(write.transform.document)
    raise invalid("A write must set one of update, delete or transform.")


def check_precondition(write: Any, name: str, current: Record | None, commit_us: int) -> None:
    if not write.HasField("current_document"):
        return
    condition = write.current_document
    kind = condition.WhichOneof("condition_type")
    if kind == "exists":
        if condition.exists and current is None:
            raise not_found(f"No document to update: {name}")
        if not condition.exists and current is not None:
            raise already_exists(f"Document already exists: {name}")
    elif kind == "update_time":
        wanted = condition.update_time
        if not (_MIN_SECONDS <= wanted.seconds <= _MAX_SECONDS and 0 <= wanted.nanos < 1_000_000_000):
            raise invalid(f"Precondition update_time on {name} is not a valid timestamp.")
        wanted_us = nanos_of(wanted) // 1000
        if wanted_us > commit_us:
            # No version can have been written after the commit that checks it: production
            # refuses the request itself rather than reporting a failed precondition.
            raise invalid(f"Precondition update_time {wanted.ToJsonString()} on {name} is in the future.")
        stored_us = 0 if current is None else current.update_us
        if current is None or nanos_of(condition.update_time) != stored_us * 1000:
            raise failed_precondition(
                f"the stored version ({stored_us}) does not match the required base version ({wanted_us})"
            )


def apply_write(
    write: Any, name: str, relative: str, current: Record | None, commit_us: int, commit_ts: Any
) -> tuple[Record | None, Any]:
    """The new version of the document (None: deleted) and the WriteResult for ``write``."""
    check_precondition(write, name, current, commit_us)
    op = write.WhichOneof("operation")
    if op == "delete":
        return None, WriteResult()
    if op == "update":
        if write.HasField("update_mask"):
            doc = Document(name=name)
            if current is not None:
                doc.fields.MergeFrom(current.doc.fields)
            source = write.update.fields
            for text in write.update_mask.field_paths:
                path = parse_field_path(text)
                value = get_field(source, path)
                if value is None:
                    delete_field(doc.fields, path)
                else:
                    set_field(doc.fields, path, value)
        else:
            # The request message is ours alone: reuse it instead of copying every field.
            doc = write.update
            doc.ClearField("create_time")
            doc.ClearField("update_time")
        transforms = write.update_transforms
    else:
        doc = Document(name=name)
        if current is not None:
            doc.fields.MergeFrom(current.doc.fields)
        transforms = write.transform.field_transforms
    result = WriteResult()
    for transform in transforms:
        result.transform_results.append(_transform(doc.fields, transform, commit_ts))
    if current is not None and doc.fields == current.doc.fields:
        result.update_time.CopyFrom(current.doc.update_time)
        return current, result
    limits.check_document(relative, doc)
    if current is None:
        doc.create_time.CopyFrom(commit_ts)
        create_us = commit_us
    else:
        doc.create_time.CopyFrom(current.doc.create_time)
        create_us = current.create_us
    doc.update_time.CopyFrom(commit_ts)
    result.update_time.CopyFrom(commit_ts)
    return Record(doc, create_us, commit_us), result


def _transform(fields: Any, transform: Any, commit_ts: Any) -> Any:
    path = parse_field_path(transform.field_path)
    kind = transform.WhichOneof("transform_type")
    current = get_field(fields, path)
    if kind == "set_to_server_value":
        if transform.set_to_server_value != _REQUEST_TIME:
            raise invalid(f"Field transform on {transform.field_path!r}: unknown server value.")
        value = Value(timestamp_value=commit_ts)
    elif kind in ("increment", "maximum", "minimum"):
        operand = getattr(transform, kind)
        if number_of(operand) is None:
            raise invalid(f"Field transform {kind} on {transform.field_path!r} needs an integer or double operand.")
        value = _numeric(kind, current, operand)
    elif kind == "append_missing_elements":
        value = Value()
        value.array_value.SetInParent()
        seen: set[Any] = set()
        if current is not None and current.WhichOneof("value_type") == "array_value":
            value.array_value.values.extend(current.array_value.values)
            seen = {value_key(e) for e in current.array_value.values}
        for element in transform.append_missing_elements.values:
            key = value_key(element)
            if key not in seen:
                seen.add(key)
                value.array_value.values.append(element)
    elif kind == "remove_all_from_array":
        value = Value()
        value.array_value.SetInParent()
        drop = {value_key(e) for e in transform.remove_all_from_array.values}
        if current is not None and current.WhichOneof("value_type") == "array_value":
            value.array_value.values.extend(e for e in current.array_value.values if value_key(e) not in drop)
    else:
        raise invalid(f"Field transform on {transform.field_path!r} sets no transform.")
    set_field(fields, path, value)
    if kind in ("append_missing_elements", "remove_all_from_array"):
        return Value(null_value=0)
    return value


def _numeric(kind: str, current: Any | None, operand: Any) -> Any:
    stored = None if current is None else number_of(current)
    given = number_of(operand)
    assert given is not None
    if stored is None:
        copy = Value()
        copy.CopyFrom(operand)
        return copy
    if kind == "increment":
        if isinstance(stored, int) and isinstance(given, int):
            return Value(integer_value=max(INT64_MIN, min(INT64_MAX, stored + given)))
        return Value(double_value=float(stored) + float(given))
    if (isinstance(stored, float) and math.isnan(stored)) or (isinstance(given, float) and math.isnan(given)):
        return Value(double_value=math.nan)
    # Equal operands (3 and 3.0, 0 and -0.0) keep the stored value and its type.
    if stored == given:
        return number_value(stored)
    wins = given > stored if kind == "maximum" else given < stored
    return number_value(given if wins else stored)
