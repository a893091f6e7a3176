"""What a scenario publishes and how its sidecar is configured: the stream, the subscription entry
of the sidecar's config, and the deadline of a phase.

The stream: messages round-robin over K keys with sequences 1, 2, ...; 10% are swapped with the
next message of their key (so they arrive out of order) and 1% are published a second time (a
publisher retry: same key, sequence and dedup attribute, a new message_id). The baseline counts
every published message (it cannot tell a retry); the sidecar counts distinct messages only.

Rules this module keeps:
- A stream is a pure function of its arguments and seed: the same run publishes the same messages
  in the same order, before and after a change.
- Every subscription entry names the publisher's retry-stable ``event_id`` as its dedup attribute:
  sequence mode dedups by key and sequence, the other modes need that id to drop a retry.
- A phase's deadline is generous (shared, noisy cores) yet finite.
"""

from __future__ import annotations

import random
from typing import Any

from bench.harness import BenchError
from bench.pubsub_clients import Outgoing
from bench.scenarios import METRIC_DELAY_SECONDS, METRIC_PERIOD_SECONDS, Scenario

SHUFFLED_FRACTION = 0.10
DUPLICATED_FRACTION = 0.01


def build_stream(
    count: int,
    keys: int,
    phase: str,
    key_prefix: str,
    seed: int,
    shuffled: float = SHUFFLED_FRACTION,
    duplicated: float = DUPLICATED_FRACTION,
) -> tuple[list[Outgoing], int]:
    """``count`` distinct messages over ``keys`` keys, shuffled and duplicated as the module says
    (``shuffled``, ``duplicated``: the fractions; 0 and 0 give in-order traffic). Returns the
    publish order and the number of distinct messages."""
    rng = random.Random(seed)
    keys = max(1, min(keys, count))
    stream = [Outgoing(f"{key_prefix}{i % keys}", i // keys + 1, phase) for i in range(count)]
    for index in range(count):
        # The next message of the same key is `keys` places later in round-robin order.
        if rng.random() < shuffled and index + keys < count:
            stream[index], stream[index + keys] = stream[index + keys], stream[index]
    with_retries: list[Outgoing] = []
    for message in stream:
        with_retries.append(message)
        if rng.random() < duplicated:
            with_retries.append(message)
    return with_retries, count


def subscription_entry(scenario: Scenario, subscription: str) -> dict[str, Any]:
    key = {"attribute": "order_id"}
    ordering: dict[str, Any]
    if scenario.mode == "sequence":
        ordering = {"mode": "sequence", "key": key, "sequence": {"attribute": "seq", "start": 1}}
    elif scenario.mode == "watermark":
        period_plus_delay = METRIC_PERIOD_SECONDS + METRIC_DELAY_SECONDS
        ordering = {
            "mode": "watermark",
            "key": key,
            "timestamp": {"source": "publish_time"},
            "watermark": {
                "poll_interval": "500ms",
                "safety_margin": "0s",
                "max_metric_delay": f"{period_plus_delay:g}s",
            },
        }
    elif scenario.mode == "none":
        ordering = {"mode": "none", "key": key}
    else:
        raise BenchError(f"scenario {scenario.name!r}: unknown mode {scenario.mode!r}")
    entry: dict[str, Any] = {"name": "bench", "subscription": subscription, "ordering": ordering}
    if scenario.window != 1:
        entry["delivery"] = {"max_in_flight_per_key": scenario.window}
    # Sequence mode dedups by (key, sequence); the others need the publisher's retry-stable id.
    entry["dedup"] = {"attribute": "event_id", "ttl": "1h"}
    return entry


def phase_timeout(count: int) -> float:
    """Deadline for a phase: generous (shared, noisy cores) yet finite."""
    return 120.0 + count / 20.0
