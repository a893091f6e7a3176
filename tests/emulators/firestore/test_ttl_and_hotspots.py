"""TTL policies and the hotspot counter, through the official client against the ``indexed`` emulator.

That emulator sweeps after every commit (``ttl_sweep_seconds=0``); ``sessions.expire_at`` is its TTL
field and ``events.ts`` is exempted from indexing (INDEX_CONFIG in firestore_harness).
"""

from __future__ import annotations

import asyncio
import datetime
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from firestore_harness import Endpoint
from google.cloud import firestore
from listen_harness import Watches, watches_fixture

from sidecar.emulators.firestore import FirestoreEmulator

watches = pytest.fixture(watches_fixture)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _on_loop(endpoint: Endpoint, fn: Any, *args: Any) -> Any:
    """Run ``fn`` on the emulator's loop (its state is the loop's alone) and return its result."""

    async def call() -> Any:
        return fn(*args)

    assert endpoint.loop is not None
    return asyncio.run_coroutine_threadsafe(call(), endpoint.loop).result(30)


def _emulator(endpoint: Endpoint) -> FirestoreEmulator:
    assert endpoint.emulator is not None
    return endpoint.emulator


def test_expired_documents_are_deleted_at_the_next_commit_and_billed_as_deletes(
    indexed: Endpoint, indexed_client: firestore.Client
) -> None:
    col = indexed_client.collection("sessions")
    before = _emulator(indexed).counters
    batch = indexed_client.batch()
    batch.set(col.document("old"), {"expire_at": _now() - datetime.timedelta(hours=1)})
    batch.set(col.document("new"), {"expire_at": _now() + datetime.timedelta(hours=1)})
    batch.set(col.document("text"), {"expire_at": "2000-01-01T00:00:00Z"})  # not a timestamp: ignored
    batch.set(col.document("none"), {"other": 1})
    batch.commit()
    assert sorted(d.id for d in col.stream()) == ["new", "none", "text"]
    after = _emulator(indexed).counters
    assert after["ttl_deletes"] - before["ttl_deletes"] == 1
    assert after["deletes"] - before["deletes"] == 1
    assert after["writes"] - before["writes"] == 4


def test_a_rewritten_expiry_is_the_one_that_counts(indexed: Endpoint, indexed_client: firestore.Client) -> None:
    ref = indexed_client.collection("sessions").document("moved")
    ref.set({"expire_at": _now() + datetime.timedelta(minutes=10)})
    ref.set({"expire_at": _now() + datetime.timedelta(days=2)})
    as_of_us = int((_now() + datetime.timedelta(hours=1)).timestamp() * 1_000_000)
    _on_loop(indexed, _emulator(indexed).ttl.sweep, as_of_us)  # counts other tests' documents too
    assert ref.get().exists


def test_a_ttl_delete_leaves_a_listen_unbilled_and_history_readable(
    indexed: Endpoint, indexed_client: firestore.Client, watches: Watches
) -> None:
    col = indexed_client.collection("sessions")
    col.document("a").set({"expire_at": _now() + datetime.timedelta(hours=1)})
    written = col.document("b").set({"expire_at": _now() + datetime.timedelta(hours=3)})
    _, recorder = watches.start(col)
    recorder.wait_docs({"a", "b"})
    reads = _emulator(indexed).counters["reads"]
    as_of_us = int((_now() + datetime.timedelta(hours=2)).timestamp() * 1_000_000)
    assert _on_loop(indexed, _emulator(indexed).ttl.sweep, as_of_us) >= 1
    snapshot = recorder.wait_docs({"b"})
    assert snapshot.changes == [("REMOVED", "a")]
    assert _emulator(indexed).counters["reads"] == reads, "a deleted document leaves a Listen result unbilled"
    assert not col.document("a").get().exists
    assert col.document("a").get(read_time=written.update_time).exists


