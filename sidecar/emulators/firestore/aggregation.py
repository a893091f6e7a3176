"""RunAggregationQuery's aggregations (count, sum, avg): validation and results.

Rules (production's, with the official emulator's messages where production's are not published):
- 1 to 5 aggregations ("Aggregations can not be empty."; "The maximum number of aggregations
  allowed in an aggregation query is 5. Received: N"); each sets an operator.
- An unnamed aggregation is called ``field_1``, ``field_2``, ... counting unnamed ones only, so an
  explicit ``field_1`` next to an unnamed one is a duplicate ("Aggregation aliases contain
  duplicate alias: X."); ``__.*__`` aliases are reserved.
- ``count`` counts the query's documents, at most ``up_to`` (0 allowed, negative refused).
- ``sum`` adds integers exactly and stays an integer when only integers were found and the total
  fits in 64 bits; any double makes it a double (integers summed exactly, then added to the
  doubles); values that are not numbers are skipped; nothing to add gives the integer 0.
- ``avg`` is a double, or null when no number was found.
- The fields of ``sum`` and ``avg`` also shape the query (``required_fields``): see query.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sidecar.emulators.firestore.documents import Record
from sidecar.emulators.firestore.errors import invalid
from sidecar.emulators.firestore.paths import NAME_PATH, FieldPath, parse_field_path
from sidecar.emulators.firestore.protos import Value
from sidecar.emulators.firestore.values import INT64_MAX, INT64_MIN, get_field

MAX_AGGREGATIONS = 5


@dataclass(frozen=True, slots=True)
class Aggregation:
    alias: str
    kind: str
    """``count``, ``sum`` or ``avg``."""
    path: FieldPath | None = None
    up_to: int | None = None


def parse_aggregations(items: Any) -> list[Aggregation]:
    """Validate a StructuredAggregationQuery's ``aggregations``; raises INVALID_ARGUMENT."""
    if not items:
        raise invalid("Aggregations can not be empty.")
    if len(items) > MAX_AGGREGATIONS:
        raise invalid(
            f"The maximum number of aggregations allowed in an aggregation query is {MAX_AGGREGATIONS}. "
            f"Received: {len(items)}"
        )
    parsed: list[Aggregation] = []
    unnamed = 0
    for item in items:
        kind = item.WhichOneof("operator")
        if kind is None:
            raise invalid("Operator field in Aggregation is not set.")
        alias = item.alias
        if not alias:
            unnamed += 1
            alias = f"field_{unnamed}"
        if kind == "count":
            up_to = None
            if item.count.HasField("up_to"):
                up_to = item.count.up_to.value
                if up_to < 0:
                    raise invalid("The `up_to` value in a COUNT aggregation must be greater than or equal to zero.")
            parsed.append(Aggregation(alias, kind, up_to=up_to))
        else:
            parsed.append(Aggregation(alias, kind, path=_field(getattr(item, kind).field.field_path)))
    seen: set[str] = set()
    for aggregation in parsed:
        alias = aggregation.alias
        if len(alias) >= 4 and alias.startswith("__") and alias.endswith("__"):
            raise invalid(f'The property.name "{alias}" is reserved.')
        if alias in seen:
            raise invalid(f"Aggregation aliases contain duplicate alias: {alias}.")
        seen.add(alias)
    return parsed


def _field(text: str) -> FieldPath:
    if not text:
        raise invalid("Invalid empty property path string.")
    path = parse_field_path(text)
    if path == NAME_PATH:
        raise invalid("Aggregations are not supported for the property: __key__")
    return path


def required_fields(aggregations: list[Aggregation]) -> list[FieldPath]:
    """The fields every aggregated document must have (those of sum and avg), once each."""
    return list(dict.fromkeys(a.path for a in aggregations if a.path is not None))


def aggregate(aggregation: Aggregation, records: list[Record]) -> Any:
    """The result Value of one aggregation over the query's records."""
    if aggregation.kind == "count":
        count = len(records)
        return Value(integer_value=count if aggregation.up_to is None else min(count, aggregation.up_to))
    assert aggregation.path is not None
    integers, doubles, count, saw_double = 0, 0.0, 0, False
    for value in _values(records, aggregation.path):
        kind = value.WhichOneof("value_type")
        if kind == "integer_value":
            integers += value.integer_value
        elif kind == "double_value":
            doubles += value.double_value
            saw_double = True
        else:
            continue
        count += 1
    if aggregation.kind == "avg":
        if count == 0:
            return Value(null_value=0)
        return Value(double_value=(float(integers) + doubles) / count)
    if not saw_double and INT64_MIN <= integers <= INT64_MAX:
        return Value(integer_value=integers)
    return Value(double_value=float(integers) + doubles)


def _values(records: list[Record], path: FieldPath) -> Iterator[Any]:
    for record in records:
        value = get_field(record.doc.fields, path)
        if value is not None:
            yield value
