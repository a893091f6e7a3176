"""`pubsub-sidecar status`: rendering (pure, from constructed responses), errors, and one real sidecar."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from incoming_messages import sequence_message

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.commands import main as cli
from sidecar.commands.exit_codes import EXIT_FAILED
from sidecar.commands.status import fetch_and_render, format_age, format_json, format_table, status_to_dict
from sidecar.delivery.server import GrpcServer
from sidecar.engine.types import EngineConfig, Message
from sidecar.pipeline.runtime import SubscriptionRuntime, wall_clock_ms
from sidecar.store.api import PersistOutcome
from sidecar.store.memory import MemoryStore

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)

SUBSCRIPTION_FIELDS = [
    "name", "mode", "buffered", "ready", "in_flight", "keys", "keys_blocked", "oldest_undelivered_age_seconds",
    "watermark", "watermark_lag_seconds", "counts", "keys_detail", "pod", "shard_count", "shards",
    "pull_failure", "current", "capacity", "lease_problem",
]  # fmt: skip
KEY_FIELDS = [
    "key", "state", "waiting_for", "since", "age_seconds", "buffered", "in_flight", "next_sequence",
    "missing_sequence", "last_missing_sequence", "free_with",
]  # fmt: skip


def timestamp(instant: datetime) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromDatetime(instant)
    return value


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def sample_response(*, keys_blocked_orders: int = 2) -> sidecar_pb2.GetStatusResponse:
    """Two subscriptions: `orders` (sequence, two keys on gaps, one in flight) and `prices` (watermark)."""
    orders = sidecar_pb2.SubscriptionStatus(
        name="orders",
        mode="sequence",
        pod="orders-7f9c-1-a1b2c3",
        shard_count=16,
        shards=[sidecar_pb2.ShardStatus(shard=3, epoch=5), sidecar_pb2.ShardStatus(shard=11, epoch=2)],
        buffered=7,
        ready=1,
        in_flight=1,
        keys=4,
        keys_blocked=keys_blocked_orders,
        oldest_undelivered_age=duration(305.5),
        counts={"acked": 40, "stored": 50, "delivered": 42, "dead_lettered:conflict": 1, "dead_lettered": 1},
        keys_detail=[
            sidecar_pb2.KeyStatus(
                key="order-7",
                state="waiting_sequence",
                waiting_for="sequence 3",
                since=timestamp(NOW - timedelta(minutes=5, seconds=2)),
                buffered=4,
                next_sequence=3,
                missing_sequence=3,
                last_missing_sequence=4,
            ),
            sidecar_pb2.KeyStatus(
                key="order-9",
                state="blocked_dead_letter",
                waiting_for="dead-lettered message sequence 5",
                since=timestamp(NOW - timedelta(seconds=42)),
                buffered=1,
                next_sequence=5,
            ),
            sidecar_pb2.KeyStatus(key="order-1", state="in_flight", buffered=1, in_flight=1, next_sequence=8),
        ],
    )
    prices = sidecar_pb2.SubscriptionStatus(
        name="prices",
        mode="watermark",
        buffered=120,
        keys=30,
        keys_blocked=30,
        watermark=timestamp(NOW - timedelta(minutes=3)),
        watermark_lag=duration(180),
    )
    return sidecar_pb2.GetStatusResponse(subscriptions=[orders, prices])


# ---- pure rendering --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (-0.2, "0ms"),
        (0.85, "850ms"),
        (42.9, "42s"),
        (302, "5m02s"),
        (3 * 3600 + 4 * 60 + 59, "3h04m"),
        (2 * 86400 + 3 * 3600, "2d03h"),
    ],
)
def test_ages_are_rounded_down_to_readable_units(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


def test_json_document_has_stable_field_names_and_converted_values() -> None:
    document = status_to_dict(sample_response(), NOW, target="127.0.0.1:50051")
    assert list(document) == ["target", "generated_at", "subscriptions", "relays"]
    assert document["generated_at"] == "2026-05-01T12:00:00.000Z"
    orders, prices = document["subscriptions"]
    assert list(orders) == SUBSCRIPTION_FIELDS
    assert orders["oldest_undelivered_age_seconds"] == 305.5
    assert orders["watermark"] is None and orders["watermark_lag_seconds"] is None
    # Known counters in lifecycle order, others after them alphabetically.
    assert list(orders["counts"]) == ["stored", "delivered", "acked", "dead_lettered", "dead_lettered:conflict"]
    gap, dead, busy = orders["keys_detail"]
    assert [list(key) for key in orders["keys_detail"]] == [KEY_FIELDS] * 3
    assert gap == {
        "key": "order-7",
        "state": "waiting_sequence",
        "waiting_for": "sequence 3",
        "since": "2026-05-01T11:54:58.000Z",
        "age_seconds": 302.0,
        "buffered": 4,
        "in_flight": 0,
        "next_sequence": 3,
        "missing_sequence": 3,
        "last_missing_sequence": 4,
        "free_with": (
            "pubsub-sidecar skip-gap --target 127.0.0.1:50051 --subscription orders --key order-7 --through 4"
        ),
    }
    # proto3 `optional`: unset is null, not 0.
    assert dead["missing_sequence"] is None and dead["last_missing_sequence"] is None
    assert dead["free_with"] == "pubsub-sidecar unblock --target 127.0.0.1:50051 --subscription orders --key order-9"
    assert busy["free_with"] is None
    assert busy["since"] is None and busy["age_seconds"] is None
    assert prices["watermark"] == "2026-05-01T11:57:00.000Z"
    assert prices["watermark_lag_seconds"] == 180.0
    assert prices["oldest_undelivered_age_seconds"] is None
    assert orders["shards"] == [{"shard": 3, "epoch": 5}, {"shard": 11, "epoch": 2}]
    assert (orders["pod"], orders["shard_count"]) == ("orders-7f9c-1-a1b2c3", 16)
    assert prices["shard_count"] == 0 and prices["shards"] == []


def test_table_says_which_shards_this_pod_owns_with_their_epochs() -> None:
    text = format_table(sample_response(), NOW)
    assert "pod orders-7f9c-1-a1b2c3: owns 2 of 16 shards (shard@epoch): 3@5 11@2" in text
    assert "prices:" not in text or "owns" not in text.split("prices:")[1]


def test_json_output_parses_back_to_the_document() -> None:
    response = sample_response()
    assert json.loads(format_json(response, NOW, "t")) == status_to_dict(response, NOW, "t")


def test_table_has_a_row_per_subscription_with_backlog_and_watermark() -> None:
    lines = format_table(sample_response(), NOW).splitlines()
    header = lines[0].split()
    assert header[:3] == ["SUBSCRIPTION", "MODE", "BUFFERED"]
    orders_row = next(line for line in lines if line.startswith("orders "))
    prices_row = next(line for line in lines if line.startswith("prices "))
    assert orders_row.split()[:9] == ["orders", "sequence", "7", "1", "1", "4", "2", "5m05s", "-"]
    assert prices_row.split() == [
        "prices", "watermark", "120", "0", "0", "30", "30", "-", "2026-05-01T11:57:00.000Z", "(lag", "3m00s)",
    ]  # fmt: skip


def test_table_lists_waiting_keys_with_what_they_wait_for_and_since_when() -> None:
    text = format_table(sample_response(), NOW)
    section = text.split("\norders:\n", 1)[1].split("\nprices:\n", 1)[0]
    assert (
        "counts since the process started: stored=50 delivered=42 acked=40 dead_lettered=1 dead_lettered:conflict=1"
        in section
    )
    assert "keys waiting (2 of 2, longest first):" in section
    gap_row = next(line for line in section.splitlines() if "order-7" in line)
    assert "waiting_sequence" in gap_row and "sequence 3" in gap_row
    assert "2026-05-01T11:54:58.000Z" in gap_row and "5m02s" in gap_row
    dead_row = next(line for line in section.splitlines() if "order-9" in line)
    assert "blocked_dead_letter" in dead_row and "42s" in dead_row
    # A key that is merely in flight does not wait: not in the waiting list.
    assert "order-1" not in section


def test_table_names_the_command_that_frees_each_stuck_key_with_the_target_given() -> None:
    text = format_table(sample_response(), NOW, target="10.0.0.7:50051")
    section = text.split("\norders:\n", 1)[1].split("\nprices:\n", 1)[0]
    assert section.splitlines()[-3:] == [
        "  to free a stuck key:",
        "    pubsub-sidecar skip-gap --target 10.0.0.7:50051 --subscription orders --key order-7 --through 4",
        "    pubsub-sidecar unblock --target 10.0.0.7:50051 --subscription orders --key order-9",
    ]


def test_a_key_that_needs_shell_quoting_is_quoted_in_its_command() -> None:
    response = sidecar_pb2.GetStatusResponse(
        subscriptions=[
            sidecar_pb2.SubscriptionStatus(
                name="orders",
                mode="sequence",
                keys_blocked=1,
                keys_detail=[
                    sidecar_pb2.KeyStatus(
                        key="it's $HOME", state="waiting_sequence", missing_sequence=2, last_missing_sequence=2
                    )
                ],
            )
        ]
    )
    (key,) = status_to_dict(response, NOW, "unix:///run/s.sock")["subscriptions"][0]["keys_detail"]
    assert key["free_with"] == (
        "pubsub-sidecar skip-gap --target unix:///run/s.sock --subscription orders --key 'it'\"'\"'s $HOME' --through 2"
    )


def test_table_says_how_many_waiting_keys_the_detail_left_out() -> None:
    text = format_table(sample_response(keys_blocked_orders=5), NOW)
    assert "keys waiting (2 of 5, longest first):" in text
    assert "... and 3 more waiting keys not shown" in text
    # prices has 30 waiting keys and no per-key detail at all: still said, not hidden.
    assert "30 keys wait; none in the per-key detail the sidecar returned" in text


def test_table_for_an_idle_sidecar() -> None:
    response = sidecar_pb2.GetStatusResponse(subscriptions=[sidecar_pb2.SubscriptionStatus(name="orders", mode="none")])
    assert "no keys waiting" in format_table(response, NOW)
    assert format_table(sidecar_pb2.GetStatusResponse(), NOW) == "no subscriptions\n"


# ---- the command against no sidecar ----------------------------------------------------------


def test_unreachable_sidecar_is_one_line_on_stderr_and_exit_code_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"unix://{tmp_path}/nobody-listens.sock"
    assert cli.main(["status", "--target", target, "--json"]) == EXIT_FAILED
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"pubsub-sidecar status: cannot reach the sidecar at {target}: UNAVAILABLE")
    assert "Traceback" not in err


# ---- the command against a real sidecar ------------------------------------------------------


@dataclass
class _DiscardDeadLetters:
    """Nothing in this test is dead-lettered; the runtime still needs a sink."""

    published: int = 0

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        self.published += 1


@pytest.fixture
async def sidecar_with_a_gap() -> AsyncIterator[str]:
    """A delivery layer serving `orders`: key `a` holds 2 and 3 behind missing 1, key `b` has 1 ready."""
    store = MemoryStore()
    runtime = SubscriptionRuntime("orders", EngineConfig(mode="sequence"), store, _DiscardDeadLetters())
    server = GrpcServer({"orders": runtime}, "127.0.0.1:0")
    try:
        await runtime.recover()
        await runtime.loaded()
        await runtime.start()
        address = await server.start()
        await server.set_serving()
        results = await store.persist(
            "orders", [sequence_message("a", 2), sequence_message("a", 3), sequence_message("b", 1)], wall_clock_ms()
        )
        assert {r.outcome for r in results} == {PersistOutcome.STORED}
        runtime.on_stored([r.message for r in results])
        yield address
    finally:
        await server.stop(0)
        await runtime.stop(0)


async def test_status_of_a_running_sidecar_shows_the_key_behind_a_gap(sidecar_with_a_gap: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.wait_for(fetch_and_render(sidecar_with_a_gap, as_json=True, out=out, err=err), 15)
    assert (code, err.getvalue()) == (0, "")
    (orders,) = json.loads(out.getvalue())["subscriptions"]
    assert (orders["name"], orders["mode"]) == ("orders", "sequence")
    assert (orders["buffered"], orders["keys"], orders["keys_blocked"]) == (3, 2, 1)
    keys = {key["key"]: key for key in orders["keys_detail"]}
    assert keys["a"]["state"] == "waiting_sequence"
    assert (keys["a"]["missing_sequence"], keys["a"]["last_missing_sequence"]) == (1, 1)
    assert keys["a"]["free_with"] == (
        f"pubsub-sidecar skip-gap --target {sidecar_with_a_gap} --subscription orders --key a --through 1"
    )
    assert keys["a"]["buffered"] == 2
    assert keys["b"]["state"] == "ready"

    out = io.StringIO()
    assert await fetch_and_render(sidecar_with_a_gap, out=out, err=err) == 0
    gap_row = next(line for line in out.getvalue().splitlines() if line.strip().startswith("a "))
    assert "waiting_sequence" in gap_row and keys["a"]["waiting_for"] in gap_row


def test_a_subscription_that_pub_sub_delivers_nothing_to_says_why() -> None:
    response = sample_response()
    response.subscriptions[0].pull_failure = "every streaming pull failed for 12s, last with RESOURCE_EXHAUSTED: quota"
    document = status_to_dict(response, NOW)
    assert document["subscriptions"][0]["pull_failure"].startswith("every streaming pull failed for 12s")
    assert document["subscriptions"][1]["pull_failure"] is None
    text = format_table(response, NOW)
    line = "  PUB/SUB DELIVERS NOTHING: every streaming pull failed for 12s, last with RESOURCE_EXHAUSTED: quota"
    assert line in text.splitlines()
    assert text.count("PUB/SUB DELIVERS NOTHING") == 1


# ---- what the numbers are, lost leases, capacity (issue 31) -------------------------------------


def test_running_totals_and_current_values_are_labelled_apart() -> None:
    response = sample_response()
    response.subscriptions[0].counts["dead_letters_pending"] = 3
    response.subscriptions[0].counts["shards_loading"] = 1
    orders = status_to_dict(response, NOW)["subscriptions"][0]
    assert "dead_letters_pending" not in orders["counts"] and "shards_loading" not in orders["counts"]
    assert orders["current"] == {"dead_letters_pending": 3, "shards_loading": 1}
    section = format_table(response, NOW).split("\norders:\n", 1)[1]
    assert "  now: dead_letters_pending=3 shards_loading=1" in section.splitlines()


def test_lost_leases_are_said_plainly_with_the_cause() -> None:
    response = sample_response()
    orders = response.subscriptions[0]
    del orders.shards[:]
    orders.lease_problem = "Firestore unavailable since 2026-05-01T11:58:00.000Z: 12 lease reads failed"
    assert status_to_dict(response, NOW)["subscriptions"][0]["lease_problem"] == orders.lease_problem
    lines = format_table(response, NOW).split("\norders:\n", 1)[1].splitlines()
    assert lines[0] == "  LEASES LOST: Firestore unavailable since 2026-05-01T11:58:00.000Z: 12 lease reads failed"
    assert lines[1] == (
        "  pod orders-7f9c-1-a1b2c3: owns none of 16 shards: its leases are lost (above); it delivers no key"
    )
    orders.lease_problem = ""
    text = format_table(response, NOW)
    assert "LEASES LOST" not in text and "owns none of 16 shards: other pods own them" in text


def test_a_growing_backlog_is_said_with_the_rates_and_for_how_long() -> None:
    response = sample_response()
    orders, prices = response.subscriptions
    orders.capacity.intake_per_second = 120.0
    orders.capacity.delivered_per_second = 100.0
    orders.capacity.deficit_per_second = 20.0
    orders.capacity.growing_for.CopyFrom(duration(302))
    prices.capacity.intake_per_second = 5.0
    prices.capacity.delivered_per_second = 5.0
    prices.capacity.growing_for.CopyFrom(duration(0))
    document = status_to_dict(response, NOW)["subscriptions"]
    assert document[0]["capacity"] == {
        "intake_per_second": 120.0, "delivered_per_second": 100.0, "deficit_per_second": 20.0,
        "backlog_growing": True, "growing_for_seconds": 302.0,
    }  # fmt: skip
    assert document[1]["capacity"]["backlog_growing"] is False
    text = format_table(response, NOW)
    assert (
        "  BACKLOG GROWING for 5m02s: 20.0 msg/s more in than out; intake 120.0 msg/s, delivery 100.0 msg/s "
        "(last minute)" in text.splitlines()
    )
    assert "  capacity: intake 5.0 msg/s, delivery 5.0 msg/s (last minute); the backlog does not grow" in text
    assert status_to_dict(sample_response(), NOW)["subscriptions"][0]["capacity"] is None
