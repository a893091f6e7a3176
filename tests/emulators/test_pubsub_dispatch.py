"""The Pub/Sub emulator's dispatcher on its own (no gRPC): which open stream a message is leased to.

The streams' writers are played by the test: ``written`` takes what a writer would write next.
"""

from __future__ import annotations

import asyncio

import grpc
from google.pubsub_v1 import types

from sidecar.emulators.pubsub_model import StreamState, Subscription
from sidecar.emulators.pubsub_state import Broker

TOPIC = "projects/p/topics/topic-1"
SUBSCRIPTION = "projects/p/subscriptions/sub-1"


def _broker() -> tuple[Broker, Subscription]:
    broker = Broker()
    broker.add_topic(types.Topic.pb()(name=TOPIC))
    sub = broker.add_subscription(types.Subscription.pb()(name=SUBSCRIPTION, topic=TOPIC))
    return broker, sub


def _publish(broker: Broker, data: bytes) -> None:
    broker.publish(TOPIC, [types.PubsubMessage.pb()(data=data)])


async def _dispatched() -> None:
    """Let the dispatch that ``notify`` scheduled (call_soon) run."""
    await asyncio.sleep(0)


def written(stream: StreamState) -> list[str]:
    """What the stream's writer takes from its outbox now (as it would write it): the ack ids."""
    return [lease.ack_id for lease in stream.next_response()]


async def test_a_single_message_goes_to_the_least_loaded_stream_not_by_turn() -> None:
    broker, sub = _broker()
    slow = broker.open_stream(sub, 60, 0, 0, "slow")  # never acks
    quick = broker.open_stream(sub, 60, 0, 0, "quick")  # acks each message at once
    for i in range(6):
        _publish(broker, f"m{i}".encode())
        await _dispatched()
        slow_got, quick_got = written(slow), written(quick)
        assert len(slow_got) + len(quick_got) == 1
        if i > 0:
            # The slow stream holds one message; the quick one holds none: by load, not by turn.
            assert quick_got, f"message {i} went to the stream that holds the most"
        broker.acknowledge(sub, quick_got)
    assert slow.outstanding_messages == 1


async def test_a_stream_with_unwritten_leases_gets_nothing_more_until_its_writer_caught_up() -> None:
    broker, sub = _broker()
    blocked = broker.open_stream(sub, 60, 0, 0, "blocked")
    other = broker.open_stream(sub, 60, 0, 0, "other")
    _publish(broker, b"first")
    await _dispatched()
    holder, idle = (blocked, other) if blocked.outbox else (other, blocked)
    # The holder's writer does not take its outbox (a write waits on a client that does not read).
    for i in range(4):
        _publish(broker, f"next-{i}".encode())
        await _dispatched()
        assert len(written(idle)) == 1
        broker.acknowledge(sub, [lease.ack_id for lease in list(sub.leases.values()) if lease.stream is idle])
    assert len(holder.outbox) == 1
    # Caught up, its writer asks for more (``writer_idle``) and gets its share again.
    assert len(written(holder)) == 1
    _publish(broker, b"a")
    _publish(broker, b"b")
    broker.writer_idle(holder)
    await _dispatched()
    assert (len(written(holder)), len(written(idle))) == (1, 1)


async def test_ending_a_stream_forgets_it_and_gives_its_unwritten_leases_to_the_others() -> None:
    broker, sub = _broker()
    ending = broker.open_stream(sub, 60, 0, 0, "ending")
    for i in range(3):
        _publish(broker, f"m{i}".encode())
    await _dispatched()
    assert len(ending.outbox) == 3  # leased, not written: its writer waits
    broker.end_stream(ending, grpc.StatusCode.UNAVAILABLE, "broken")
    assert ending.break_code is grpc.StatusCode.UNAVAILABLE
    assert list(sub.streams) == [] and not ending.outbox and not sub.leases
    assert [p.message.data for p in sub.available] == [b"m0", b"m1", b"m2"]
    assert all(p.attempts == 0 for p in sub.available), "never delivered: not an attempt"
    other = broker.open_stream(sub, 60, 0, 0, "other")
    await _dispatched()
    assert len(written(other)) == 3
    histories = [list(p.history) for p in sub.unacked.values()]
    for history in histories:
        events = [what for _, what in history]
        assert "(client ending)" in events[0] and "given back unwritten" in events[1], events
        assert "(client other)" in events[2], events
    # Ending twice (the RPC's end after a break) changes nothing.
    broker.end_stream(ending, grpc.StatusCode.CANCELLED, "RPC ended")
    assert ending.break_code is grpc.StatusCode.UNAVAILABLE and len(sub.leases) == 3
