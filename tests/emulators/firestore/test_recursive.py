"""Kindless all-descendants queries: ``recursive()`` and ``recursive_delete`` through the official client.

``recursive()`` sends a query with an empty collection id and ``all_descendants``, bounded by
``__name__`` cursors on the original collection (``coll/__id-9223372036854775808__`` to
``coll\\0/__id-...__``); ``recursive_delete`` pages through it with ``limit(chunk_size)`` and
``start_after`` and deletes through BulkWriter (BatchWrite). Expectations follow the official
client's system tests, which run against production.
"""

from __future__ import annotations

from typing import Any

import pytest
from firestore_harness import gapic
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.bulk_writer import BulkWriterOptions, SendMode

PHILOSOPHERS: dict[str, Any] = {
    "Socrates": {
        "pets": ["Scruffy", "Snowflake"],
        "hobbies": ["pontificating", "journaling"],
        "philosophers": ["Aristotle", "Plato"],
    },
    "Aristotle": {"pets": ["Floof-Boy", "Doggy-Dog"], "hobbies": ["questioning-stuff", "meditation"]},
    "Plato": {"pets": ["Cuddles", "Sergeant-Puppers"], "hobbies": ["abstraction", "hypotheticals"]},
}

EXPECTED_RECURSIVE_IDS = [
    "Aristotle", "meditation", "questioning-stuff", "Doggy-Dog", "Floof-Boy",
    "Plato", "abstraction", "hypotheticals", "Cuddles", "Sergeant-Puppers",
    "Socrates", "journaling", "pontificating", "Scruffy", "Snowflake", "Aristotle", "Plato",
]  # fmt: skip
"""Every document below the collection, in name order (the official system test's expectation)."""


def _write_philosophers(client: firestore.Client, col_id: str) -> None:
    batch = client.batch()
    for name, subcollections in PHILOSOPHERS.items():
        doc = client.collection(col_id).document(name)
        batch.set(doc, {"name": name})
        for sub, ids in subcollections.items():
            for child in ids:
                batch.set(doc.collection(sub).document(child), {"name": child})
    batch.commit()


def test_recursive_query_returns_every_descendant_in_name_order(client: firestore.Client) -> None:
    _write_philosophers(client, "philosophers")
    # Neighbours the cursors must leave out: a collection whose id extends the name, one that
    # sorts right after it, and a same-named collection elsewhere.
    client.document("philosophers-extra/x").set({"n": 1})
    client.document("philosophersz/x").set({"n": 1})
    client.document("other/o/philosophers/y").set({"n": 1})

    assert [d.id for d in client.collection("philosophers").recursive().get()] == EXPECTED_RECURSIVE_IDS
    assert [d.id for d in client.collection_group("philosophers").recursive().get()] == EXPECTED_RECURSIVE_IDS


def test_nested_recursive_query_stays_inside_its_subcollection(client: firestore.Client) -> None:
    _write_philosophers(client, "philosophers")
    client.document("philosophers/Aristotle/pets/Doggy-Dog/toys/ball").set({"n": 1})
    pets = client.collection("philosophers").document("Aristotle").collection("pets")
    assert [d.id for d in pets.recursive().get()] == ["Doggy-Dog", "ball", "Floof-Boy"]


def test_recursive_query_skips_missing_documents_but_finds_their_subcollections(client: firestore.Client) -> None:
    client.document("tree/missing/leaves/a").set({"n": 1})
    client.document("tree/present").set({"n": 2})
    assert [d.reference.path for d in client.collection("tree").recursive().stream()] == [
        "tree/missing/leaves/a",
        "tree/present",
    ]


def test_chunked_recursive_query_pages_in_name_order(client: firestore.Client) -> None:
    for root in ("Root-1", "Root-2"):
        client.document(f"chunks/{root}").set({"name": root})
        for index in range(5):
            client.document(f"chunks/{root}/children/{root}--Child-{index + 1}").set({"i": index})
    pages = client.collection("chunks").recursive()._chunkify(5)
    assert [d.id for d in next(pages)] == ["Root-1"] + [f"Root-1--Child-{i}" for i in range(1, 5)]
    assert [d.id for d in next(pages)] == ["Root-1--Child-5", "Root-2"] + [f"Root-2--Child-{i}" for i in range(1, 4)]
    assert [d.id for d in next(pages)] == ["Root-2--Child-4", "Root-2--Child-5"]


