"""Config file: DESIGN §7's example loads as is; every bad input is one line naming file, path, reason."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config import errors as config_errors
from sidecar.config.durations import (
    MAX_DURATION_MS,
    format_duration_ms,
    parse_byte_size,
    parse_duration_ms,
)
from sidecar.config.model import (
    EXIT_CONFIG,
    ConfigError,
    SequenceOrdering,
    SubscriptionConfig,
    WatermarkOrdering,
    config_error_exit,
    load_config,
    parse_config,
)
from sidecar.engine.types import EngineConfig

# DESIGN.md §7, verbatim (contract: this file must be accepted as is).
DESIGN_EXAMPLE = """\
project: demo-project
listen: 127.0.0.1:50051          # or unix:///var/run/sidecar/sidecar.sock
http: 127.0.0.1:9090              # /healthz /readyz /metrics
firestore: {database: "(default)", root: pubsub-sidecar}
subscriptions:
  - name: orders
    subscription: projects/demo-project/subscriptions/orders
    ordering:
      mode: sequence              # sequence | watermark | none
      key: {attribute: order_id}  # or {ordering_key: true}
      sequence: {attribute: seq, start: 1}
      gap_timeout: null           # e.g. 5m
      on_gap_timeout: hold        # hold | skip
    dedup: {by: message_id, ttl: 7d}     # or {attribute: event_id, ttl: 7d}
    delivery: {max_in_flight_per_key: 1, ack_deadline: 60s, max_delivery_attempts: 5,
               backoff: {initial: 1s, maximum: 10m}, on_dead_letter: block}
    dead_letter_topic: projects/demo-project/topics/orders-dead-letter
  - name: prices
    subscription: projects/demo-project/subscriptions/prices
    ordering:
      mode: watermark
      key: {ordering_key: true}
      timestamp: {source: publish_time}  # or {attribute: event_time, allowed_skew: 2s}
      watermark: {poll_interval: 30s, safety_margin: 10s, max_metric_delay: 180s}
      on_late: dead_letter        # dead_letter | deliver
