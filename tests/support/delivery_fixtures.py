"""Fixtures for the delivery-layer component tests (the harness itself is in ``delivery_harness``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from delivery_harness import Harness, sequence_config

from sidecar.engine.types import EngineConfig


@pytest.fixture
async def make_harness() -> AsyncIterator[Callable[..., Harness]]:
    harnesses: list[Harness] = []

    def make(
        configs: dict[str, EngineConfig] | None = None, listen: str = "127.0.0.1:0", max_held_bytes: int | None = None
    ) -> Harness:
        harness = Harness(configs or {"orders": sequence_config()}, listen, max_held_bytes)
        harnesses.append(harness)
        return harness

    yield make
    for harness in harnesses:
        await harness.stop()


@pytest.fixture
async def harness(make_harness: Callable[..., Harness]) -> Harness:
    return await make_harness().start()
