"""Crash simulation, skipped ranges only from the engine and drops only over pending records: fast-path
acks beside stored ones, stale copies of acked messages, acks retried across a re-take.
"""

from __future__ import annotations

import pytest
from crash_sim import Simulation
from crash_sim_support import _PAGED_EXAMPLES, _finish
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_world import SUB, Published, SimConfig

from sidecar.engine.types import Message


def test_27a_a_fast_path_ack_committed_beside_a_later_stored_one_is_no_skip_after_a_restart() -> None:
    """No gap timeout: 1 takes the fast path, 2 (stored first, out of order) is delivered after it;
    both acks go in one ``commit_acks``, whose stored ack 2 (cursor 3) is folded and checkpointed
    before the fast-path ack of 1. Killed before 1's checkpoint: 1 comes back from Pub/Sub below the
    cursor, a duplicate (dropped), never a ``late`` dead letter (nothing was ever skipped)."""
    sim = Simulation(SimConfig(keys=1, per_key=2, fast_path=True))
    sim.step("ingest", 3)  # the copy of 2: out of order, stored
    sim.step("pubsub_ack", 0)
    sim.step("ingest", 0)  # the copy of 1: the fast path (no document)
    assert sim.pending_documents() == {("k0", 2)} and len(sim.life.fast) == 1
    for seq in (1, 2):
        assert [d.message.sequence for d in sim.take()] == [seq]
        sim.ack("k0", seq)
    sim.step("commit_acks", 0)  # ack 2's Commit writes the checkpoint; ack 1 waits for the next one
    sim.step("crash", 0)
    cursor = sim.life.store.cursor(SUB, "k0")
    assert cursor is not None and (cursor.next_sequence, cursor.skipped) == (3, ()), "1 recorded as skipped"
    sim.ingest_all()  # Pub/Sub delivers 1 again: its ack was never confirmed
    sim.dead_letter_all()
    assert sim.dead_letter_topic == [], "a duplicate of a delivered message was dead-lettered"
    assert sim.life.engine.status(sim.now_ms)[0].counts["duplicates"] == 1
    _finish(sim)


def test_27a_a_range_a_gap_timeout_skipped_stays_skipped_when_a_later_ack_is_durable_first() -> None:
    """Gap skip: 1 missing, 2 delivered past it. Its ack's Commit applies but its answer is lost,
    3's ack (cursor 4) is durable first and checkpointed: that ack carried the skipped range too
    (no ack can be sure to be the first the store folds). Killed: 1 arrives at last, late."""
    sim = Simulation(
        SimConfig(keys=1, per_key=3, gap_timeout_ms=1_000, on_gap_timeout="skip", unpublished=frozenset({("k0", 1)}))
    )
    sim.ingest_all()
    sim.step("tick", 2)  # past the gap timeout: 1 is skipped
    (second,) = sim.take()
    assert second.message.sequence == 2 and [(s.first, s.last) for s in second.skipped] == [(1, 1)]
    sim.ack("k0", 2)
    sim.step("lose_answer", 0)
    sim.step("commit_acks", 0)  # applied, the answer lost: the runtime retries it later
    assert sim.life.acks and ("k0", 2) not in sim.confirmed
    retried, sim.life.acks = sim.life.acks, []
    assert [d.message.sequence for d in sim.take()] == [3]  # the app's ack freed the key's slot
    sim.ack("k0", 3)
    sim.step("commit_acks", 0)
    sim.life.acks = retried
    sim.step("crash", 0)  # before the retry of 2's ack
    cursor = sim.life.store.cursor(SUB, "k0")
    assert cursor is not None and (cursor.next_sequence, cursor.skipped) == (4, ((1, 1),))
    sim.publish(Published("k0", 1))
    sim.ingest_all()
    sim.dead_letter_all()
    assert [(m.sequence, reason) for m, reason in sim.dead_letter_topic if isinstance(m, Message)] == [(1, "late")]
    _finish(sim)


