"""LoopScheduler: the official subscriber's callbacks run on the event loop, many per wake-up.

The unmodified ``SubscriberClient`` streams from the Pub/Sub emulator with ``scheduler=LoopScheduler``.
To make a batch (or a shutdown with messages buffered) certain rather than likely, a test keeps the
event loop's thread busy on purpose, polling with a deadline until the client's thread has buffered
what it published; nothing waits on a bare sleep.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber._protocol import requests
from google.cloud.pubsub_v1.subscriber.futures import StreamingPullFuture
from google.cloud.pubsub_v1.subscriber.message import Message
from google.pubsub_v1 import types
from ingest_harness import IngestHarness
from pubsub_admin import WAIT_SECONDS, PubSubAdmin, block_loop_until, wait_until

from sidecar.emulators.stack import EmulatorStack
from sidecar.pipeline.ingest_scheduler import LoopScheduler

pytestmark = pytest.mark.timeout(90)

MakeHarness = Callable[..., IngestHarness]

_SHUTDOWN_THREAD_NAME = "Thread-RegularStreamShutdown"
"""The thread the client's ``StreamingPullManager.close()`` shuts the stream down on."""


@pytest.fixture
def subscriber(pubsub_env: EmulatorStack) -> Iterator[pubsub_v1.SubscriberClient]:
    client = pubsub_v1.SubscriberClient()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
async def pulls() -> AsyncIterator[list[StreamingPullFuture]]:
    """Streaming pulls a test opens; each is shut down (and waited for) at the end."""
    futures: list[StreamingPullFuture] = []
    yield futures
    for future in futures:
        await cancel_and_wait(future)


async def cancel_and_wait(future: StreamingPullFuture) -> None:
    """Cancel a streaming pull and wait for the client's shutdown sequence to finish.

    Joins the shutdown thread rather than the future: a future that a callback error already
    failed is done before the stream is shut down.
    """
    before = set(threading.enumerate())
    future.cancel()
    for thread in set(threading.enumerate()) - before:
        if thread.name == _SHUTDOWN_THREAD_NAME:
            await asyncio.to_thread(thread.join, WAIT_SECONDS)
            assert not thread.is_alive(), "the client's stream shutdown did not finish"


async def loop_caught_up() -> None:
    """Return once every callback queued on the loop before this call has run (the ready queue is FIFO)."""
    loop = asyncio.get_running_loop()
    caught_up: asyncio.Future[None] = loop.create_future()
    loop.call_soon(caught_up.set_result, None)
    await caught_up


async def topic_with_messages(admin: PubSubAdmin, count: int) -> tuple[str, list[bytes]]:
    """A topic and subscription with ``count`` messages published; returns the subscription and payloads."""
    topic = await admin.create_topic("sched")
    subscription = await admin.create_subscription("sched", topic)
    payloads = [f"m{i:03d}".encode() for i in range(count)]
    await asyncio.gather(*(admin.publish(topic, payload) for payload in payloads))
    return subscription, payloads


async def test_messages_that_arrive_while_the_loop_is_busy_run_as_one_batch_on_the_loop(
    admin: PubSubAdmin, subscriber: pubsub_v1.SubscriberClient, pulls: list[StreamingPullFuture]
) -> None:
    subscription, payloads = await topic_with_messages(admin, 50)
    scheduler = LoopScheduler(asyncio.get_running_loop())
    calls: list[tuple[bytes, int, int]] = []

    def callback(message: Message) -> None:
        calls.append((message.data, threading.get_ident(), scheduler.runs))
        message.ack()

    pulls.append(subscriber.subscribe(subscription, callback=callback, scheduler=scheduler))
    block_loop_until(lambda: scheduler.buffered() == len(payloads), "all messages buffered")
    assert calls == []  # nothing runs on the client's threads

    await wait_until(lambda: len(calls) == len(payloads), "every callback")
    assert sorted(data for data, _, _ in calls) == payloads
    assert {thread for _, thread, _ in calls} == {threading.get_ident()}  # the loop's thread
    assert {run for _, _, run in calls} == {1} and scheduler.runs == 1  # one wake-up for all 50
    assert scheduler.callbacks == len(payloads)
    # The acks went out through the scheduler's queue: nothing is left for Pub/Sub to redeliver
    # once the stream is shut down (the dispatcher sends queued acks before it stops).
    await cancel_and_wait(pulls[0])
    assert await admin.pull_available(subscription) == []


async def test_a_burst_larger_than_one_run_is_split_over_turns_of_the_loop(
    admin: PubSubAdmin, subscriber: pubsub_v1.SubscriberClient, pulls: list[StreamingPullFuture]
) -> None:
    subscription, payloads = await topic_with_messages(admin, 50)
    scheduler = LoopScheduler(asyncio.get_running_loop(), max_callbacks_per_run=20)
    runs: list[int] = []

    def callback(message: Message) -> None:
        runs.append(scheduler.runs)
        message.ack()

    pulls.append(subscriber.subscribe(subscription, callback=callback, scheduler=scheduler))
    block_loop_until(lambda: scheduler.buffered() == len(payloads), "all messages buffered")
    await wait_until(lambda: len(runs) == len(payloads), "every callback")
    assert collections.Counter(runs) == {1: 20, 2: 20, 3: 10}


