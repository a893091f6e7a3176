"""Recording ``on_snapshot`` callbacks of the official sync client, and waiting on them without sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

WAIT_SECONDS = 30.0
"""Generous: the machine is shared; every wait ends as soon as its condition holds."""


@dataclass(frozen=True)
class Snapshot:
    docs: dict[str, dict[str, Any]]
    """Document id -> data, the whole result set of the snapshot."""
    changes: list[tuple[str, str]]
    """(ADDED | MODIFIED | REMOVED, document id) in the client's order."""
    read_time: Any


class Recorder:
    """The callback to pass to ``on_snapshot``; keeps every snapshot it was called with."""

    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self._changed = threading.Condition()

    def __call__(self, docs: list[Any], changes: list[Any], read_time: Any) -> None:
        snapshot = Snapshot(
            {doc.id: doc.to_dict() or {} for doc in docs},
            [(change.type.name, change.document.id) for change in changes],
            read_time,
        )
        with self._changed:
            self.snapshots.append(snapshot)
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[list[Snapshot]], bool], what: str) -> Snapshot:
        """Block until ``predicate(snapshots)`` holds; the latest snapshot then."""
        deadline = time.monotonic() + WAIT_SECONDS
        with self._changed:
            while not predicate(self.snapshots):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pytest.fail(f"timed out waiting for {what}; snapshots: {self.snapshots}")
                self._changed.wait(remaining)
            return self.snapshots[-1]

    def wait_count(self, count: int) -> Snapshot:
        return self.wait_for(lambda s: len(s) >= count, f"{count} snapshot(s)")

    def wait_docs(self, ids: set[str]) -> Snapshot:
        return self.wait_for(lambda s: bool(s) and set(s[-1].docs) == ids, f"a snapshot holding exactly {sorted(ids)}")


def poll(condition: Callable[[], bool], what: str) -> None:
    """Wait for a condition that no callback signals (a server-side count); fails after the deadline."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


class Watches:
    """Unsubscribes every watch a test started, so none outlives it (and bills reads later)."""

    def __init__(self) -> None:
        self._watches: list[Any] = []

    def start(self, ref: Any) -> tuple[Any, Recorder]:
        recorder = Recorder()
        watch = ref.on_snapshot(recorder)
        self._watches.append(watch)
        return watch, recorder

    def close(self) -> None:
        for watch in self._watches:
            watch.unsubscribe()


def watches_fixture() -> Iterator[Watches]:
    watches = Watches()
    try:
        yield watches
    finally:
        watches.close()