"""


def write(tmp_path: Path, text: str, name: str = "sidecar.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def minimal(**overrides: Any) -> dict[str, Any]:
    """A valid file as data: one dedup-only subscription; ``overrides`` patch the subscription."""
    sub: dict[str, Any] = {"name": "orders", "subscription": "orders", "ordering": {"mode": "none"}}
    sub.update(overrides)
    return {"project": "demo-project", "subscriptions": [sub]}


def error_of(tmp_path: Path, data: Any) -> ConfigError:
    text = data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False)
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    return info.value


# ---- the contract example --------------------------------------------------------------------


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
    data = minimal(
        ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"attribute": "event_time"}}
    )
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


# ---- bad input: one line, field path, reason ------------------------------------------------

BAD_INPUTS: list[tuple[str, Any, str, str]] = [
    # (id, data, expected path, expected fragment of the reason)
    ("unknown top field", {**minimal(), "extra": 1}, "extra", "unknown field"),
    ("unknown subscription field", minimal(ordering_mode="x"), "subscriptions[0].ordering_mode", "unknown field"),
    (
        "unknown deep field",
        minimal(delivery={"backoff": {"initial": "1s", "maxi": "2s"}}),
        "subscriptions[0].delivery.backoff.maxi",
        "allowed: initial, maximum",
    ),
    ("unknown firestore field", {**minimal(), "firestore": {"db": "x"}}, "firestore.db", "unknown field"),
    ("wrong type int", minimal(delivery={"max_delivery_attempts": "5"}), "subscriptions[0].delivery.max_delivery_attempts", "expected an integer"),  # noqa: E501
    ("bool for int", minimal(delivery={"max_in_flight_per_key": True}), "subscriptions[0].delivery.max_in_flight_per_key", "expected an integer"),  # noqa: E501
    ("wrong type str", minimal(name=12), "subscriptions[0].name", "expected a string"),
    ("wrong type section", minimal(delivery=[1]), "subscriptions[0].delivery", "expected a mapping"),
    ("subscriptions not a list", {"project": "p1", "subscriptions": {"a": 1}}, "subscriptions", "expected a list"),
    ("zero attempts", minimal(delivery={"max_delivery_attempts": 0}), "subscriptions[0].delivery.max_delivery_attempts", "at least 1"),  # noqa: E501
    ("negative in flight", minimal(delivery={"max_in_flight_per_key": -1}), "subscriptions[0].delivery.max_in_flight_per_key", "at least 1"),  # noqa: E501
    ("zero ack deadline", minimal(delivery={"ack_deadline": "0s"}), "subscriptions[0].delivery.ack_deadline", "longer than 0s"),  # noqa: E501
    ("zero ttl", minimal(dedup={"ttl": "0ms"}), "subscriptions[0].dedup.ttl", "longer than 0s"),
    ("zero outstanding", minimal(flow_control={"max_outstanding_messages": 0}), "subscriptions[0].flow_control.max_outstanding_messages", "at least 1"),  # noqa: E501
    ("bare number duration", minimal(delivery={"ack_deadline": 60}), "subscriptions[0].delivery.ack_deadline", "needs a unit"),  # noqa: E501
    ("bad duration", minimal(dedup={"ttl": "7 days"}), "subscriptions[0].dedup.ttl", "expected a duration"),
    ("backoff inverted", minimal(delivery={"backoff": {"initial": "1m", "maximum": "1s"}}), "subscriptions[0].delivery.backoff", "maximum must be at least initial"),  # noqa: E501
    ("no mode", minimal(ordering={"key": {"ordering_key": True}}), "subscriptions[0].ordering.mode", "required"),
    ("unknown mode", minimal(ordering={"mode": "fifo"}), "subscriptions[0].ordering.mode", "got 'fifo'"),
    ("ordering not a mapping", minimal(ordering="sequence"), "subscriptions[0].ordering", "expected a mapping"),
    (
        "sequence without key",
        minimal(ordering={"mode": "sequence", "sequence": {"attribute": "seq"}}),
        "subscriptions[0].ordering.key",
        "required in sequence mode",
    ),
    (
        "sequence without sequence",
        minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}}),
        "subscriptions[0].ordering.sequence",
        "required in sequence mode",
    ),
    (
        "sequence without attribute",
        minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}, "sequence": {"start": 1}}),
        "subscriptions[0].ordering.sequence.attribute",
        "required",
    ),
    (
        "watermark without timestamp",
        minimal(ordering={"mode": "watermark", "key": {"ordering_key": True}}),
        "subscriptions[0].ordering.timestamp",
        "required in watermark mode",
    ),
    (
        "watermark without key",
        minimal(ordering={"mode": "watermark", "timestamp": {"source": "publish_time"}}),
        "subscriptions[0].ordering.key",
        "required in watermark mode",
    ),
    (
        "timestamp in sequence mode",
        minimal(
            ordering={
                "mode": "sequence",
                "key": {"attribute": "k"},
                "sequence": {"attribute": "seq"},
                "timestamp": {"source": "publish_time"},
            }
        ),
        "subscriptions[0].ordering.timestamp",
        "not allowed in sequence mode (it belongs to watermark mode)",
    ),
    (
        "sequence in watermark mode",
        minimal(
            ordering={
                "mode": "watermark",
                "key": {"attribute": "k"},
                "timestamp": {"source": "publish_time"},
                "sequence": {"attribute": "seq"},
            }
        ),
        "subscriptions[0].ordering.sequence",
        "not allowed in watermark mode (it belongs to sequence mode)",
    ),
    (
        "gap timeout in none mode",
        minimal(ordering={"mode": "none", "gap_timeout": "5m"}),
        "subscriptions[0].ordering.gap_timeout",
        "not allowed in none mode",
    ),
    ("key with both sources", minimal(ordering={"mode": "none", "key": {"attribute": "k", "ordering_key": True}}), "subscriptions[0].ordering.key", "exactly one"),  # noqa: E501
    ("key with no source", minimal(ordering={"mode": "none", "key": {}}), "subscriptions[0].ordering.key", "exactly one"),  # noqa: E501
    ("ordering_key false", minimal(ordering={"mode": "none", "key": {"ordering_key": False}}), "subscriptions[0].ordering.key", "ordering_key: false"),  # noqa: E501
    ("empty attribute name", minimal(ordering={"mode": "none", "key": {"attribute": ""}}), "subscriptions[0].ordering.key.attribute", "must not be empty"),  # noqa: E501
    (
        "skew with publish_time",
        minimal(ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"allowed_skew": "2s"}}),
        "subscriptions[0].ordering.timestamp",
        "allowed_skew applies only",
    ),
    (
        "timestamp source attribute without name",
        minimal(ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"source": "attribute"}}),
        "subscriptions[0].ordering.timestamp",
        "needs attribute",
    ),
    ("dedup by attribute without name", minimal(dedup={"by": "attribute"}), "subscriptions[0].dedup", "needs attribute"),  # noqa: E501
    ("dedup by message_id with name", minimal(dedup={"by": "message_id", "attribute": "e"}), "subscriptions[0].dedup", "exclusive"),  # noqa: E501
    ("bad literal", minimal(delivery={"on_dead_letter": "drop"}), "subscriptions[0].delivery.on_dead_letter", "'block' or 'skip'"),  # noqa: E501
    ("zero gap timeout", minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}, "sequence": {"attribute": "s"}, "gap_timeout": "0s"}), "subscriptions[0].ordering.gap_timeout", "longer than 0s"),  # noqa: E501
    ("negative start", minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}, "sequence": {"attribute": "s", "start": -1}}), "subscriptions[0].ordering.sequence.start", "at least 0"),  # noqa: E501
    ("duplicate names", {"project": "p1", "subscriptions": [minimal()["subscriptions"][0]] * 2}, "subscriptions[1].name", "duplicate name 'orders'"),  # noqa: E501
    ("bad name", minimal(name="a/b"), "subscriptions[0].name", "not a valid name"),
    ("bad subscription path", minimal(subscription="projects/p/topics/orders"), "subscriptions[0].subscription", "neither"),  # noqa: E501
    ("short id too short", minimal(subscription="ab"), "subscriptions[0].subscription", "3-255"),
    ("goog prefix", minimal(subscription="googorders"), "subscriptions[0].subscription", "goog"),
    ("bad topic", minimal(dead_letter_topic="projects/p/subscriptions/x"), "subscriptions[0].dead_letter_topic", "topics"),  # noqa: E501
    ("no subscriptions", {"project": "p1"}, "subscriptions", "required"),
    ("empty subscriptions", {"project": "p1", "subscriptions": []}, "subscriptions", "must not be empty"),
    ("bad listen", {**minimal(), "listen": "localhost"}, "listen", "HOST:PORT"),
    ("relative unix socket", {**minimal(), "listen": "unix:sidecar.sock"}, "listen", "unix:///absolute/path"),
    ("unbracketed ipv6", {**minimal(), "listen": "::1:50051"}, "listen", "brackets"),
    ("port out of range", {**minimal(), "http": "127.0.0.1:70000"}, "http", "0..65535"),
    ("bad firestore root", {**minimal(), "firestore": {"root": "a/b"}}, "firestore.root", "collection id"),
    ("bad size", minimal(flow_control={"max_outstanding_bytes": "100 MiB"}), "subscriptions[0].flow_control.max_outstanding_bytes", "expected a size"),  # noqa: E501
    ("lease extension too short", minimal(flow_control={"max_lease_extension": "5s"}), "subscriptions[0].flow_control.max_lease_extension", "between 10s and 600s"),  # noqa: E501
    ("lease extension too long", minimal(flow_control={"max_lease_extension": "11m"}), "subscriptions[0].flow_control.max_lease_extension", "between 10s and 600s"),  # noqa: E501
    ("lease extension fraction", minimal(flow_control={"max_lease_extension": "10500ms"}), "subscriptions[0].flow_control.max_lease_extension", "whole seconds"),  # noqa: E501
    ("lease extension bare number", minimal(flow_control={"max_lease_extension": 10}), "subscriptions[0].flow_control.max_lease_extension", "unit"),  # noqa: E501
]


@pytest.mark.parametrize(("data", "path", "reason"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_field_path_and_reason(tmp_path: Path, data: Any, path: str, reason: str) -> None:
    err = error_of(tmp_path, data)
    assert err.path == path
    assert reason in err.reason
    assert str(err).startswith(f"{err.file}: {path}: ")


def test_missing_project_without_environment_says_how_to_set_it(tmp_path: Path) -> None:
    data = minimal()
    del data["project"]
    err = error_of(tmp_path, data)
    assert err.path == "project"
    assert "GOOGLE_CLOUD_PROJECT" in err.reason


def test_error_shows_the_yaml_line_of_the_field(tmp_path: Path) -> None:
    err = error_of(tmp_path, DESIGN_EXAMPLE.replace("max_delivery_attempts: 5", "max_delivery_attempts: five"))
    assert err.path == "subscriptions[0].delivery.max_delivery_attempts"
    assert err.reason.endswith("(line 15)")


def test_more_problems_are_counted_on_the_same_line(tmp_path: Path) -> None:
    err = error_of(tmp_path, minimal(delivery={"max_delivery_attempts": 0, "max_in_flight_per_key": 0}))
    assert "[+1 more]" in err.reason


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("just text\n", "the top level must be a mapping"),
    ],
)
def test_empty_or_non_mapping_file(tmp_path: Path, text: str, fragment: str) -> None:
    assert fragment in str(error_of(tmp_path, text))


def test_invalid_yaml_reports_line_and_column(tmp_path: Path) -> None:
    err = error_of(tmp_path, "project: p\nsubscriptions: [\n  {name: a\n")
    assert err.path.startswith("line ")
    assert ", column " in err.path
    assert "invalid YAML" in err.reason


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, "project: a\nsubscriptions: []\nproject: b\n")
    assert err.path == "project"
    assert "duplicate key (line 3; first on line 1)" in err.reason


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path)  # a directory
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"project: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


def _billion_laughs() -> str:
    """The classic alias bomb: 10 levels of 10 references, 10^10 values from half a kilobyte."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, 10):
        refs = ",".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