async def test_shutdown_returns_buffered_messages_which_the_client_nacks_and_pubsub_redelivers(
    admin: PubSubAdmin, subscriber: pubsub_v1.SubscriberClient, pulls: list[StreamingPullFuture]
) -> None:
    subscription, payloads = await topic_with_messages(admin, 30)
    scheduler = LoopScheduler(asyncio.get_running_loop())
    handed_over: list[bytes] = []
    pull = subscriber.subscribe(subscription, callback=lambda m: handed_over.append(m.data), scheduler=scheduler)
    pulls.append(pull)
    block_loop_until(lambda: scheduler.buffered() == len(payloads), "all messages buffered")

    # Shut the stream down while the loop is still busy: the wake-up the client's thread queued has
    # not run, so no message was handed over; the scheduler returns them all and the client nacks them.
    pull.cancel()
    block_loop_until(pull.done, "the stream shut down")
    assert scheduler.is_shut_down and scheduler.buffered() == 0
    await loop_caught_up()  # the queued wake-up ran: it found nothing to hand over
    assert handed_over == [] and scheduler.runs == 0

    # Nacked, not merely left to their lease: another subscriber gets every one well within the
    # subscription's 10 s ack deadline.
    collector = admin.collect(subscription)
    await wait_until(lambda: len(collector.messages) >= len(payloads), "every message redelivered", 8.0)
    assert sorted({m.data for m in collector.messages}) == payloads


async def test_shutdown_waits_for_the_run_the_loop_is_in_and_that_run_is_handed_over_whole(
    admin: PubSubAdmin, subscriber: pubsub_v1.SubscriberClient, pulls: list[StreamingPullFuture]
) -> None:
    subscription, payloads = await topic_with_messages(admin, 20)
    scheduler = LoopScheduler(asyncio.get_running_loop())
    handed_over: list[bytes] = []
    seen_in_run: list[tuple[bool, bool]] = []

    def callback(message: Message) -> None:
        if not handed_over:
            # The first callback of the run stops the pull, and keeps the loop busy until the
            # client's shutdown thread has reached the scheduler's shutdown.
            pull.cancel()
            block_loop_until(lambda: scheduler.is_shut_down, "the scheduler's shutdown called")
        seen_in_run.append((scheduler.is_shut_down, pull.done()))
        handed_over.append(message.data)
        message.ack()

    # As ingest opens it: the client's shutdown waits for callbacks in progress.
    pull = subscriber.subscribe(subscription, callback=callback, scheduler=scheduler, await_callbacks_on_shutdown=True)
    pulls.append(pull)
    block_loop_until(lambda: scheduler.buffered() == len(payloads), "all messages buffered")
    await asyncio.wait({asyncio.wrap_future(pull)}, timeout=WAIT_SECONDS)

    assert pull.done()
    # Every callback of the run ran during the shutdown, and the shutdown did not end before the run.
    assert seen_in_run == [(True, False)] * len(payloads)
    assert sorted(handed_over) == payloads and scheduler.runs == 1
    # Acks made during the shutdown were still sent: nothing comes back.
    assert await admin.pull_available(subscription) == []


async def test_a_callback_that_raises_nacks_its_message_fails_the_pull_and_the_run_goes_on(
    admin: PubSubAdmin, subscriber: pubsub_v1.SubscriberClient, pulls: list[StreamingPullFuture]
) -> None:
    subscription, payloads = await topic_with_messages(admin, 10)
    bad = {payloads[2], payloads[6]}
    scheduler = LoopScheduler(asyncio.get_running_loop())
    attempts: collections.Counter[bytes] = collections.Counter()
    first_run: list[bytes] = []
    handled: set[bytes] = set()

    def callback(message: Message) -> None:
        attempts[message.data] += 1
        if scheduler.runs == 1:
            first_run.append(message.data)
        if message.data in bad and attempts[message.data] == 1:
            raise ValueError(f"cannot handle {message.data!r}")
        handled.add(message.data)
        message.ack()

    pull = subscriber.subscribe(subscription, callback=callback, scheduler=scheduler)
    pulls.append(pull)
    block_loop_until(lambda: scheduler.buffered() == len(payloads), "all messages buffered")
    await wait_until(lambda: handled == set(payloads), "every message handled")

    # The client's wrapper nacked each failing message (so Pub/Sub redelivered it at once) and
    # failed the pull future with the first error; the second error could not fail it again, and
    # the scheduler went on with the rest of the run.
    assert sorted(first_run) == payloads
    assert {data: attempts[data] for data in bad} == {data: 2 for data in bad}
    assert all(attempts[data] == 1 for data in payloads if data not in bad)
    assert pull.done() and isinstance(pull.exception(), ValueError)


# ---- the contract without a stream: closed or stopped loops, shutdown on the loop's thread ------


