"""A write that leaves a document as it was keeps its version (WriteResult.update_time: "If the
write did not actually change the document, this will be the previous update_time"), in Commit
and in BatchWrite, so an ``update_time`` precondition taken before it still matches after it.
Leases rely on the converse: every renewal changes a field, so every renewal moves the version."""

from __future__ import annotations

import pytest
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.bulk_writer import BulkWriteFailure, BulkWriter


def test_unchanged_commit_with_update_time_precondition_keeps_the_version(client: firestore.Client) -> None:
    ref = client.collection("cas").document("same")
    created = ref.create({"owner": "a", "beat": 1})
    option = client.write_option(last_update_time=created.update_time)
    batch = client.batch()
    batch.update(ref, {"owner": "a"}, option=option)
    (unchanged,) = batch.commit()
    assert unchanged.update_time == created.update_time == ref.get().update_time
    # The same precondition still names the stored version; a real change moves it.
    changed = ref.update({"beat": 2}, option=option)
    assert changed.update_time > created.update_time
    with pytest.raises(exceptions.FailedPrecondition):
        ref.update({"beat": 3}, option=option)
    assert ref.get().to_dict() == {"owner": "a", "beat": 2}


def test_unchanged_batch_write_keeps_the_version_and_a_stale_precondition_fails_only_its_write(
    client: firestore.Client,
) -> None:
    same, moved = client.collection("cas").document("bw-same"), client.collection("cas").document("bw-moved")
    same_time = same.create({"beat": 1}).update_time
    stale = moved.create({"beat": 1}).update_time
    moved.update({"beat": 2})
    results: dict[str, object] = {}
    failures: list[str] = []

    def failed(error: BulkWriteFailure, _: BulkWriter) -> bool:
        failures.append(f"{error.code} {error.operation.reference.id}")
        return False  # no retry: the precondition will not match later either

    writer: BulkWriter = client.bulk_writer()
    writer.on_write_result(lambda ref, result, _: results.__setitem__(ref.id, result.update_time))
    writer.on_write_error(failed)
    writer.update(same, {"beat": 1}, option=client.write_option(last_update_time=same_time))
    writer.update(moved, {"beat": 3}, option=client.write_option(last_update_time=stale))
    writer.close()
    assert results == {"bw-same": same_time}
    assert failures == ["9 bw-moved"]
    assert same.get().update_time == same_time and moved.get().to_dict() == {"beat": 2}