HOSTILE_FILES = [
    # (id, file bytes, expected fragment of the one line)
    ("nul byte", b"project: demo\x00\nsubscriptions: []\n", "line 1, column 14: invalid YAML: a NUL byte"),
    ("control character", b"project: demo\n\x1b[31msubscriptions: []\n", "character #x001b is not allowed"),
    ("alias bomb", _billion_laughs().encode(), "expand to more than 100,000 through YAML aliases (an alias bomb?)"),
    ("deep flow nesting", b"project: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested more than 64 levels"),
    ("deep block nesting", "".join(f"{'  ' * i}k{i}:\n" for i in range(5_000)).encode(), "nested more than 64 levels"),
    ("recursive alias", b"project: &p [*p]\n", "an alias refers to a node that contains it"),
    ("bad tagged value", b"project: 2001-02-30\nsubscriptions: []\n", "invalid YAML value: day is out of range"),
]


@pytest.mark.parametrize(("raw", "fragment"), [c[1:] for c in HOSTILE_FILES], ids=[c[0] for c in HOSTILE_FILES])
def test_hostile_files_are_refused_quickly_with_one_line(tmp_path: Path, raw: bytes, fragment: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(raw)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    elapsed = time.monotonic() - started
    # Generous for a loaded machine; the alias bomb alone took 30 s and then ran out of memory.
    assert elapsed < 2.0, f"took {elapsed:.1f}s"
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert fragment in message
    assert "\n" not in message and len(message) < 300


def test_billion_laughs_is_small_and_ordinary_aliases_still_load(tmp_path: Path) -> None:
    assert len(_billion_laughs()) < 2048
    text = """\
project: demo
subscriptions:
  - name: a
    subscription: a-sub
    ordering: {mode: none}
    delivery: &delivery {max_delivery_attempts: 3, backoff: {initial: 2s, maximum: 1m}}
  - name: b
    subscription: b-sub
    ordering: {mode: none}
    delivery: *delivery
"""
    config = load_config(write(tmp_path, text), env={})
    assert config.subscriptions[0].delivery == config.subscriptions[1].delivery
    assert config.subscriptions[1].delivery.max_delivery_attempts == 3


def test_config_error_exit_prints_one_line_and_returns_2(tmp_path: Path) -> None:
    err = error_of(tmp_path, minimal(delivery={"max_delivery_attempts": 0}))
    stream = io.StringIO()
    assert config_error_exit(err, stream) == EXIT_CONFIG == 2
    output = stream.getvalue()
    assert output.count("\n") == 1
    assert output == f"pubsub-sidecar: {err}\n"


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["project", "subscriptions", "name", "ordering", "mode", "key", "x"]), inner, max_size=4), max_leaves=12))  # noqa: E501
def test_arbitrary_data_gives_config_error_or_config(data: Any) -> None:
    try:
        parse_config(data)
    except ConfigError as err:
        assert "\n" not in str(err)


