"""Listen through the official sync client's watch (``on_snapshot``), and the raw protocol beneath it."""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from firestore_harness import Endpoint, gapic
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter
from google.cloud.firestore_v1.types import ListenRequest, Target
from listen_harness import Recorder, Watches, poll, watches_fixture

from sidecar.emulators.faults import FaultInjector, FaultRule

watches = pytest.fixture(watches_fixture)


def _inbox(client: firestore.Client, inbox: int) -> Any:
    messages = client.collection("subs/orders/messages")
    return messages.where(filter=FieldFilter("inbox", "==", inbox)).where(filter=FieldFilter("state", "==", "pending"))


def _reads(endpoint: Endpoint) -> int:
    return endpoint.local().counters["reads"]


def test_initial_snapshot_holds_exactly_the_documents_matching_both_equalities(
    client: firestore.Client, watches: Watches
) -> None:
    messages = client.collection("subs/orders/messages")
    messages.document("a").set({"inbox": 3, "state": "pending", "n": 1})
    messages.document("b").set({"inbox": 3, "state": "done"})
    messages.document("c").set({"inbox": 4, "state": "pending"})
    messages.document("d").set({"state": "pending"})
    client.collection("subs/other/messages").document("e").set({"inbox": 3, "state": "pending"})
    _, recorder = watches.start(_inbox(client, 3))
    first = recorder.wait_count(1)
    assert first.docs == {"a": {"inbox": 3, "state": "pending", "n": 1}}
    assert first.changes == [("ADDED", "a")]
    assert isinstance(first.read_time, datetime.datetime)


def test_an_empty_result_still_gets_an_initial_snapshot(client: firestore.Client, watches: Watches) -> None:
    _, recorder = watches.start(_inbox(client, 9))
    assert recorder.wait_count(1).docs == {}


def test_add_modify_remove_by_change_and_delete_arrive_as_changes(client: firestore.Client, watches: Watches) -> None:
    messages = client.collection("subs/orders/messages")
    messages.document("a").set({"inbox": 3, "state": "pending"})
    _, recorder = watches.start(_inbox(client, 3))
    recorder.wait_docs({"a"})
    messages.document("b").set({"inbox": 3, "state": "pending"})
    assert recorder.wait_docs({"a", "b"}).changes == [("ADDED", "b")]
    messages.document("a").update({"payload": b"\x00\x01"})
    modified = recorder.wait_for(lambda s: s[-1].changes == [("MODIFIED", "a")], "a modified")
    assert modified.docs["a"]["payload"] == b"\x00\x01"
    messages.document("a").set({"inbox": 3, "state": "done"})  # still exists, no longer matches
    assert recorder.wait_docs({"b"}).changes == [("REMOVED", "a")]
    messages.document("b").delete()
    assert recorder.wait_docs(set()).changes == [("REMOVED", "b")]


def test_a_write_that_leaves_a_document_outside_the_result_sends_nothing(
    client: firestore.Client, watches: Watches
) -> None:
    messages = client.collection("subs/orders/messages")
    _, recorder = watches.start(_inbox(client, 3))
    recorder.wait_count(1)
    messages.document("x").set({"inbox": 4, "state": "pending"})
    messages.document("y").set({"inbox": 3, "state": "pending"})
    last = recorder.wait_docs({"y"})
    assert [change for s in recorder.snapshots for change in s.changes] == [("ADDED", "y")]
    assert last is recorder.snapshots[1]


def test_snapshots_follow_commit_order_and_never_show_half_a_commit(client: firestore.Client, watches: Watches) -> None:
    col = client.collection("order")
    col.document("left").set({"v": 0})
    col.document("right").set({"v": 0})
    _, recorder = watches.start(col)
    recorder.wait_docs({"left", "right"})
    for version in range(1, 41):
        batch = client.batch()  # one atomic commit: both documents or neither
        batch.set(col.document("left"), {"v": version})
        batch.set(col.document("right"), {"v": version})
        batch.commit()
    recorder.wait_for(lambda s: s[-1].docs["left"] == {"v": 40}, "the last commit")
    seen = [(s.docs["left"]["v"], s.docs["right"]["v"]) for s in recorder.snapshots]
    assert all(left == right for left, right in seen), seen
    assert [left for left, _ in seen] == sorted({left for left, _ in seen}), "snapshots went back in time"
    times = [s.read_time for s in recorder.snapshots]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_many_listeners_each_see_their_own_inbox(client: firestore.Client, watches: Watches) -> None:
    recorders = {inbox: watches.start(_inbox(client, inbox))[1] for inbox in range(12)}
    for recorder in recorders.values():
        recorder.wait_count(1)
    messages = client.collection("subs/orders/messages")
    for inbox in range(12):
        for n in range(inbox % 3 + 1):
            messages.document(f"m-{inbox}-{n}").set({"inbox": inbox, "state": "pending"})
    for inbox, recorder in recorders.items():
        recorder.wait_docs({f"m-{inbox}-{n}" for n in range(inbox % 3 + 1)})


