"""The seam leases use, on both implementations: versioned reads and compare-and-set writes.

FirestoreDocuments against our emulator (official client) and MemoryDocuments must agree: a read's
time is no earlier than any update time it shows; a write over the version read applies and moves
the version; over any other version it fails with FAILED_PRECONDITION (9) in BatchWrite and
``PreconditionFailed`` in Commit; a create over an existing document is ALREADY_EXISTS (6); a write
that changes nothing keeps the version.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from sidecar.store import documents as docs
from sidecar.store.firestore import FirestoreDocuments
from sidecar.store.memory_documents import MemoryDocuments

PATH = "pubsub-sidecar/orders/leases/0000"
OTHER = "pubsub-sidecar/orders/leases/0001"


@pytest.fixture(params=["firestore", "memory"])
async def documents(request: pytest.FixtureRequest) -> AsyncIterator[docs.Documents]:
    if request.param == "firestore":
        request.getfixturevalue("emulator")
        store: docs.Documents = FirestoreDocuments(f"versioned-{uuid.uuid4().hex[:12]}")
    else:
        store = MemoryDocuments()
    try:
        yield store
    finally:
        await store.close()


async def test_missing_documents_read_as_no_fields_and_no_version(documents: docs.Documents) -> None:
    read_us, found = await documents.get_versioned([PATH, OTHER])
    assert read_us > 0
    assert found == {PATH: docs.Versioned(None, None), OTHER: docs.Versioned(None, None)}


async def test_compare_and_set_applies_over_the_version_read_and_fails_over_any_other(
    documents: docs.Documents,
) -> None:
    assert await documents.batch_write([docs.compare_and_set(PATH, {"beat": 1}, None)]) == [(0, "")]
    read_us, found = await documents.get_versioned([PATH])
    first = found[PATH]
    assert first.fields == {"beat": 1} and first.update_time_us is not None and read_us >= first.update_time_us

    [(code, _)] = await documents.batch_write([docs.compare_and_set(PATH, {"beat": 9}, None)])
    assert code == docs.ALREADY_EXISTS
    assert await documents.batch_write([docs.compare_and_set(PATH, {"beat": 2}, first.update_time_us)]) == [(0, "")]
    _, found = await documents.get_versioned([PATH])
    second = found[PATH]
    assert second.fields == {"beat": 2} and second.update_time_us is not None
    assert second.update_time_us > first.update_time_us

    # A pod writing from its stale read loses, in BatchWrite (per write) and in Commit (all of it).
    statuses = await documents.batch_write(
        [docs.compare_and_set(PATH, {"beat": 3}, first.update_time_us), docs.replace(OTHER, {"beat": 1})]
    )
    assert [code for code, _ in statuses] == [docs.FAILED_PRECONDITION, docs.OK]
    with pytest.raises(docs.PreconditionFailed):
        await documents.commit([docs.compare_and_set(PATH, {"beat": 3}, first.update_time_us)])
    _, found = await documents.get_versioned([PATH])
    assert found[PATH] == second


async def test_a_write_that_changes_nothing_keeps_the_version(documents: docs.Documents) -> None:
    await documents.commit([docs.create(PATH, {"owner": "a", "beat": 1})])
    _, found = await documents.get_versioned([PATH])
    version = found[PATH].update_time_us
    await documents.commit([docs.compare_and_set(PATH, {"owner": "a", "beat": 1}, version)])
    _, found = await documents.get_versioned([PATH])
    assert found[PATH].update_time_us == version
    # True is not 1 in Firestore: a change of type is a change.
    await documents.commit([docs.compare_and_set(PATH, {"owner": "a", "beat": True}, version)])
    _, found = await documents.get_versioned([PATH])
    assert found[PATH].update_time_us is not None and found[PATH].update_time_us > version  # type: ignore[operator]


def test_a_write_carries_one_precondition_at_most() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        docs.Write(PATH, {"beat": 1}, None, True, 5)


async def test_memory_update_times_come_from_its_clock_and_grow_strictly() -> None:
    documents = MemoryDocuments(clock_us=lambda: 1_000)
    await documents.batch_write([docs.create(PATH, {"beat": 1}), docs.create(OTHER, {"beat": 1})])
    read_us, found = await documents.get_versioned([PATH, OTHER])
    assert (found[PATH].update_time_us, found[OTHER].update_time_us) == (1_000, 1_001)
    assert read_us == 1_001
