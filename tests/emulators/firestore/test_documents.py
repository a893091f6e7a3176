"""Documents through the official client: CRUD, preconditions, masks, transforms, Value kinds."""

from __future__ import annotations

import datetime
import math

import pytest
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1 import GeoPoint
from google.cloud.firestore_v1.field_path import FieldPath


def _all_kinds(client: firestore.Client) -> dict[str, object]:
    return {
        "null": None,
        "bool": True,
        "int": -(2**63),
        "double": 2.5,
        "nan": math.nan,
        "timestamp": datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.UTC),
        "string": "héllo \u2603",
        "bytes": b"\x00\xffbin",
        "reference": client.collection("other").document("x"),
        "geo": GeoPoint(47.5, -122.25),
        "array": [1, "two", None, {"three": 3.0}],
        "map": {"nested": {"deep": [True, b"b"]}, "empty": {}},
        "empty_array": [],
    }


def test_every_value_kind_round_trips(client: firestore.Client) -> None:
    ref = client.collection("kinds").document("all")
    written = _all_kinds(client)
    ref.set(written)
    got = ref.get().to_dict()
    assert got is not None
    assert math.isnan(got.pop("nan"))
    written.pop("nan")
    assert got.pop("reference").path == "other/x"
    written.pop("reference")
    assert got == written


def test_create_existing_is_already_exists_and_update_missing_is_not_found(client: firestore.Client) -> None:
    ref = client.collection("c").document("one")
    ref.create({"a": 1})
    with pytest.raises(exceptions.AlreadyExists):
        ref.create({"a": 2})
    with pytest.raises(exceptions.NotFound):
        client.collection("c").document("missing").update({"a": 1})
    assert ref.get().to_dict() == {"a": 1}


def test_set_replaces_merge_keeps_and_update_deletes_masked_fields(client: firestore.Client) -> None:
    ref = client.collection("c").document("d")
    ref.set({"a": 1, "b": {"x": 1, "y": 2}, "c": 3})
    ref.set({"b": {"x": 10}}, merge=True)
    assert ref.get().to_dict() == {"a": 1, "b": {"x": 10, "y": 2}, "c": 3}
    ref.update({"b.y": firestore.DELETE_FIELD, "c": firestore.DELETE_FIELD, "a": 5})
    assert ref.get().to_dict() == {"a": 5, "b": {"x": 10}}
    ref.set({"only": True})
    assert ref.get().to_dict() == {"only": True}


def test_mask_paths_honour_backtick_quoting(client: firestore.Client) -> None:
    ref = client.collection("c").document("quoted")
    ref.set({"a.b": 1, "a": {"b": 2}, "we`ird": {"x y": 0}})
    ref.update({FieldPath("a.b").to_api_repr(): 10, "`we\\`ird`.`x y`": 7})
    assert ref.get().to_dict() == {"a.b": 10, "a": {"b": 2}, "we`ird": {"x y": 7}}
    assert ref.get(field_paths=["`a.b`"]).to_dict() == {"a.b": 10}


def test_preconditions_on_update_time(client: firestore.Client) -> None:
    ref = client.collection("c").document("pre")
    first = ref.set({"v": 1})
    second = ref.set({"v": 2})
    assert second.update_time > first.update_time
    with pytest.raises(exceptions.FailedPrecondition):
        ref.update({"v": 3}, option=client.write_option(last_update_time=first.update_time))
    ref.update({"v": 3}, option=client.write_option(last_update_time=second.update_time))
    with pytest.raises(exceptions.FailedPrecondition):
        ref.delete(option=client.write_option(last_update_time=second.update_time))
    assert ref.get().to_dict() == {"v": 3}


def test_create_update_times_and_unchanged_write_keeps_update_time(client: firestore.Client) -> None:
    ref = client.collection("c").document("times")
    created = ref.create({"v": 1})
    snap = ref.get()
    assert snap.create_time == snap.update_time == created.update_time
    same = ref.set({"v": 1})
    assert same.update_time == created.update_time
    changed = ref.update({"v": 2})
    after = ref.get()
    assert after.create_time == created.update_time
    assert after.update_time == changed.update_time > created.update_time


def test_delete_missing_succeeds_and_delete_removes(client: firestore.Client) -> None:
    ref = client.collection("c").document("gone")
    ref.delete()
    ref.set({"a": 1})
    ref.delete()
    assert not ref.get().exists


