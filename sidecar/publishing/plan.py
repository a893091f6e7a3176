"""Which entries of a shard a relay publishes next, with which sequence numbers. Pure, property-tested
(tests/publishing/test_plan_properties.py).

Rules:

- **Commit order per key.** A key's entries are numbered in the order of their update time (the
  commit time of the app's transaction), then document id; the first one not yet published gets the
  key's last published number + 1 (``start`` when the key never had one). No gap, no repeat.
- **Deterministic.** The plan depends only on the entries (their ids, fields' verdicts and update
  times), the shard's counters and ``limit``, never on the order they arrived in: after a crash
  between a publish and its commit, the same entries get the same numbers again.
- **A key waits behind its first unpublishable entry** (``Unpublishable`` with its key, or an entry
  id in ``waiting``: one that failed for good at publish time). Its earlier entries go out; it and
  everything after it wait (no number is used: a discarded entry leaves no gap). Other keys flow.
  An unpublishable entry without a usable key blocks nothing but itself.
- **A batch is at most ``limit`` entries and ``MAX_BATCH_BYTES``**, the keys taken in the order of
  their oldest pending entry, so no key starves; a key may be cut in the middle (the rest comes next
  batch, in order). A key's run in a batch stays in one topic, so each topic's share of a batch is
  one Publish request: a key's messages of a batch are all published or none is.
- **What a stale view shows is skipped** (``settled_already``): an entry at or before its key's
  last settled entry was published and deleted; the counters say so, whatever the view says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sidecar.publishing.entries import Entry, Message, Rules, Unpublishable, message
from sidecar.store.outbox import Counter

MAX_BATCH_BYTES = 9 * 1024 * 1024
"""A batch's data and attributes: under Pub/Sub's 10 MB per Publish request, so a topic's share of a
batch is one request (all or nothing)."""


@dataclass(frozen=True, slots=True)
class Batch:
    messages: list[Message]
    """In per-key order: a key's messages are consecutive, with consecutive sequence numbers."""
    blocked: dict[str, Unpublishable] = field(default_factory=dict)
    """Key -> the entry it waits behind."""
    unkeyed: list[Unpublishable] = field(default_factory=list)
    """Unpublishable entries without a usable key."""


def advanced(counters: Mapping[str, Counter], published: Iterable[Message]) -> dict[str, Counter]:
    """``counters`` moved on by ``published`` (whole key runs of a batch, in order)."""
    moved = dict(counters)
    for m in published:
        moved[m.key] = Counter(m.sequence, m.update_time_us, m.entry_id)
    return moved


def next_number(counters: Mapping[str, Counter], key: str, start: int) -> int:
    """The number of ``key``'s next entry: after its last published one, or ``start``."""
    previous = counters.get(key)
    return start if previous is None else previous.last + 1


def settled_already(counters: Mapping[str, Counter], entry: Entry | Unpublishable) -> bool:
    """True when ``entry`` is at or before its key's last settled entry in commit order: a stale
    view still shows it, but it was published and deleted (a key settles in commit order)."""
    counter = counters.get(entry.key) if entry.key is not None else None
    return counter is not None and order_key(entry) <= (counter.at_us, counter.at_id)


def order_key(entry: Entry | Unpublishable) -> tuple[int, str]:
    """Commit order: the update time, then the document id."""
    return (entry.update_time_us, entry.id)


def plan_batch(
    entries: Iterable[Entry | Unpublishable],
    counters: Mapping[str, Counter],
    start: int,
    rules: Rules,
    limit: int,
    waiting: Mapping[str, str] | None = None,
) -> Batch:
    """The next batch of a shard: ``entries`` (its pending entries, in any order), ``counters`` (its
    counters, as settled), ``waiting`` (entry id -> why it failed for good)."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    held = waiting or {}
    by_key: dict[str, list[Entry | Unpublishable]] = {}
    unkeyed: list[Unpublishable] = []
    for entry in entries:
        if settled_already(counters, entry):
            continue
        if entry.key is None:
            assert isinstance(entry, Unpublishable)
            unkeyed.append(entry)
        else:
            by_key.setdefault(entry.key, []).append(entry)
    for run in by_key.values():
        run.sort(key=order_key)
    messages: list[Message] = []
    blocked: dict[str, Unpublishable] = {}
    size = 0
    for key in sorted(by_key, key=lambda k: order_key(by_key[k][0])):
        number = next_number(counters, key, start)
        taking = True
        topic = None
        for entry in by_key[key]:
            if isinstance(entry, Entry) and entry.id in held:
                entry = Unpublishable(entry.id, key, held[entry.id], entry.update_time_us)
            if isinstance(entry, Unpublishable):
                blocked[key] = entry
                break
            entry_size = entry.size()
            if topic is not None and entry.topic != topic:
                taking = False  # a key's run stays in one topic: one request, all or nothing
            if len(messages) >= limit or (messages and size + entry_size > MAX_BATCH_BYTES):
                taking = False
            if not taking:
                continue  # past the batch: only looking for what blocks the key
            topic = entry.topic
            size += entry_size
            messages.append(message(entry, number, rules))
            number += 1
    unkeyed.sort(key=order_key)
    return Batch(messages, blocked, unkeyed)
