"""The in-process Firestore emulator the conformance suite runs against (see conftest.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.firestore import FirestoreEmulator


class FakeMonotonic:
    """time.monotonic plus an offset that tests move forward (transaction expiry)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


INDEX_CONFIG: dict[str, Any] = {
    "indexes": [
        {
            "collectionGroup": "people",
            "queryScope": "COLLECTION",
            "fields": [{"fieldPath": "city", "order": "ASCENDING"}, {"fieldPath": "nick", "order": "DESCENDING"}],
        }
    ],
    "fieldOverrides": [
        {"collectionGroup": "people", "fieldPath": "nick", "indexes": []},
        {
            "collectionGroup": "people",
            "fieldPath": "tags",
            "indexes": [{"arrayConfig": "CONTAINS", "queryScope": "COLLECTION"}],
        },
        {
            "collectionGroup": "people",
            "fieldPath": "age",
            "indexes": [
                {"order": "ASCENDING", "queryScope": "COLLECTION"},
                {"order": "ASCENDING", "queryScope": "COLLECTION_GROUP"},
            ],
        },
        {"collectionGroup": "sessions", "fieldPath": "expire_at", "ttl": True, "indexes": []},
        {"collectionGroup": "events", "fieldPath": "ts", "indexes": []},
    ],
}
"""The ``indexed`` emulator's firestore.indexes.json: in ``people``, ``nick`` is exempted (but the
composite (city, nick desc) covers it), ``tags`` keeps only array-contains, ``age`` only ascending
(in both scopes), ``city`` and the rest keep the defaults; ``sessions.expire_at`` is a TTL field;
``events.ts`` is exempted (no hotspot counted)."""


@dataclass
class Endpoint:
    host: str
    emulator: FirestoreEmulator | None = None
    injector: FaultInjector | None = None
    clock: FakeMonotonic | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def local(self) -> FirestoreEmulator:
        """The in-process emulator, or skip (an external endpoint has no counters or faults)."""
        if self.emulator is None:
            pytest.skip("emulator-only test: FIRESTORE_EMULATOR_HOST points at an external endpoint")
        return self.emulator


def gapic(client: Any) -> Any:
    """The official client's generated layer (``FirestoreClient`` or its async twin), for requests
    the high-level API never builds (malformed ones included): same channel, metadata and retries."""
    return client._firestore_api