def test_transforms_server_time_increment_min_max_arrays(client: firestore.Client) -> None:
    ref = client.collection("c").document("tx")
    ref.set({"i": 1, "d": 1.5, "s": "text", "big": 2**63 - 2, "arr": [1, 2, 2, 3], "lo": 5, "hi": 5})
    result = ref.update(
        {
            "when": firestore.SERVER_TIMESTAMP,
            "i": firestore.Increment(2),
            "d": firestore.Increment(1),
            "s": firestore.Increment(4),
            "big": firestore.Increment(10),
            "new": firestore.Increment(1.5),
            "arr": firestore.ArrayRemove([2]),
            "lo": firestore.Minimum(3.0),
            "hi": firestore.Maximum(5.0),
        }
    )
    got = ref.get().to_dict()
    assert got is not None
    assert got["when"] == result.update_time
    assert got["i"] == 3 and isinstance(got["i"], int)
    assert got["d"] == 2.5
    assert got["s"] == 4
    assert got["big"] == 2**63 - 1
    assert got["new"] == 1.5
    assert got["arr"] == [1, 3]
    assert got["lo"] == 3.0 and isinstance(got["lo"], float)
    assert got["hi"] == 5 and isinstance(got["hi"], int)
    ref.update({"arr": firestore.ArrayUnion([3, 4, 4.0, 5])})
    assert ref.get().get("arr") == [1, 3, 4, 5]


def test_update_with_only_transforms_keeps_other_fields(client: firestore.Client) -> None:
    ref = client.collection("c").document("only-transforms")
    ref.set({"keep": "me", "n": 1})
    ref.update({"n": firestore.Increment(1)})
    assert ref.get().to_dict() == {"keep": "me", "n": 2}


def test_batch_commit_is_atomic(client: firestore.Client) -> None:
    existing = client.collection("c").document("exists")
    existing.set({"v": 0})
    batch = client.batch()
    batch.set(client.collection("c").document("a"), {"v": 1})
    batch.create(existing, {"v": 2})
    with pytest.raises(exceptions.AlreadyExists):
        batch.commit()
    assert not client.collection("c").document("a").get().exists
    batch = client.batch()
    target = client.collection("c").document("seq")
    batch.set(target, {"v": 1})
    batch.update(target, {"w": 2})
    results = batch.commit()
    assert len(results) == 2
    assert target.get().to_dict() == {"v": 1, "w": 2}


def test_get_all_reports_found_and_missing(client: firestore.Client) -> None:
    col = client.collection("g")
    col.document("a").set({"n": 1})
    snaps = {s.id: s for s in client.get_all([col.document("a"), col.document("b")])}
    assert snaps["a"].exists and snaps["a"].to_dict() == {"n": 1}
    assert not snaps["b"].exists


def test_subcollections_list_documents_and_collection_ids(client: firestore.Client) -> None:
    root = client.collection("root")
    root.document("a").set({"x": 1})
    root.document("b").collection("sub").document("s1").set({"y": 2})
    root.document("a").collection("kids").document("k").set({})
    root.document("a").collection("pets").document("p").set({})
    listed = sorted(d.id for d in root.list_documents())
    assert listed == ["a", "b"]  # "b" exists only as the parent of a subcollection
    assert sorted(c.id for c in root.document("a").collections()) == ["kids", "pets"]
    assert sorted(c.id for c in client.collections()) == ["root"]
    assert root.document("b").collection("sub").document("s1").get().to_dict() == {"y": 2}


def test_add_generates_an_id(client: firestore.Client) -> None:
    _, ref = client.collection("auto").add({"v": 1})
    assert len(ref.id) == 20
    assert ref.get().to_dict() == {"v": 1}


async def test_async_client_crud_and_errors(aclient: firestore.AsyncClient) -> None:
    ref = aclient.collection("async").document("d")
    await ref.create({"n": 1, "when": firestore.SERVER_TIMESTAMP})
    with pytest.raises(exceptions.AlreadyExists):
        await ref.create({"n": 2})
    await ref.update({"n": firestore.Increment(41)})
    snap = await ref.get()
    assert snap.get("n") == 42
    with pytest.raises(exceptions.NotFound):
        await aclient.collection("async").document("none").update({"n": 1})
    await ref.delete()
    assert not (await ref.get()).exists
