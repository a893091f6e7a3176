"""Transactions through the official client: isolation, retries, read-only, read_time, expiry."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from firestore_harness import Endpoint
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter


def test_eight_threads_incrementing_one_counter_in_transactions_reach_400(client: firestore.Client) -> None:
    ref = client.collection("counters").document("c")
    ref.set({"n": 0})
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker() -> None:
        # One transactional wrapper per thread: the wrapper keeps per-call retry state.
        @firestore.transactional
        def bump(transaction: firestore.Transaction) -> None:
            snapshot = ref.get(transaction=transaction)
            transaction.update(ref, {"n": snapshot.get("n") + 1})

        try:
            start.wait(timeout=30)
            for _ in range(50):
                bump(client.transaction())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert ref.get().get("n") == 400


def test_create_race_between_eight_writers_has_exactly_one_winner(client: firestore.Client) -> None:
    ref = client.collection("race").document("only")
    start = threading.Barrier(8)
    outcomes: list[str] = []
    lock = threading.Lock()

    def writer(i: int) -> None:
        start.wait(timeout=30)
        try:
            ref.create({"writer": i})
            result = "won"
        except exceptions.AlreadyExists:
            result = "lost"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["lost"] * 7 + ["won"]
    assert ref.get().get("writer") in range(8)


def test_two_transactions_on_the_same_document_cannot_both_commit(client: firestore.Client) -> None:
    ref = client.collection("iso").document("x")
    ref.set({"n": 0})
    older, younger = client.transaction(), client.transaction()
    older._begin()
    younger._begin()
    # The younger reads first; the older one never waits for a younger one.
    assert ref.get(transaction=younger).get("n") == 0
    assert ref.get(transaction=older).get("n") == 0
    younger.set(ref, {"n": 2})
    older.set(ref, {"n": 1})
    outcome: dict[str, BaseException | None] = {}

    def commit_younger() -> None:
        # Waits for the older reader (production's "older wins"), then fails validation.
        try:
            younger._commit()
            outcome["younger"] = None
        except BaseException as exc:
            outcome["younger"] = exc

    thread = threading.Thread(target=commit_younger)
    thread.start()
    older._commit()
    thread.join(timeout=60)
    assert isinstance(outcome["younger"], exceptions.Aborted)
    assert ref.get().get("n") == 1


def test_younger_read_waits_for_older_reader_and_sees_its_write(client: firestore.Client) -> None:
    ref = client.collection("iso").document("w")
    ref.set({"n": 0})
    older, younger = client.transaction(), client.transaction()
    older._begin()
    younger._begin()
    assert ref.get(transaction=older).get("n") == 0
    seen: list[int] = []

    def younger_increments() -> None:
        seen.append(ref.get(transaction=younger).get("n"))
        younger.set(ref, {"n": seen[0] + 1})
        younger._commit()

    thread = threading.Thread(target=younger_increments)
    thread.start()
    older.set(ref, {"n": 1})
    older._commit()
    thread.join(timeout=60)
    assert seen == [1]
    assert ref.get().get("n") == 2


def test_non_transactional_write_wins_and_transaction_aborts(client: firestore.Client) -> None:
    ref = client.collection("iso").document("y")
    ref.set({"n": 0})
    tx = client.transaction()
    tx._begin()
    ref.get(transaction=tx)
    ref.set({"n": 5})
    tx.set(ref, {"n": 1})
    with pytest.raises(exceptions.Aborted):
        tx._commit()
    assert ref.get().get("n") == 5


def test_query_in_transaction_detects_phantoms(client: firestore.Client) -> None:
    col = client.collection("phantom")
    tx = client.transaction()
    tx._begin()
    assert list(col.where(filter=FieldFilter("k", "==", 1)).stream(transaction=tx)) == []
    col.document("new").set({"k": 1})
    tx.set(col.document("summary"), {"count": 0})
    with pytest.raises(exceptions.Aborted):
        tx._commit()


def test_read_only_transaction_reads_a_snapshot_and_refuses_writes(client: firestore.Client) -> None:
    ref = client.collection("ro").document("d")
    ref.set({"v": 1})
    tx = client.transaction(read_only=True)
    tx._begin()
    assert ref.get(transaction=tx).get("v") == 1
    ref.set({"v": 2})
    assert ref.get(transaction=tx).get("v") == 1
    tx._rollback()
    tx = client.transaction(read_only=True)
    tx._begin()
    # The client refuses writes in a read-only transaction itself; send one anyway.
    write = {"update": {"name": ref._document_path, "fields": {"v": {"integer_value": 3}}}}
    with pytest.raises(exceptions.InvalidArgument, match="read-only"):
        client._firestore_api.commit(
            request={"database": client._database_string, "writes": [write], "transaction": tx._id},
            metadata=client._rpc_metadata,
        )
    assert ref.get().get("v") == 2


def test_read_time_reads_the_past(client: firestore.Client) -> None:
    ref = client.collection("rt").document("d")
    first = ref.set({"v": 1})
    ref.set({"v": 2})
    assert ref.get(read_time=first.update_time).get("v") == 1
    ref.delete()
    assert ref.get(read_time=first.update_time).get("v") == 1
    assert not ref.get().exists
    assert [d.get("v") for d in client.collection("rt").stream(read_time=first.update_time)] == [1]


def test_rollback_of_unknown_transaction_is_ok_and_rollback_ends_it(client: firestore.Client) -> None:
    client._firestore_api.rollback(
        request={"database": client._database_string, "transaction": b"no-such-transaction"},
        metadata=client._rpc_metadata,
    )
    tx = client.transaction()
    tx._begin()
    tx_id = tx._id
    tx._rollback()
    with pytest.raises(exceptions.InvalidArgument, match="expired or is no longer valid"):
        client._firestore_api.commit(
            request={"database": client._database_string, "writes": [], "transaction": tx_id},
            metadata=client._rpc_metadata,
        )


def test_transaction_expires_after_idle_and_total_time(client: firestore.Client, endpoint: Endpoint) -> None:
    endpoint.local()
    assert endpoint.clock is not None
    ref = client.collection("exp").document("d")
    ref.set({"v": 1})
    try:
        tx = client.transaction()
        tx._begin()
        ref.get(transaction=tx)
        endpoint.clock.offset += 61
        with pytest.raises(exceptions.InvalidArgument, match="expired"):
            ref.get(transaction=tx)
        tx = client.transaction()
        tx._begin()
        for _ in range(4):
            endpoint.clock.offset += 55
            ref.get(transaction=tx)  # used within 60 s each time: still alive
        endpoint.clock.offset += 55
        tx.set(ref, {"v": 2})
        with pytest.raises(exceptions.InvalidArgument, match="expired"):
            tx._commit()  # 275 s after it began
    finally:
        endpoint.clock.offset = 0
    assert ref.get().get("v") == 1


def test_an_abandoned_transaction_holds_back_younger_reads_briefly_and_their_commits_until_it_expires(
    client: firestore.Client, endpoint: Endpoint
) -> None:
    # A process killed between a transaction's read and its Commit leaves the transaction open
    # until it expires (60 s idle). Production's read locks are shared: other transactions read
    # the document at once, and only a write of it waits for the expiry. Before, every younger
    # read waited for the abandoned one (lock timeout, ABORTED, again) for the whole minute: the
    # fenced commits of a sidecar restarted after a kill -9 stalled that long.
    from sidecar.emulators.firestore.transactions import MAX_IDLE_SECONDS, READ_GATE_IDLE_SECONDS

    endpoint.local()
    assert endpoint.clock is not None
    ref = client.collection("abandoned").document("d")
    ref.set({"n": 0})
    abandoned, younger = client.transaction(), client.transaction()
    abandoned._begin()
    younger._begin()
    try:
        assert ref.get(transaction=abandoned).get("n") == 0
        endpoint.clock.offset += READ_GATE_IDLE_SECONDS + 1
        started = time.monotonic()
        assert ref.get(transaction=younger).get("n") == 0
        assert time.monotonic() - started < 15.0, "the read waited out the lock timeout (20 s)"
        # Its Commit writes what the abandoned one read: it waits until that one expires, two
        # seconds from now, and no longer (not until its own lock timeout, 20 s).
        endpoint.clock.offset += MAX_IDLE_SECONDS - READ_GATE_IDLE_SECONDS - 3
        younger.set(ref, {"n": 1})
        started = time.monotonic()
        younger._commit()
        assert 1.0 < time.monotonic() - started < 15.0
    finally:
        endpoint.clock.offset = 0
    assert ref.get().get("n") == 1


async def test_async_transactions_increment_and_create_race(aclient: firestore.AsyncClient) -> None:
    ref = aclient.collection("acount").document("c")
    await ref.set({"n": 0})

    async def worker() -> None:
        @firestore.async_transactional
        async def bump(transaction: firestore.AsyncTransaction) -> None:
            snapshot = await ref.get(transaction=transaction)
            transaction.update(ref, {"n": snapshot.get("n") + 1})

        for _ in range(10):
            await bump(aclient.transaction())

    await asyncio.gather(*(worker() for _ in range(8)))
    assert (await ref.get()).get("n") == 80

    target = aclient.collection("arace").document("one")

    async def create(i: int) -> bool:
        try:
            await target.create({"i": i})
            return True
        except exceptions.AlreadyExists:
            return False

    assert sorted(await asyncio.gather(*(create(i) for i in range(8)))) == [False] * 7 + [True]


async def test_expired_older_readers_found_while_waiting_are_ended_without_breaking_the_scan() -> None:
    # Two older transactions read one document and then expire; a younger one asking for its turn
    # ends them while it scans that document's readers (the scan once failed with "Set changed size
    # during iteration", an INTERNAL error for a fenced commit).
    from sidecar.emulators.firestore.transactions import MAX_IDLE_SECONDS, TransactionManager

    now = [1000.0]
    manager = TransactionManager(monotonic=lambda: now[0])
    name = "projects/p/databases/(default)/documents/c/d"
    older = [manager.begin(False, None), manager.begin(False, None)]
    for tx in older:
        manager.record_read(tx, name, None)
    now[0] += MAX_IDLE_SECONDS + 1
    younger = manager.begin(False, None)
    await manager.wait_turn(younger, [name], to_write=True)
    assert all(manager.find(tx.id) is None for tx in older)
