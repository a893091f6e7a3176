"""Requests the server cannot decode, and client input too large to echo, get production's status codes.

A real ``grpc.aio`` server and a generic channel call with identity serializers, so the test sends raw
bytes that are not a valid protobuf message. An undecodable request is the client's mistake:
INVALID_ARGUMENT, logged below ERROR and without a stack trace. An error that quotes client input
cuts it short: status details travel in a header, and clients refuse headers above 8 KiB by
default, which would turn NOT_FOUND into RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import contextlib
import logging

import grpc
import pytest
from delivery_harness import Harness
from google.protobuf.message import DecodeError

from pubsub_sidecar.v1 import sidecar_pb2

SUBSCRIBE = "/pubsub_sidecar.v1.OrderedDelivery/Subscribe"
GET_STATUS = "/pubsub_sidecar.v1.OrderedDelivery/GetStatus"

UNDECODABLE = b"\x0a\xff\xff\xff\xff\xff"
"""Field 1 (``open``), length-delimited, with a length varint that never ends: not a message."""

HUGE_NAME = "s" * (1024 * 1024)


def _identity(data: bytes) -> bytes:
    return data


def _no_error_records(caplog: pytest.LogCaptureFixture) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [(r.name, r.getMessage()) for r in loud]


async def _raw_subscribe(harness: Harness, *frames: bytes) -> tuple[grpc.StatusCode, str]:
    assert harness.channel is not None
    call = harness.channel.stream_stream(SUBSCRIBE, request_serializer=_identity, response_deserializer=_identity)()
    for frame in frames:
        await call.write(frame)
    with contextlib.suppress(grpc.aio.AioRpcError):  # the status is read below
        async for _response in call:
            pass
    return await call.code(), await call.details()


def test_undecodable_bytes_really_are_not_a_subscribe_request() -> None:
    with pytest.raises(DecodeError):
        sidecar_pb2.SubscribeRequest.FromString(UNDECODABLE)


async def test_undecodable_first_request_is_invalid_argument_without_a_stack_trace(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    code, details = await _raw_subscribe(harness, UNDECODABLE)

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "pubsub_sidecar.v1.SubscribeRequest" in details
    _no_error_records(caplog)


async def test_undecodable_request_after_open_is_invalid_argument(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    opening = sidecar_pb2.SubscribeRequest(open=sidecar_pb2.Open(subscription="orders")).SerializeToString()

    code, details = await _raw_subscribe(harness, opening, UNDECODABLE)

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode" in details
    _no_error_records(caplog)


async def test_undecodable_get_status_is_invalid_argument(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert harness.channel is not None
    call = harness.channel.unary_unary(GET_STATUS, request_serializer=_identity, response_deserializer=_identity)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(UNDECODABLE)

    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "pubsub_sidecar.v1.GetStatusRequest" in (info.value.details() or "")
    _no_error_records(caplog)


async def test_subscribe_naming_a_1_mb_subscription_is_not_found_with_the_name_cut_short(harness: Harness) -> None:
    subscriber = await harness.subscribe(HUGE_NAME)

    code, details = await subscriber.wait_end()

    assert code is grpc.StatusCode.NOT_FOUND
    assert len(details.encode()) < 1024
    assert "sss" in details and f"{len(HUGE_NAME)} bytes" in details


async def test_get_status_naming_a_1_mb_subscription_is_not_found(harness: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.stub.GetStatus(sidecar_pb2.GetStatusRequest(subscription=HUGE_NAME))

    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert len((info.value.details() or "").encode()) < 1024
