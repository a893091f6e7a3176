"""The relay's plan (sidecar/publishing/plan.py), property-tested: commit order per key, gap-free
numbers from the counters, determinism whatever the arrival order, a key waiting behind its first
unpublishable entry while the others flow, and batches that never split a key's run wrongly."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.publishing.entries import Entry, Rules, Unpublishable
from sidecar.publishing.plan import advanced, order_key, plan_batch
from sidecar.store.outbox import Counter

RULES = Rules("demo", "projects/demo/topics/t", "k", "seq", ordering_key=False)
KEYS = ["a", "b", "c"]
State = tuple[list[Entry | Unpublishable], dict[str, Counter], int]


@st.composite
def shard_state(draw: st.DrawFn) -> State:
    count = draw(st.integers(0, 30))
    entries: list[Entry | Unpublishable] = []
    for index in range(count):
        key = draw(st.sampled_from(KEYS))
        time = draw(st.integers(0, 8))  # collisions: one transaction, several entries
        entry_id = f"{draw(st.integers(0, 10**6)):07d}-{index}"
        if draw(st.integers(0, 15)) == 0:
            entries.append(Unpublishable(entry_id, key, "bad", time))
        else:
            topic = draw(st.sampled_from([RULES.topic, RULES.topic, "projects/demo/topics/u"]))
            entries.append(Entry(entry_id, key, b"x", {}, topic, time))
    counters = {k: Counter(draw(st.integers(0, 50)), -1, "") for k in KEYS if draw(st.booleans())}
    return entries, counters, draw(st.integers(1, 12))


@settings(max_examples=300, deadline=None)
@given(state=shard_state(), order=st.randoms(use_true_random=False), start=st.integers(0, 3))
def test_numbers_follow_commit_order_without_gaps(state: State, order: random.Random, start: int) -> None:
    entries, counters, limit = state
    batch = plan_batch(entries, counters, start, RULES, limit)
    shuffled = list(entries)
    order.shuffle(shuffled)
    assert plan_batch(shuffled, counters, start, RULES, limit) == batch
    assert len(batch.messages) <= limit
    by_key: dict[str, list[int]] = {}
    for m in batch.messages:
        by_key.setdefault(m.key, []).append(m.sequence)
    for key, numbers in by_key.items():
        first = counters[key].last + 1 if key in counters else start
        assert numbers == list(range(first, first + len(numbers)))
        runs = [e for e in sorted(entries, key=order_key) if e.key == key]
        published = [m.entry_id for m in batch.messages if m.key == key]
        assert published == [e.id for e in runs[: len(published)]]  # a prefix in commit order
        assert all(isinstance(e, Entry) for e in runs[: len(published)])
        assert len({m.topic for m in batch.messages if m.key == key}) == 1
    for key, blocker in batch.blocked.items():
        before = [e for e in sorted(entries, key=order_key) if e.key == key]
        assert blocker == next(e for e in before if isinstance(e, Unpublishable))
        assert all(order_key(blocker) > (m.update_time_us, m.entry_id) for m in batch.messages if m.key == key)


@settings(max_examples=200, deadline=None)
@given(state=shard_state())
def test_settled_batches_add_up_to_every_publishable_entry_once(state: State) -> None:
    """Planning and settling batch after batch (the view not updated: it is stale, the counters are
    not) publishes each entry before its key's first unpublishable one exactly once, in order."""
    entries, _, limit = state
    counters: dict[str, Counter] = {}
    published = []
    for _ in range(100):
        batch = plan_batch(entries, counters, 1, RULES, limit)
        if not batch.messages:
            break
        published += batch.messages
        counters = advanced(counters, batch.messages)
    for key in KEYS:
        run = [e for e in sorted(entries, key=order_key) if e.key == key]
        cut = next((i for i, e in enumerate(run) if isinstance(e, Unpublishable)), len(run))
        mine = [m for m in published if m.key == key]
        assert [m.entry_id for m in mine] == [e.id for e in run[:cut]]
        assert [m.sequence for m in mine] == list(range(1, cut + 1))


def test_an_entry_waiting_for_an_operator_blocks_its_key_only() -> None:
    entries: list[Entry | Unpublishable] = [
        Entry("1", "a", b"", {}, RULES.topic, 1),
        Entry("2", "a", b"", {}, RULES.topic, 2),
        Entry("3", "a", b"", {}, RULES.topic, 3),
        Entry("4", "b", b"", {}, RULES.topic, 1),
    ]
    batch = plan_batch(entries, {}, 1, RULES, 10, waiting={"2": "topic gone"})
    assert [(m.entry_id, m.sequence) for m in batch.messages] == [("1", 1), ("4", 1)]
    assert batch.blocked["a"].reason == "topic gone"
