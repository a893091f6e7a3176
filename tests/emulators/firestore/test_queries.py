"""Queries through the official client: filters, order, cursors, select, groups, aggregations."""

from __future__ import annotations

import datetime

import pytest
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1 import GeoPoint
from google.cloud.firestore_v1.base_query import And, FieldFilter, Or


def _ids(query: firestore.Query) -> list[str]:
    return [d.id for d in query.stream()]


@pytest.fixture
def people(client: firestore.Client) -> firestore.CollectionReference:
    col = client.collection("people")
    rows = {
        "ann": {"age": 30, "city": "Oslo", "tags": ["a", "b"], "score": 1.5},
        "bob": {"age": 25, "city": "Rome", "tags": ["b"], "score": None},
        "cid": {"age": 35, "city": "Oslo", "tags": [], "score": float("nan")},
        "dan": {"age": 25, "city": "Paris", "tags": ["c", "a"]},
        "eve": {"city": "Rome", "tags": ["a"], "score": 7},
    }
    batch = client.batch()
    for doc_id, data in rows.items():
        batch.set(col.document(doc_id), data)
    batch.commit()
    return col


@pytest.mark.parametrize(
    ("field", "op", "value", "expected"),
    [
        ("age", "==", 25, ["bob", "dan"]),
        ("age", "!=", 25, ["ann", "cid"]),
        ("age", "<", 30, ["bob", "dan"]),
        ("age", "<=", 30, ["ann", "bob", "dan"]),
        ("age", ">", 25, ["ann", "cid"]),
        ("age", ">=", 30, ["ann", "cid"]),
        ("city", "in", ["Oslo", "Paris"], ["ann", "cid", "dan"]),
        ("city", "not-in", ["Oslo", "Paris"], ["bob", "eve"]),
        ("tags", "array_contains", "a", ["ann", "dan", "eve"]),
        ("tags", "array_contains_any", ["c", "b"], ["ann", "bob", "dan"]),
        ("score", "==", None, ["bob"]),
        ("score", "!=", None, ["ann", "cid", "eve"]),
        ("score", "==", float("nan"), ["cid"]),
        ("age", ">", "a string", []),
    ],
)
def test_field_and_unary_filters(
    people: firestore.CollectionReference, field: str, op: str, value: object, expected: list[str]
) -> None:
    assert sorted(_ids(people.where(filter=FieldFilter(field, op, value)))) == expected


def test_composite_and_or(people: firestore.CollectionReference) -> None:
    query = people.where(
        filter=Or([And([FieldFilter("city", "==", "Oslo"), FieldFilter("age", ">", 30)]), FieldFilter("age", "==", 25)])
    )
    assert sorted(_ids(query)) == ["bob", "cid", "dan"]


def test_order_limit_offset_and_missing_order_field_excluded(people: firestore.CollectionReference) -> None:
    query = people.order_by("age", direction=firestore.Query.DESCENDING).order_by("city")
    assert _ids(query) == ["cid", "ann", "dan", "bob"]  # eve has no age
    assert _ids(query.limit(2)) == ["cid", "ann"]
    assert _ids(query.offset(1).limit(2)) == ["ann", "dan"]
    assert [d.id for d in people.order_by("age").limit_to_last(2).get()] == ["ann", "cid"]
    # Implicit __name__ order breaks ties in the direction of the last order.
    assert _ids(people.where(filter=FieldFilter("age", "==", 25))) == ["bob", "dan"]
    assert _ids(people.order_by("__name__", direction=firestore.Query.DESCENDING).limit(2)) == ["eve", "dan"]


def test_cursors(people: firestore.CollectionReference) -> None:
    by_age = people.order_by("age")
    assert _ids(by_age.start_at({"age": 30})) == ["ann", "cid"]
    assert _ids(by_age.start_after({"age": 25})) == ["ann", "cid"]
    assert _ids(by_age.end_at({"age": 30})) == ["bob", "dan", "ann"]
    assert _ids(by_age.end_before({"age": 30})) == ["bob", "dan"]
    bob = people.document("bob").get()
    assert _ids(by_age.start_after(bob)) == ["dan", "ann", "cid"]
    assert _ids(people.order_by("__name__").start_after(bob).end_before(people.document("eve").get())) == [
        "cid",
        "dan",
    ]


def test_select_projects_fields(people: firestore.CollectionReference) -> None:
    docs = list(people.where(filter=FieldFilter("city", "==", "Rome")).select(["city"]).stream())
    assert [d.to_dict() for d in docs] == [{"city": "Rome"}, {"city": "Rome"}]


def test_collection_group_query(client: firestore.Client) -> None:
    client.collection("a").document("x").collection("items").document("1").set({"n": 1})
    client.collection("b").document("y").collection("items").document("2").set({"n": 2})
    client.collection("items").document("3").set({"n": 3})
    client.collection("b").document("y").collection("other").document("4").set({"n": 4})
    group = client.collection_group("items")
    assert sorted(d.get("n") for d in group.stream()) == [1, 2, 3]
    assert [d.get("n") for d in group.where(filter=FieldFilter("n", ">", 1)).order_by("n").stream()] == [2, 3]
    sub = client.collection("b").document("y").collection("items")
    assert [d.id for d in sub.stream()] == ["2"]


def test_cross_type_ordering(client: firestore.Client) -> None:
    col = client.collection("mixed")
    values: list[object] = [
        {"m": 1},
        [1, 2],
        GeoPoint(1, 2),
        client.collection("r").document("x"),
        b"bytes",
        "string",
        datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        2.5,
        1,
        float("nan"),
        True,
        None,
    ]
    for index, value in enumerate(values):
        col.document(f"d{index:02d}").set({"v": value})
    ordered = [d.id for d in col.order_by("v").stream()]
    assert ordered == [f"d{i:02d}" for i in [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]]


