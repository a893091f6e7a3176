"""Fixtures for the watermark-mode end-to-end tests: one emulators process per session, one scenario
per test. The helpers (scenario, app recorder, GetStatus sampler) live in ``wm_support``; every
process, app and sampler a test starts is stopped by the ``scenario`` fixture, also on failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from wm_support import METRIC_DELAY_S, METRIC_PERIOD_S, EmulatorsProcess, PubSub, Scenario


@pytest.fixture(scope="session")
def emulators() -> Iterator[EmulatorsProcess]:
    process = EmulatorsProcess(metric_period=METRIC_PERIOD_S, metric_delay=METRIC_DELAY_S)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def pubsub(emulators: EmulatorsProcess) -> Iterator[PubSub]:
    client = PubSub(emulators.env)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
async def scenario(emulators: EmulatorsProcess, pubsub: PubSub) -> AsyncIterator[Scenario]:
    world = Scenario(emulators, pubsub)
    try:
        yield world
    finally:
        emulators.clear_faults()
        emulators.admin("DELETE", "/pubsub/delay")
        await world.close()
