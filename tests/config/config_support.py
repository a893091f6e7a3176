"""Helpers the config tests share: DESIGN §7's example file, writing a file, a minimal valid file as
data, and the one-line error a bad file gives.

``error_of`` asserts the error's shape every bad input must have (one line, starting with the file's
path), so each test states only the field path and the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config.model import ConfigError, load_config

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
