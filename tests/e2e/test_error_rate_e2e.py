"""End to end (g): one pod under a Firestore and Pub/Sub error rate, with kill -9s (issue 27, cases A and B).

The configuration of the issue's runs (sequence mode, the fast path on, no gap timeout, one message
in flight per key, a 15 s ack deadline, 60 attempts, backoff 100 ms..2 s, dead letters block,
flow control 300 undelivered / 200 outstanding); keys x messages published shuffled, a tenth of
them twice. While the app acks everything, 20% of every Firestore RPC and 10% of every Pub/Sub RPC
fail UNAVAILABLE (in the second run half of the Firestore failures are writes that applied but
whose reply was lost), and the sidecar is killed with SIGKILL four times: twice right after a
checkpoint confirmed acks (others' confirmations and Pub/Sub acks still on their way), each time
followed by a kill during the recovery that follows. It restarts under the same pod name each time,
as a container killed in its pod does.

Checked from what the app saw and what the dead-letter subscription holds:
- nothing reaches the dead-letter topic: every message is valid, and a copy of an acked message
  (a Pub/Sub redelivery after a kill, a duplicate publish) is a duplicate, never `late` (case A);
- every ack the app sends is confirmed within ``CONFIRM_BOUND_SECONDS`` while its stream lives
  (case B); an ack whose stream ended (the kill) before that is excused: G3 lets it come again;
- G1-G3 as the app sees them (every key's 1..N delivered in order, none delivered again once an ack
  of it was confirmed, and no confirmed delivery followed by another of its position), and the pod
  never crashes on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import pytest
from conftest import Scenario
from e2e_checks import check_acks_confirmed_within, check_confirmed_deliveries_are_final, check_sequence_guarantees
from e2e_config import order_message
from e2e_fleet import async_wait_drained
from e2e_google import dump_firestore
from e2e_processes import LOG_DIR, SidecarProcess
from e2e_waits import async_wait_until

from pubsub_sidecar_client import get_status

pytestmark = [
    pytest.mark.e2e,
    # Opt in: about 100 s for its two cases. Of 66 cases run in a loop after the last fixes, one
    # ended with a message delivered just past the 60 s wait after the last publish (nothing lost,
    # order kept); an earlier run held a key (its next message redelivered by Pub/Sub again and
    # again, in neither the engine nor Firestore). Kept runnable so that either can be found:
    # E2E_ERROR_RATE=1, with E2E_LOG_DIR for the evidence (Pub/Sub history, ingest stages).
    pytest.mark.skipif(
        os.environ.get("E2E_ERROR_RATE") != "1",
        reason="run (g): about 100 s; E2E_ERROR_RATE=1 runs it",
    ),
]

KEYS = 20
PER_KEY = 20
FIRESTORE_ERROR_RATE = 0.2
PUBSUB_ERROR_RATE = 0.1
CONFIRM_BOUND_SECONDS = 10.0
"""An app's ack to its confirmation, while its stream lives, under these error rates. A fast-path
ack waits for its shard's next checkpoint (at most a second apart, up to 1.75 s in the first one)
and that Commit; a stored message's ack for one Commit. A failed Commit is retried after 0.1, 0.2,
0.4 ... s, and at 20% per RPC four failures in a row are rare (about 1 in 600 for a plain Commit,
1 in 40 for a fenced one of two RPCs): a few seconds. 10 s leaves room for two loaded cores."""

DELIVERY = {
    "max_in_flight_per_key": 1,
    "ack_deadline": "15s",
    "max_delivery_attempts": 60,
    "backoff": {"initial": "100ms", "maximum": "2s"},
    "on_dead_letter": "block",
}
FLOW_CONTROL = {"max_undelivered_messages": 300, "max_outstanding_messages": 200}
SHARDING = {"lease_duration": "10s"}
"""The product's default lease."""


