"""Several pods on one subscription: the Deployment in k8s/ scales, rolls and drains without a stop.

Rendered with the real kustomize (base and example overlay): three replicas; a RollingUpdate that
starts a new pod before it stops an old one; a PodDisruptionBudget that lets a node drain evict one
pod at a time while the others keep consuming; the pod name from the downward API (the sidecar's
identity in the lease documents); pods spread over nodes and zones as a preference; and a
termination grace period that covers the sidecar's SIGTERM sequence (stop ingest, drain, hand the
shards over, commit acks) as its ConfigMap's ``sharding`` values make it, the loader's defaults
where the ConfigMap sets none (docs/operations.md, "Scaling out").
"""

from __future__ import annotations

import re
from pathlib import Path

from kustomize_build import Resource
from rendered_manifests import (
    BASE,
    CONFIG_KEY,
    K8S,
    loaded_config,
    only,
    pod_spec,
    rendered_copy,
    sidecar_args,
    sidecar_container,
)

from sidecar.config.model import ShardingConfig, SidecarConfig

REPLICAS = 3
MAX_SURGE = 1
MAX_UNAVAILABLE = 0
"""The rollout the manifests promise: one extra pod at a time, never fewer Ready pods than replicas."""

MIN_CONSUMING_PODS_DURING_A_DRAIN = 2

# The pod's shutdown, step by step (deployment.yaml's comment has the same table).
APP_EXIT_SECONDS = 10
"""The app's own shutdown: the kubelet signals the sidecar only once the app has exited."""
INGEST_STOP_SECONDS = 5
"""Stopping ingest: persists in progress finish (``sidecar.wiring.shutdown`` bounds this step at 5 s)."""
HANDOVER_SECONDS = 2
"""Writing the hand-over of every owned lease (one conditional write each, all at once): the < 2 s target."""
ACK_COMMIT_SECONDS = 5
"""Committing the acks queued by the drain (``sidecar.wiring.shutdown`` bounds this step at 5 s)."""
CLIENT_CLOSE_SECONDS = 5
"""Closing the Pub/Sub, Firestore and Monitoring clients at the end (normally milliseconds)."""


def sidecar_shutdown_seconds(config: SidecarConfig) -> float:
    """The sidecar's SIGTERM sequence with its config's ``sharding`` values, subscription after
    subscription: stop ingest, drain the app's in-flight messages of its shards (``drain_timeout``),
    hand the shards over, commit the queued acks."""
    return sum(
        INGEST_STOP_SECONDS + sub.sharding.drain_timeout_ms / 1000 + HANDOVER_SECONDS + ACK_COMMIT_SECONDS
        for sub in config.subscriptions
    )


def minimum_termination_grace_seconds(config: SidecarConfig, sidecar_grace_period: float) -> float:
    """What terminationGracePeriodSeconds must cover: the app's exit, then the sidecar's shutdown
    (cut at its --grace-period, so budgeted at least that long), then closing its clients."""
    return APP_EXIT_SECONDS + max(sidecar_grace_period, sidecar_shutdown_seconds(config)) + CLIENT_CLOSE_SECONDS


