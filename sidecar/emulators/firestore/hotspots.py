"""Index hotspot counter: how many writes land at the end of a single-field index.

Production writes each indexed field's entry (value in Firestore's value order, then document
name) into that field's index. When the values grow monotonically (timestamps, counters), every new
entry sorts after all the others and lands on the same tablet: production caps such a collection
near 500 writes/s. This module counts, per (collection group, field path), the writes that are
*appends*, and the peak number of appends within one wall-clock second. An append is a write whose
value sorts after every value the field held when the current second began: its entry lands in index
space at the end that did not exist a moment ago, where production has had no time to split the
range, whatever the document name. So a timestamp that many writes share (one Commit's) counts for
each of them, while a value that existed before (``state == "pending"``, a shard number) never
counts: its entries spread over a long-lived range by their random document names.

- Fields counted: every top-level field a write sets, and every map subfield (``a.b``), as
  production indexes them; a field whose value did not change is not rewritten in the index and is
  not counted. Fields without an ascending collection-scope index (exempted in the index config)
  are not counted.
- Cost: O(1) amortised per field written. Only the current maximum entry per (group, field) is
  kept, not the index. Deleting the maximum entry does not lower it (lazily left): the next entry
  below the old maximum is then not counted as an append although production would place it last.
  For monotonic fields, the case this exists for, that never matters.
- Peak: per wall-clock second buckets (``int(time.time())``), not a sliding window: the peak is the
  largest count of appends stamped with one same second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sidecar.emulators.firestore.documents import Record
from sidecar.emulators.firestore.indexes import IndexConfig
from sidecar.emulators.firestore.paths import FieldPath, format_field_path
from sidecar.emulators.firestore.query import name_key
from sidecar.emulators.firestore.values import Key, value_key


@dataclass(slots=True)
class _Tally:
    maximum: tuple[Key, Key] | None = None
    appends: int = 0
    peak_per_s: int = 0
    second: int = -1
    in_second: int = 0
    base: Key | None = None
    """The largest value when ``base_second`` began: a value above it is an append."""
    base_second: int = -1


class HotspotCounter:
    """Per (collection group, field path) append counts; fed by ``DocumentStore.write_observers``."""

    def __init__(self, indexes: IndexConfig, wall_clock: Callable[[], float] = time.time) -> None:
        self.indexes = indexes
        self._clock = wall_clock
        self._tallies: dict[tuple[str, FieldPath], _Tally] = {}

    def on_write(self, name: str, old: Record | None, record: Record | None) -> None:
        if record is None:
            return
        group = name.rpartition("/")[0].rpartition("/")[2]
        old_fields = old.doc.fields if old is not None else None
        doc_key: Key | None = None
        for path, value in _indexed_values(record.doc.fields, old_fields, ()):
            if self.indexes.is_ordered_index_exempt(group, path):
                continue
            if doc_key is None:
                doc_key = name_key(name)
            entry = (value_key(value), doc_key)
            tally = self._tallies.get((group, path))
            if tally is None:
                tally = self._tallies[(group, path)] = _Tally()
            second = int(self._clock())
            if second != tally.base_second:
                tally.base_second = second
                tally.base = None if tally.maximum is None else tally.maximum[0]
            newest = tally.maximum is None or entry > tally.maximum
            if newest:
                tally.maximum = entry
            # A field with no value before this second: only entries at its very end count.
            if entry[0] > tally.base if tally.base is not None else newest:
                self._count(tally)

    def _count(self, tally: _Tally) -> None:
        tally.appends += 1
        second = int(self._clock())
        if second != tally.second:
            tally.second, tally.in_second = second, 0
        tally.in_second += 1
        tally.peak_per_s = max(tally.peak_per_s, tally.in_second)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"<group>.<field>": {"appends": n, "peak_per_s": p}}`` for the fields with an append."""
        return {
            f"{group}.{format_field_path(path)}": {"appends": t.appends, "peak_per_s": t.peak_per_s}
            for (group, path), t in sorted(self._tallies.items())
            if t.appends
        }

    def reset_counts(self) -> None:
        """Zero the counts (with the other counters); the maxima stay: the index still holds them."""
        for tally in self._tallies.values():
            tally.appends = tally.peak_per_s = tally.in_second = 0
            tally.second = tally.base_second = -1

    def clear(self) -> None:
        """The store was emptied: the indexes are empty too."""
        self._tallies.clear()


def _indexed_values(fields: Any, old_fields: Any, prefix: FieldPath) -> Iterator[tuple[FieldPath, Any]]:
    """(path, value) of every field and map subfield whose value differs from ``old_fields``."""
    for key, value in fields.items():
        before = None if old_fields is None else old_fields.get(key)
        if before is not None and before == value:
            continue
        path = (*prefix, key)
        yield path, value
        if value.WhichOneof("value_type") == "map_value":
            old_map = before.map_value.fields if before is not None and before.HasField("map_value") else None
            yield from _indexed_values(value.map_value.fields, old_map, path)
