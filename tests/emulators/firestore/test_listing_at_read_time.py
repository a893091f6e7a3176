"""Listing collection ids and documents at a read time: what existed then, not what ever existed.

A collection exists while it holds a document (at any depth below it); the official client's
``collections()``, ``DocumentReference.collections()`` and ``list_documents()`` (which always asks
for missing documents) all pass ``read_time`` through to ListCollectionIds / ListDocuments.
"""

from __future__ import annotations

import datetime

import pytest
from firestore_harness import gapic
from google.api_core import exceptions
from google.cloud import firestore
from google.protobuf import timestamp_pb2


def test_client_collections_at_read_time_show_only_collections_that_existed(client: firestore.Client) -> None:
    doomed = client.document("doomed/d")
    doomed.set({"n": 0})
    read_time = client.document("early/d").create({"n": 1}).update_time
    client.document("late/d").create({"n": 2})
    # Deleted after read_time: it still existed then.
    doomed.delete()
    # Created after read_time, under a document that existed then: not there yet.
    client.document("early/d/child/x").set({"n": 3})

    assert sorted(c.id for c in client.collections()) == ["early", "late"]
    assert sorted(c.id for c in client.collections(read_time=read_time)) == ["doomed", "early"]
    assert [c.id for c in client.document("early/d").collections(read_time=read_time)] == []
    assert [c.id for c in client.document("early/d").collections()] == ["child"]


def test_collection_emptied_before_read_time_is_not_listed(client: firestore.Client) -> None:
    gone = client.document("gone/d")
    gone.set({"n": 1})
    gone.delete()
    read_time = client.document("kept/d").create({"n": 1}).update_time
    assert [c.id for c in client.collections(read_time=read_time)] == ["kept"]


def test_document_collections_at_read_time(client: firestore.Client) -> None:
    parent = client.document("parents/p")
    parent.create({"n": 0})
    read_time = None
    for child in ("child1", "child2"):
        update_time, _ = parent.collection(child).add({"foo": "bar"})
        read_time = update_time if read_time is None or update_time > read_time else read_time
    parent.collection("child3").add({"foo": "bar"})
    assert sorted(c.id for c in parent.collections(read_time=read_time)) == ["child1", "child2"]
    assert sorted(c.id for c in parent.collections()) == ["child1", "child2", "child3"]


def test_list_documents_at_read_time_including_missing_parents(client: firestore.Client) -> None:
    col = client.collection("things")
    first = col.document("a")
    read_time = first.create({"n": 1}).update_time
    col.document("b").create({"n": 2})
    # "ghost" has no fields of its own, only a subcollection: listed as missing once that exists.
    col.document("ghost").collection("sub").document("x").set({"n": 3})

    assert sorted(d.id for d in col.list_documents()) == ["a", "b", "ghost"]
    assert [d.id for d in col.list_documents(read_time=read_time)] == ["a"]


async def test_async_collections_and_list_documents_at_read_time(aclient: firestore.AsyncClient) -> None:
    read_time = (await aclient.document("early/d").create({"n": 1})).update_time
    await aclient.document("late/d").create({"n": 2})
    await aclient.document("early/d/child/x").set({"n": 3})
    await aclient.document("early/e").set({"n": 4})

    assert sorted([c.id async for c in aclient.collections()]) == ["early", "late"]
    assert [c.id async for c in aclient.collections(read_time=read_time)] == ["early"]
    assert [c.id async for c in aclient.document("early/d").collections(read_time=read_time)] == []
    assert [c.id async for c in aclient.document("early/d").collections()] == ["child"]
    assert [d.id async for d in aclient.collection("early").list_documents(read_time=read_time)] == ["d"]
    assert sorted([d.id async for d in aclient.collection("early").list_documents()]) == ["d", "e"]


def test_list_collection_ids_refuses_malformed_requests(client: firestore.Client) -> None:
    api = gapic(client)
    root = f"projects/{client.project}/databases/(default)/documents"
    with pytest.raises(exceptions.InvalidArgument):
        api.list_collection_ids(request={"parent": "nope"})
    with pytest.raises(exceptions.InvalidArgument):
        api.list_collection_ids(request={"parent": f"{root}/only-a-collection"})
    with pytest.raises(exceptions.InvalidArgument):
        api.list_collection_ids(request={"parent": root, "page_size": -1})
    # A read time older than the emulator's retention is refused, not answered from a guess.
    with pytest.raises(exceptions.FailedPrecondition):
        api.list_collection_ids(request={"parent": root, "read_time": timestamp_pb2.Timestamp(seconds=1)})


def test_list_documents_refuses_malformed_requests(client: firestore.Client) -> None:
    api = gapic(client)
    root = f"projects/{client.project}/databases/(default)/documents"
    for request in (
        {"parent": root, "collection_id": ""},
        {"parent": root, "collection_id": "__bad__"},
        {"parent": root, "collection_id": "c", "page_size": -1},
        {"parent": f"{root}/odd", "collection_id": "c"},
    ):
        with pytest.raises(exceptions.InvalidArgument):
            list(api.list_documents(request={**request, "show_missing": True}))


def test_list_documents_at_a_read_time_older_than_retention_is_refused(client: firestore.Client) -> None:
    with pytest.raises(exceptions.FailedPrecondition):
        list(client.collection("x").list_documents(read_time=datetime.datetime(2001, 1, 1, tzinfo=datetime.UTC)))
