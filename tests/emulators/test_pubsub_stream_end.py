"""A StreamingPull stream that ended, or whose client stopped reading, gets no more messages.

Production stops delivering to a stream whose connection is gone and spreads messages over the
streams that take them. Here one stream ("dead") is opened on a channel of its own and never read,
so that the emulator's write to it blocks mid-send; it is then ended abruptly (client cancel, the
channel closed without a half-close as a killed process would, or a server-side break), or left
blocked. Every message not already written to it must reach the live stream, and no lease may go
to the dead stream after the emulator saw it end. The emulator's own reports (open streams,
leases, the histories of unacked and acked messages) are the evidence.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.pubsub_v1 import types
from pubsub_clients import publish_all, wait_until

pytestmark = pytest.mark.timeout(180)

_METHOD = "/google.pubsub.v1.Subscriber/StreamingPull"
_Request = types.StreamingPullRequest.pb()
_Response = types.StreamingPullResponse.pb()
BIG = 1_000_000
"""Bytes per message used to fill the dead stream's transport until the emulator's write blocks."""
SMALL_MESSAGES = 20
DEADLINE_SECONDS = 600
"""Stream ack deadline: no lease expires during a test, so only the emulator's stream handling can
move a message from one stream to another."""
WAIT_SECONDS = 60.0

Emulators = Any
"""The session fixture of tests/emulators/conftest.py (not importable by name: every test folder has a
conftest module)."""


class RawStream:
    """A StreamingPull on a gRPC channel of its own (raw protobuf); it reads only if ``start_reading``."""

    def __init__(self, host: str, subscription: str, client_id: str) -> None:
        self.client_id = client_id
        self.channel = grpc.insecure_channel(host)
        call = self.channel.stream_stream(
            _METHOD, request_serializer=_Request.SerializeToString, response_deserializer=_Response.FromString
        )
        self._requests: queue.Queue[Any] = queue.Queue()
        self._requests.put(
            _Request(subscription=subscription, stream_ack_deadline_seconds=DEADLINE_SECONDS, client_id=client_id)
        )
        self.call = call(iter(self._requests.get, None))
        self.received: list[bytes] = []
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start_reading(self, ack: Callable[[list[str]], None]) -> None:
        def read() -> None:
            try:
                for response in self.call:
                    ack([m.ack_id for m in response.received_messages])
                    with self._lock:
                        self.received.extend(m.message.data for m in response.received_messages)
            except grpc.RpcError:
                pass  # ended by the test's cleanup

        self._reader = threading.Thread(target=read, name=f"stream-{self.client_id}", daemon=True)
        self._reader.start()

    def data(self) -> list[bytes]:
        with self._lock:
            return list(self.received)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        if self._reader is not None:
            self._reader.join(10)


def report(emulators: Emulators, what: str, subscription: str) -> Any:
    status, body = emulators.admin("GET", f"/pubsub/{what}?subscription={subscription}")
    assert status == 200, body
    return body


def stream_entry(emulators: Emulators, subscription: str, client_id: str) -> dict[str, Any] | None:
    return next((s for s in report(emulators, "streams", subscription) if s["client_id"] == client_id), None)


def block_writes_to(emulators: Emulators, resources: Any, topic: str, subscription: str, dead: RawStream) -> None:
    """Publish big messages until the emulator's write to ``dead`` (which never reads) is blocked."""
    wait_until(lambda: stream_entry(emulators, subscription, dead.client_id) is not None, 30, "the stream to open")

    def blocked() -> bool:
        entry = stream_entry(emulators, subscription, dead.client_id)
        return entry is not None and entry["unwritten"] > 0 and entry["write_blocked_seconds"] >= 1.0

    for batch in range(32):
        publish_all(resources.publisher, topic, [bytes([65 + batch % 26]) * BIG for _ in range(4)])
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if blocked():
                return
            time.sleep(0.1)
    pytest.fail("the emulator's write to a stream that never reads did not block")


def end_stream(emulators: Emulators, dead: RawStream, how: str) -> None:
    if how == "client_cancel":
        dead.call.cancel()
    elif how == "channel_closed":
        dead.channel.close()  # no half-close: what the server sees of a killed process
    else:
        status, body = emulators.admin("POST", "/streams/break", {"service": "pubsub", "code": "UNAVAILABLE"})
        assert status == 200, body


