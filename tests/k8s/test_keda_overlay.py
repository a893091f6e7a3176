"""k8s/overlays/keda: the app's Deployment scaled on lag by KEDA, checked as kustomize renders it.

Schemas: the ScaledObject and the TriggerAuthentication validate against the CRDs of the KEDA
release pinned in tests/k8s/schemas (their ``openAPIV3Schema``, with the ``jsonschema`` package),
strictly: an unknown field fails, as ``kubectl apply --validate=strict`` would refuse it (the API
server would otherwise prune it without a word). The core kinds validate against the Kubernetes
schemas as in ``test_k8s_manifests``; the PodMonitoring (Managed Prometheus) is not schema-checked.

Consistency: the ScaledObject scales the Deployment kustomize rendered, which no longer sets
``replicas``; at most one pod per shard (and the 4-shards-per-pod sizing rule of
docs/operations.md) at maxReplicaCount; scale-down damped; the lag query names the sidecar's own
metric as the sidecar exports it, for the namespace and subscription of the config; the backlog
query names Pub/Sub's metric under its PromQL name, for the config's project and subscription;
every trigger authenticates through Workload Identity (podIdentity provider gcp).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from kustomize_build import Resource, load_yaml_documents
from prometheus_client import generate_latest
from rendered_manifests import K8S, loaded_config, only, rendered_copy

from sidecar.emulators.monitoring import NUM_UNDELIVERED
from sidecar.ops.observability import Metrics

KEDA = K8S / "overlays" / "keda"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KEDA_RELEASE = "v2.20.2"
SHARDS_PER_POD = 4
"""docs/operations.md, "Sizing S": at least 4 shards per pod at the largest replica count."""

CRD_KINDS = {
    "ScaledObject": "keda.sh_scaledobjects.yaml",
    "TriggerAuthentication": "keda.sh_triggerauthentications.yaml",
}


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the CRD lists an object's fields."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.cache
def crd_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    (crd,) = load_yaml_documents(SCHEMAS / CRD_KINDS[kind])
    assert crd["spec"]["names"]["kind"] == kind
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    # metadata is the API server's to check (ObjectMeta); the CRD says only "object".
    return jsonschema.Draft7Validator(schema)


def validate_custom_resource(resource: Resource) -> None:
    crd_validator(resource["kind"], resource["apiVersion"]).validate(resource)


def rendered_keda() -> list[Resource]:
    return rendered_copy(KEDA)


def prometheus_triggers(scaled: Resource) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"}


def promql_name(monitoring_metric_type: str) -> str:
    """A Cloud Monitoring metric type as PromQL names it: the first / becomes :, other specials _."""
    domain, _, path = monitoring_metric_type.partition("/")
    return re.sub(r"[^A-Za-z0-9_]", "_", domain) + ":" + re.sub(r"[^A-Za-z0-9_]", "_", path)


# ---- schemas ---------------------------------------------------------------------------------


def test_schemas_are_the_pinned_keda_release() -> None:
    for name in CRD_KINDS.values():
        header = (SCHEMAS / name).read_text().splitlines()[:2]
        assert f"KEDA {KEDA_RELEASE} " in header[0], name
        assert header[1] == f"# https://github.com/kedacore/keda/blob/{KEDA_RELEASE}/config/crd/bases/{name}"


def test_custom_resources_validate_against_the_keda_crds() -> None:
    resources = rendered_keda()
    custom = [r for r in resources if r["kind"] in CRD_KINDS]
    assert sorted(r["kind"] for r in custom) == ["ScaledObject", "TriggerAuthentication"]
    for resource in custom:
        validate_custom_resource(resource)


def test_core_resources_validate_against_the_kubernetes_schema() -> None:
    resources = rendered_keda()
    core = [r for r in resources if r["apiVersion"].partition("/")[0] in ("v1", "apps", "policy", "networking.k8s.io")]
    assert sorted(r["kind"] for r in core) == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ServiceAccount",
    ]
    for resource in core:
        kubernetes_validate.validate(resource, kubernetes_validate.utils.latest_version(), strict=True)


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("ScaledObject", lambda r: r["spec"].update(maxReplicaCounts=4)),
        ("ScaledObject", lambda r: r["spec"]["advanced"]["horizontalPodAutoscalerConfig"].update(behaviour={})),
        ("ScaledObject", lambda r: r["spec"]["triggers"][0]["metadata"].update(threshold=30)),
        ("ScaledObject", lambda r: r["spec"].pop("scaleTargetRef")),
        ("TriggerAuthentication", lambda r: r["spec"]["podIdentity"].update(provider="gke")),
    ],
    ids=["misspelt-field", "misspelt-behavior", "threshold-not-a-string", "no-target", "unknown-provider"],
)
def test_crd_validation_rejects_a_broken_resource(kind: str, mutate: Any) -> None:
    """Guards the check above: each of these must fail, not pass silently."""
    resource = copy.deepcopy(only(rendered_keda(), kind))
    validate_custom_resource(resource)
    mutate(resource)
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(resource)


# ---- consistency -----------------------------------------------------------------------------


def test_scaled_object_targets_the_deployment_whose_replicas_it_owns() -> None:
    resources = rendered_keda()
    deployment = only(resources, "Deployment")
    scaled = only(resources, "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("apiVersion"), target.get("kind"), target["name"]) == (
        deployment["apiVersion"],
        deployment["kind"],
        deployment["metadata"]["name"],
    )
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    # kubectl apply would otherwise reset the HPA's count at every apply.
    assert "replicas" not in deployment["spec"]
    assert "replicas" in only(rendered_copy(K8S / "overlays" / "example"), "Deployment")["spec"]


def shard_fit_errors(spec: dict[str, Any], shards: int) -> list[str]:
    """What is wrong with a ScaledObject's replica range for a subscription of ``shards`` shards."""
    errors = []
    if spec["maxReplicaCount"] > shards:
        # A pod beyond the S-th owns no shard: it would ingest but never deliver.
        errors.append(f"maxReplicaCount {spec['maxReplicaCount']} > {shards} shards")
    if spec["maxReplicaCount"] * SHARDS_PER_POD > shards:
        errors.append(f"fewer than {SHARDS_PER_POD} shards per pod at maxReplicaCount {spec['maxReplicaCount']}")
    if not 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]:
        errors.append(f"replica range {spec['minReplicaCount']}..{spec['maxReplicaCount']}")
    return errors


