"""/readyz's checks name the cause of a failure (issue 31): never an exception's empty text."""

from __future__ import annotations

import asyncio

from sidecar.ops.observability import NotReady, Readiness


async def _hangs() -> None:
    await asyncio.Event().wait()


async def _times_out_inside() -> None:
    raise TimeoutError


async def _refused() -> None:
    raise ConnectionError("connection refused")


async def _empty_with_a_cause() -> None:
    try:
        raise OSError("DNS lookup of firestore.googleapis.com failed")
    except OSError as exc:
        raise RuntimeError() from exc


async def _explains_itself() -> None:
    raise NotReady("StreamingPull failed for 10 s: RESOURCE_EXHAUSTED")


async def test_a_check_that_does_not_answer_in_time_says_so_naming_the_dependency() -> None:
    readiness = Readiness({"firestore": _hangs, "pubsub:orders": _times_out_inside}, timeout_seconds=0.05)
    readiness.mark_recovered()
    ready, checks = await readiness.evaluate()
    assert not ready
    assert checks["firestore"] == "no answer from Firestore within 0.05 s (TimeoutError)"
    assert checks["pubsub:orders"] == "no answer from Pub/Sub within 0.05 s (TimeoutError)"


async def test_other_failures_keep_their_text_or_their_causes() -> None:
    readiness = Readiness(
        {"firestore": _refused, "pubsub:orders": _empty_with_a_cause, "streaming_pull:orders": _explains_itself}
    )
    readiness.mark_recovered()
    _, checks = await readiness.evaluate()
    assert checks["firestore"] == "Firestore check failed: ConnectionError: connection refused"
    assert checks["pubsub:orders"] == (
        "Pub/Sub check failed: RuntimeError: OSError: DNS lookup of firestore.googleapis.com failed"
    )
    assert checks["streaming_pull:orders"] == "StreamingPull failed for 10 s: RESOURCE_EXHAUSTED"
    assert all(text.strip() and not text.endswith(": ") for text in checks.values())