def test_unsubscribe_ends_the_stream_and_the_callbacks(
    client: firestore.Client, endpoint: Endpoint, watches: Watches
) -> None:
    emulator = endpoint.local()
    poll(lambda: emulator.listen_streams == 0, "the streams of earlier tests to close")
    before = 0
    stopped, stopped_recorder = watches.start(_inbox(client, 5))
    _, witness = watches.start(_inbox(client, 5))
    stopped_recorder.wait_count(1)
    witness.wait_count(1)
    assert emulator.listen_streams == before + 2
    stopped.unsubscribe()
    poll(lambda: emulator.listen_streams == before + 1, "the server to close the unsubscribed stream")
    client.collection("subs/orders/messages").document("late").set({"inbox": 5, "state": "pending"})
    witness.wait_docs({"late"})
    assert len(stopped_recorder.snapshots) == 1


def test_document_listen_reports_create_update_and_delete(client: firestore.Client, watches: Watches) -> None:
    ref = client.collection("leases").document("0003")
    _, recorder = watches.start(ref)
    assert recorder.wait_count(1).docs == {}
    ref.set({"owner": "pod-a", "epoch": 1})
    recorder.wait_docs({"0003"})
    ref.update({"epoch": 2})
    assert recorder.wait_for(lambda s: s[-1].docs.get("0003", {}).get("epoch") == 2, "epoch 2").changes == [
        ("MODIFIED", "0003")
    ]
    ref.delete()
    assert recorder.wait_docs(set()).changes == [("REMOVED", "0003")]


def test_reads_are_billed_per_change_in_the_result(
    client: firestore.Client, endpoint: Endpoint, watches: Watches
) -> None:
    messages = client.collection("subs/orders/messages")
    _, empty = watches.start(_inbox(client, 8))
    empty.wait_count(1)
    for name in ("a", "b", "c"):
        messages.document(name).set({"inbox": 3, "state": "pending"})
    start = _reads(endpoint)
    _, recorder = watches.start(_inbox(client, 3))
    recorder.wait_docs({"a", "b", "c"})
    assert _reads(endpoint) - start == 3  # the initial result: one per document
    steps: list[tuple[Any, set[str], int]] = [
        (lambda: messages.document("d").set({"inbox": 3, "state": "pending"}), {"a", "b", "c", "d"}, 1),
        (lambda: messages.document("a").update({"n": 1}), {"a", "b", "c", "d"}, 1),
        (lambda: messages.document("b").set({"inbox": 3, "state": "done"}), {"a", "c", "d"}, 1),
        (lambda: messages.document("c").delete(), {"a", "d"}, 0),
    ]
    for count, (write, expected, reads) in enumerate(steps, start=2):
        before = _reads(endpoint)
        write()
        recorder.wait_for(lambda s, n=count, e=expected: len(s) >= n and set(s[-1].docs) == e, f"step {count}")
        assert _reads(endpoint) - before == reads
    before = _reads(endpoint)
    _, second_empty = watches.start(_inbox(client, 7))
    second_empty.wait_count(1)
    assert _reads(endpoint) - before == 1  # an empty result costs one read


def _break_listen_streams(endpoint: Endpoint, faults: FaultInjector) -> int:
    assert endpoint.loop is not None
    breaking = faults.break_streams("firestore", grpc.StatusCode.UNAVAILABLE)
    future = asyncio.run_coroutine_threadsafe(breaking, endpoint.loop)
    return future.result(timeout=30)


def test_a_broken_stream_resumes_with_only_what_changed_meanwhile(
    client: firestore.Client, endpoint: Endpoint, faults: FaultInjector, watches: Watches
) -> None:
    messages = client.collection("subs/orders/messages")
    for name in ("a", "b", "c", "e", "f"):
        messages.document(name).set({"inbox": 3, "state": "pending"})
    _, recorder = watches.start(_inbox(client, 3))
    recorder.wait_docs({"a", "b", "c", "e", "f"})
    # Refuse every reopen (slowly, so the client does not spin) until the changes are made.
    refusing = faults.add(FaultRule(service="firestore", method="Listen", delay_seconds=0.05, remaining=100_000))
    assert _break_listen_streams(endpoint, faults) >= 1
    messages.document("d").set({"inbox": 3, "state": "pending"})  # added
    messages.document("b").update({"n": 1})  # modified
    messages.document("c").delete()  # deleted: not billed
    messages.document("e").set({"inbox": 3, "state": "done"})  # removed because it changed
    poll(lambda: refusing.remaining is not None and refusing.remaining < 100_000, "a refused reopen")
    before = _reads(endpoint)
    count = len(recorder.snapshots)
    faults.clear()
    resumed = recorder.wait_for(lambda s: len(s) > count, "the snapshot after the reconnect")
    assert set(resumed.docs) == {"a", "b", "d", "f"}
    assert sorted(resumed.changes) == [("ADDED", "d"), ("MODIFIED", "b"), ("REMOVED", "c"), ("REMOVED", "e")]
    assert _reads(endpoint) - before == 3, "a resume bills only the changes, not the whole result again"