def test_max_replicas_fit_the_shard_count(tmp_path: Path) -> None:
    resources = rendered_keda()
    (subscription,) = loaded_config(resources, tmp_path).subscriptions
    assert shard_fit_errors(only(resources, "ScaledObject")["spec"], subscription.sharding.shards) == []


@pytest.mark.parametrize(("shards", "expected"), [(3, "maxReplicaCount 4 > 3 shards"), (12, "fewer than 4 shards")])
def test_max_replica_check_follows_the_config(tmp_path: Path, shards: int, expected: str) -> None:
    """Guards the check above: a config with too few shards for maxReplicaCount fails it."""
    resources = rendered_keda()
    configmap = only(resources, "ConfigMap")
    configmap["data"]["sidecar.yaml"] = configmap["data"]["sidecar.yaml"].replace("shards: 16", f"shards: {shards}")
    (subscription,) = loaded_config(resources, tmp_path).subscriptions
    assert subscription.sharding.shards == shards
    errors = shard_fit_errors(only(resources, "ScaledObject")["spec"], subscription.sharding.shards)
    assert any(expected in error for error in errors), errors


def test_scale_down_is_damped_and_one_pod_at_a_time() -> None:
    behavior = only(rendered_keda(), "ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    down = behavior["scaleDown"]
    # Each scale event moves shard leases: wait out short dips, then remove one pod per period.
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["policies"] and all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
    assert all(p["periodSeconds"] >= 60 for p in down["policies"])
    assert down.get("selectPolicy", "Max") in ("Min", "Max")


def test_every_trigger_authenticates_through_workload_identity() -> None:
    resources = rendered_keda()
    auth = only(resources, "TriggerAuthentication")
    assert auth["spec"] == {"podIdentity": {"provider": "gcp"}}, "no key file, no Secret"
    triggers = only(resources, "ScaledObject")["spec"]["triggers"]
    assert triggers and all(t["type"] == "prometheus" for t in triggers), "Prometheus scaler only, not gcp-pubsub"
    assert all(t["authenticationRef"] == {"name": auth["metadata"]["name"]} for t in triggers)


def test_lag_trigger_reads_the_sidecars_own_metric(tmp_path: Path) -> None:
    resources = rendered_keda()
    config = loaded_config(resources, tmp_path)
    trigger = prometheus_triggers(only(resources, "ScaledObject"))["sidecar-lag"]
    metadata = trigger["metadata"]
    assert metadata["serverAddress"] == (
        f"https://monitoring.googleapis.com/v1/projects/{config.project}/location/global/prometheus"
    )
    match = re.fullmatch(r"max\((\w+)\{namespace=\"([^\"]+)\", subscription=\"([^\"]+)\"\}\)", metadata["query"])
    assert match, metadata["query"]
    metric, namespace, subscription = match.groups()
    metrics = Metrics()
    metrics.add_collector(list)
    exported = generate_latest(metrics.registry).decode()
    assert f"# TYPE {metric} gauge" in exported, f"the sidecar exports no gauge {metric}"
    assert metric.endswith("oldest_undelivered_age_seconds")
    assert namespace == only(resources, "Deployment")["metadata"]["namespace"]
    assert subscription in [s.name for s in config.subscriptions]
    # An age is not shared among pods: the HPA scales by value / threshold.
    assert trigger["metricType"] == "Value"


def test_backlog_trigger_reads_pubsubs_metric_for_the_configs_subscription(tmp_path: Path) -> None:
    resources = rendered_keda()
    config = loaded_config(resources, tmp_path)
    trigger = prometheus_triggers(only(resources, "ScaledObject"))["pubsub-backlog"]
    metadata = trigger["metadata"]
    assert (
        metadata["serverAddress"]
        == prometheus_triggers(only(resources, "ScaledObject"))["sidecar-lag"]["metadata"]["serverAddress"]
    )
    match = re.fullmatch(r"sum\(([\w:]+)\{(.*)\}\)", metadata["query"])
    assert match, metadata["query"]
    metric, selector = match.groups()
    assert metric == promql_name(NUM_UNDELIVERED) == "pubsub_googleapis_com:subscription_num_undelivered_messages"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', selector))
    (subscription,) = config.subscriptions
    project, _, subscription_id = subscription.subscription.removeprefix("projects/").partition("/subscriptions/")
    assert labels == {
        "monitored_resource": "pubsub_subscription",
        "project_id": project,
        "subscription_id": subscription_id,
    }
    # Messages are shared among pods: the HPA divides the backlog by the replica count.
    assert trigger["metricType"] == "AverageValue"


def test_pod_monitoring_scrapes_the_sidecars_metrics_port(tmp_path: Path) -> None:
    resources = rendered_keda()
    monitoring = only(resources, "PodMonitoring")
    deployment = only(resources, "Deployment")
    assert monitoring["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitoring["spec"]["endpoints"]
    http = loaded_config(resources, tmp_path).http
    assert endpoint["port"] == int(http.rpartition(":")[2])
    assert endpoint["path"] == "/metrics"


def test_keda_overlay_is_the_example_plus_autoscaling() -> None:
    """The overlay changes nothing of the example but the replica count (owned by the HPA now)."""
    example = {(r["kind"], r["metadata"]["name"]): r for r in rendered_copy(K8S / "overlays" / "example")}
    keda = {(r["kind"], r["metadata"]["name"]): r for r in rendered_keda()}
    added = sorted(kind for kind, _ in set(keda) - set(example))
    assert added == ["PodMonitoring", "ScaledObject", "TriggerAuthentication"]
    assert set(example) <= set(keda)
    for key, resource in example.items():
        if key[0] == "Deployment":
            resource["spec"].pop("replicas")
        assert keda[key] == resource, key
