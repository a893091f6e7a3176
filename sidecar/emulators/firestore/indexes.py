"""Index configuration: a ``firestore.indexes.json`` in the Firebase CLI's format.

Production keeps, for every field of every collection group, single-field indexes ascending,
descending and array-contains with collection scope; collection-group scope single-field indexes
exist only where a field override lists them. A ``fieldOverrides`` entry replaces that default for
one (collection group, field path): ``"indexes": []`` exempts the field, and ``"ttl": true`` makes
it the group's TTL field (``ttl.py``). ``indexes`` lists composite indexes. The emulator honours all
of it for query planning (``index_plan.py``), hotspot counting (``hotspots.py``), TTL sweeps and
the FirestoreAdmin field RPCs (``admin_fields.py``).

``IndexConfig.everything()`` (no file) is production's default with nothing refused: every field
indexed in both scopes, so the emulator then accepts every query as it always did.

A malformed file is refused with one ``ValueError`` line naming the entry (``emulators`` prints it
and exits 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.emulators.firestore.errors import FirestoreError
from sidecar.emulators.firestore.paths import NAME_PATH, FieldPath, format_field_path, parse_field_path

ASCENDING = "ASCENDING"
DESCENDING = "DESCENDING"
CONTAINS = "CONTAINS"
"""Index kinds: the two orders and array-contains (the Firebase CLI's ``arrayConfig: CONTAINS``)."""
COLLECTION = "COLLECTION"
COLLECTION_GROUP = "COLLECTION_GROUP"
_SCOPES = (COLLECTION, COLLECTION_GROUP)
DEFAULT_SINGLE: frozenset[tuple[str, str]] = frozenset((kind, COLLECTION) for kind in (ASCENDING, DESCENDING, CONTAINS))
"""What production indexes for a field without an override: all three kinds, collection scope only."""
_INDEX_KEYS = {"collectionGroup", "queryScope", "fields", "apiScope", "density"}
_OVERRIDE_KEYS = {"collectionGroup", "fieldPath", "indexes", "ttl"}


@dataclass(frozen=True, slots=True)
class CompositeIndex:
    """One composite index: (field path, kind) in index order, for one collection group and scope."""

    collection_group: str
    query_scope: str
    fields: tuple[tuple[FieldPath, str], ...]


@dataclass(frozen=True, slots=True)
class FieldOverride:
    """A field override: the single-field indexes kept, as (kind, scope) pairs, and the TTL flag.

    ``indexes`` None: the entry has no ``indexes`` key (a TTL-only override) and keeps the default.
    """

    collection_group: str
    field_path: FieldPath
    indexes: frozenset[tuple[str, str]] | None
    ttl: bool = False

    @property
    def single_indexes(self) -> frozenset[tuple[str, str]]:
        return DEFAULT_SINGLE if self.indexes is None else self.indexes

    @property
    def is_exempt(self) -> bool:
        return self.indexes is not None and not self.indexes


@dataclass
class IndexConfig:
    """The loaded configuration; ``everything()`` when no file was given."""

    overrides: dict[tuple[str, FieldPath], FieldOverride] = field(default_factory=dict)
    composites: list[CompositeIndex] = field(default_factory=list)
    enforced: bool = True
    """False for ``everything()``: every single-field index exists in both scopes."""

    @classmethod
    def everything(cls) -> IndexConfig:
        return cls(enforced=False)

    def has_single(self, group: str, path: FieldPath, kind: str, scope: str) -> bool:
        """Whether the single-field index ``kind`` of ``group``.``path`` exists in ``scope``."""
        if path == NAME_PATH or not self.enforced:
            return True
        # A map field's override governs its subfields too, unless one has its own (production).
        override = None
        for end in range(len(path), 0, -1):
            override = self.overrides.get((group, path[:end]))
            if override is not None:
                break
        return (kind, scope) in (DEFAULT_SINGLE if override is None else override.single_indexes)

    def is_ordered_index_exempt(self, group: str, path: FieldPath) -> bool:
        """Whether writes to ``group``.``path`` skip its ascending collection-scope index (no hotspot)."""
        return not self.has_single(group, path, ASCENDING, COLLECTION)

    def ttl_fields(self) -> list[tuple[str, FieldPath]]:
        return [(o.collection_group, o.field_path) for o in self.overrides.values() if o.ttl]


def load_index_config(path: str | Path) -> IndexConfig:
    """Read and validate a ``firestore.indexes.json``; OSError if unreadable, ValueError if malformed."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    return parse_index_config(data, str(path))


def parse_index_config(data: Any, source: str = "firestore.indexes.json") -> IndexConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be an object with 'indexes' and 'fieldOverrides'")
    unknown = set(data) - {"indexes", "fieldOverrides"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level key {sorted(unknown)[0]!r}")
    config = IndexConfig()
    for number, entry in enumerate(_list_of(data, "indexes", source)):
        config.composites.append(_composite(entry, f"{source}: indexes[{number}]"))
    for number, entry in enumerate(_list_of(data, "fieldOverrides", source)):
        override = _override(entry, f"{source}: fieldOverrides[{number}]")
        key = (override.collection_group, override.field_path)
        if key in config.overrides:
            raise ValueError(
                f"{source}: fieldOverrides[{number}] ({override.collection_group}.{format_field_path(key[1])}):"
                " the field is overridden twice"
            )
        config.overrides[key] = override
    return config


def _list_of(data: dict[str, Any], key: str, source: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{source}: '{key}' must be a list")
    return value


def _group_of(entry: Any, where: str, keys: set[str]) -> str:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object")
    unknown = set(entry) - keys
    if unknown:
        raise ValueError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    group = entry.get("collectionGroup")
    if not isinstance(group, str) or not group or "/" in group:
        raise ValueError(f"{where}: 'collectionGroup' must be a collection id")
    return group


def _path_of(text: Any, where: str) -> FieldPath:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: 'fieldPath' must be a non-empty string")
    try:
        return parse_field_path(text)
    except FirestoreError as exc:
        raise ValueError(f"{where}: fieldPath {text!r}: {exc.message}") from exc


def _scope_of(value: Any, where: str) -> str:
    scope = COLLECTION if value is None else value
    if scope not in _SCOPES:
        raise ValueError(f"{where}: 'queryScope' must be COLLECTION or COLLECTION_GROUP, not {value!r}")
    return str(scope)


def _kind_of(entry: dict[str, Any], where: str) -> str:
    order, array = entry.get("order"), entry.get("arrayConfig")
    if (order is None) == (array is None):
        raise ValueError(f"{where}: needs exactly one of 'order' and 'arrayConfig'")
    if array is not None:
        if array != CONTAINS:
            raise ValueError(f"{where}: 'arrayConfig' must be CONTAINS, not {array!r}")
        return CONTAINS
    if order not in (ASCENDING, DESCENDING):
        raise ValueError(f"{where}: 'order' must be ASCENDING or DESCENDING, not {order!r}")
    return str(order)


def _composite(entry: Any, where: str) -> CompositeIndex:
    group = _group_of(entry, where, _INDEX_KEYS)
    where = f"{where} ({group})"
    scope = _scope_of(entry.get("queryScope"), where)
    fields = entry.get("fields")
    if not isinstance(fields, list) or not fields:
        raise ValueError(f"{where}: 'fields' must be a non-empty list")
    out: list[tuple[FieldPath, str]] = []
    for number, item in enumerate(fields):
        item_where = f"{where}: fields[{number}]"
        if not isinstance(item, dict) or set(item) - {"fieldPath", "order", "arrayConfig"}:
            raise ValueError(f"{item_where}: must be an object with fieldPath and order or arrayConfig")
        path = _path_of(item.get("fieldPath"), item_where)
        if any(path == p for p, _ in out):
            raise ValueError(f"{item_where}: field {format_field_path(path)!r} appears twice")
        out.append((path, _kind_of(item, item_where)))
    return CompositeIndex(group, scope, tuple(out))


def _override(entry: Any, where: str) -> FieldOverride:
    group = _group_of(entry, where, _OVERRIDE_KEYS)
    path = _path_of(entry.get("fieldPath"), where)
    where = f"{where} ({group}.{format_field_path(path)})"
    ttl = entry.get("ttl", False)
    if not isinstance(ttl, bool):
        raise ValueError(f"{where}: 'ttl' must be true or false")
    if "indexes" not in entry:
        if not ttl:
            raise ValueError(f"{where}: needs 'indexes' ([] exempts the field) or 'ttl': true")
        return FieldOverride(group, path, None, ttl)
    raw = entry.get("indexes")
    if not isinstance(raw, list):
        raise ValueError(f"{where}: 'indexes' must be a list ([] exempts the field)")
    kept: set[tuple[str, str]] = set()
    for number, item in enumerate(raw):
        item_where = f"{where}: indexes[{number}]"
        if not isinstance(item, dict) or set(item) - {"order", "arrayConfig", "queryScope"}:
            raise ValueError(f"{item_where}: must be an object with order or arrayConfig and queryScope")
        kept.add((_kind_of(item, item_where), _scope_of(item.get("queryScope"), item_where)))
    return FieldOverride(group, path, frozenset(kept), ttl)
