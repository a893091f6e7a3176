"""The two intakes, the official subscriber's (``intake: client``) and the sidecar's own StreamingPull
(``intake: stream``), under one fault script against the Pub/Sub emulator: what each stores, acks,
nacks and modacks must be the same story.

The script: 30 messages over 3 keys; the first 3 persists fail (ingest nacks those messages, Pub/Sub
redelivers them); the streams are broken twice with UNAVAILABLE while messages arrive; the first two
Acknowledge calls fail with UNAVAILABLE (both intakes retry those). Counted at the
emulator (``/pubsub/counters``, ``/pubsub/unacked``) and by ingest's counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from ingest_harness import IngestHarness, assert_subscription_empty
from pubsub_admin import wait_until

pytestmark = pytest.mark.timeout(240)

MakeHarness = Callable[..., IngestHarness]
KEYS = ("A", "B", "C")
PER_KEY = 10
FAILED_PERSISTS = 3


async def _run_script(make_harness: MakeHarness, intake: str) -> dict[str, Any]:
    h = make_harness(intake=intake, name=f"orders-{intake}", max_outstanding_messages=50)
    await h.setup()
    await h.admin.reset_counters()
    await h.start_ingest()
    h.store.fail_next("persist", FAILED_PERSISTS)
    await h.admin.add_fault(method="Acknowledge", code="UNAVAILABLE", remaining=2)
    total = len(KEYS) * PER_KEY
    published = 0
    for seq in range(1, PER_KEY + 1):
        for key in KEYS:
            await h.publish_order(key, seq)
            published += 1
            if published in (total // 3, 2 * total // 3):
                await h.admin.break_streams("UNAVAILABLE")
    await wait_until(
        lambda: h.counters.persisted == total and h.counters.acked == total + h.counters.duplicates,
        f"{intake}: all {total} stored and acked",
        within_seconds=60,
    )
    stored = sorted((m.key, m.sequence) for m in await h.stored_pending())
    counters = h.counters
    summary = {
        "stored": stored,
        "persist_failures": counters.persist_failures,
        "nacked": counters.nacked,
        "redelivered": counters.received - total,
        "duplicates": counters.duplicates,
    }
    await assert_subscription_empty(h)
    at_pubsub = await h.admin.counters()
    summary["pubsub_nacked_ids"] = at_pubsub["nack_ack_ids"]
    summary["every_receipt_modacked"] = at_pubsub["modify_ack_deadline_ack_ids"] >= counters.received
    summary["every_message_acked"] = at_pubsub["acknowledge_ack_ids"] >= total
    await h.admin.clear_faults()
    return summary


async def test_both_intakes_store_ack_nack_and_modack_the_same_under_one_fault_script(
    make_harness: MakeHarness,
) -> None:
    results = {}
    for intake in ("client", "stream"):
        results[intake] = await _run_script(make_harness, intake)
        await asyncio.sleep(0)
    client, stream = results["client"], results["stream"]
    expected_stored = sorted((key, seq) for key in KEYS for seq in range(1, PER_KEY + 1))
    for intake, summary in results.items():
        assert summary["stored"] == expected_stored, intake
        # What ingest could not store is nacked (a failed persist nacks its whole batch, so one or
        # more messages each: ``persist_failures`` counts messages), once each, and Pub/Sub
        # redelivered exactly those: a broken stream or a failed Acknowledge call costs no redelivery.
        assert FAILED_PERSISTS <= summary["persist_failures"] == summary["nacked"], (intake, summary)
        assert summary["nacked"] == summary["pubsub_nacked_ids"], (intake, summary)
        assert summary["redelivered"] == summary["nacked"] and summary["duplicates"] == 0, (intake, summary)
        assert summary["every_receipt_modacked"], (intake, summary)
        assert summary["every_message_acked"], (intake, summary)
    # The same story; only how many messages a failed persist held depends on the timing.
    for summary in (client, stream):
        for timing_dependent in ("persist_failures", "nacked", "pubsub_nacked_ids", "redelivered"):
            del summary[timing_dependent]
    assert client == stream
