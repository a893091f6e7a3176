"""A document of a newer layout is refused, never misread: every decoder an older sidecar runs says,
in one line, which document it is, its version and this sidecar's, and to upgrade.

This is what makes a rollback across layout versions fail safe (docs/upgrades.md): the older release
stops at the first document a newer one wrote instead of folding it into a cursor it does not
understand. Each decoder is called as the store calls it, with the layout's current fields and
``v`` one above what this release writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sidecar.cluster.leases.layout import LEASE_LAYOUT_VERSION, lease_fields, read_lease
from sidecar.store import documents, layout, recovery
from sidecar.store.cursors import CursorRules
from sidecar.store.layout import LAYOUT_VERSION, CorruptDocument

NEWER = LAYOUT_VERSION + 1
_RULES = CursorRules("sequence", shards=4)


def _subscription() -> None:
    fields = {"name": "orders", "mode": "sequence", "created_ms": 1, "v": NEWER}
    recovery.check_subscription("orders", "sequence", "root/orders", fields)


def _checkpoint() -> None:
    recovery.checkpoint_of("root/orders/checkpoints/0001", {"shard": 1, "clean_ms": 5, "v": NEWER})


def _cursor() -> None:
    cursor = {"key": "a", "next_seq": 3, "shard": 1, "v": NEWER}
    recovery.recover(_RULES, [("k1", cursor)], [], [], 0)


def _pending_message() -> None:
    fields = {"key": "a", "seq": 1, "state": "pending", "dedup_id": "a/1", "shard": 1, "v": NEWER}
    layout.message_from_fields("m1", fields)


def _tombstone() -> None:
    fields = {"key": "a", "seq": 1, "state": "acked", "done_ms": 9, "cursor_seq": 2, "shard": 1, "v": NEWER}
    recovery.recover(_RULES, [], [("m1", fields)], [], 0)


@pytest.mark.parametrize(
    ("decode", "document"),
    [
        (_subscription, "subscription document root/orders"),
        (_checkpoint, "checkpoint document root/orders/checkpoints/0001"),
        (_cursor, "cursor document keys/k1"),
        (_pending_message, "message document m1"),
        (_tombstone, "message document m1"),
    ],
    ids=["subscription", "checkpoint", "cursor", "pending-message", "tombstone"],
)
def test_a_document_of_a_newer_layout_is_refused_in_one_line(decode: Callable[[], Any], document: str) -> None:
    with pytest.raises(CorruptDocument) as refused:
        decode()
    line = str(refused.value)
    assert line.startswith(f"{document}: layout version {NEWER} is newer than this sidecar's {LAYOUT_VERSION}")
    assert line.endswith("upgrade this sidecar") and "\n" not in line


def test_this_layout_is_read() -> None:
    # The same documents at this release's own version decode (the refusal is about the version only).
    fields = {"key": "a", "seq": 1, "state": "pending", "dedup_id": "a/1", "stored_ms": 1, "shard": 1}
    assert layout.message_from_fields("m1", {**fields, "v": LAYOUT_VERSION}).sequence == 1
    with pytest.raises(CorruptDocument, match="layout version"):
        layout.message_from_fields("m1", {**fields, "v": NEWER})
    assert recovery.checkpoint_of("c", {"shard": 1, "clean_ms": 5, "v": LAYOUT_VERSION}) == 5


def test_a_lease_document_of_a_newer_layout_stops_its_shard_in_one_line() -> None:
    fields = {**lease_fields(4, "pod-b", 7, 1, 10_000, ""), "v": LEASE_LAYOUT_VERSION + 1}
    view = read_lease("root/orders/leases/0001", 1, 4, 2_000_000, documents.Versioned(fields, 1_000_000))
    assert view.problem == (
        f"lease document root/orders/leases/0001: layout version {LEASE_LAYOUT_VERSION + 1} was written by a "
        f"newer sidecar (this one reads version {LEASE_LAYOUT_VERSION}); upgrade this pod"
    )
    current = read_lease("p", 1, 4, 2_000_000, documents.Versioned(lease_fields(4, "pod-b", 7, 1, 10_000, ""), 1))
    assert not current.problem and current.owner == "pod-b"