def test_monotonic_values_are_appends_and_random_ones_rarely(
    indexed: Endpoint, indexed_client: firestore.Client
) -> None:
    col = indexed_client.collection("events")
    before = _emulator(indexed).hotspots.snapshot()
    rng = random.Random(5)
    for start in range(0, 200, 50):
        batch = indexed_client.batch()
        for i in range(start, start + 50):
            batch.set(
                col.document(uuid.uuid4().hex),
                {"seq": i, "rand": rng.random(), "ts": _now(), "m": {"n": i}},
            )
        batch.commit()
    after = _emulator(indexed).hotspots.snapshot()

    def appends(field: str) -> int:
        return int(after.get(field, {}).get("appends", 0) - before.get(field, {}).get("appends", 0))

    assert appends("events.seq") == 200
    assert appends("events.m.n") == 200
    assert appends("events.rand") < 30  # a random order has about ln(200) ~ 6 new maxima
    assert "events.ts" not in after, "an exempted field has no index, so no hotspot"
    assert 1 <= after["events.seq"]["peak_per_s"] <= after["events.seq"]["appends"]


def test_a_timestamp_shared_by_a_commit_counts_for_each_write_and_an_old_value_never(
    indexed: Endpoint, indexed_client: firestore.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _emulator(indexed).hotspots
    col = indexed_client.collection("tombs")
    col.document("seed").set({"done": 0, "state": "pending"})
    # A new second begins for the counter: what existed before it is the base.
    now = [1_000_000.0]
    monkeypatch.setattr(clock, "_clock", lambda: now[0])
    before = clock.snapshot()
    for stamp in (1, 2):
        now[0] += 1
        batch = indexed_client.batch()
        for _ in range(30):  # one Commit: one finish time, random document names
            batch.set(col.document(uuid.uuid4().hex), {"done": stamp, "state": "pending"})
        batch.commit()
    after = clock.snapshot()

    def appends(field: str) -> int:
        return int(after.get(field, {}).get("appends", 0) - before.get(field, {}).get("appends", 0))

    assert appends("tombs.done") == 60, "every entry of a new time lands at the end of the index"
    assert appends("tombs.state") == 0, "a value the field already held spreads by document name"
    assert after["tombs.done"]["peak_per_s"] >= 30


def test_an_unchanged_field_is_not_rewritten_in_its_index(indexed: Endpoint, indexed_client: firestore.Client) -> None:
    ref = indexed_client.collection("ticks").document("only")
    ref.set({"n": 1, "other": 1})
    counted = _emulator(indexed).hotspots.snapshot()["ticks.n"]["appends"]
    ref.set({"n": 1, "other": 2})
    assert _emulator(indexed).hotspots.snapshot()["ticks.n"]["appends"] == counted


@pytest.fixture
def ttl_on_timer() -> Iterator[FirestoreEmulator]:
    emulator = FirestoreEmulator(firestore_injector(), ttl_sweep_seconds=3600)
    yield emulator


def firestore_injector() -> Any:
    from sidecar.emulators.faults import FaultInjector

    return FaultInjector()


async def test_programmatic_policy_indexes_existing_documents_and_sweeps_on_demand(
    ttl_on_timer: FirestoreEmulator,
) -> None:
    from sidecar.emulators.firestore import protos as pb
    from sidecar.emulators.firestore.documents import Record

    store = ttl_on_timer._store
    name = "projects/p/databases/(default)/documents/carts/c1"
    doc = pb.Document(name=name)
    doc.fields["until"].timestamp_value.seconds = 1_000
    commit_us = store.clock.tick()
    store.apply({name: Record(doc, commit_us, commit_us)}, commit_us)
    ttl_on_timer.ttl.add_policy("carts", ("until",))
    assert ttl_on_timer.ttl.sweep() == 1
    assert store.get(name) is None
    assert ttl_on_timer.counters["ttl_deletes"] == 1
    await ttl_on_timer.close()
