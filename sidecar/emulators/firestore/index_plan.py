"""Query planning against the index configuration: refuse what production has no index for.

Production serves every query from indexes, never by filtering documents after a scan, so
(simplified to the rules a client can observe):
- Equality filters (``==``, ``in``, ``is null``, ``is nan``) on several fields, with
  ``array-contains``/``array-contains-any`` filters and ordered by ``__name__`` only, are served by
  merging single-field indexes: each equality field needs an ascending or descending single-field
  index, each array filter its array-contains index.
- One ordered field (an ``order_by``, or an inequality field, which the query is implicitly ordered
  by), with no other equality or array filter, needs that field's single-field index in the
  order's direction. Equality on the ordered field itself needs nothing more.
- Anything else (equality plus an ordered field, several ordered fields) needs a composite index:
  the equality and array fields first (any order), then the ordered fields in order, all in the
  query's directions or all reversed.
- ``__name__`` needs no index. A kindless query (no collection id) can only use ``__name__``.
- The scope is the query's: ``all_descendants`` (collection-group) queries need
  COLLECTION_GROUP-scope indexes, which production keeps only where an override lists them.
An aggregation's sum/avg fields are read from their index like inequality fields. An OR's branches
are planned together (a simplification: each field a branch uses needs what it would need alone).

A refusal is FAILED_PRECONDITION with production's message: "The query requires an index. You can
create it here: <console link>", the link carrying the wanted index (``create_composite``) or the
field override (``create_exemption``) as production does, base64 of the admin proto.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.emulators.firestore import names
from sidecar.emulators.firestore import protos as pb
from sidecar.emulators.firestore.errors import FirestoreError, failed_precondition
from sidecar.emulators.firestore.indexes import (
    ASCENDING,
    COLLECTION,
    COLLECTION_GROUP,
    CONTAINS,
    DESCENDING,
    IndexConfig,
)
from sidecar.emulators.firestore.paths import NAME_PATH, FieldPath, format_field_path, parse_field_path

_OP = pb.OP
_EQUALITIES = {_OP.Value("EQUAL"), _OP.Value("IN")}
_CONTAINS = {_OP.Value("ARRAY_CONTAINS"), _OP.Value("ARRAY_CONTAINS_ANY")}
_UNARY_EQUALITIES = {pb.UNARY_OP.Value("IS_NAN"), pb.UNARY_OP.Value("IS_NULL")}
_DESCENDING = pb.DIRECTION.Value("DESCENDING")
_CONSOLE = "https://console.firebase.google.com/v1/r/project/{project}/firestore/indexes?{kind}={blob}"


@dataclass
class _Needs:
    equalities: set[FieldPath] = field(default_factory=set)
    contains: set[FieldPath] = field(default_factory=set)
    inequalities: list[FieldPath] = field(default_factory=list)


def check_query(config: IndexConfig, parent: str, sq: Any, required_fields: Iterable[FieldPath] = ()) -> None:
    """Raise FAILED_PRECONDITION when no index of ``config`` can serve ``sq`` under ``parent``."""
    if not config.enforced or len(sq.from_) != 1 or not sq.from_[0].collection_id:
        return
    group = sq.from_[0].collection_id
    scope = COLLECTION_GROUP if sq.from_[0].all_descendants else COLLECTION
    needs = _Needs()
    if sq.HasField("where"):
        _collect(sq.where, needs)
    needs.inequalities.extend(required_fields)
    ordered: list[tuple[FieldPath, bool]] = []
    for order in sq.order_by:
        path = parse_field_path(order.field.field_path)
        if path not in {p for p, _ in ordered}:
            ordered.append((path, order.direction == _DESCENDING))
    for path in sorted(set(needs.inequalities) - {p for p, _ in ordered}, key=format_field_path):
        ordered.append((path, False))
    # __name__ is every index's last column; an order on an equality field changes nothing.
    ordered = [(p, d) for p, d in ordered if p != NAME_PATH and p not in needs.equalities]
    equalities = needs.equalities - {NAME_PATH}
    contains = needs.contains - {NAME_PATH}
    if _singles_serve(config, group, scope, equalities, contains, ordered):
        return
    if any(
        _covers(index.fields, equalities, contains, ordered)
        for index in config.composites
        if index.collection_group == group and index.query_scope == scope
    ):
        return
    raise _refusal(parent, group, scope, equalities, contains, ordered)


def _collect(f: Any, needs: _Needs) -> None:
    kind = f.WhichOneof("filter_type")
    if kind == "composite_filter":
        for sub in f.composite_filter.filters:
            _collect(sub, needs)
    elif kind == "field_filter":
        path = parse_field_path(f.field_filter.field.field_path)
        op = f.field_filter.op
        if op in _EQUALITIES:
            needs.equalities.add(path)
        elif op in _CONTAINS:
            needs.contains.add(path)
        else:
            needs.inequalities.append(path)
    elif kind == "unary_filter":
        path = parse_field_path(f.unary_filter.field.field_path)
        if f.unary_filter.op in _UNARY_EQUALITIES:
            needs.equalities.add(path)
        else:
            needs.inequalities.append(path)


def _singles_serve(
    config: IndexConfig,
    group: str,
    scope: str,
    equalities: set[FieldPath],
    contains: set[FieldPath],
    ordered: list[tuple[FieldPath, bool]],
) -> bool:
    if not ordered:
        return all(
            config.has_single(group, p, ASCENDING, scope) or config.has_single(group, p, DESCENDING, scope)
            for p in equalities
        ) and all(config.has_single(group, p, CONTAINS, scope) for p in contains)
    if len(ordered) == 1 and not equalities and not contains:
        path, descending = ordered[0]
        return config.has_single(group, path, DESCENDING if descending else ASCENDING, scope)
    return False


def _covers(
    index_fields: tuple[tuple[FieldPath, str], ...],
    equalities: set[FieldPath],
    contains: set[FieldPath],
    ordered: list[tuple[FieldPath, bool]],
) -> bool:
    """Whether a composite index serves the query: equality/array fields first, then the orders."""
    fields = [(p, k) for p, k in index_fields if p != NAME_PATH]
    if len(fields) != len(equalities) + len(contains) + len(ordered):
        return False
    head, tail = fields[: len(fields) - len(ordered)], fields[len(fields) - len(ordered) :]
    if {p for p, k in head if k == CONTAINS} != contains or {p for p, k in head if k != CONTAINS} != equalities:
        return False
    if [p for p, _ in tail] != [p for p, _ in ordered] or any(k == CONTAINS for _, k in tail):
        return False
    same = [(k == DESCENDING) == d for (_, k), (_, d) in zip(tail, ordered, strict=True)]
    return all(same) or not any(same)


def _refusal(
    parent: str,
    group: str,
    scope: str,
    equalities: set[FieldPath],
    contains: set[FieldPath],
    ordered: list[tuple[FieldPath, bool]],
) -> FirestoreError:
    database = names.database_of(parent)
    project = database.split("/")[1]
    group_name = f"{database}/collectionGroups/{group}"
    wanted = sorted(equalities | contains, key=format_field_path)
    if len(wanted) + len(ordered) == 1:
        # One field: production links to a single-field exemption of that field.
        path = (wanted or [p for p, _ in ordered])[0]
        blob = pb.AdminField(name=f"{group_name}/fields/{format_field_path(path)}").SerializeToString()
        kind = "create_exemption"
    else:
        index = pb.AdminIndex(name=f"{group_name}/indexes/_", query_scope=pb.AdminIndex.QueryScope.Value(scope))
        for path in wanted:
            entry = index.fields.add(field_path=format_field_path(path))
            if path in contains:
                entry.array_config = pb.AdminIndex.IndexField.ArrayConfig.Value(CONTAINS)
            else:
                entry.order = pb.AdminIndex.IndexField.Order.Value(ASCENDING)
        for path, descending in ordered:
            order = DESCENDING if descending else ASCENDING
            index.fields.add(field_path=format_field_path(path), order=pb.AdminIndex.IndexField.Order.Value(order))
        index.fields.add(
            field_path="__name__",
            order=pb.AdminIndex.IndexField.Order.Value(DESCENDING if ordered and ordered[-1][1] else ASCENDING),
        )
        blob = index.SerializeToString()
        kind = "create_composite"
    link = _CONSOLE.format(project=project, kind=kind, blob=base64.urlsafe_b64encode(blob).decode("ascii").rstrip("="))
    return failed_precondition(f"The query requires an index. You can create it here: {link}")
