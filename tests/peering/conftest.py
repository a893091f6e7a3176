"""Fixtures of the peering tests: ``ingest_fixtures`` (tests/support) and two pods joined by the peer channel."""

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from ingest_fixtures import admin, emulators, pubsub_env  # noqa: F401  (fixtures: pytest finds them here)
from peer_harness import TwoPods
from pubsub_admin import PubSubAdmin


@pytest.fixture
async def make_pods(admin: PubSubAdmin) -> AsyncIterator[Callable[..., TwoPods]]:  # noqa: F811
    made: list[TwoPods] = []

    def make(**kwargs: Any) -> TwoPods:
        pods = TwoPods(admin, **kwargs)
        made.append(pods)
        return pods

    yield make
    for pods in made:
        await pods.close()
