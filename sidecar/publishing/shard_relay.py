"""One shard of a relay while this pod holds its lease: plan a batch, publish it, settle it.

A ``ShardRelay`` lives for one lease (one epoch): made when the shard is gained, dropped when it is
lost. Each ``step`` does, in this order and never otherwise:

1. read the shard's counters if it has none (once per lease, and again after a Commit whose outcome
   is unknown: it may have applied);
2. plan the next batch (``sidecar.publishing.plan``: commit order per key, the next numbers);
3. publish it (``Publisher.publish``, one request per topic), if the lease is still held within
   its safety margin (``holds``): a pod that lost the shard publishes nothing more, and one that
   lost it while publishing cannot settle (the fence), so another owner's numbers never meet a
   stale owner's, but for a publish already under way when the margin ran out (the same bound the
   subscriber side's deliveries have);
4. only for what Pub/Sub took, whole key runs: delete the entries and move the counters in ONE
   Commit fenced by the shard's lease (``sidecar.store.outbox.settle``).

A crash anywhere leaves the entries in the outbox with the counters as they were before the batch
(step 4 is one atomic Commit): the next owner plans the same entries with the same numbers and
publishes the same messages again; the subscriber side drops them as duplicates. A ``Fenced``
Commit (the lease moved on) applies nothing and ends the shard here (``ShardLost``).

Failures: a transient one (``PublishFailure`` not permanent, ``Unavailable``) is for the caller to
back off and call ``step`` again: nothing moved, so nothing reorders. A permanent publish failure is
counted per entry (the first of its key's run); after ``give_up_after`` in a row the entry waits
(``waiting``: it and the rest of its key are not planned until an operator retries or discards it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sidecar.publishing.entries import Entry, Rules, Unpublishable
from sidecar.publishing.plan import Batch, advanced, plan_batch
from sidecar.publishing.publisher import Publisher, PublishFailure
from sidecar.store import documents as docs
from sidecar.store import outbox
from sidecar.store.api import ShardLost

_LOGGER = logging.getLogger(__name__)

GIVE_UP_AFTER = 5
"""Permanent publish failures in a row before an entry waits for an operator (a topic created late
by a deployment gets a few backoffs first)."""


@dataclass(frozen=True, slots=True)
class Step:
    planned: int = 0
    """Messages in the batch (0: nothing to do)."""
    settled: int = 0
    """Entries published and settled (deleted, counters moved)."""
    failed: int = 0
    """Messages Pub/Sub did not take (the caller backs off)."""


@dataclass(slots=True)
class ShardCounts:
    published: int = 0
    settled_batches: int = 0
    publish_failures: int = 0
    republished: int = 0
    """Messages published again after a failed settle or a failed publish of the same batch."""


@dataclass(slots=True)
class ShardRelay:
    relay: str
    """The relay's document root (``outbox.relay_root``)."""
    collection: str
    shard: int
    epoch: int
    documents: docs.Documents
    publisher: Publisher
    rules: Rules
    start: int
    limit: int
    fence: Callable[[], docs.Fence]
    """The shard's lease as a fence; raises ``ShardLost`` when this pod no longer holds it."""
    holds: Callable[[], bool]
    """Whether this pod still holds the lease at ``epoch``, within its safety margin (asked right
    before every publish: a pod that lost the shard, or slept past its margin, publishes nothing)."""
    give_up_after: int = GIVE_UP_AFTER
    counters: dict[str, outbox.Counter] | None = None
    waiting: dict[str, str] = field(default_factory=dict)
    """Entry id -> why it failed for good at publish time (its key waits behind it). The relay shares
    one for all its shards, kept from the waiting documents (an operator's retry removes one)."""
    on_give_up: Callable[[str, str, str], None] | None = None
    """(entry id, key, reason): the entry went to ``waiting`` (the relay records it durably)."""
    attempts: dict[str, int] = field(default_factory=dict)
    last_batch: Batch | None = None
    counts: ShardCounts = field(default_factory=ShardCounts)
    _published_before: set[tuple[str, int]] = field(default_factory=set)

    async def step(self, entries: Iterable[Entry | Unpublishable]) -> Step:
        """One batch: plan, publish, settle. Raises ``ShardLost`` (fence failed), ``StoreError``
        (transient or not: the caller backs off; the counters are read again)."""
        if self.counters is None:
            self.counters = await outbox.read_counters(self.documents, self.relay, self.shard)
        batch = plan_batch(entries, self.counters, self.start, self.rules, self.limit, self.waiting)
        self.last_batch = batch
        if not batch.messages:
            return Step()
        if not self.holds():
            raise ShardLost(self.relay, [self.shard], {self.shard: self.epoch})
        outcomes = await self.publisher.publish(batch.messages)
        taken = [m for m, failure in zip(batch.messages, outcomes, strict=True) if failure is None]
        self.counts.published += len(taken)
        for m in taken:
            if (m.entry_id, m.sequence) in self._published_before:
                self.counts.republished += 1
            self._published_before.add((m.entry_id, m.sequence))
        self._note_failures(batch, outcomes)
        if taken:
            moved = advanced(self.counters, taken)
            fence = self.fence()
            try:
                await outbox.settle(
                    self.documents, self.collection, self.relay, self.shard, [m.entry_id for m in taken], moved, fence
                )
            except docs.Fenced as exc:
                raise ShardLost(self.relay, [self.shard], {self.shard: self.epoch}) from exc
            except BaseException:
                self.counters = None  # the Commit may have applied: read them again
                raise
            self.counters = moved
            self.counts.settled_batches += 1
            for m in taken:
                self.attempts.pop(m.entry_id, None)
                self._published_before.discard((m.entry_id, m.sequence))
        return Step(len(batch.messages), len(taken), len(batch.messages) - len(taken))

    def _note_failures(self, batch: Batch, outcomes: Sequence[PublishFailure | None]) -> None:
        first_of_run: dict[str, str] = {}
        for m, failure in zip(batch.messages, outcomes, strict=True):
            if failure is None:
                continue
            self.counts.publish_failures += 1
            first_of_run.setdefault(m.key, m.entry_id)
            if m.entry_id != first_of_run[m.key]:
                continue
            reason = failure.reason
            if not failure.permanent:
                continue
            count = self.attempts.get(m.entry_id, 0) + 1
            self.attempts[m.entry_id] = count
            if count >= self.give_up_after:
                self.waiting[m.entry_id] = f"{reason} ({count} attempts)"
                if self.on_give_up is not None:
                    self.on_give_up(m.entry_id, m.key, self.waiting[m.entry_id])
                _LOGGER.error(
                    "relay shard %d: entry %s of a key waits for an operator: %s", self.shard, m.entry_id, reason
                )
