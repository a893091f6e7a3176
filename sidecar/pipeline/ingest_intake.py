"""The intake: what ``Ingestor`` pulls a subscription with, and the choice between the two.

- ``stream`` (``sidecar.pipeline.ingest_stream.StreamIntake``, the default): the sidecar's own
  StreamingPull on the event loop, raw protobuf, no threads.
- ``client`` (``sidecar.pipeline.ingest_pull.StreamingPull``): the official subscriber's streaming
  pull manager, its threads handing over through ``LoopScheduler``; taken whenever a
  ``SubscriberClient`` is passed in, and needed for exactly-once subscriptions (docs/ingest.md,
  "The intake").

``Intake`` is what ingest uses of either; ``tests/pipeline/test_intake_conformance.py`` runs one
fault script against both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from google.api_core import exceptions as api_exceptions

from sidecar.config.model import SubscriptionConfig
from sidecar.pipeline.ingest_pull import StreamingPull, SubscriberClient
from sidecar.pipeline.ingest_stream import StreamIntake
from sidecar.pipeline.pull_health import PullHealth


class Intake(Protocol):
    """One subscription's streaming pull, as ingest drives it."""

    done: asyncio.Future[Any] | None
    """The current pull: fails with the Pub/Sub error that closed it for good, ends cancelled after
    ``cancel()`` or ``shut_down()``."""

    @property
    def flow_control(self) -> Any: ...
    @property
    def is_opened(self) -> bool: ...
    @property
    def handoff_runs(self) -> int: ...
    @property
    def handoff_buffered(self) -> int: ...
    @property
    def can_give_back(self) -> bool: ...
    def make_client(self) -> None: ...
    def subscribe(self, loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None]) -> None: ...
    def report_closed(self, error: api_exceptions.GoogleAPICallError) -> float: ...
    def cancel(self) -> None: ...
    async def shut_down(self) -> bool: ...
    async def nack_ids(self, ack_ids: list[str]) -> None: ...
    async def close_client(self) -> list[BaseException]: ...
    async def ping(self, timeout_seconds: float) -> bool: ...


def make_intake(
    sub_config: SubscriptionConfig,
    health: PullHealth,
    *,
    subscriber: SubscriberClient | None,
    max_lease_duration_seconds: float,
) -> Intake:
    """The subscription's intake: ``sub_config.intake``, or the official one around ``subscriber``."""
    if subscriber is None and sub_config.intake == "stream":
        return StreamIntake(
            sub_config.name,
            sub_config.subscription,
            sub_config.flow_control,
            health,
            max_lease_duration_seconds=max_lease_duration_seconds,
        )
    return StreamingPull(
        sub_config.name,
        sub_config.subscription,
        sub_config.flow_control,
        health,
        subscriber=subscriber,
        max_lease_duration_seconds=max_lease_duration_seconds,
    )
