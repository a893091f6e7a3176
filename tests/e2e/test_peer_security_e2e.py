"""End to end: forged calls on a running sidecar's peer port (issue 29, run (i)).

A raw gRPC client (the peer protocol's generated stub, nothing of the sidecar's forwarder) calls
``PeerIntake.Forward`` on a real ``pubsub-sidecar run`` with the peer channel on:

- with the shared secret but an epoch the pod does not hold its shard at: every message is REFUSED
  ``STALE_EPOCH`` and none reaches the app; a copy of a message the app already acked, forwarded at
  the current epoch, is ACCEPTED (a durable copy exists) and not delivered again;
- without credentials, and with a wrong secret: the call ends with UNAUTHENTICATED, its message is
  never delivered, and ``pubsub_sidecar_peer_unauthenticated_total`` counts both calls.

After them, the key's order, no second delivery of a confirmed message and nothing lost are checked
from what the app saw (``check_sequence_guarantees``, ``check_confirmed_deliveries_are_final``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest
from conftest import Scenario
from e2e_checks import check_confirmed_deliveries_are_final, check_sequence_guarantees
from e2e_config import order_message
from e2e_fleet import PeeringFleet, all_seen, peer_counts
from e2e_waits import async_wait_until
from google.protobuf import timestamp_pb2

from pubsub_sidecar_client.status import get_status
from sidecar.peering.auth import METADATA_KEY
from sidecar.peering.proto import peer_pb2, peer_pb2_grpc
from sidecar.shards import shard_of

pytestmark = pytest.mark.e2e

SHARDS = 4
CALL_SECONDS = 30.0


def _forwarded(local_id: int, key: str, seq: int, epoch: int, message_id: str) -> peer_pb2.ForwardedMessage:
    data, attributes = order_message(key, seq)
    return peer_pb2.ForwardedMessage(
        local_id=local_id,
        shard=shard_of(key, SHARDS),
        epoch=epoch,
        message_id=message_id,
        data=data,
        attributes=attributes,
        publish_time=timestamp_pb2.Timestamp(seconds=1_700_000_000),
        delivery_attempt=1,
    )


async def _forward(
    target: str, messages: Sequence[peer_pb2.ForwardedMessage], metadata: tuple[tuple[str, bytes], ...]
) -> dict[int, peer_pb2.Outcome]:
    """One ``Forward`` call with ``messages`` in one request; the outcomes by local id (raises the
    call's ``AioRpcError`` when it ends otherwise)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = peer_pb2_grpc.PeerIntakeStub(channel).Forward(metadata=metadata)
        await call.write(peer_pb2.ForwardRequest(subscription="orders", messages=list(messages)))
        outcomes: dict[int, peer_pb2.Outcome] = {}
        while len(outcomes) < len(messages):
            response = await asyncio.wait_for(call.read(), CALL_SECONDS)
            assert response is not grpc.aio.EOF, f"the call ended after {len(outcomes)} outcomes"
            outcomes.update({outcome.local_id: outcome for outcome in response.outcomes})
        await call.done_writing()
        return outcomes


async def test_forged_peer_calls_are_refused(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders", sharding={"shards": SHARDS})
    fleet = PeeringFleet(scenario)
    (pod,) = await fleet.start(1)
    app = scenario.pod_app(sub, 0)
    target = fleet.peers[0].advertise
    valid = ((METADATA_KEY, fleet.secret),)

    await scenario.pubsub.publish_all(sub.topic, [order_message("a", seq) for seq in (1, 2, 3)])
    await async_wait_until(lambda: all_seen([app], {"a": 3}), "a#1..3 at the app")
    await async_wait_until(lambda: len(app.confirmed_at) >= 3, "the app's acks of a#1..3 confirmed")
    a1 = next(seen for seen in app.seen if seen.key == "a" and seen.sequence == 1)
    epochs = {
        shard.shard: shard.epoch
        for shard in (await get_status(scenario.pod_listen(0), sub.name)).subscriptions[0].shards
    }
    assert sorted(epochs) == list(range(SHARDS)), epochs

    # 1. The secret, an epoch the pod does not hold the shard at: refused, nothing delivered.
    stale = await _forward(
        target,
        [
            _forwarded(1, "a", 1, epochs[shard_of("a", SHARDS)] - 1, a1.message_id),
            _forwarded(2, "b", 1, epochs[shard_of("b", SHARDS)] - 1, "forged-b1"),
        ],
        valid,
    )
    for outcome in stale.values():
        assert (outcome.verdict, outcome.reason) == (peer_pb2.Outcome.REFUSED, peer_pb2.Outcome.STALE_EPOCH), stale

    # 2. A copy of an acked message at the current epoch: accepted (a durable copy), not delivered.
    current = await _forward(target, [_forwarded(3, "a", 1, epochs[shard_of("a", SHARDS)], a1.message_id)], valid)
    assert current[3].verdict == peer_pb2.Outcome.ACCEPTED, current

    # 3. No secret, and a wrong one: UNAUTHENTICATED, counted; the message is never taken.
    for metadata in ((), ((METADATA_KEY, b"not-the-secret"),)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _forward(target, [_forwarded(4, "c", 1, epochs[shard_of("c", SHARDS)], "forged-c1")], metadata)
        # A write that loses the race with the server's end makes grpc's client set the call's status
        # to INTERNAL itself ("Internal error from Core", over the server's status): the pod's own count
        # below says that the pod refused both calls.
        raced = refused.value.code() == grpc.StatusCode.INTERNAL and "from Core" in (refused.value.details() or "")
        assert raced or refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value

    # The genuine traffic afterwards: b's and a's next ones, and a key that marks the end.
    await scenario.pubsub.publish_all(
        sub.topic, [order_message("b", 2), order_message("a", 4), order_message("b", 1), order_message("end", 1)]
    )
    expected = {"a": 4, "b": 2, "end": 1}
    await async_wait_until(lambda: all_seen([app], expected), "a#4, b#1..2 and end#1 at the app")
    await async_wait_until(lambda: len(app.confirmed_at) >= 7, "every ack confirmed")
    check_sequence_guarantees(app, expected)
    check_confirmed_deliveries_are_final([app])
    deliveries = [(seen.key, seen.sequence) for seen in app.seen]
    assert deliveries.count(("a", 1)) == 1 and deliveries.count(("b", 1)) == 1, deliveries
    assert all(key != "c" for key, _ in deliveries), "a message of an unauthenticated call was delivered"
    answered = peer_counts(pod, "answered")
    assert answered.get("stale_epoch") == 2 and answered.get("accepted") == 1, answered
    assert pod.metric("pubsub_sidecar_peer_unauthenticated_total") == 2
