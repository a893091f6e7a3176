"""The shipped firestore.indexes.json, loaded by the EmulatorStack, driven with the official client.

Covers the stack flags (``firestore_indexes``, ``ttl_sweep_seconds``), the admin routes
(``POST /firestore/ttl/sweep`` with ``as_of_ms``, ``GET /firestore/counters`` with ``ttl_deletes``
and ``hotspots``, reset) and the store's queries on the shipped file's indexed fields.
"""

from __future__ import annotations

import datetime
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from sidecar.emulators.firestore.indexes import load_index_config
from sidecar.emulators.stack import EmulatorStack

pytestmark = pytest.mark.timeout(60)

SHIPPED = Path(__file__).resolve().parents[2] / "firestore.indexes.json"
_MAX_SINGLE_FIELD_EXEMPTIONS = 200
"""Production's limit of single-field index exemptions per database."""


@pytest.fixture(scope="module")
def stack() -> Iterator[EmulatorStack]:
    stack = EmulatorStack(firestore_indexes=str(SHIPPED), ttl_sweep_seconds=3600)
    stack.start_in_thread()
    try:
        yield stack
    finally:
        stack.stop_thread()


@pytest.fixture
def client(stack: EmulatorStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[firestore.Client]:
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", stack.firestore_host)
    c = firestore.Client(project=f"file-{uuid.uuid4().hex[:12]}")
    try:
        yield c
    finally:
        c.close()


def _admin(stack: EmulatorStack, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(stack.admin_url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_the_shipped_file_stays_within_production_limits() -> None:
    config = load_index_config(SHIPPED)
    exemptions = [o for o in config.overrides.values() if o.is_exempt]
    assert len(exemptions) <= _MAX_SINGLE_FIELD_EXEMPTIONS
    assert config.ttl_fields() == [("messages", ("expire_at",))]
    assert not config.composites


def test_the_store_queries_run_and_an_exempted_field_is_refused(stack: EmulatorStack, client: firestore.Client) -> None:
    messages = client.collection("subs").document("s").collection("messages")
    for i in range(3):
        messages.document(f"m{i}").set({"shard": i % 2, "inbox": 1, "state": "pending", "done_slot": i, "done_ms": i})
    pending = messages.where(filter=FieldFilter("inbox", "==", 1)).where(filter=FieldFilter("state", "==", "pending"))
    assert len(list(pending.stream())) == 3
    assert [d.id for d in messages.where(filter=FieldFilter("shard", "==", 0)).stream()] == ["m0", "m2"]
    since = messages.where(filter=FieldFilter("done_slot", ">=", 1)).order_by("done_slot")
    assert [d.id for d in since.stream()] == ["m1", "m2"]
    with pytest.raises(exceptions.FailedPrecondition, match="The query requires an index"):
        list(messages.where(filter=FieldFilter("done_ms", ">=", 1)).stream())


def test_ttl_sweep_route_counts_what_a_week_of_ttl_will_delete(stack: EmulatorStack, client: firestore.Client) -> None:
    _admin(stack, "POST", "/firestore/counters/reset")
    messages = client.collection("subs").document("t").collection("messages")
    now = datetime.datetime.now(datetime.UTC)
    batch = client.batch()
    for i in range(5):
        batch.set(messages.document(f"m{i}"), {"expire_at": now + datetime.timedelta(days=7, minutes=i)})
    batch.set(messages.document("later"), {"expire_at": now + datetime.timedelta(days=30)})
    batch.commit()
    assert _admin(stack, "POST", "/firestore/ttl/sweep") == {"deleted": 0}
    as_of_ms = int((now + datetime.timedelta(days=8)).timestamp() * 1000)
    assert _admin(stack, "POST", "/firestore/ttl/sweep", {"as_of_ms": as_of_ms}) == {"deleted": 5}
    assert [d.id for d in messages.stream()] == ["later"]
    counters = _admin(stack, "GET", "/firestore/counters")
    assert counters["ttl_deletes"] == 5 and counters["deletes"] == 5
    assert "messages.expire_at" not in counters["hotspots"], "the TTL field is exempted"
    reset = _admin(stack, "POST", "/firestore/counters/reset")
    assert reset["ttl_deletes"] == 0 and reset["hotspots"] == {}


def test_hotspots_in_the_counters_route(stack: EmulatorStack, client: firestore.Client) -> None:
    _admin(stack, "POST", "/firestore/counters/reset")
    keys = client.collection("subs").document("h").collection("keys")
    for i in range(4):
        keys.document(uuid.uuid4().hex).set({"shard": i, "next_seq": i})
    hotspots = _admin(stack, "GET", "/firestore/counters")["hotspots"]
    assert hotspots["keys.shard"]["appends"] == 4 and hotspots["keys.shard"]["peak_per_s"] >= 1
    assert "keys.next_seq" not in hotspots


def test_a_bad_as_of_is_refused(stack: EmulatorStack) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        _admin(stack, "POST", "/firestore/ttl/sweep", {"as_of_ms": "tomorrow"})
    assert caught.value.code == 400
