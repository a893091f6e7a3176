"""``Documents.listen``: FirestoreDocuments (the official watch, against our emulator) and its in-memory twin,
through the same cases."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from sidecar.store import documents as docs
from sidecar.store.api import StoreError
from sidecar.store.firestore import FirestoreDocuments
from sidecar.store.memory_documents import MemoryDocuments

_PARENT = "pubsub-sidecar/orders"
_MESSAGES = f"{_PARENT}/messages"
_PENDING_3 = [docs.Filter("inbox", "EQUAL", 3), docs.Filter("state", "EQUAL", "pending")]
_WAIT_SECONDS = 30.0
"""Generous: the machine is shared; every wait ends as soon as its condition holds."""


class Changes:
    """``on_change``/``on_error`` recorder: the Changes in order, the result they add up to, the threads."""

    def __init__(self) -> None:
        self.changes: list[docs.Change] = []
        self.state: dict[str, docs.Fields] = {}
        self.errors: list[StoreError] = []
        self.threads: set[int] = set()
        self._arrived = asyncio.Event()

    def on_change(self, change: docs.Change) -> None:
        self.threads.add(threading.get_ident())
        if change.initial:
            self.state = {}
        for doc_id, fields, _ in change.upserts:
            self.state[doc_id] = fields
        for doc_id in change.removals:
            self.state.pop(doc_id, None)
        self.changes.append(change)
        self._arrived.set()

    def on_error(self, error: StoreError) -> None:
        self.errors.append(error)
        self._arrived.set()

    async def until(self, predicate: Callable[[Changes], bool], what: str) -> None:
        async def wait() -> None:
            while not predicate(self):
                self._arrived.clear()
                await self._arrived.wait()

        try:
            await asyncio.wait_for(wait(), _WAIT_SECONDS)
        except TimeoutError:
            pytest.fail(f"timed out waiting for {what}; changes: {self.changes}, errors: {self.errors}")


@pytest.fixture(params=["memory", "firestore"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "firestore":
        request.getfixturevalue("emulator")  # FIRESTORE_EMULATOR_HOST for this test
        documents: Any = FirestoreDocuments(f"listen-{uuid.uuid4().hex[:12]}")
    else:
        documents = MemoryDocuments()
    try:
        yield documents
    finally:
        await documents.close()


def _message(inbox: int, state: str = "pending", **extra: Any) -> dict[str, Any]:
    return {"inbox": inbox, "state": state, **extra}


async def test_initial_snapshot_is_the_full_result_with_get_all_types(store: Any) -> None:
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.UTC)
    fields = _message(3, data=b"\x00\xff", seq=2**40, at=when, tags=["x", 1])
    await store.commit([docs.replace(f"{_MESSAGES}/a", fields), docs.replace(f"{_MESSAGES}/b", _message(4))])
    seen = Changes()
    listening = store.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    try:
        await seen.until(lambda c: len(c.changes) >= 1, "the initial snapshot")
        (first,) = seen.changes
        assert first.initial and first.removals == []
        [(doc_id, got, update_time_us)] = first.upserts
        expected = (await store.get_all([f"{_MESSAGES}/a"]))[f"{_MESSAGES}/a"]
        assert doc_id == "a" and got == expected
        assert {name: type(value) for name, value in got.items()} == {n: type(v) for n, v in expected.items()}
        assert type(got["at"]) is datetime.datetime and got["at"] == when
        assert update_time_us > 1_600_000_000_000_000 and first.read_time_us >= update_time_us
    finally:
        await listening.close()


async def test_changes_arrive_on_the_loop_in_commit_order(store: Any) -> None:
    seen = Changes()
    listening = store.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    try:
        await seen.until(lambda c: len(c.changes) >= 1, "the initial snapshot")
        assert seen.changes[0].upserts == []
        await store.commit([docs.replace(f"{_MESSAGES}/a", _message(3)), docs.replace(f"{_MESSAGES}/x", _message(5))])
        await store.batch_write([docs.replace(f"{_MESSAGES}/b", _message(3))])
        await seen.until(lambda c: set(c.state) == {"a", "b"}, "a and b added")
        await store.commit([docs.merge(f"{_MESSAGES}/a", {"state": "done"}, ["state"])])  # no longer matches
        await seen.until(lambda c: set(c.state) == {"b"}, "a removed because it changed")
        await store.commit([docs.delete(f"{_MESSAGES}/b")])
        await seen.until(lambda c: c.state == {}, "b deleted")
        for n in range(20):
            await store.commit([docs.replace(f"{_MESSAGES}/c", _message(3, n=n))])
        await seen.until(lambda c: c.state.get("c", {}).get("n") == 19, "the last of 20 commits")
    finally:
        await listening.close()
    assert seen.threads == {threading.get_ident()}, "on_change ran off the event loop's thread"
    later = [change for change in seen.changes if not change.initial]
    assert [change.initial for change in seen.changes] == [True] + [False] * len(later)
    read_times = [change.read_time_us for change in seen.changes]
    assert read_times == sorted(read_times) and len(set(read_times)) == len(read_times)
    ns = [fields["n"] for change in later for doc_id, fields, _ in change.upserts if doc_id == "c"]
    assert ns == sorted(ns) and ns[-1] == 19
    update_times = [t for change in later for doc_id, _, t in change.upserts if doc_id == "c"]
    assert update_times == sorted(update_times) and len(set(update_times)) == len(update_times)
    assert [r for change in later for r in change.removals] == ["a", "b"]


async def test_no_change_reaches_a_closed_listen(store: Any) -> None:
    stopped, witness = Changes(), Changes()
    closing = store.listen(_PARENT, "messages", _PENDING_3, stopped.on_change, stopped.on_error)
    listening = store.listen(_PARENT, "messages", _PENDING_3, witness.on_change, witness.on_error)
    try:
        await stopped.until(lambda c: len(c.changes) >= 1, "the initial snapshot")
        await closing.close()
        await closing.close()  # idempotent
        await store.commit([docs.replace(f"{_MESSAGES}/late", _message(3))])
        await witness.until(lambda c: "late" in c.state, "the witness to see the write")
        await asyncio.sleep(0)  # anything already scheduled for the closed listen runs now
        assert len(stopped.changes) == 1
    finally:
        await listening.close()


async def test_reads_are_billed_per_change(store: Any, request: pytest.FixtureRequest) -> None:
    def reads() -> int:
        if isinstance(store, MemoryDocuments):
            return store.reads
        return int(request.getfixturevalue("emulator").counters()["reads"])

    marker = f"{_MESSAGES}/marker"
    await store.commit([docs.replace(f"{_MESSAGES}/a", _message(3)), docs.replace(marker, _message(3, n=0))])
    seen = Changes()
    before = reads()
    listening = store.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    try:
        await seen.until(lambda c: set(c.state) == {"a", "marker"}, "the initial snapshot")
        assert reads() - before == 2
        steps = [
            (docs.replace(f"{_MESSAGES}/b", _message(3)), 1),  # added
            (docs.replace(f"{_MESSAGES}/b", _message(3, n=1)), 1),  # changed
            (docs.replace(f"{_MESSAGES}/x", _message(4)), 0),  # outside the result
            (docs.merge(f"{_MESSAGES}/a", {"state": "done"}, ["state"]), 1),  # removed because it changed
            (docs.delete(f"{_MESSAGES}/b"), 0),  # a delete is free
        ]
        for step, (write, cost) in enumerate(steps, start=1):
            before = reads()
            await store.commit([write])
            # A barrier: the marker's change arrives after whatever the step caused, and costs one read.
            await store.commit([docs.replace(marker, _message(3, n=step))])
            await seen.until(lambda c, n=step: c.state["marker"]["n"] == n, f"step {step}")
            assert reads() - before == cost + 1, write
        assert set(seen.state) == {"marker"}
    finally:
        await listening.close()


async def test_firestore_listen_runs_on_the_loop_and_ends_its_stream_on_close(emulator: Any) -> None:
    documents = FirestoreDocuments(f"listen-{uuid.uuid4().hex[:12]}")
    seen = Changes()
    threads_before = set(threading.enumerate())
    listening = documents.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    await seen.until(lambda c: len(c.changes) >= 1, "the initial snapshot")
    assert seen.threads == {threading.get_ident()}  # called on the loop's thread
    assert emulator.emulator.listen_streams
    await documents.close()  # closes the listen too
    await listening.close()
    assert not [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("Thread-Consume")]
    # The cancellation reaches the server on its own time: poll, with a deadline.
    deadline = time.monotonic() + _WAIT_SECONDS
    while emulator.emulator.listen_streams:
        if time.monotonic() > deadline:
            pytest.fail("the server never closed the listen stream")
        await asyncio.sleep(0.01)


async def test_firestore_listen_that_fails_for_good_calls_on_error(emulator: Any) -> None:
    documents = FirestoreDocuments(f"listen-{uuid.uuid4().hex[:12]}")
    seen = Changes()
    listening = documents.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    try:
        await seen.until(lambda c: len(c.changes) >= 1, "the initial snapshot")
        # Not retryable: the watch gives up, and says so through on_error (on the loop).
        broken = await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(
                emulator.injector.break_streams("firestore", grpc.StatusCode.PERMISSION_DENIED),
                emulator.loop,
            )
        )
        assert broken >= 1
        await seen.until(lambda c: bool(c.errors), "on_error")
        assert isinstance(seen.errors[0], docs.Misconfigured)
        assert seen.threads == {threading.get_ident()}
    finally:
        await listening.close()
        await documents.close()


async def test_memory_expiry_removes_from_the_result() -> None:
    store = MemoryDocuments()
    when = docs.utc_from_ms(1_000)
    await store.commit([docs.replace(f"{_MESSAGES}/a", _message(3, expire_at=when))])
    seen = Changes()
    listening = store.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    await seen.until(lambda c: "a" in c.state, "the initial snapshot")
    assert store.expire(2_000) == 1
    await seen.until(lambda c: c.state == {}, "the expired document to leave")
    assert seen.changes[-1].removals == ["a"]
    await listening.close()


async def test_a_whole_collection_without_filters(store: Any) -> None:
    # The lease documents are watched whole: every renewal, take or release is a change.
    leases = f"{_PARENT}/leases"
    await store.commit([docs.replace(f"{leases}/0000", {"owner": "a", "epoch": 1})])
    seen = Changes()
    listening = store.listen(_PARENT, "leases", [], seen.on_change, seen.on_error)
    try:
        await seen.until(lambda c: "0000" in c.state, "the initial snapshot")
        await store.commit([docs.replace(f"{leases}/0001", {"owner": "b", "epoch": 1})])
        await store.commit([docs.replace(f"{leases}/0000", {"owner": "", "epoch": 2})])
        await seen.until(
            lambda c: c.state.get("0000", {}).get("epoch") == 2 and "0001" in c.state, "the take and the release"
        )
        assert not seen.errors
    finally:
        await listening.close()


async def test_firestore_listen_resumes_after_a_transient_failure_with_only_what_changed(emulator: Any) -> None:
    documents = FirestoreDocuments(f"listen-{uuid.uuid4().hex[:12]}")
    await documents.commit([docs.replace(f"{_MESSAGES}/a", _message(3))])
    seen = Changes()
    listening = documents.listen(_PARENT, "messages", _PENDING_3, seen.on_change, seen.on_error)
    try:
        await seen.until(lambda c: "a" in c.state, "the initial snapshot")
        broken = await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(
                emulator.injector.break_streams("firestore", grpc.StatusCode.UNAVAILABLE), emulator.loop
            )
        )
        assert broken >= 1
        await documents.commit([docs.replace(f"{_MESSAGES}/b", _message(3))])
        await seen.until(lambda c: "b" in c.state, "a change after the resume")
        assert not seen.errors
        assert [c.initial for c in seen.changes] == [True] + [False] * (len(seen.changes) - 1)
        # Resumed from its token: "a" is not sent again as a new result.
        assert sum(1 for c in seen.changes for doc_id, _, _ in c.upserts if doc_id == "a") == 1
    finally:
        await listening.close()
        await documents.close()
