"""Limits, bad input, BatchWrite, counters, faults and admin routes."""

from __future__ import annotations

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from firestore_harness import Endpoint
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.bulk_batch import BulkWriteBatch

from sidecar.emulators.faults import FaultInjector, FaultRule
from sidecar.emulators.firestore import FirestoreEmulator


@pytest.mark.parametrize("doc_id", [".", "..", "__id__", "x" * 1501])
def test_invalid_document_ids_are_refused(client: firestore.Client, doc_id: str) -> None:
    with pytest.raises(exceptions.InvalidArgument, match="id"):
        client.collection("ids").document(doc_id).set({"a": 1})


def test_field_names_depth_and_nested_arrays_are_refused(client: firestore.Client) -> None:
    ref = client.collection("f").document("d")
    with pytest.raises(exceptions.InvalidArgument, match="reserved"):
        ref.set({"__bad__": 1})
    deep: dict[str, object] = {"leaf": 1}
    for _ in range(20):
        deep = {"m": deep}
    with pytest.raises(exceptions.InvalidArgument, match="deeper than 20"):
        ref.set(deep)
    with pytest.raises(exceptions.InvalidArgument, match="array"):
        ref.set({"a": [[1]]})
    assert not ref.get().exists


def test_document_size_limit_uses_firestores_formula(client: firestore.Client) -> None:
    ref = client.collection("big").document("d")
    # name "big/d" = 4 + 2 + 16 = 22; doc overhead 32; field "s" = 2; string = len + 1.
    fits = 1_048_576 - 22 - 32 - 2 - 1
    ref.set({"s": "x" * fits})
    with pytest.raises(exceptions.InvalidArgument, match="exceeds the maximum allowed size"):
        ref.set({"s": "x" * (fits + 1)})
    assert len(ref.get().get("s")) == fits


def test_request_size_limit(client: firestore.Client) -> None:
    batch = client.batch()
    for i in range(11):
        batch.set(client.collection("req").document(f"d{i}"), {"b": b"x" * 1_000_000})
    with pytest.raises(exceptions.InvalidArgument, match="Request payload size exceeds the limit"):
        batch.commit()


def test_batch_write_reports_status_per_write_and_is_not_atomic(client: firestore.Client) -> None:
    col = client.collection("bw")
    col.document("taken").set({"v": 0})
    batch = BulkWriteBatch(client)
    batch.create(col.document("new"), {"v": 1})
    batch.create(col.document("taken"), {"v": 2})
    batch.update(col.document("absent"), {"v": 3})
    batch.set(col.document("other"), {"v": 4})
    response = batch.commit()
    codes = [s.code for s in response.status]
    assert codes == [0, grpc.StatusCode.ALREADY_EXISTS.value[0], grpc.StatusCode.NOT_FOUND.value[0], 0]
    assert len(response.write_results) == 4
    assert response.write_results[0].update_time is not None
    assert col.document("new").get().get("v") == 1
    assert col.document("taken").get().get("v") == 0
    assert col.document("other").get().get("v") == 4


def test_bulk_writer_writes_everything(client: firestore.Client) -> None:
    col = client.collection("bulk")
    writer = client.bulk_writer()
    for i in range(120):
        writer.create(col.document(f"d{i:03d}"), {"i": i})
    writer.close()
    assert client.collection("bulk").count().get()[0][0].value == 120


def test_counters_bill_like_firestore(client: firestore.Client, endpoint: Endpoint) -> None:
    emulator = endpoint.local()
    col = client.collection("bill")
    emulator.reset_counters()
    col.document("a").set({"v": 1, "n": firestore.Increment(1)})
    col.document("b").set({"v": 2})
    col.document("b").delete()
    col.document("zz").delete()
    assert emulator.counters == {"reads": 0, "writes": 2, "deletes": 2, "ttl_deletes": 0}
    list(client.get_all([col.document("a"), col.document("missing")]))
    assert emulator.counters["reads"] == 2
    list(col.where(filter=firestore.FieldFilter("v", "==", 99)).stream())
    assert emulator.counters["reads"] == 3  # an empty result still costs one read
    list(col.stream())
    assert emulator.counters["reads"] == 4
    with pytest.raises(exceptions.AlreadyExists):
        col.document("a").create({})
    assert emulator.counters["writes"] == 2  # refused writes are not billed
    emulator.reset_counters()
    assert emulator.counters == {"reads": 0, "writes": 0, "deletes": 0, "ttl_deletes": 0}


def test_injected_faults_take_effect(client: firestore.Client, faults: FaultInjector) -> None:
    ref = client.collection("faults").document("d")
    # UNAVAILABLE on Commit is retried by the client: the write still lands.
    faults.add(FaultRule(service="firestore", method="Commit", code=grpc.StatusCode.UNAVAILABLE, remaining=2))
    ref.set({"v": 1})
    assert faults.rules()[0].remaining == 0
    faults.clear()
    faults.add(FaultRule(service="firestore", method="BatchGetDocuments", code=grpc.StatusCode.PERMISSION_DENIED))
    with pytest.raises(exceptions.PermissionDenied, match="injected fault"):
        ref.get()
    faults.clear()
    assert ref.get().get("v") == 1


def test_bad_requests_get_invalid_argument_with_a_message(client: firestore.Client) -> None:
    api, meta = client._firestore_api, client._rpc_metadata
    with pytest.raises(exceptions.InvalidArgument, match="projects/P/databases/D"):
        api.get_document(request={"name": "not/a/name"}, metadata=meta)
    with pytest.raises(exceptions.InvalidArgument, match="even number"):
        api.get_document(request={"name": f"{client._database_string}/documents/c"}, metadata=meta)
    bad_write = {
        "update": {"name": f"{client._database_string}/documents/c/d"},
        "update_mask": {"field_paths": ["a..b"]},
    }
    with pytest.raises(exceptions.InvalidArgument, match="field path"):
        api.commit(request={"database": client._database_string, "writes": [bad_write]}, metadata=meta)
    with pytest.raises(exceptions.InvalidArgument, match="500 writes"):
        api.commit(
            request={
                "database": client._database_string,
                "writes": [{"delete": f"{client._database_string}/documents/c/d{i}"} for i in range(501)],
            },
            metadata=meta,
        )
    assert client.collection("c").document("d").get().exists is False


async def test_admin_routes_read_and_reset() -> None:
    emulator = FirestoreEmulator(FaultInjector())
    app = web.Application()
    app.add_routes(emulator.admin_routes())
    async with TestClient(TestServer(app)) as http:
        emulator._counters.writes = 3
        response = await http.get("/firestore/counters")
        assert await response.json() == {"reads": 0, "writes": 3, "deletes": 0, "ttl_deletes": 0, "hotspots": {}}
        response = await http.post("/firestore/counters/reset")
        assert (await response.json())["writes"] == 0
        response = await http.post("/firestore/reset")
        assert response.status == 200
    await emulator.close()
