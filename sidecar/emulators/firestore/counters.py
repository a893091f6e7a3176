"""Operation counters, billed the way Firestore bills.

- reads: one per document returned by a get, batch get (a missing document costs a read too),
  query or list; a query or list that returns nothing costs one; an aggregation costs one per
  1,000 documents matched (at least one); ListCollectionIds costs one per call. A Listen costs
  one per document added to or changed in its result, one per document that left it because it
  changed (not when deleted), and at least one when it starts (``listen``).
- writes: one per document written by a set, update, create or transform (a write carrying
  transforms is still one write).
- deletes: one per delete write, existing document or not, and one per document a TTL policy
  deleted (production bills a TTL deletion as a delete).
- ttl_deletes: the part of ``deletes`` that TTL sweeps made (``ttl``).
Only writes that were applied are billed: a refused or aborted commit costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    reads: int = 0
    writes: int = 0
    deletes: int = 0
    ttl_deletes: int = 0

    def snapshot(self) -> dict[str, int]:
        return {"reads": self.reads, "writes": self.writes, "deletes": self.deletes, "ttl_deletes": self.ttl_deletes}

    def reset(self) -> None:
        self.reads = self.writes = self.deletes = self.ttl_deletes = 0
