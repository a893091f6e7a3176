"""Fixtures for the Firestore emulator conformance suite.

The suite drives the official google-cloud-firestore client (sync and async). By default it
starts our emulator on port 0, on its own event loop in a background thread, behind the fault
interceptor. If FIRESTORE_EMULATOR_HOST is set before the tests start, the suite runs against
that endpoint instead and skips the emulator-only tests (counters, faults, expiry clock).
Every test uses its own project id, so tests never see each other's data and need no reset.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from firestore_harness import INDEX_CONFIG, Endpoint, FakeMonotonic

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.firestore import FirestoreEmulator
from sidecar.emulators.firestore.indexes import parse_index_config
from sidecar.emulators.firestore.threaded import ServerThread

_EXTERNAL = os.environ.get("FIRESTORE_EMULATOR_HOST")


@pytest.fixture(scope="session")
def endpoint() -> Iterator[Endpoint]:
    if _EXTERNAL:
        yield Endpoint(host=_EXTERNAL)
        return
    injector = FaultInjector(seed=7)
    clock = FakeMonotonic()
    emulator = FirestoreEmulator(injector, monotonic=clock, lock_timeout_seconds=20.0)
    thread = ServerThread(emulator, injector)
    thread.start()
    assert thread.ready.wait(30), "emulator did not start"
    if thread.error is not None:
        raise thread.error
    host = f"127.0.0.1:{thread.port}"
    previous = os.environ.get("FIRESTORE_EMULATOR_HOST")
    os.environ["FIRESTORE_EMULATOR_HOST"] = host
    try:
        yield Endpoint(host=host, emulator=emulator, injector=injector, clock=clock, loop=thread.loop)
    finally:
        if previous is None:
            os.environ.pop("FIRESTORE_EMULATOR_HOST", None)
        else:
            os.environ["FIRESTORE_EMULATOR_HOST"] = previous
        injector.clear()
        thread.stop()


@pytest.fixture
def project() -> str:
    return f"conf-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client(endpoint: Endpoint, project: str) -> Iterator[object]:
    from google.cloud import firestore

    c = firestore.Client(project=project)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def aclient(endpoint: Endpoint, project: str):  # type: ignore[no-untyped-def]
    from google.cloud import firestore

    c = firestore.AsyncClient(project=project)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def faults(endpoint: Endpoint) -> Iterator[FaultInjector]:
    endpoint.local()
    assert endpoint.injector is not None
    try:
        yield endpoint.injector
    finally:
        endpoint.injector.clear()


@pytest.fixture(scope="session")
def indexed() -> Iterator[Endpoint]:
    """A second emulator, loaded with ``INDEX_CONFIG`` and sweeping TTL after every commit.

    Index configs are per emulator, so these tests get their own; they point the clients at it with
    ``indexed_client``. Never external: an external endpoint has its own configuration.
    """
    if _EXTERNAL:
        pytest.skip("emulator-only test: the index configuration is the in-process emulator's")
    injector = FaultInjector(seed=7)
    emulator = FirestoreEmulator(injector, indexes=parse_index_config(INDEX_CONFIG), ttl_sweep_seconds=0)
    thread = ServerThread(emulator, injector)
    thread.start()
    assert thread.ready.wait(30), "emulator did not start"
    if thread.error is not None:
        raise thread.error
    try:
        yield Endpoint(host=f"127.0.0.1:{thread.port}", emulator=emulator, injector=injector, loop=thread.loop)
    finally:
        thread.stop()


@pytest.fixture
def indexed_client(indexed: Endpoint, project: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from google.cloud import firestore

    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", indexed.host)
    c = firestore.Client(project=project)
    try:
        yield c
    finally:
        c.close()
