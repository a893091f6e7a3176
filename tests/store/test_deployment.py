"""The start-up deployment check: the expected exemptions equal the shipped file; warnings per missing piece.

``check_deployment`` reads the fields through the official admin client from our emulator: with the
shipped ``firestore.indexes.json`` loaded it warns of nothing; without it (production's defaults)
it gives one summary warning naming every field and the TTL policy; a refused admin API gives one warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import Emulator

from sidecar.emulators.faults import FaultInjector, FaultRule
from sidecar.emulators.firestore import FirestoreEmulator
from sidecar.emulators.firestore.indexes import load_index_config
from sidecar.emulators.firestore.threaded import ServerThread
from sidecar.store import deployment
from sidecar.store.firestore import check_deployment

SHIPPED = Path(__file__).resolve().parents[2] / "firestore.indexes.json"
_DB = "(default)"


def test_the_expected_exemptions_are_the_shipped_file() -> None:
    data = json.loads(SHIPPED.read_text())
    assert data["indexes"] == []
    exempted: dict[str, set[str]] = {}
    ttl = []
    for entry in data["fieldOverrides"]:
        assert entry["indexes"] == []
        exempted.setdefault(entry["collectionGroup"], set()).add(entry["fieldPath"])
        if entry.get("ttl"):
            ttl.append((entry["collectionGroup"], entry["fieldPath"]))
    assert exempted == {group: set(fields) for group, fields in deployment.EXEMPTED_FIELDS.items()}
    assert ttl == [(deployment.TTL_GROUP, deployment.TTL_FIELD)]
    for group, fields in deployment.INDEXED_FIELDS.items():
        assert not set(fields) & exempted[group], "a queried field must keep its index"


def _all_good() -> dict[tuple[str, str], deployment.FieldState]:
    return {pair: deployment.FieldState(exempted=True, ttl_active=pair == ("messages", "expire_at"))
            for pair in deployment.fields_to_check()}  # fmt: skip


def test_a_complete_deployment_has_no_warning() -> None:
    assert deployment.deployment_warnings(_all_good(), _DB) == []


def test_every_missing_piece_is_in_one_warning_naming_the_commands() -> None:
    answers = _all_good()
    answers[("messages", "expire_at")] = deployment.FieldState(exempted=True, ttl_active=False)
    answers[("keys", "pos_ts")] = deployment.FieldState(exempted=False, ttl_active=False)
    answers[("messages", "seq")] = deployment.FieldState(exempted=False, ttl_active=False)
    [warning] = deployment.deployment_warnings(answers, "orders-db")
    assert (
        "gcloud firestore fields ttls update expire_at --collection-group=messages --enable-ttl --database=orders-db"
        in warning
    )
    assert "2 fields are still indexed (messages: seq; keys: pos_ts)" in warning
    assert "--collection-group=GROUP --disable-indexes --database=orders-db" in warning
    assert warning.endswith("firebase deploy --only firestore:indexes (docs/operations.md)")


def test_only_the_ttl_policy_missing_is_one_warning_about_it_alone() -> None:
    answers = _all_good()
    answers[("messages", "expire_at")] = deployment.FieldState(exempted=True, ttl_active=False)
    [warning] = deployment.deployment_warnings(answers, "d")
    assert "TTL policy" in warning and "still indexed" not in warning


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    injector = FaultInjector()
    thread = ServerThread(FirestoreEmulator(injector, indexes=load_index_config(SHIPPED)), injector)
    thread.start()
    assert thread.ready.wait(30) and thread.error is None
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{thread.port}")
    try:
        yield "p"
    finally:
        thread.stop()


async def test_the_shipped_file_deployed_logs_nothing(configured: str, caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.deployment")
    with caplog.at_level(logging.WARNING, logger="test.deployment"):
        await check_deployment(configured, _DB, log)
    assert caplog.records == []


async def test_production_defaults_log_one_summary_warning(
    emulator: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("test.deployment")
    with caplog.at_level(logging.WARNING, logger="test.deployment"):
        await check_deployment("p", _DB, log)
    [message] = [r.getMessage() for r in caplog.records]
    assert "--enable-ttl" in message
    assert f"{len(deployment.fields_to_check())} fields are still indexed" in message


async def test_a_refused_admin_api_is_one_warning_naming_the_role(
    emulator: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    emulator.injector.add(FaultRule("firestore", "GetField", grpc.StatusCode.PERMISSION_DENIED))
    log = logging.getLogger("test.deployment")
    with caplog.at_level(logging.WARNING, logger="test.deployment"):
        await check_deployment("p", _DB, log)
    [record] = caplog.records
    assert "Could not verify" in record.getMessage() and "PermissionDenied" in record.getMessage()
    assert "roles/datastore.indexAdmin" in record.getMessage()
