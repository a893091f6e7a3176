"""Value and precondition details the official clients' system tests pin down against production.

- ``update_time`` preconditions: a past, non-matching time is FAILED_PRECONDITION ("the stored
  version (...) does not match the required base version (...)"); a time in the future is
  INVALID_ARGUMENT (``test_document_delete`` / ``test_update_document``).
- ``!= NaN`` (IS_NOT_NAN) matches neither NaN nor null (``test_query_unary``).
- Vectors (``Vector([...])``, sent as ``{"__type__": "__vector__", "value": [doubles]}``) round-trip,
  are not refused as reserved names, and sort between arrays and maps, by dimension first.
"""

from __future__ import annotations

import datetime

import pytest
from firestore_harness import gapic
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter
from google.cloud.firestore_v1.vector import Vector

AN_HOUR = datetime.timedelta(hours=1)


def test_update_time_precondition_in_the_future_is_invalid_argument(client: firestore.Client) -> None:
    ref = client.document("pre/d")
    ref.create({"not": "much"})
    snapshot = ref.get()
    future = client.write_option(last_update_time=snapshot.update_time + AN_HOUR)
    with pytest.raises(exceptions.InvalidArgument, match="in the future"):
        ref.delete(option=future)
    with pytest.raises(exceptions.InvalidArgument, match="in the future"):
        ref.update({"bad": "time-future"}, option=future)
    # A past time that is not the stored one is a failed precondition, in production's words.
    ref.update({"v": 2})
    stale = client.write_option(last_update_time=snapshot.update_time)
    mismatch = r"the stored version \(\d+\) does not match the required base version \(\d+\)"
    with pytest.raises(exceptions.FailedPrecondition, match=mismatch):
        ref.update({"bad": "time-past"}, option=stale)
    assert ref.get().to_dict() == {"not": "much", "v": 2}
    ref.delete(option=client.write_option(last_update_time=ref.get().update_time))
    assert not ref.get().exists


def test_future_update_time_in_a_batch_write_fails_only_that_write(client: firestore.Client) -> None:
    kept = client.document("pre/kept")
    kept.set({"n": 1})
    future = client.write_option(last_update_time=kept.get().update_time + AN_HOUR)
    batch = client.bulk_writer()
    failures: list[int] = []
    batch.on_write_error(lambda error, writer: failures.append(error.code) or False)
    batch.delete(kept, option=future)
    batch.create(client.document("pre/new"), {"n": 2})
    batch.close()
    assert failures == [3]  # INVALID_ARGUMENT, not retried
    assert kept.get().exists and client.document("pre/new").get().exists


@pytest.mark.parametrize("update_time", [{"seconds": 10**15}, {"seconds": 1, "nanos": -5}, {"nanos": 10**9}])
def test_invalid_update_time_precondition_is_invalid_argument(client: firestore.Client, update_time: dict) -> None:
    ref = client.document("pre/ts")
    ref.set({"n": 1})
    write = {"delete": ref._document_path, "current_document": {"update_time": update_time}}
    database = f"projects/{client.project}/databases/(default)"
    with pytest.raises(exceptions.InvalidArgument, match="not a valid timestamp"):
        gapic(client).commit(request={"database": database, "writes": [write]})
    assert ref.get().exists


async def test_async_update_time_precondition_in_the_future(aclient: firestore.AsyncClient) -> None:
    ref = aclient.document("pre/async")
    await ref.create({"n": 1})
    snapshot = await ref.get()
    future = aclient.write_option(last_update_time=snapshot.update_time + AN_HOUR)
    with pytest.raises(exceptions.InvalidArgument):
        await ref.delete(option=future)
    with pytest.raises(exceptions.InvalidArgument):
        await ref.update({"n": 2}, option=future)
    assert (await ref.get()).to_dict() == {"n": 1}


@pytest.fixture
def unary(client: firestore.Client) -> firestore.CollectionReference:
    col = client.collection("unary")
    for doc_id, value in {"null": None, "nan": float("nan"), "int": 123, "text": "x"}.items():
        col.document(doc_id).set({"foo": value})
    col.document("absent").set({"other": 1})
    return col


def test_not_equal_nan_matches_neither_nan_nor_null(unary: firestore.CollectionReference) -> None:
    def ids(op: str, value: object) -> list[str]:
        return sorted(d.id for d in unary.where(filter=FieldFilter("foo", op, value)).stream())

    assert ids("!=", float("nan")) == ["int", "text"]
    assert ids("!=", None) == ["int", "nan", "text"]
    assert ids("==", float("nan")) == ["nan"]
    assert ids("==", None) == ["null"]


async def test_async_not_equal_nan(aclient: firestore.AsyncClient) -> None:
    col = aclient.collection("unary")
    await col.document("null").set({"foo": None})
    await col.document("nan").set({"foo": float("nan")})
    await col.document("int").set({"foo": 123})
    got = [d.id async for d in col.where(filter=FieldFilter("foo", "!=", float("nan"))).stream()]
    assert got == ["int"]