# ---- durations and sizes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("0s", 0),
        ("500ms", 500),
        ("30s", 30_000),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
        ("1m30s", 90_000),
        ("1h30m", 5_400_000),
        ("1d2h3m4s5ms", 93_784_005),
        ("3650d", MAX_DURATION_MS),
    ],
)
def test_durations_parse(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    "value",
    [60, 1.5, True, None, "", "60", " 30s", "30s ", "1.5s", "-1s", "30S", "30sec", "30 s", "s", "30s1m", "1s1s",
     "3651d", "99999999999999999999999d", ["30s"]],
)  # fmt: skip
def test_durations_reject(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration_ms(value)


@given(st.integers(min_value=0, max_value=MAX_DURATION_MS))
def test_duration_format_round_trips(ms: int) -> None:
    assert parse_duration_ms(format_duration_ms(ms)) == ms


@pytest.mark.parametrize(
    ("value", "size"),
    [(4096, 4096), ("4096B", 4096), ("10KB", 10_000), ("10KiB", 10_240), ("100MiB", 104_857_600), ("1GB", 10**9)],
)
def test_byte_sizes_parse(value: Any, size: int) -> None:
    assert parse_byte_size(value) == size


@pytest.mark.parametrize("value", ["100 MiB", "100mib", "1.5GB", "-1", True, 1.5, None])
def test_byte_sizes_reject(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(value)


def _many_subscriptions(count: int, *, duplicate_of: int | None = None, shared_delivery: bool = False) -> str:
    """A config of ``count`` subscriptions written out in full (about 20 YAML values each), the last
    one named like subscription ``duplicate_of`` when given; with ``shared_delivery`` each entry
    also refers to one delivery block through an alias."""
    lines = ["project: demo-project", "subscriptions:"]
    for index in range(count):
        name = f"s{duplicate_of if duplicate_of is not None and index == count - 1 else index}"
        lines += [
            f"  - name: {name}",
            f"    subscription: sub-{index}",
            "    ordering: {mode: sequence, key: {attribute: order_id}, sequence: {attribute: seq}}",
            "    dead_letter_topic: dead-letters",
        ]
        if shared_delivery:
            anchor = "&delivery " if index == 0 else ""
            lines.append(
                "    delivery: " + (f"{anchor}{{ack_deadline: 60s, max_delivery_attempts: 5, max_in_flight_per_key: 1}}"
                                    if index == 0 else "*delivery")
            )  # fmt: skip
    return "\n".join(lines) + "\n"


def test_a_big_file_without_aliases_is_refused_for_its_size_not_as_an_alias_bomb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound scaled down (the real one takes 5,000 subscriptions and seconds to read): the rule is
    # the same. Before, such a file was "an alias bomb" although it holds no alias.
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 2_000)
    err = error_of(tmp_path, _many_subscriptions(200, duplicate_of=0))
    assert "the file is too big: it holds more than 2,000 YAML values" in err.reason
    assert "alias" not in err.reason
    assert "split the subscriptions over several sidecars" in err.reason


def test_a_file_within_the_bound_reports_its_duplicate_subscription_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 2_000)
    err = error_of(tmp_path, _many_subscriptions(80, duplicate_of=3))
    assert err.path == "subscriptions[79].name"
    assert "duplicate name 's3': subscriptions[3] has it already" in err.reason


def test_aliases_that_expand_a_file_past_the_bound_are_named_with_the_written_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 2_000)
    # 90 entries of 18 written values plus an alias each: within the bound as written, past it expanded.
    text = _many_subscriptions(90, shared_delivery=True)
    err = error_of(tmp_path, text)
    assert "as written expand to more than 2,000 through YAML aliases (an alias bomb?)" in err.reason
    written = int(err.reason.split("its ", 1)[1].split(" values", 1)[0].replace(",", ""))
    assert written <= 2_000
    # Without the aliases' expansion pushing it over, the same file loads.
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 100_000)
    assert len(load_config(write(tmp_path, text), env={}).subscriptions) == 90