def _scaled(value: int | str, total: int) -> int:
    """A budget's int-or-percent as the disruption controller reads it (a percentage rounds up)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"(\d+)%", value)
    assert match, f"not an int or a percentage: {value!r}"
    return -(-int(match.group(1)) * total // 100)


def disruptions_allowed(pdb: Resource, replicas: int) -> int:
    """Evictions the budget allows at once while all ``replicas`` pods are healthy."""
    spec = pdb["spec"]
    if "minAvailable" in spec:
        return replicas - _scaled(spec["minAvailable"], replicas)
    return _scaled(spec["maxUnavailable"], replicas)


# ---- replicas and rollout --------------------------------------------------------------------


def test_three_pods_share_the_subscription_and_roll_one_at_a_time(rendered: list[Resource]) -> None:
    spec = only(rendered, "Deployment")["spec"]
    assert spec["replicas"] == REPLICAS
    # A new pod is Ready before an old one stops: consumption never drops below the replica count.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": MAX_SURGE, "maxUnavailable": MAX_UNAVAILABLE},
    }


def test_no_manifest_is_left_with_recreate_or_a_single_replica() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 8, files
    for path in files:
        text = path.read_text()
        assert "Recreate" not in text, path
        assert not re.search(r"\breplicas:\s*1\b", text), path
        assert "one replica" not in text.lower(), path


def test_the_sidecar_knows_its_pod_name_from_the_downward_api(rendered: list[Resource]) -> None:
    env = {e["name"]: e for e in sidecar_container(rendered).get("env", [])}
    assert env["POD_NAME"] == {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def test_pods_spread_over_nodes_and_zones_as_a_preference(rendered: list[Resource]) -> None:
    labels = only(rendered, "Deployment")["spec"]["template"]["metadata"]["labels"]
    constraints = {c["topologyKey"]: c for c in pod_spec(rendered)["topologySpreadConstraints"]}
    assert set(constraints) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for constraint in constraints.values():
        assert constraint["labelSelector"]["matchLabels"].items() <= labels.items()
        # A preference: a small cluster, and the rollout's surge pod, still schedule.
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"
        # Only pods of the same revision count, so the old ReplicaSet does not skew the new one.
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]


# ---- disruption budget -----------------------------------------------------------------------


def test_disruption_budget_lets_a_drain_through_while_the_other_pods_consume(rendered: list[Resource]) -> None:
    pdb = only(rendered, "PodDisruptionBudget")
    deployment = only(rendered, "Deployment")
    assert pdb["metadata"].get("namespace") == deployment["metadata"].get("namespace")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    replicas = deployment["spec"]["replicas"]
    allowed = disruptions_allowed(pdb, replicas)
    # A budget that allows no eviction blocks node drains and GKE upgrades for ever.
    assert allowed >= 1
    # The pods left keep delivering while the evicted one hands its shards over.
    assert replicas - allowed >= MIN_CONSUMING_PODS_DURING_A_DRAIN
    # A crash-looping pod must not wedge a drain.
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_disruption_budget_arithmetic() -> None:
    """Guards the check above with budgets that must fail it, and the forms Kubernetes accepts."""

    def budget(**spec: int | str) -> Resource:
        return {"spec": spec}

    assert disruptions_allowed(budget(maxUnavailable=1), 3) == 1
    assert disruptions_allowed(budget(minAvailable=2), 3) == 1
    assert disruptions_allowed(budget(minAvailable=3), 3) == 0  # blocks every drain
    assert disruptions_allowed(budget(maxUnavailable="50%"), 3) == 2  # leaves one pod: too few
    assert disruptions_allowed(budget(minAvailable="50%"), 3) == 1


# ---- termination grace period ----------------------------------------------------------------


def test_grace_period_covers_ingest_stop_drain_hand_over_and_commit(rendered: list[Resource], tmp_path: Path) -> None:
    config = loaded_config(rendered, tmp_path)
    grace_period = sidecar_args(rendered).grace_period
    # The sidecar cuts its shutdown at --grace-period: its hand-over sequence must fit in it.
    assert grace_period >= sidecar_shutdown_seconds(config)
    termination_grace = pod_spec(rendered)["terminationGracePeriodSeconds"]
    assert termination_grace >= minimum_termination_grace_seconds(config, grace_period)
    # The shipped ConfigMaps write the defaults out, and the minimum is the one deployment.yaml shows.
    assert {sub.sharding for sub in config.subscriptions} == {ShardingConfig()}
    assert minimum_termination_grace_seconds(config, grace_period) == 40


def test_grace_period_check_follows_the_configmaps_sharding_values(tmp_path: Path) -> None:
    """Guards the check above: a longer drain in the ConfigMap needs a longer grace period, and a
    ConfigMap without ``sharding`` is checked with the sidecar's own defaults."""
    resources = rendered_copy(BASE)
    data = only(resources, "ConfigMap")["data"]
    text = data[CONFIG_KEY]
    grace_period = sidecar_args(resources).grace_period
    shipped = pod_spec(resources)["terminationGracePeriodSeconds"]

    data[CONFIG_KEY] = text.replace("drain_timeout: 5s", "drain_timeout: 60s")
    assert data[CONFIG_KEY] != text
    long_drain = loaded_config(resources, tmp_path)
    assert sidecar_shutdown_seconds(long_drain) > grace_period
    assert minimum_termination_grace_seconds(long_drain, grace_period) > shipped

    data[CONFIG_KEY] = "\n".join(line for line in text.splitlines() if "sharding:" not in line)
    assert data[CONFIG_KEY] != text
    defaults = loaded_config(resources, tmp_path)
    assert [sub.sharding for sub in defaults.subscriptions] == [ShardingConfig()]
    assert minimum_termination_grace_seconds(defaults, grace_period) <= shipped