def test_vectors_round_trip_and_are_not_reserved_names(client: firestore.Client) -> None:
    ref = client.document("vectors/one")
    ref.set({"embedding": Vector([1.0, 2, 3.0]), "nested": {"v": Vector([0.5])}, "list": [Vector([4.0])]})
    got = ref.get().to_dict()
    assert got == {"embedding": Vector([1.0, 2.0, 3.0]), "nested": {"v": Vector([0.5])}, "list": [Vector([4.0])]}
    assert isinstance(got["embedding"], Vector)
    ref.update({"embedding": Vector([9.0])})
    assert ref.get().get("embedding") == Vector([9.0])
    found = client.collection("vectors").where(filter=FieldFilter("embedding", "==", Vector([9.0]))).get()
    assert [d.id for d in found] == ["one"]


def test_vectors_sort_between_arrays_and_maps_by_dimension_first(client: firestore.Client) -> None:
    col = client.collection("order")
    rows = {
        "map": {"a": 1},
        "long-vector": Vector([0.0, 0.0]),
        "short-big-vector": Vector([5.0]),
        "short-small-vector": Vector([1.0]),
        "array": [100],
    }
    for doc_id, value in rows.items():
        col.document(doc_id).set({"v": value})
    assert [d.id for d in col.order_by("v").stream()] == [
        "array",
        "short-small-vector",
        "short-big-vector",
        "long-vector",
        "map",
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"__type__": "__vector__"}, "Vector map is missing key 'value'."),
        ({"__type__": "__vector__", "value": 1.0}, "Vector value type must be an array."),
        ({"__type__": "__vector__", "value": [1.0], "extra": 1}, "Vector value map has extraneous entries."),
        ({"__type__": "__vector__", "value": []}, "Cannot have a zero length vector."),
        ({"__type__": "__vector__", "value": [1]}, "Vector must only contain values of type 'double'"),
        ({"__type__": "__vector__", "value": [float("nan")]}, "Vector cannot contain NaN values."),
        ({"__type__": "__vector__", "value": [0.5] * 2049}, "Vectors must be at most 2048 dimensions."),
        ({"__type__": "something-else"}, "reserved"),
    ],
)
def test_malformed_vectors_are_invalid_argument(client: firestore.Client, value: dict, message: str) -> None:
    with pytest.raises(exceptions.InvalidArgument) as error:
        client.document("vectors/bad").set({"v": value})
    assert message in error.value.message
    assert not client.document("vectors/bad").get().exists


def test_reserved_type_key_at_the_top_level_is_still_refused(client: firestore.Client) -> None:
    with pytest.raises(exceptions.InvalidArgument, match="reserved"):
        client.document("vectors/top").set({"__type__": "__vector__", "value": [1.0]})


async def test_async_vectors_round_trip(aclient: firestore.AsyncClient) -> None:
    ref = aclient.document("vectors/async")
    await ref.set({"embedding": Vector([1.5, -2.0])})
    assert (await ref.get()).get("embedding") == Vector([1.5, -2.0])
    with pytest.raises(exceptions.InvalidArgument):
        await ref.set({"embedding": {"__type__": "__vector__", "value": []}})


def test_a_vector_in_a_batch_write_refused_alone(client: firestore.Client) -> None:
    database = f"projects/{client.project}/databases/(default)"
    request = {
        "database": database,
        "writes": [
            {"update": {"name": f"{database}/documents/vb/ok", "fields": {"v": {"map_value": {"fields": {
                "__type__": {"string_value": "__vector__"},
                "value": {"array_value": {"values": [{"double_value": 1.0}]}},
            }}}}}},
            {"update": {"name": f"{database}/documents/vb/bad", "fields": {"v": {"map_value": {"fields": {
                "__type__": {"string_value": "__vector__"},
                "value": {"string_value": "nope"},
            }}}}}},
        ],
    }  # fmt: skip
    response = gapic(client).batch_write(request=request)
    assert [s.code for s in response.status] == [0, 3]
    assert response.status[1].message == "Vector value type must be an array."
    assert client.document("vb/ok").get().get("v") == Vector([1.0])


def test_vector_search_and_query_explain_are_refused_not_answered_wrongly(client: firestore.Client) -> None:
    from google.cloud.firestore_v1.base_vector_query import DistanceMeasure
    from google.cloud.firestore_v1.query_profile import ExplainOptions

    col = client.collection("vectors")
    col.document("a").set({"embedding": Vector([1.0, 2.0])})
    nearest = col.find_nearest(
        vector_field="embedding", query_vector=Vector([1.0, 2.0]), distance_measure=DistanceMeasure.EUCLIDEAN, limit=1
    )
    with pytest.raises(exceptions.MethodNotImplemented, match="find_nearest"):
        nearest.get()
    with pytest.raises(exceptions.MethodNotImplemented, match="explain"):
        col.get(explain_options=ExplainOptions(analyze=True))
    with pytest.raises(exceptions.MethodNotImplemented, match="explain"):
        col.count().get(explain_options=ExplainOptions(analyze=False))