def test_count_aggregation(people: firestore.CollectionReference) -> None:
    result = people.where(filter=FieldFilter("city", "==", "Oslo")).count(alias="n").get()
    assert result[0][0].alias == "n" and result[0][0].value == 2
    assert people.count().get()[0][0].value == 5
    assert people.limit(3).count().get()[0][0].value == 3


def test_query_errors_are_invalid_argument(people: firestore.CollectionReference) -> None:
    with pytest.raises(exceptions.InvalidArgument, match="non-empty array"):
        list(people.where(filter=FieldFilter("age", "in", [])).stream())
    with pytest.raises(exceptions.InvalidArgument, match="at most 30"):
        list(people.where(filter=FieldFilter("age", "in", list(range(31)))).stream())


async def test_async_query_stream_and_count(aclient: firestore.AsyncClient) -> None:
    col = aclient.collection("aq")
    for i in range(5):
        await col.document(f"d{i}").set({"i": i})
    got = [
        d.get("i")
        async for d in col.where(filter=FieldFilter("i", ">=", 2)).order_by("i", direction="DESCENDING").stream()
    ]
    assert got == [4, 3, 2]
    assert (await col.count().get())[0][0].value == 5
    assert [d.id async for d in col.list_documents()] == [f"d{i}" for i in range(5)]


def test_range_queries_follow_writes_after_their_index_is_built(client: firestore.Client) -> None:
    """``field < value`` (and ``<=``, ``>``, ``>=``) reads the documents holding a scalar in that
    field from its index: values of other types, missing fields, updates, deletes, equalities
    ANDed with the range, and cursors all answer as a scan would."""
    col = client.collection("ranges")
    batch = client.batch()
    values: dict[str, object] = {"a": 1, "b": 2.5, "c": 3, "d": 7, "e": "x", "f": [1, 2], "g": None, "h": 4}
    for doc_id, value in values.items():
        batch.set(col.document(doc_id), {"n": value, "shard": 1 if doc_id in "abcd" else 2})
    batch.set(col.document("none"), {"shard": 1})
    batch.commit()

    def between(low: float, high: float) -> list[str]:
        query = col.where(filter=And([FieldFilter("n", ">=", low), FieldFilter("n", "<", high)]))
        return _ids(query.order_by("n"))

    assert between(2, 5) == ["b", "c", "h"]  # by n: 2.5, 3, 4; not the string, array, null or missing
    col.document("d").update({"n": 2})
    col.document("h").update({"n": "4"})
    col.document("c").delete()
    col.document("i").set({"n": 4.5, "shard": 1})
    assert between(2, 5) == ["d", "b", "i"]
    assert _ids(col.where(filter=FieldFilter("n", ">", 2)).order_by("n", direction="DESCENDING")) == ["i", "b"]
    assert _ids(col.where(filter=FieldFilter("n", "<=", 2))) == ["a", "d"]
    assert _ids(col.where(filter=FieldFilter("n", ">=", "0"))) == ["h", "e"]  # strings only: "4", "x"
    shard_one = col.where(filter=And([FieldFilter("shard", "==", 1), FieldFilter("n", ">", 1)])).order_by("n")
    assert _ids(shard_one) == ["d", "b", "i"]
    first = list(shard_one.limit(2).stream())
    assert _ids(shard_one.start_after(first[-1])) == ["i"]
    col.document("i").update({"n": firestore.DELETE_FIELD})
    assert between(0, 10) == ["a", "d", "b"]


def test_equality_queries_follow_writes_after_their_index_is_built(client: firestore.Client) -> None:
    """``field == value`` is served from an index built on first use and kept by every commit:
    later creates, updates that move a document between values, deletes and an emptied
    collection all show in the next query, pages and cursors included, ints equal to doubles."""
    col = client.collection("shards")
    batch = client.batch()
    for i in range(12):
        batch.set(col.document(f"d{i:02d}"), {"shard": i % 3, "state": "pending", "n": float(i)})
    batch.commit()

    def shard(value: object, state: str = "pending") -> list[str]:
        return _ids(col.where(filter=And([FieldFilter("shard", "==", value), FieldFilter("state", "==", state)])))

    assert shard(1) == ["d01", "d04", "d07", "d10"]  # builds the index
    col.document("d04").update({"shard": 2})
    col.document("d07").update({"state": "acked"})
    col.document("d10").delete()
    col.document("d20").set({"shard": 1, "state": "pending"})
    assert shard(1) == ["d01", "d20"]
    assert shard(1.0) == ["d01", "d20"]  # a double equals the int
    assert shard(1, "acked") == ["d07"]
    assert shard(2) == ["d02", "d04", "d05", "d08", "d11"]
    page = col.where(filter=FieldFilter("shard", "==", 2)).order_by("__name__").limit(2)
    first = list(page.stream())
    assert [d.id for d in first] == ["d02", "d04"]
    assert _ids(page.start_after(first[-1])) == ["d05", "d08"]
    assert _ids(col.where(filter=FieldFilter("shard", "==", 2)).order_by("__name__", direction="DESCENDING")) == [
        "d11",
        "d08",
        "d05",
        "d04",
        "d02",
    ]
    assert _ids(col.where(filter=FieldFilter("n", "==", 3))) == ["d03"]  # an int equals the double
    for doc in col.stream():
        doc.reference.delete()
    assert shard(1) == []
    col.document("z").set({"shard": 1, "state": "pending"})
    assert shard(1) == ["z"]