def assert_reaches_live_stream_only(
    emulators: Emulators, resources: Any, topic: str, subscription: str, live: RawStream, dead: RawStream
) -> None:
    """Small messages published now all reach ``live``; whatever is still unacked afterwards was
    written to ``dead`` before it ended (it returns when its lease expires); nothing else is held."""
    small = [f"small-{i}".encode() for i in range(SMALL_MESSAGES)]
    ids = set(publish_all(resources.publisher, topic, small))
    dead_label = f"(client {dead.client_id})"

    def settled() -> bool:
        if not set(small) <= set(live.data()):
            return False
        leases = report(emulators, "leases", subscription)
        unacked = report(emulators, "unacked", subscription)
        return len(leases) == len(unacked) and all(
            lease["written"] and lease["holder"].endswith(dead_label) for lease in leases
        )

    try:
        wait_until(settled, WAIT_SECONDS, "every message not written to the dead stream to reach the live one")
    except BaseException:
        print("leases:", report(emulators, "leases", subscription))
        print("streams:", report(emulators, "streams", subscription))
        raise
    finished = {m["message_id"]: m for m in report(emulators, "finished", subscription)}
    assert ids <= finished.keys()
    for message_id in ids:
        leases = [event for event in finished[message_id]["history"] if " leased " in event]
        assert leases, finished[message_id]
        assert not any(dead_label in event for event in leases), f"leased to the dead stream: {finished[message_id]}"
    # A message given back by the dead stream was leased to it only before it ended.
    for message in finished.values():
        events = message["history"]
        ended = [i for i, event in enumerate(events) if "given back" in event]
        if ended:
            assert not any(dead_label in event for event in events[ended[-1] :] if " leased " in event), events


@pytest.mark.parametrize("how", ["client_cancel", "channel_closed", "server_break"])
def test_a_stream_ended_mid_send_is_forgotten_and_gets_nothing_more(
    how: str, emulators: Emulators, resources: Any, subscriber: Any
) -> None:
    emulators.require_admin()
    topic = resources.topic()
    subscription = resources.subscription(topic)
    streams: list[RawStream] = []

    def open_live() -> RawStream:
        live = RawStream(emulators.pubsub_host, subscription, f"live-{how}")
        streams.append(live)
        live.start_reading(lambda ack_ids: subscriber.acknowledge(subscription=subscription, ack_ids=ack_ids))
        wait_until(lambda: stream_entry(emulators, subscription, live.client_id) is not None, 30, "the live stream")
        return live

    try:
        dead = RawStream(emulators.pubsub_host, subscription, f"dead-{how}")
        streams.append(dead)
        block_writes_to(emulators, resources, topic, subscription, dead)
        # A server-side break ends every open stream: the live one opens after it.
        live = None if how == "server_break" else open_live()
        end_stream(emulators, dead, how)
        wait_until(
            lambda: stream_entry(emulators, subscription, dead.client_id) is None,
            WAIT_SECONDS,
            "the emulator to forget the ended stream",
        )
        assert_reaches_live_stream_only(emulators, resources, topic, subscription, live or open_live(), dead)
    finally:
        for stream in streams:
            stream.close()


def test_a_stream_whose_client_stopped_reading_gets_nothing_more(
    emulators: Emulators, resources: Any, subscriber: Any
) -> None:
    emulators.require_admin()
    topic = resources.topic()
    subscription = resources.subscription(topic)
    stuck = RawStream(emulators.pubsub_host, subscription, "stuck")
    live = RawStream(emulators.pubsub_host, subscription, "live")
    try:
        block_writes_to(emulators, resources, topic, subscription, stuck)
        live.start_reading(lambda ack_ids: subscriber.acknowledge(subscription=subscription, ack_ids=ack_ids))
        wait_until(lambda: stream_entry(emulators, subscription, "live") is not None, 30, "live stream")
        small = [f"small-{i}".encode() for i in range(SMALL_MESSAGES)]
        ids = set(publish_all(resources.publisher, topic, small))
        wait_until(lambda: set(small) <= set(live.data()), WAIT_SECONDS, "every new message on the live stream")
        finished = {m["message_id"]: m for m in report(emulators, "finished", subscription)}
        for message_id in ids:
            assert not any("(client stuck)" in event for event in finished[message_id]["history"]), finished[message_id]
    finally:
        stuck.close()
        live.close()
