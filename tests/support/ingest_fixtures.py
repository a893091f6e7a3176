"""Fixtures for the ingest and dead-letter tests: the Pub/Sub emulator, fresh topics, a harness.

The emulator stack runs in a thread for the whole session (started on first use). Each test gets
its own topic, subscription and dead-letter topic (uuid names), and PUBSUB_EMULATOR_HOST only for
its own duration (monkeypatch), so that the clients the code under test makes reach our emulator.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from pubsub_admin import PubSubAdmin

from sidecar.emulators.stack import EmulatorStack

if TYPE_CHECKING:
    from ingest_harness import IngestHarness


@pytest.fixture(scope="session")
def emulators() -> Iterator[EmulatorStack]:
    stack = EmulatorStack()
    stack.start_in_thread()
    try:
        yield stack
    finally:
        stack.stop_thread()


@pytest.fixture
def pubsub_env(emulators: EmulatorStack, monkeypatch: pytest.MonkeyPatch) -> EmulatorStack:
    for name, value in emulators.env.items():
        monkeypatch.setenv(name, value)
    return emulators


@pytest.fixture
async def admin(pubsub_env: EmulatorStack) -> AsyncIterator[PubSubAdmin]:
    admin = PubSubAdmin(pubsub_env, prefix=f"t{uuid.uuid4().hex[:10]}")
    try:
        yield admin
    finally:
        await admin.close()


@pytest.fixture
async def make_harness(admin: PubSubAdmin) -> AsyncIterator[Callable[..., IngestHarness]]:
    # Imported here so that the dead-letter tests need none of the ingest pipeline's modules.
    from ingest_harness import IngestHarness

    harnesses: list[IngestHarness] = []

    def make(**kwargs: object) -> IngestHarness:
        harness = IngestHarness(admin, **kwargs)  # type: ignore[arg-type]
        harnesses.append(harness)
        return harness

    yield make
    for harness in harnesses:
        await harness.close()