def test_27_3_a_stale_copy_of_an_acked_message_never_replaces_its_tombstone() -> None:
    """2's ack is durable on its tombstone only (the checkpoint was written a moment before, with
    1's ack). A stale copy of 2 (a read-back that raced the ack, a Listen snapshot older than it)
    reaches the engine, which drops it; the drop must not replace the acked tombstone, which
    carries the key's cursor: killed before the next checkpoint, 3 must still be delivered."""
    sim = Simulation(SimConfig(keys=1, per_key=3))
    sim.step("ingest", 0)  # 1 only
    sim.step("pubsub_ack", 0)
    sim.take()
    sim.ack("k0", 1)
    sim.step("commit_acks", 0)  # tombstone 1 and the shard's checkpoint (next 2)
    sim.ingest_all()
    (second,) = sim.take()
    sim.ack("k0", 2)
    sim.step("tick", 0)  # 10 ms: the checkpoint is not due again
    sim.step("commit_acks", 0)  # tombstone 2 (cursor 3) only
    sim.life.seen = [second.message]
    sim.step("stale_copy", 0)
    assert sim.life.drops == [second.message], "the engine finishes the stale copy's record"
    sim.step("drops", 0)
    assert sim.documents.docs[f"pubsub-sidecar/{SUB}/messages/{second.message.payload.ref}"]["state"] == "acked"  # type: ignore[union-attr]
    sim.step("crash", 0)
    assert [d.message.sequence for d in sim.take()] == [3], "the key waits for 2, which is finished"
    _finish(sim)


def _ack_retried_across_a_re_take(sim: Simulation) -> None:
    """k0/1 delivered and acked; its Commit fails in a brownout and is retried after the lease
    moved to this very pod at epoch + 1 and the pod reloaded the shard (k0/1 pending there)."""
    sim.ingest_all()
    (delivery,) = sim.take()
    assert delivery.message.sequence == 1
    sim.ack("k0", 1)
    sim.step("brownout", 0)  # the next write fails before it applies
    sim.step("commit_acks", 0)  # refused by Firestore: the runtime retries it
    assert sim.unavailable == 1 and not sim.confirmed
    sim.step("lose_lease", 0)  # one pod: the lease goes to p0 itself, epoch 2 (its margin ran out)
    sim.step("take_over", 0)  # p0 takes the shard back and reloads it: k0/1 is still pending
    assert sim.handovers == 1
    sim.step("commit_acks", 0)  # the retry, now that Firestore answers


def test_27_1_an_ack_retried_across_a_re_take_is_refused_not_confirmed() -> None:
    """Case 1: the retried ack is refused (its engine is gone, and the store holds the shard at
    epoch 2), so it is never confirmed; the epoch-2 engine delivers k0/1 again, which G3 allows."""
    sim = Simulation(SimConfig(keys=1, per_key=2))
    _ack_retried_across_a_re_take(sim)
    assert ("k0", 1) not in sim.confirmed and sim.stale_acks == 1
    (again,) = sim.take()
    assert again.message.sequence == 1
    _finish(sim)


def test_27_1_without_the_epoch_rule_the_simulation_finds_a_confirmed_ack_delivered_again() -> None:
    """The same run with the code before the rule (writes fenced with the epoch the pod holds when
    they are sent): the retry passes the epoch-2 fence, the ack is confirmed, and the epoch-2
    engine delivers k0/1 again: the check on every delivery catches it."""
    sim = Simulation(SimConfig(keys=1, per_key=2, epoch_rule=False))
    _ack_retried_across_a_re_take(sim)
    assert ("k0", 1) in sim.confirmed
    with pytest.raises(AssertionError, match="G3"):
        sim.take()
    sim.close()


# Fast-path acks beside stored ones, lost answers, stale copies of finished records, drops and
# crashes, on one pod with no skip policy (the fast path on or off): where a ``late`` dead letter
# can only be a mistake (the check in ``Simulation._apply``) and a drop over a finished record
# stalls a key after a restart.
_FOCUSED_OPS = (
    *("ingest", "ingest", "pubsub_ack", "take", "take", "app_ack", "app_ack", "commit_acks", "commit_acks"),
    *("flush", "tick", "crash", "arm_crash", "lose_answer", "redeliver", "stale_copy", "drops", "page"),
)


@st.composite
def _focused_configs(draw: st.DrawFn) -> SimConfig:
    return SimConfig(
        keys=draw(st.integers(1, 2)),
        per_key=draw(st.integers(2, 5)),
        max_in_flight=draw(st.integers(1, 2)),
        fast_path=draw(st.booleans()),
        paged=draw(st.booleans()),
        page_size=draw(st.integers(1, 3)),
    )


@settings(
    max_examples=_PAGED_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    config=_focused_configs(),
    steps=st.lists(st.tuples(st.sampled_from(_FOCUSED_OPS), st.integers(0, 1_000)), min_size=20, max_size=80),
)
def test_27_fast_path_acks_stale_copies_and_crashes_keep_every_guarantee(
    config: SimConfig, steps: list[tuple[str, int]]
) -> None:
    Simulation(config).run(steps)
