"""delivery_attempt keeps counting when a shard's engine is dropped and the shard taken back by the
same process (a lease lost in a Firestore outage, issue 31): kept in memory, nothing written."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from test_runtime_shards import World, keys_of_shard

from sidecar.engine import Engine
from sidecar.engine.types import DeadLetter, EngineConfig, Message


async def test_a_shard_taken_back_goes_on_counting_the_attempts_of_its_pending_messages(world: World) -> None:
    [key] = keys_of_shard(0, 1)
    world.hold(0, 5)
    await world.runtime.adopt_shard(0, 5)
    await world.runtime.loaded()
    await world.store_messages([(key, 1)])
    [first] = world.runtime.take("c", 10)
    assert first.attempt == 1
    # The lease runs out (Firestore does not answer): the shard is dropped, its delivery unacked.
    assert world.runtime.drop_shard(0, 5)
    world.hold(0, 6)
    await world.runtime.adopt_shard(0, 6)
    await world.runtime.loaded()
    [again] = world.runtime.take("c", 10)
    assert (again.message.key, again.message.sequence, again.epoch) == (key, 1, 6)
    assert again.attempt == 2


def _message(seq: int, prior: int) -> Message:
    return Message("k", f"d{seq}", f"m{seq}", 0, sequence=seq, known_fingerprint=b"f", prior_attempts=prior)


def test_the_engine_counts_prior_attempts_in_attempt_numbers_and_the_retry_bound() -> None:
    engine = Engine(EngineConfig(mode="sequence", max_delivery_attempts=3, ack_deadline_ms=1_000), id_prefix="x-")
    assert engine.on_stored(_message(1, prior=2), 0) == []
    [delivery] = engine.take("c", 1, 0)
    assert delivery.attempt == 3
    [action] = engine.nack("c", delivery.delivery_id, 10)
    assert isinstance(action, DeadLetter) and action.reason == "max_delivery_attempts" and action.attempts == 3


@given(prior=st.integers(0, 8), max_attempts=st.integers(1, 8))
def test_attempts_go_on_from_the_prior_ones_until_the_bound(prior: int, max_attempts: int) -> None:
    engine = Engine(
        EngineConfig(mode="sequence", max_delivery_attempts=max_attempts, ack_deadline_ms=1_000, backoff_initial_ms=0),
        id_prefix="x-",
    )
    engine.on_stored(_message(1, prior=prior), 0)
    seen: list[int] = []
    for now in range(1, 20):
        deliveries = engine.take("c", 1, now)
        if not deliveries:
            break
        seen.append(deliveries[0].attempt)
        actions = engine.nack("c", deliveries[0].delivery_id, now, retry_after_ms=0)
        if any(isinstance(action, DeadLetter) for action in actions):
            break
    # Attempt numbers go on from the prior ones, and the bound counts them: at least one delivery.
    assert seen == list(range(prior + 1, max(prior + 1, max_attempts) + 1))
