"""The SkipGap RPC against a real delivery layer: recorded before it answers, and one status per
refusal (NOT_FOUND, FAILED_PRECONDITION naming what the key waits on instead, INVALID_ARGUMENT naming
the valid range, UNAVAILABLE when the store did not record it)."""

from __future__ import annotations

import grpc
import pytest
from gap_sidecar import GapSidecar, gap_sidecar, until

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.store.api import StoreUnavailable

pytestmark = pytest.mark.timeout(60)


async def _skip(sidecar: GapSidecar, key: str = "a", through: int = 3, subscription: str = "orders") -> object:
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        return await sidecar_pb2_grpc.OrderedDeliveryStub(channel).SkipGap(
            sidecar_pb2.SkipGapRequest(subscription=subscription, key=key, through=through), timeout=20
        )


async def _refused(sidecar: GapSidecar, **request: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _skip(sidecar, **request)  # type: ignore[arg-type]
    return caught.value.code(), caught.value.details() or ""


async def test_skip_gap_is_recorded_then_the_key_goes_on_and_a_late_copy_is_dead_lettered() -> None:
    async with gap_sidecar() as sidecar:
        response = await _skip(sidecar, through=3)
        assert (response.skipped_from, response.skipped_through) == (3, 3)  # type: ignore[attr-defined]
        cursor = sidecar.store.cursor("orders", "a")
        assert cursor is not None and (cursor.next_sequence, cursor.skipped) == (4, ((3, 3),))
        assert await sidecar.take_and_ack() == [4]
        assert await sidecar.take_and_ack() == [5]
        await sidecar.store_and_hand(3)
        await until(lambda: sidecar.sink.published == [(3, "late")], "3 dead-lettered as late")


async def test_an_unknown_subscription_is_not_found() -> None:
    async with gap_sidecar() as sidecar:
        code, details = await _refused(sidecar, subscription="nope")
        assert code == grpc.StatusCode.NOT_FOUND and "unknown subscription 'nope'" in details


async def test_a_key_not_waiting_on_a_gap_is_failed_precondition_naming_what_it_waits_on() -> None:
    async with gap_sidecar(on_dead_letter="block") as sidecar:
        code, details = await _refused(sidecar, key="never-seen")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "it holds no messages" in details
        await sidecar.store_and_hand(3)  # the gap fills: the key delivers
        code, details = await _refused(sidecar)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "delivering its messages in order" in details
        (third,) = sidecar.runtime.take("app", 10)
        sidecar.runtime.nack("app", [third.delivery_id], dead_letter=True)
        await until(lambda: sidecar.runtime.status()[0].keys_blocked == 1, "the key to block")
        code, details = await _refused(sidecar)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "blocked by a dead letter at sequence 3 (use unblock)" in details


async def test_a_through_outside_the_missing_range_is_invalid_argument_naming_the_range() -> None:
    async with gap_sidecar() as sidecar:
        code, details = await _refused(sidecar, through=4)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "misses sequence 3: the last sequence to skip must be in that range, got 4 (4 is held" in details
        code, details = await _refused(sidecar, key="")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "key is required" in details
        assert sidecar.runtime.take("app", 10) == []  # nothing changed


async def test_a_store_that_does_not_record_it_is_unavailable_and_nothing_is_skipped() -> None:
    async with gap_sidecar() as sidecar:
        sidecar.store.fail_next("skip_gap", error=StoreUnavailable("Firestore is down"))
        code, details = await _refused(sidecar)
        assert code == grpc.StatusCode.UNAVAILABLE and "retry" in details
        assert sidecar.runtime.take("app", 10) == []  # the engine did not skip what the store did not record
        cursor = sidecar.store.cursor("orders", "a")
        assert cursor is not None and cursor.next_sequence == 3
        await _skip(sidecar)  # the retry
        assert await sidecar.take_and_ack() == [4]