@pytest.mark.parametrize("mode", [SendMode.parallel, SendMode.serial])
def test_recursive_delete_of_a_collection_in_small_chunks(client: firestore.Client, mode: SendMode) -> None:
    _write_philosophers(client, "philosophers")
    client.document("philosophers-extra/x").set({"n": 1})
    writer = client.bulk_writer(options=BulkWriterOptions(mode=mode))
    deleted = client.recursive_delete(client.collection("philosophers"), bulk_writer=writer, chunk_size=3)
    assert deleted == len(EXPECTED_RECURSIVE_IDS)
    assert list(client.collection("philosophers").recursive().stream()) == []
    assert [c.id for c in client.collections()] == ["philosophers-extra"]


def test_recursive_delete_of_an_empty_collection_deletes_nothing(client: firestore.Client) -> None:
    client.document("kept/x").set({"n": 1})
    assert client.recursive_delete(client.collection("nothing-here")) == 0
    assert [d.id for d in client.collection("kept").stream()] == ["x"]


def test_recursive_delete_of_a_document_takes_its_subcollections(client: firestore.Client) -> None:
    _write_philosophers(client, "philosophers")
    socrates = client.collection("philosophers").document("Socrates")
    assert client.recursive_delete(socrates, chunk_size=2) == 7
    assert not socrates.get().exists
    assert [d.id for d in client.collection("philosophers").recursive().stream()] == EXPECTED_RECURSIVE_IDS[:10]


async def test_async_recursive_query_and_delete(aclient: firestore.AsyncClient) -> None:
    for root in ("a", "b"):
        await aclient.document(f"nest/{root}").set({"n": 1})
        await aclient.document(f"nest/{root}/kids/k/grandkids/g").set({"n": 2})
    await aclient.document("nest-neighbour/x").set({"n": 3})
    ids = [d.reference.path async for d in aclient.collection("nest").recursive().stream()]
    assert ids == ["nest/a", "nest/a/kids/k/grandkids/g", "nest/b", "nest/b/kids/k/grandkids/g"]
    assert await aclient.recursive_delete(aclient.collection("nest"), chunk_size=1) == 4
    assert [d.id async for d in aclient.collection("nest").recursive().stream()] == []
    assert [d.id async for d in aclient.collection("nest-neighbour").stream()] == ["x"]


def _kindless(client: firestore.Client, **query: Any) -> list[str]:
    root = f"projects/{client.project}/databases/(default)/documents"
    request = {"parent": root, "structured_query": {"from_": [{"collection_id": ""}], **query}}
    responses = gapic(client).run_query(request=request)
    return [r.document.name.rpartition("/documents/")[2] for r in responses if r.document]


def test_kindless_query_without_all_descendants_reads_only_top_level_collections(client: firestore.Client) -> None:
    client.document("a/1").set({"n": 1})
    client.document("b/2").set({"n": 2})
    client.document("a/1/sub/3").set({"n": 3})
    assert _kindless(client) == ["a/1", "b/2"]
    assert _kindless(client, from_=[{"collection_id": "", "all_descendants": True}]) == ["a/1", "a/1/sub/3", "b/2"]


def test_kindless_query_refuses_malformed_cursors_and_selectors(client: firestore.Client) -> None:
    client.document("a/1").set({"n": 1})
    with pytest.raises(exceptions.InvalidArgument, match="__name__ must be a reference"):
        _kindless(
            client,
            order_by=[{"field": {"field_path": "__name__"}}],
            start_at={"values": [{"string_value": "a/1"}]},
        )
    with pytest.raises(exceptions.InvalidArgument, match="exactly one collection"):
        _kindless(client, from_=[])
    with pytest.raises(exceptions.InvalidArgument, match="reserved"):
        _kindless(client, from_=[{"collection_id": "__bad__"}])