def _listen_raw(client: firestore.Client, target: dict[str, Any], database: str | None = None) -> Iterator[Any]:
    """One add_target on a raw Listen stream that then half-closes: the responses up to the end."""
    request = ListenRequest(database=database or client._database_string, add_target=target)
    return iter(gapic(client).listen(requests=iter([request])))


def test_raw_protocol_add_documents_current_then_a_global_snapshot(client: firestore.Client) -> None:
    client.collection("raw").document("a").set({"x": 1})
    parent, _ = client.collection("raw")._parent_info()
    query = Target.QueryTarget(parent=parent, structured_query=client.collection("raw")._query()._to_protobuf())
    responses = [r._pb for r in _listen_raw(client, {"query": query, "target_id": 7})]
    kinds = [r.WhichOneof("response_type") for r in responses]
    assert kinds == ["target_change", "document_change", "target_change", "target_change"]
    add, change, current, snapshot = responses
    assert add.target_change.target_change_type == 1 and list(add.target_change.target_ids) == [7]  # ADD
    assert change.document_change.document.name.endswith("/raw/a") and list(change.document_change.target_ids) == [7]
    assert current.target_change.target_change_type == 3 and current.target_change.resume_token  # CURRENT
    assert snapshot.target_change.target_change_type == 0 and not snapshot.target_change.target_ids  # NO_CHANGE
    assert snapshot.target_change.read_time.seconds > 0 and snapshot.target_change.resume_token


def test_a_resume_from_beyond_retention_resets_the_target(client: firestore.Client) -> None:
    client.collection("old").document("a").set({"x": 1})
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=2)
    ref = client.collection("old").document("a")
    target = {"documents": {"documents": [ref._document_path]}, "target_id": 1, "read_time": long_ago}
    responses = [r._pb for r in _listen_raw(client, target)]
    types = [r.target_change.target_change_type for r in responses if r.HasField("target_change")]
    assert types[:2] == [1, 4]  # ADD, then RESET: the client drops what it had and gets the full set


_DOC = "projects/{project}/databases/(default)/documents/c/d"


@pytest.mark.parametrize(
    ("database", "target", "message"),
    [
        ("projects/{project}", {"documents": {"documents": [_DOC]}}, "Database"),
        (None, {"documents": {"documents": ["projects/other/databases/(default)/documents/c/d"]}}, "not in database"),
        (None, {"documents": {"documents": []}}, "at least one"),
        (None, {"target_id": 1}, "query or documents"),
        (None, {"documents": {"documents": [_DOC.rpartition("/")[0]]}}, "even number"),
        (None, {"documents": {"documents": [_DOC]}, "target_id": -2}, "negative"),
    ],
)
def test_bad_listen_requests_are_invalid_argument(
    client: firestore.Client, database: str | None, target: dict[str, Any], message: str
) -> None:
    documents = [name.format(project=client.project) for name in target.get("documents", {}).get("documents", [])]
    if "documents" in target:
        target = {**target, "documents": {"documents": documents}}
    with pytest.raises(exceptions.InvalidArgument, match=message):
        list(_listen_raw(client, target, database and database.format(project=client.project)))


def test_a_resume_token_the_server_never_issued_is_invalid_argument(client: firestore.Client) -> None:
    ref = client.collection("c").document("d")
    target = {"documents": {"documents": [ref._document_path]}, "resume_token": b"forged"}
    with pytest.raises(exceptions.InvalidArgument, match="resume token"):
        list(_listen_raw(client, target))


def test_an_injected_fault_on_listen_is_retried_by_the_watch(
    client: firestore.Client, faults: FaultInjector, watches: Watches
) -> None:
    rule = faults.add(FaultRule(service="firestore", method="Listen", remaining=3))
    client.collection("subs/orders/messages").document("z").set({"inbox": 6, "state": "pending"})
    _, recorder = watches.start(_inbox(client, 6))
    recorder.wait_docs({"z"})
    assert rule.remaining == 0


def test_watch_threads_end_after_unsubscribe(client: firestore.Client) -> None:
    recorder = Recorder()
    watch = _inbox(client, 11).on_snapshot(recorder)
    recorder.wait_count(1)
    consumer = watch._consumer._thread
    watch.unsubscribe()
    poll(lambda: not consumer.is_alive(), "the watch's consumer thread to end")
    assert consumer not in threading.enumerate()
