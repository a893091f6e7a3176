"""The relay under crashes (tests/publishing/relay_sim.py): a crash before or after every relay
write and every publish, stale views and a zombie owner. Every entry published with gap-free
numbers per key in commit order, every republish identical, the outbox empty at the end."""

from __future__ import annotations

import pytest
from relay_sim import CrashPoint, SimConfig, run_sim

_SEEDS = range(6)


def _points() -> list[CrashPoint]:
    points = []
    for kind, count in (("write", 10), ("publish", 14)):
        for when in ("before", "after"):
            points += [CrashPoint(kind, when, index) for index in range(count)]
    return points


@pytest.mark.parametrize("seed", _SEEDS)
def test_without_crashes(seed: int) -> None:
    sim = run_sim(SimConfig(seed=seed))
    assert sim.pubsub.taken


@pytest.mark.parametrize("point", _points(), ids=lambda p: f"{p.when}-{p.kind}-{p.index}")
@pytest.mark.parametrize("seed", _SEEDS)
def test_a_crash_anywhere(seed: int, point: CrashPoint) -> None:
    """Before or after the n-th settle Commit or publish: the restarted relay (a new owner, the
    counters read again, a view that may be stale) numbers the same entries the same way."""
    sim = run_sim(SimConfig(seed=seed, crash=point))
    assert sim.crashed or sim.writes <= point.index or sim.pubsub.calls <= point.index


def test_crashes_between_publish_and_settle_republish_identically() -> None:
    """A crash after a publish and before its settle: the batch is published again, the same
    messages (the check compares every publish of a number), and each counts once."""
    republished = 0
    for seed in _SEEDS:
        sim = run_sim(SimConfig(seed=seed, crash=CrashPoint("write", "before", 1), transient_rate=0.0))
        assert sim.crashed
        distinct = {(m.key, m.sequence) for m in sim.pubsub.taken}
        republished += len(sim.pubsub.taken) - len(distinct)
    assert republished > 0


@pytest.mark.parametrize("seed", _SEEDS)
def test_a_zombie_owner_cannot_settle(seed: int) -> None:
    """The lease moves on while the old owner still steps (a paused pod that wakes): its publishes
    are duplicates the subscriber drops, and its settles fail their fence, changing nothing."""
    sim = run_sim(SimConfig(seed=seed, zombie=True, entries=30))
    assert sim.zombie is not None


def test_zombie_runs_meet_their_fence() -> None:
    fenced = sum(run_sim(SimConfig(seed=seed, zombie=True, entries=30)).fenced for seed in range(12))
    assert fenced > 0


@pytest.mark.parametrize("start", [0, 1, 1000])
def test_numbers_begin_at_the_configured_start(start: int) -> None:
    run_sim(SimConfig(seed=3, start=start, crash=CrashPoint("publish", "after", 2)))
