"""Config file, the contract: DESIGN §7's example loads as is and maps onto the engine's configs;
defaults are the documented ones; names resolve under the project; the models are frozen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from config_support import DESIGN_EXAMPLE, minimal, write

from sidecar.config.model import SequenceOrdering, SubscriptionConfig, WatermarkOrdering, load_config, parse_config
from sidecar.engine.types import EngineConfig


def test_design_example_loads_as_is(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, DESIGN_EXAMPLE), env={})

    assert config.project == "demo-project"
    assert config.listen == "127.0.0.1:50051"
    assert config.http == "127.0.0.1:9090"
    assert (config.firestore.database, config.firestore.root) == ("(default)", "pubsub-sidecar")
    orders, prices = config.subscriptions
    assert orders.name == "orders"
    assert orders.subscription == "projects/demo-project/subscriptions/orders"
    assert orders.dead_letter_topic == "projects/demo-project/topics/orders-dead-letter"
    assert isinstance(orders.ordering, SequenceOrdering)
    assert orders.ordering.key.attribute == "order_id"
    assert (orders.ordering.sequence.attribute, orders.ordering.sequence.start) == ("seq", 1)
    assert orders.ordering.gap_timeout_ms is None
    assert orders.dedup.by == "message_id" and orders.dedup.ttl_ms == 7 * 86_400_000
    assert orders.delivery.backoff.maximum_ms == 600_000
    assert isinstance(prices.ordering, WatermarkOrdering)
    assert prices.ordering.key.ordering_key is True
    assert prices.ordering.timestamp.source == "publish_time"
    assert prices.ordering.timestamp.attribute is None
    assert prices.ordering.watermark.max_metric_delay_ms == 180_000
    assert prices.dead_letter_topic is None


def test_design_example_maps_onto_engine_configs(tmp_path: Path) -> None:
    orders, prices = load_config(write(tmp_path, DESIGN_EXAMPLE), env={}).subscriptions

    assert orders.engine_config() == EngineConfig(
        mode="sequence",
        sequence_start=1,
        first_sequence_any=False,
        gap_timeout_ms=None,
        on_gap_timeout="hold",
        on_late="dead_letter",
        dedup_ttl_ms=604_800_000,
        max_in_flight_per_key=1,
        ack_deadline_ms=60_000,
        max_delivery_attempts=5,
        backoff_initial_ms=1_000,
        backoff_maximum_ms=600_000,
        on_dead_letter="block",
    )
    assert prices.engine_config().mode == "watermark"
    assert prices.engine_config().on_late == "dead_letter"


def test_engine_config_carries_every_non_default_setting() -> None:
    config = parse_config(
        {
            "project": "p1",
            "subscriptions": [
                {
                    "name": "orders",
                    "subscription": "orders",
                    "ordering": {
                        "mode": "sequence",
                        "key": {"ordering_key": True},
                        "sequence": {"attribute": "seq", "start": 0},
                        "gap_timeout": "1m30s",
                        "on_gap_timeout": "skip",
                        "first_sequence": "any",
                        "on_late": "deliver",
                    },
                    "dedup": {"attribute": "event_id", "ttl": "2h", "memory_max_entries": 7},
                    "delivery": {
                        "max_in_flight_per_key": 4,
                        "ack_deadline": "500ms",
                        "max_delivery_attempts": 9,
                        "backoff": {"initial": "250ms", "maximum": "5s"},
                        "on_dead_letter": "skip",
                    },
                }
            ],
        }
    )
    assert config.subscriptions[0].engine_config() == EngineConfig(
        mode="sequence",
        sequence_start=0,
        first_sequence_any=True,
        gap_timeout_ms=90_000,
        on_gap_timeout="skip",
        on_late="deliver",
        dedup_ttl_ms=7_200_000,
        max_in_flight_per_key=4,
        ack_deadline_ms=500,
        max_delivery_attempts=9,
        backoff_initial_ms=250,
        backoff_maximum_ms=5_000,
        on_dead_letter="skip",
        dedup_memory_max_entries=7,
    )


def test_defaults_are_the_documented_ones() -> None:
    config = parse_config(minimal())
    sub = config.subscriptions[0]
    assert (config.listen, config.http) == ("127.0.0.1:50051", "127.0.0.1:9090")
    assert (config.firestore.database, config.firestore.root) == ("(default)", "pubsub-sidecar")
    assert sub.ordering.key is None
    assert (sub.dedup.by, sub.dedup.attribute, sub.dedup.ttl_ms) == ("message_id", None, 604_800_000)
    assert sub.delivery.model_dump() == {
        "max_in_flight_per_key": 1,
        "ack_deadline_ms": 60_000,
        "max_delivery_attempts": 5,
        "backoff": {"initial_ms": 1_000, "maximum_ms": 600_000},
        "on_dead_letter": "block",
        "on_replay_behind": "refuse",
    }
    assert sub.flow_control.model_dump() == {
        "max_undelivered_messages": 10_000,
        "max_outstanding_messages": 5_000,
        "max_outstanding_bytes": 100 * 1024 * 1024,
        "max_lease_extension_ms": 10_000,
        "max_idle_keys": 10_000,
        "max_held_bytes": 64 * 1024 * 1024,
    }
    assert sub.dead_letter_topic is None
    assert sub.engine_config() == EngineConfig(mode="none")


def test_watermark_defaults_and_timestamp_attribute_skew() -> None:
    data = minimal(ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"attribute": "event_time"}})
    ordering = parse_config(data).subscriptions[0].ordering
    assert isinstance(ordering, WatermarkOrdering)
    assert (ordering.timestamp.source, ordering.timestamp.attribute) == ("attribute", "event_time")
    assert ordering.timestamp.allowed_skew_ms == 2_000
    assert ordering.watermark.model_dump() == {
        "poll_interval_ms": 30_000,
        "safety_margin_ms": 10_000,
        "max_metric_delay_ms": 180_000,
    }
    assert ordering.on_late == "dead_letter"
    explicit_null = minimal(
        ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"attribute": "t", "allowed_skew": None}}
    )
    assert parse_config(explicit_null).subscriptions[0].ordering.timestamp.allowed_skew_ms == 2_000  # type: ignore[union-attr]


def test_short_names_resolve_under_the_project() -> None:
    sub = parse_config(minimal(dead_letter_topic="orders-dlq")).subscriptions[0]
    assert sub.subscription == "projects/demo-project/subscriptions/orders"
    assert sub.dead_letter_topic == "projects/demo-project/topics/orders-dlq"


def test_full_names_in_another_project_are_kept() -> None:
    sub = parse_config(
        minimal(subscription="projects/other/subscriptions/orders", dead_letter_topic="projects/x/topics/dlq")
    ).subscriptions[0]
    assert sub.subscription == "projects/other/subscriptions/orders"
    assert sub.dead_letter_topic == "projects/x/topics/dlq"


def test_project_defaults_to_google_cloud_project(tmp_path: Path) -> None:
    data = minimal()
    del data["project"]
    path = write(tmp_path, yaml.safe_dump(data))
    config = load_config(path, env={"GOOGLE_CLOUD_PROJECT": "from-env"})
    assert config.project == "from-env"
    assert config.subscriptions[0].subscription == "projects/from-env/subscriptions/orders"
    # the file wins over the environment
    assert load_config(write(tmp_path, yaml.safe_dump(minimal())), env={"GOOGLE_CLOUD_PROJECT": "x"}).project == (
        "demo-project"
    )


def test_unix_socket_listen_and_ipv6_are_accepted() -> None:
    assert parse_config({**minimal(), "listen": "unix:///run/sidecar/s.sock"}).listen == "unix:///run/sidecar/s.sock"
    assert parse_config({**minimal(), "listen": "[::1]:0"}).listen == "[::1]:0"


def test_subscription_config_validates_alone() -> None:
    """Components and tests build a SubscriptionConfig directly from a mapping."""
    sub = SubscriptionConfig.model_validate(
        {"name": "a", "subscription": "projects/p/subscriptions/abc", "ordering": {"mode": "none"}}
    )
    assert sub.flow_control.max_undelivered_messages == 10_000


def test_flow_control_accepts_sizes_and_no_undelivered_limit() -> None:
    sub = parse_config(
        minimal(flow_control={"max_undelivered_messages": None, "max_outstanding_bytes": "10MB"})
    ).subscriptions[0]
    assert sub.flow_control.max_undelivered_messages is None
    assert sub.flow_control.max_outstanding_bytes == 10_000_000


def test_lease_extension_takes_whole_seconds_in_pubsub_range_or_null() -> None:
    def extension(value: Any) -> int | None:
        sub = parse_config(minimal(flow_control={"max_lease_extension": value})).subscriptions[0]
        return sub.flow_control.max_lease_extension_ms

    assert (extension("10s"), extension("1m"), extension("10m"), extension(None)) == (10_000, 60_000, 600_000, None)


def test_models_are_frozen() -> None:
    config = parse_config(minimal())
    with pytest.raises(ValueError, match="frozen"):
        config.project = "other"  # type: ignore[misc]
