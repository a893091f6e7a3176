"""Index configuration: queries an exempted field cannot serve are refused as production refuses them.

Runs against the ``indexed`` emulator (``INDEX_CONFIG`` in firestore_harness): ``people.nick`` is
exempted but covered by the composite (city asc, nick desc); ``tags`` keeps only array-contains;
``age`` only ascending, in both scopes; ``city`` keeps the defaults (collection scope).
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from firestore_harness import gapic
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter
from google.cloud.firestore_v1.types import ListenRequest, Target

from sidecar.emulators.firestore.indexes import IndexConfig, parse_index_config

_NEEDS_INDEX = "The query requires an index. You can create it here: https://console.firebase.google.com/v1/r/project/"


@pytest.fixture
def people(indexed_client: firestore.Client) -> firestore.CollectionReference:
    col = indexed_client.collection("people")
    rows = {
        "ann": {"age": 30, "city": "Oslo", "nick": "a", "tags": ["x"]},
        "bob": {"age": 25, "city": "Rome", "nick": "b", "tags": ["y"]},
        "cid": {"age": 35, "city": "Oslo", "nick": "c", "tags": ["x", "y"]},
    }
    batch = indexed_client.batch()
    for doc_id, data in rows.items():
        batch.set(col.document(doc_id), data)
    batch.commit()
    return col


def _ids(query: Any) -> list[str]:
    return [d.id for d in query.stream()]


def _refused(query: Any, kind: str) -> str:
    with pytest.raises(exceptions.FailedPrecondition) as caught:
        list(query.stream())
    message = caught.value.message
    assert message.startswith(_NEEDS_INDEX), message
    assert f"/firestore/indexes?{kind}=" in message
    return str(message)


@pytest.mark.parametrize(
    "build",
    [
        lambda c: c.where(filter=FieldFilter("nick", ">", "a")),
        lambda c: c.order_by("nick"),
        lambda c: c.where(filter=FieldFilter("nick", "==", "a")),
        lambda c: c.where(filter=FieldFilter("nick", "in", ["a", "b"])),
        lambda c: c.where(filter=FieldFilter("tags", ">", ["x"])),
        lambda c: c.order_by("age", direction=firestore.Query.DESCENDING),
    ],
    ids=["range-on-exempt", "order-on-exempt", "equality-on-exempt", "in-on-exempt", "range-on-contains-only", "desc"],
)
def test_a_query_needing_an_exempted_single_field_index_is_failed_precondition(
    people: firestore.CollectionReference, build: Any
) -> None:
    message = _refused(build(people), "create_exemption")
    assert people._client.project in message


def test_equalities_on_several_indexed_fields_merge_single_field_indexes(people: firestore.CollectionReference) -> None:
    query = people.where(filter=FieldFilter("city", "==", "Oslo")).where(filter=FieldFilter("age", "==", 35))
    assert _ids(query) == ["cid"]
    assert _ids(
        people.where(filter=FieldFilter("tags", "array_contains", "x")).where(filter=FieldFilter("city", "==", "Oslo"))
    ) == ["ann", "cid"]


def test_one_range_or_order_on_an_indexed_field_is_served(people: firestore.CollectionReference) -> None:
    assert _ids(people.where(filter=FieldFilter("age", ">=", 30))) == ["ann", "cid"]
    assert _ids(people.order_by("city", direction=firestore.Query.DESCENDING)) == ["bob", "cid", "ann"]
    assert _ids(people.where(filter=FieldFilter("age", "==", 25)).order_by("age")) == ["bob"]


def test_a_composite_index_covers_an_exempted_field_in_either_direction(people: firestore.CollectionReference) -> None:
    oslo = people.where(filter=FieldFilter("city", "==", "Oslo"))
    assert _ids(oslo.order_by("nick", direction=firestore.Query.DESCENDING)) == ["cid", "ann"]
    assert _ids(oslo.order_by("nick")) == ["ann", "cid"]
    assert _ids(oslo.where(filter=FieldFilter("nick", ">", "a"))) == ["cid"]


def test_equality_plus_a_range_on_another_field_needs_a_composite(people: firestore.CollectionReference) -> None:
    _refused(
        people.where(filter=FieldFilter("city", "==", "Oslo")).where(filter=FieldFilter("age", ">", 1)),
        "create_composite",
    )


def test_name_only_queries_always_run(people: firestore.CollectionReference) -> None:
    assert _ids(people.order_by("__name__", direction=firestore.Query.DESCENDING)) == ["cid", "bob", "ann"]
    first = people.document("ann")
    assert _ids(people.where(filter=FieldFilter("__name__", ">", first))) == ["bob", "cid"]


def test_collection_group_queries_need_collection_group_scope(
    indexed_client: firestore.Client, people: firestore.CollectionReference
) -> None:
    group = indexed_client.collection_group("people")
    assert _ids(group.where(filter=FieldFilter("age", ">", 26))) == ["ann", "cid"]
    _refused(group.where(filter=FieldFilter("city", "==", "Oslo")), "create_exemption")


def test_aggregations_are_planned_like_their_query(people: firestore.CollectionReference) -> None:
    assert people.where(filter=FieldFilter("age", ">", 26)).count().get()[0][0].value == 2
    with pytest.raises(exceptions.FailedPrecondition, match="requires an index"):
        people.where(filter=FieldFilter("nick", "==", "a")).count().get()
    with pytest.raises(exceptions.FailedPrecondition, match="requires an index"):
        people.sum("nick").get()


def test_a_listen_target_without_an_index_is_removed_with_the_cause(
    indexed_client: firestore.Client, people: firestore.CollectionReference
) -> None:
    parent, _ = people._parent_info()
    sq = people.where(filter=FieldFilter("nick", ">", "a"))._to_protobuf()
    request = ListenRequest(
        database=indexed_client._database_string,
        add_target={"query": Target.QueryTarget(parent=parent, structured_query=sq), "target_id": 3},
    )
    responses = [r._pb for r in gapic(indexed_client).listen(requests=iter([request]))]
    assert not [r for r in responses if r.WhichOneof("response_type") != "target_change"], "no document sent"
    change = responses[0].target_change
    assert change.target_change_type == 2 and list(change.target_ids) == [3]  # REMOVE
    assert change.cause.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert change.cause.message.startswith(_NEEDS_INDEX)


def test_without_a_config_everything_is_indexed() -> None:
    config = IndexConfig.everything()
    assert config.has_single("any", ("f",), "DESCENDING", "COLLECTION_GROUP")


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"fieldOverrides": [{"collectionGroup": "m", "fieldPath": "x"}]}, "fieldOverrides[0] (m.x)"),
        ({"fieldOverrides": [{"collectionGroup": "m", "fieldPath": "x", "indexes": [{"order": "UP"}]}]}, "indexes[0]"),
        ({"fieldOverrides": [{"collectionGroup": "m", "fieldPath": "x", "indexes": [], "tll": True}]}, "'tll'"),
        (
            {"fieldOverrides": [{"collectionGroup": "m", "fieldPath": "x", "indexes": []}] * 2},
            "fieldOverrides[1] (m.x)",
        ),
        ({"indexes": [{"collectionGroup": "m", "fields": []}]}, "indexes[0] (m)"),
        ({"indexes": [{"collectionGroup": "m", "fields": [{"fieldPath": "a"}]}]}, "fields[0]"),
        ({"indexes": {}}, "'indexes' must be a list"),
        ({"fieldOverride": []}, "'fieldOverride'"),
    ],
)
def test_a_malformed_config_is_refused_with_one_line_naming_the_entry(data: Any, named: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_index_config(data)
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_exempted_map_field_exempts_its_subfields_unless_one_has_its_own_override() -> None:
    config = parse_index_config(
        {
            "fieldOverrides": [
                {"collectionGroup": "c", "fieldPath": "m", "indexes": []},
                {
                    "collectionGroup": "c",
                    "fieldPath": "m.kept",
                    "indexes": [{"order": "ASCENDING", "queryScope": "COLLECTION"}],
                },
            ]
        }
    )
    assert config.is_ordered_index_exempt("c", ("m",))
    assert config.is_ordered_index_exempt("c", ("m", "x", "y")), "a subfield inherits its map's exemption"
    assert not config.is_ordered_index_exempt("c", ("m", "kept")), "its own override wins"
    assert not config.is_ordered_index_exempt("c", ("other",))