def _traffic(seed: int) -> list[tuple[bytes, dict[str, str]]]:
    """Every key's 1..PER_KEY, shuffled, a tenth of them published twice."""
    rng = random.Random(seed)
    messages = [order_message(f"e{k}", s) for k in range(KEYS) for s in range(1, PER_KEY + 1)]
    messages += rng.sample(messages, len(messages) // 10)
    rng.shuffle(messages)
    return messages


def _deliverable(messages: list[tuple[bytes, dict[str, str]]]) -> int:
    """How many of ``messages`` can be delivered without the rest: each key's run from 1 with no gap."""
    have: dict[str, set[int]] = {}
    for _data, attributes in messages:
        have.setdefault(attributes["order_id"], set()).add(int(attributes["seq"]))
    total = 0
    for sequences in have.values():
        run = 0
        while run + 1 in sequences:
            run += 1
        total += run
    return total


def _recovering(sidecar: SidecarProcess) -> bool:
    """The restarted process has read some shard's cursors and is reading its pending messages."""
    return any("recovered" in line and "reading its pending messages" in line for line in sidecar.output_lines())


@pytest.mark.parametrize("lost_replies", [False, True], ids=["unavailable", "lost-replies"])
async def test_one_pod_under_an_error_rate_and_kill9s_dead_letters_nothing_and_confirms_acks_in_time(
    scenario: Scenario, lost_replies: bool
) -> None:
    sub = scenario.add_subscription("orders", delivery=DELIVERY, flow_control=FLOW_CONTROL, sharding=SHARDING)
    assert sub.dead_letter_subscription is not None
    # One pod: its sidecar restarts under the same pod name, as a container killed in its pod does,
    # and takes its shards back at once, each at a new epoch.
    sidecar = scenario.pod_sidecar(0)
    sidecar.start(wait_ready=False)
    await sidecar.async_wait_ready()
    app = scenario.pod_app(sub, 0)
    emulators = scenario.emulators
    if lost_replies:
        # Half the Firestore failures are writes that applied and whose answer was lost.
        emulators.add_fault(service="firestore", method="*", code="UNAVAILABLE", rate=FIRESTORE_ERROR_RATE / 2)
        for method in ("Commit", "BatchWrite"):
            emulators.add_fault(
                service="firestore", method=method, code="UNAVAILABLE", rate=FIRESTORE_ERROR_RATE / 2, lose_reply=True
            )
    else:
        emulators.add_fault(service="firestore", method="*", code="UNAVAILABLE", rate=FIRESTORE_ERROR_RATE)
    emulators.add_fault(service="pubsub", method="*", code="UNAVAILABLE", rate=PUBSUB_ERROR_RATE)

    traffic = _traffic(27 + lost_replies)
    published: dict[tuple[str, int], list[str]] = {}

    async def publish(messages: list[tuple[bytes, dict[str, str]]]) -> None:
        ids = await scenario.pubsub.publish_all(sub.topic, messages)
        for (_data, attributes), message_id in zip(messages, ids, strict=True):
            published.setdefault((attributes["order_id"], int(attributes["seq"])), []).append(message_id)

    first, second = traffic[: len(traffic) // 2], traffic[len(traffic) // 2 : len(traffic) * 4 // 5]
    kills = 0

    async def kill9_and_restart(what: str, ready: bool) -> None:
        nonlocal kills
        sidecar.kill9()
        kills += 1
        print(f"kill -9 #{kills} {what}: {len(app.seen)} deliveries, {len(app.acks)} acks so far")
        await asyncio.to_thread(sidecar.start, False)
        if ready:
            await sidecar.async_wait_ready()

    def confirmed() -> int:
        return sum(r.confirmed_at is not None for r in app.acks)

    async def kill9_after_a_confirmation_then_during_recovery(acks_wanted: int) -> None:
        # Right after a checkpoint made acks durable and confirmed some (others' confirmations,
        # and the fast-path messages' Pub/Sub acks, are on their way: Pub/Sub redelivers those).
        await async_wait_until(lambda: len(app.acks) >= acks_wanted, "acks under faults")
        confirmed_before = confirmed()
        await async_wait_until(lambda: confirmed() > confirmed_before, "a confirmation under faults")
        await kill9_and_restart("right after a confirmation", ready=False)
        # Then during the recovery that follows.
        await async_wait_until(lambda: _recovering(sidecar), "the restarted sidecar to recover a shard")
        await kill9_and_restart("during recovery", ready=True)

    # Shuffled, a part of the traffic holds only each key's run from 1: wait for most of that.
    await publish(first)
    await kill9_after_a_confirmation_then_during_recovery(_deliverable(first) * 2 // 3)
    await publish(second)
    more = (_deliverable(first + second) - _deliverable(first)) // 2
    await kill9_after_a_confirmation_then_during_recovery(len(app.acks) + more)
    await publish(traffic[len(first) + len(second) :])

    expected = {f"e{k}": PER_KEY for k in range(KEYS)}
    every = {(key, seq) for key in expected for seq in range(1, PER_KEY + 1)}

    def undelivered() -> list[tuple[str, int]]:
        return sorted(every - {(s.key, s.sequence) for s in app.seen})

    try:
        await async_wait_until(lambda: not undelivered(), "every message under faults", 60)
    except AssertionError as exc:
        missing_now = undelivered()
        if LOG_DIR:
            await asyncio.to_thread(dump_firestore, emulators.env, Path(LOG_DIR) / f"firestore-{os.getpid()}.jsonl")
            unacked = {m["message_id"]: m for m in emulators.unacked(sub.subscription)}
            missing = {f"{key}#{seq}": [unacked.get(i, i) for i in published[key, seq]] for key, seq in missing_now}
            (Path(LOG_DIR) / f"pubsub-{os.getpid()}.json").write_text(json.dumps(missing, indent=1))
            status = await get_status(sidecar.grpc, "orders", max_keys=100)
            (Path(LOG_DIR) / f"status-{os.getpid()}.txt").write_text(str(status))
            metrics = (await asyncio.to_thread(sidecar.http_get, "/metrics"))[1]
            (Path(LOG_DIR) / f"metrics-{os.getpid()}.txt").write_text(metrics)
        raise AssertionError(f"{exc}: never delivered {missing_now[:20]} (now: {undelivered()[:20]})") from None
    # Every ack has its answer, or has waited past the bound (the check then says which).
    await async_wait_until(
        lambda: all(
            r.confirmed_at is not None
            or r.ended_at is not None
            or time.monotonic() - r.acked_at > CONFIRM_BOUND_SECONDS
            for r in app.acks
        ),
        "every ack confirmed, ended with its stream, or past the bound",
        CONFIRM_BOUND_SECONDS + 30,
    )
    delays = check_acks_confirmed_within([app], CONFIRM_BOUND_SECONDS)
    print(
        f"{len(app.acks)} acks under faults: {len(delays)} confirmed, median {statistics.median(delays):.2f}s, "
        f"max {max(delays):.2f}s after the ack; {sum(r.ended_at is not None for r in app.acks)} ended with "
        f"their stream; {len(app.seen)} deliveries for {len(every)} messages"
    )

    emulators.clear_faults()
    await async_wait_drained(emulators, [sidecar], sub.name, sub.subscription)
    dead_letters = await asyncio.to_thread(scenario.pubsub.pull_available, sub.dead_letter_subscription)
    assert not dead_letters, f"{len(dead_letters)} dead-lettered: " + ", ".join(
        f"{p.data.decode()} ({p.attributes.get('sidecar_reason')})" for p in dead_letters
    )
    check_confirmed_deliveries_are_final([app])
    check_sequence_guarantees(app, expected)
    assert sidecar.returncode is None, f"the sidecar exited with {sidecar.returncode} under faults"
