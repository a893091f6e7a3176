"""Config files the sidecar reads in end-to-end tests, and messages in the shape they expect.

Rules: every config names ``PROJECT`` (the project of every client too), listens where the test
says and serves HTTP on port 0. A subscription entry has test-sized timings (short backoffs and
ack deadline) but the product's default shard lease (``subscription_entry`` says why).
``order_message`` builds a message for the default sequence ordering (key in ``order_id``,
sequence in ``seq``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

PROJECT = "e2e-project"


def subscription_entry(
    name: str,
    subscription: str,
    *,
    mode: str = "sequence",
    dead_letter_topic: str | None = None,
    ordering: Mapping[str, Any] | None = None,
    delivery: Mapping[str, Any] | None = None,
    dedup: Mapping[str, Any] | None = None,
    flow_control: Mapping[str, Any] | None = None,
    sharding: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``subscriptions[]`` entry with test-sized timings (short backoffs and ack deadline).

    Shard leases keep the product's default, 10 s: a pod stops delivering a shard when a renewal is
    about half a lease late, and on two loaded cores a sidecar process can go that long without
    running (with 3 s leases, every shard was dropped and taken again mid-test now and then, and
    the messages in flight were delivered again). A restart after kill -9 waits out the dead
    process's leases; tests about failover pass a shorter ``lease_duration`` themselves."""
    order: dict[str, Any] = {"mode": mode}
    if mode == "sequence":
        order["key"] = {"attribute": "order_id"}
        order["sequence"] = {"attribute": "seq", "start": 1}
    order.update(ordering or {})
    entry: dict[str, Any] = {
        "name": name,
        "subscription": subscription,
        "ordering": order,
        "delivery": {
            "max_in_flight_per_key": 1,
            "ack_deadline": "10s",
            "max_delivery_attempts": 5,
            "backoff": {"initial": "100ms", "maximum": "500ms"},
            "on_dead_letter": "block",
            **(delivery or {}),
        },
    }
    if dedup is not None:
        entry["dedup"] = dict(dedup)
    if flow_control is not None:
        entry["flow_control"] = dict(flow_control)
    if dead_letter_topic is not None:
        entry["dead_letter_topic"] = dead_letter_topic
    entry["sharding"] = {"lease_duration": "10s", "drain_timeout": "2s", **(sharding or {})}
    return entry


def write_config(
    path: Path,
    *,
    listen: str,
    root: str,
    subscriptions: list[dict[str, Any]],
    peering: Mapping[str, Any] | None = None,
) -> Path:
    """The sidecar's config file; ``peering`` is the ``peering:`` section (none: the channel is off)."""
    body: dict[str, Any] = {
        "project": PROJECT,
        "listen": listen,
        "http": "127.0.0.1:0",
        "firestore": {"database": "(default)", "root": root},
        "subscriptions": subscriptions,
    }
    if peering is not None:
        body["peering"] = dict(peering)
    path.write_text(yaml.safe_dump(body, sort_keys=False, allow_unicode=True))
    return path


def order_message(key: str, seq: int | str, **extra: str) -> tuple[bytes, dict[str, str]]:
    """A sequence-mode message: key in ``order_id``, sequence in ``seq``, data naming both."""
    return f"{key}#{seq}".encode(), {"order_id": key, "seq": str(seq), **extra}
