"""A rollback across layout versions fails safe: this sidecar, started on a subscription whose state a
newer release wrote, stops with one log line naming the document and saying to upgrade, exits 1
(Kubernetes restarts it, and it refuses again), and acks nothing it could not read.

The "newer release" is simulated by writing its documents with ``v`` one above this release's layout
(``sidecar.store.layout.LAYOUT_VERSION``): the subscription document, or one pending message a newer
pod stored in a shard this pod loads. docs/upgrades.md explains the rollback this guards.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Scenario
from e2e_config import PROJECT
from e2e_google import emulator_env
from e2e_waits import async_wait_until
from google.cloud import firestore

from sidecar.shards import shard_of
from sidecar.store.layout import LAYOUT_VERSION

pytestmark = pytest.mark.e2e

NEWER = LAYOUT_VERSION + 1
SHARDS = 16
"""The default ``sharding.shards``: the pod takes every shard and loads each."""


@pytest.mark.parametrize("document", ["subscription", "pending-message"])
async def test_an_older_sidecar_refuses_a_newer_layout_in_one_line_and_exits_1(
    scenario: Scenario, document: str
) -> None:
    scenario.add_subscription("orders")
    path = f"{scenario.root}/orders"
    with emulator_env(scenario.emulators.env):
        client = firestore.Client(project=PROJECT)
    try:
        written: dict[str, Any] = {"name": "orders", "mode": "sequence", "created_ms": 1}
        if document == "subscription":
            client.document(path).set({**written, "v": NEWER})
            refused = f"subscription document {path}"
        else:
            client.document(path).set({**written, "v": LAYOUT_VERSION})
            message = {
                "key": "order-1", "seq": 1, "state": "pending", "dedup_id": "order-1/1", "stored_ms": 1,
                "shard": shard_of("order-1", SHARDS), "v": NEWER,
            }  # fmt: skip
            client.document(f"{path}/messages/m1").set(message)
            refused = "message document m1"
    finally:
        client.close()  # type: ignore[no-untyped-call]
    sidecar = scenario.sidecar()
    sidecar.start(wait_ready=False)
    await async_wait_until(lambda: sidecar.returncode is not None, "the sidecar to stop", 60)
    assert sidecar.returncode == 1, sidecar.output_tail()
    expected = (
        f"{refused}: layout version {NEWER} is newer than this sidecar's {LAYOUT_VERSION} (a newer release "
        "wrote it): upgrade this sidecar"
    )
    records = sidecar.log_records()
    # The line that stops the process says why, in its message (not only in its stack trace).
    stopping = [r for r in records if r["severity"] == "CRITICAL" and "failed; stopping: " in str(r["message"])]
    assert stopping, sidecar.output_tail()
    assert str(stopping[0]["message"]).endswith(expected), stopping[0]["message"]
    assert "\n" not in str(stopping[0]["message"])
    if document == "subscription":  # refused before anything is served
        assert not any("sidecar ready" in str(r.get("message", "")) for r in records)