def _message(scheduler: LoopScheduler, ack_id: str) -> Message:
    pb = types.PubsubMessage(data=ack_id.encode(), message_id=ack_id)._pb
    return Message(pb, ack_id, 0, scheduler.queue)


def _nacked(requests_queue: queue.SimpleQueue[Any]) -> list[str]:
    nacked: list[str] = []
    while not requests_queue.empty():
        request = requests_queue.get_nowait()
        assert isinstance(request, requests.NackRequest), request
        nacked.append(request.ack_id)
    return nacked


def test_messages_scheduled_on_a_closed_loop_are_nacked_at_once() -> None:
    loop = asyncio.new_event_loop()
    scheduler = LoopScheduler(loop)
    ran: list[Message] = []
    scheduler.schedule(ran.append, _message(scheduler, "a"))  # a wake-up is queued, never run
    loop.close()
    scheduler.schedule(ran.append, _message(scheduler, "b"))
    # The one left buffered by the closed loop goes back too, not only the newcomer.
    assert _nacked(scheduler.queue) == ["a", "b"]
    assert scheduler.shutdown(await_msg_callbacks=True) == [] and ran == []


def test_a_stopped_loop_keeps_messages_buffered_and_shutdown_returns_them_in_order() -> None:
    loop = asyncio.new_event_loop()
    try:
        scheduler = LoopScheduler(loop)
        ran: list[Message] = []
        messages = [_message(scheduler, ack_id) for ack_id in ("a", "b", "c")]
        for message in messages:
            scheduler.schedule(ran.append, message)
        assert scheduler.buffered() == 3
        assert scheduler.shutdown(await_msg_callbacks=True) == messages
        late = _message(scheduler, "d")
        scheduler.schedule(ran.append, late)  # after shutdown: nacked, never run
        assert _nacked(scheduler.queue) == ["d"]
        loop.run_until_complete(loop_caught_up())  # the wake-up queued before shutdown runs now
        assert ran == [] and scheduler.runs == 0
    finally:
        loop.close()


def test_shutdown_called_from_a_callback_on_the_loop_does_not_wait_for_its_own_run() -> None:
    loop = asyncio.new_event_loop()
    try:
        scheduler = LoopScheduler(loop)
        returned: list[list[Message]] = []
        ran: list[Message] = []

        def stop_here(message: Message) -> None:
            ran.append(message)
            returned.append(scheduler.shutdown(await_msg_callbacks=True))

        first, second = _message(scheduler, "a"), _message(scheduler, "b")
        scheduler.schedule(stop_here, first)
        scheduler.schedule(ran.append, second)
        loop.run_until_complete(loop_caught_up())
        # Both were taken by the run before the shutdown: both handed over, nothing returned.
        assert returned == [[]] and ran == [first, second]
        assert _nacked(scheduler.queue) == []
    finally:
        loop.close()


# ---- the Ingestor on LoopScheduler --------------------------------------------------------------


async def test_ingest_takes_a_burst_in_one_hand_off_and_persists_and_acks_all_of_it(make_harness: MakeHarness) -> None:
    h = make_harness(intake="client")  # the official client's intake: its scheduler is under test
    await h.setup()
    for seq in range(1, 41):
        await h.publish_order("A", seq)
    await h.start_ingest()
    assert h.ingestor is not None
    block_loop_until(lambda: h.ingestor is not None and h.ingestor.handoff_buffered == 40, "40 buffered")

    await wait_until(lambda: h.counters.acked == 40, "40 acks")
    assert h.ingestor.handoff_runs == 1
    assert (h.counters.received, h.counters.persisted, h.counters.nacked) == (40, 40, 0)
    assert sorted(m.sequence for m in await h.stored_pending()) == list(range(1, 41))


async def test_ingest_stop_while_the_loop_is_busy_gives_every_buffered_message_back(make_harness: MakeHarness) -> None:
    h = make_harness(intake="client")  # the official client's intake: its scheduler is under test
    await h.setup()
    for seq in range(1, 21):
        await h.publish_order("A", seq)
    await h.start_ingest()
    assert h.ingestor is not None
    ingestor = h.ingestor
    # stop() is queued before the hand-off the client's thread queues while the loop is busy: it
    # runs first, so the messages reach the ingestor only once it is stopping.
    stopping = asyncio.create_task(ingestor.stop(grace_seconds=5.0))
    block_loop_until(lambda: ingestor.handoff_buffered == 20, "20 buffered")
    await stopping

    assert (h.counters.received, h.counters.persisted, h.counters.acked, h.counters.nacked) == (20, 0, 0, 20)
    assert ingestor.held_messages == 0 and ingestor.handoff_buffered == 0

    # Nothing lost: the next ingestor gets all 20 at once (nacked, not left to their leases).
    await h.start_ingest()
    await wait_until(lambda: h.counters.persisted == 20 and h.counters.acked == 20, "20 persisted after restart", 8.0)
    assert sorted(m.sequence for m in await h.stored_pending()) == list(range(1, 21))
