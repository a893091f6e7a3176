"""Ingest reports what its StreamingPull attempts say (``Ingestor.pull_health``), against the Pub/Sub
emulator with the unmodified client: a pull closed for good (a missing subscription) is reported at
once and opened again until it works; retryable failures (quota) are reported once they last.

Before, a missing subscription ended ``run()`` (the sidecar exited 1 and, restarted, crash-looped
without /readyz, GetStatus or a metric saying why), and retryable failures were retried by the
client without end at DEBUG while every probe stayed green.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ingest_harness import IngestHarness
from pubsub_admin import wait_until

from sidecar.pipeline.pull_health import FAILING_AFTER_SECONDS

pytestmark = pytest.mark.timeout(120)

MakeHarness = Callable[..., IngestHarness]


def _problem(h: IngestHarness) -> str:
    assert h.ingestor is not None
    return h.ingestor.pull_health.problem() or ""


async def test_a_missing_subscription_is_reported_at_once_and_pulled_again_once_it_exists(
    make_harness: MakeHarness,
) -> None:
    h = make_harness()
    await h.setup(create_subscription=False)
    await h.start_ingest()
    assert h.run_task is not None and h.ingestor is not None

    await wait_until(lambda: "closed by NOT_FOUND" in _problem(h), "the close reported")
    assert "Subscription does not exist" in _problem(h)
    assert h.ingestor.pull_health.errors["NOT_FOUND"] >= 1
    assert not h.run_task.done()

    # The subscription is created (as an operator would, after seeing the 503): pulled again, and
    # what is published from then on is stored and acked.
    await h.admin.create_subscription(h.name, h.topic)
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.persisted == 1 and h.counters.acked == 1, "the message stored and acked")
    await wait_until(lambda: not _problem(h), "the report cleared")
    assert not h.run_task.done()


async def test_retryable_stream_failures_are_reported_once_they_last_and_cleared_when_a_stream_works(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness().start()
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.acked == 1, "the first message acked")
    assert _problem(h) == ""

    # Quota: the client retries RESOURCE_EXHAUSTED silently, for ever.
    await h.admin.add_fault(method="StreamingPull", code="RESOURCE_EXHAUSTED")
    await h.admin.break_streams("UNAVAILABLE")
    assert h.ingestor is not None
    health = h.ingestor.pull_health
    await wait_until(lambda: health.errors["RESOURCE_EXHAUSTED"] >= 1, "a refused attempt")
    assert _problem(h) == "", "reported before it lasted"
    await wait_until(
        lambda: "every streaming pull failed" in _problem(h),
        "the failures reported",
        within_seconds=FAILING_AFTER_SECONDS + 30,
    )
    # The report names the last attempt's failure: the server's status, or, when grpc's aio client
    # failed the call's first write before reading that status, the INTERNAL it sets itself.
    problem = _problem(h)
    assert ("RESOURCE_EXHAUSTED" in problem and "injected fault" in problem) or "Internal error from Core" in problem
    assert health.errors["RESOURCE_EXHAUSTED"] >= 1
    assert h.run_task is not None and not h.run_task.done()

    await h.admin.clear_faults()
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.acked == 2, "the next message acked once the quota is back")
    await wait_until(lambda: not _problem(h), "the report cleared")


async def test_a_permission_denied_stream_is_reported_at_once_and_pulled_again_once_granted(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness().start()
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.acked == 1, "the first message acked")

    # The role is revoked: open streams end with PERMISSION_DENIED and new ones are refused.
    await h.admin.add_fault(method="StreamingPull", code="PERMISSION_DENIED")
    await h.admin.break_streams("PERMISSION_DENIED")
    await wait_until(lambda: "closed by PERMISSION_DENIED" in _problem(h), "the close reported")
    assert h.run_task is not None and not h.run_task.done()

    await h.admin.clear_faults()  # granted back
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.acked == 2, "the next message acked once the role is back")
    await wait_until(lambda: not _problem(h), "the report cleared")
