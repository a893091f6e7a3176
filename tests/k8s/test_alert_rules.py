"""k8s/alerts: the PrometheusRule renders with `kubectl kustomize` and alerts on metrics the sidecar exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kustomize_build import render
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.config.durations import parse_duration_ms
from sidecar.ops.capacity import Capacity
from sidecar.ops.observability import SidecarCollector, SubscriptionMetrics
from sidecar.wiring.relays import RelayCollector

ALERTS = Path(__file__).resolve().parents[2] / "k8s" / "alerts"


@pytest.fixture(scope="module")
def rule() -> dict[str, Any]:
    # The shared renderer: a missing kustomize fails loudly, as for the other manifests.
    (document,) = render(ALERTS)
    return document


def exported_metrics() -> dict[str, set[str]]:
    """Metric name -> label names, from the sidecar's own collector with a blocked key and shard leases."""
    snapshot = SubscriptionMetrics(
        subscription="orders", received=1, malformed=0, duplicates=0, delivered=1, acked=0, nacked=1, late=0,
        dead_lettered={"app_dead_letter": 1}, buffered=1, in_flight=0, keys_blocked=1,
        oldest_undelivered_age_seconds=3.0, watermark_lag_seconds=None, keys_blocked_dead_letter=1,
        shards_owned=2, lease_blocked_shards=1, capacity=Capacity(12.0, 10.0, 60.0, 120.0), lease_problem=True,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(SidecarCollector(lambda: [snapshot]))
    registry.register(RelayCollector(lambda: {"orders-out": {"relay_blocked_keys": 1}}))
    metrics: dict[str, set[str]] = {}
    for line in generate_latest(registry).decode().splitlines():
        match = re.match(r"([a-z_]+)\{([^}]*)\}", line)
        if match:
            labels = {pair.split("=")[0] for pair in match.group(2).split(",") if pair}
            metrics.setdefault(match.group(1), set()).update(labels)
    return metrics


def test_the_rule_renders_as_a_prometheus_rule(rule: dict[str, Any]) -> None:
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {
        "PubsubSidecarKeyBlockedByDeadLetter",
        "PubsubSidecarDeadLettering",
        "PubsubSidecarDeadLetterBacklogOld",
        "PubsubSidecarStreamingPullFailing",
        "PubsubSidecarLeaseDocumentBlocked",
        "PubsubSidecarMalformedMessages",
        "PubsubSidecarBacklogGrowing",
        "PubsubSidecarLeaseReadsFailing",
        "PubsubSidecarRelayKeyBlocked",
    }
    for alert in alerts.values():
        assert alert["expr"].strip() and alert["labels"]["severity"] in ("page", "ticket")
        if "for" in alert:
            parse_duration_ms(alert["for"])


def test_every_sidecar_metric_an_alert_uses_is_exported_with_its_labels(rule: dict[str, Any]) -> None:
    exported = exported_metrics()
    assert exported["pubsub_sidecar_keys_blocked_dead_letter"] == {"subscription"}
    used = 0
    for group in rule["spec"]["groups"]:
        for alert in group["rules"]:
            for name in re.findall(r"\b(pubsub_sidecar_[a-z_]+)\b", alert["expr"]):
                used += 1
                assert name in exported, f"{alert['alert']} uses {name}, which the sidecar does not export"
                for labels in re.findall(r"by \(([^)]*)\)", alert["expr"]):
                    sidecar_labels = {label.strip() for label in labels.split(",")} - {"namespace", "pod"}
                    assert sidecar_labels <= exported[name], f"{alert['alert']}: {sidecar_labels} not on {name}"
    assert used == 8
