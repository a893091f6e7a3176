"""The Kubernetes manifests in k8s/: valid against real Kubernetes schemas, and consistent with the sidecar.

Validation: every base manifest file on its own, and the base and the example overlay as the real
kustomize renders them (``kubectl kustomize``, what ``kubectl apply -k`` applies; patches are
partial objects, so they are validated only once merged). The schemas ship with
``kubernetes-validate``: nothing is fetched. Versions checked: 1.29 (the first with native
sidecars on by default) and the newest the package knows.

Consistency: the config in each ConfigMap loads with the project's own loader; the probes point at
the port and paths the sidecar's HTTP endpoint really serves (checked against a running one); the
container runs a command line the CLI accepts; the socket the app is told to use is the one the
config listens on, in a volume both containers mount. How several pods share a subscription
(replicas, rollout, disruption budget, grace period): ``test_k8s_scale_out``; their peer channel
(port, secret, NetworkPolicy, the config naming them): ``test_k8s_peering``; the Grafana dashboard:
``test_dashboard``.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
import yaml
from kustomize_build import KustomizeFailed, Resource, load_yaml_documents, pod_containers, render
from rendered_manifests import (
    BASE,
    OVERLAY,
    SIDECAR_CONTAINER,
    app_containers,
    config_text,
    loaded_config,
    only,
    pod_spec,
    rendered_copy,
    sidecar_args,
    sidecar_container,
)

from sidecar.ops.observability import HttpEndpoint, Metrics, Readiness

KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
"""1.29 turned native sidecars (restartPolicy: Always on an init container) on by default."""

# ---- helpers ---------------------------------------------------------------------------------


def base_manifest_files() -> list[Path]:
    (kustomization,) = load_yaml_documents(BASE / "kustomization.yaml")
    return [BASE / entry for entry in kustomization["resources"]]


def http_port(config: Any) -> int:
    return int(config.http.rpartition(":")[2])


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[kind] for kind in ("livenessProbe", "readinessProbe", "startupProbe") if kind in container}


# ---- schema validation -----------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", base_manifest_files(), ids=lambda p: p.name)
def test_every_base_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    documents = load_yaml_documents(path)
    assert documents, f"{path} holds no manifest"
    for document in documents:
        # strict: unknown fields (a typo such as `restartPolicy` misplaced) fail too.
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_base_and_overlay_validate_against_the_kubernetes_schema(
    rendered: list[Resource], version: str
) -> None:
    kinds = sorted(r["kind"] for r in rendered)
    # The overlay creates its namespace; the base leaves the namespace to its overlays.
    namespaced = ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "ServiceAccount"]
    assert kinds in (namespaced, sorted([*namespaced, "Namespace"]))
    for resource in rendered:
        kubernetes_validate.validate(resource, version, strict=True)


def test_kustomize_refuses_a_broken_kustomization(tmp_path: Path) -> None:
    """Guards the rendering: kustomize's own errors surface, nothing renders around them."""
    shutil.copytree(OVERLAY, tmp_path / "overlays" / "example")
    shutil.copytree(BASE, tmp_path / "base")
    patch = tmp_path / "overlays" / "example" / "deployment-patch.yaml"
    patch.write_text(patch.read_text().replace("name: orders-app", "name: no-such-deployment", 1))
    with pytest.raises(KustomizeFailed, match="no-such-deployment"):
        render(tmp_path / "overlays" / "example")


def test_schema_validation_rejects_a_broken_manifest() -> None:
    """Guards the check above: a misspelt field must fail, not pass silently."""
    (deployment,) = load_yaml_documents(BASE / "deployment.yaml")
    deployment["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


# ---- the overlay -----------------------------------------------------------------------------


def test_overlay_sets_namespace_images_identity_and_resources() -> None:
    resources = rendered_copy(OVERLAY)
    assert only(resources, "Namespace")["metadata"]["name"] == "orders"
    assert {r["metadata"]["namespace"] for r in resources if r["kind"] != "Namespace"} == {"orders"}
    images = {c["name"]: c["image"] for c in pod_containers(only(resources, "Deployment"))}
    assert images == {
        # By digest: the image `make image` built last (build/image/digest, docs/image.md).
        SIDECAR_CONTAINER: "europe-west1-docker.pkg.dev/example-project/containers/pubsub-sidecar@"
        + (OVERLAY.parents[2] / "build" / "image" / "digest").read_text().strip(),
        "app": "europe-west1-docker.pkg.dev/example-project/containers/orders-app:1.4.2",
    }
    annotations = only(resources, "ServiceAccount")["metadata"]["annotations"]
    assert annotations["iam.gke.io/gcp-service-account"] == "orders-sidecar@example-project.iam.gserviceaccount.com"
    assert sidecar_container(resources)["resources"]["limits"] == {"cpu": "2", "memory": "1Gi"}
    # The patch merged into the sidecar container; it did not replace it.
    assert sidecar_container(resources)["args"] == sidecar_container(rendered_copy(BASE))["args"]


# ---- consistency with the sidecar ------------------------------------------------------------


def test_configmap_config_loads_with_the_sidecars_own_loader(rendered: list[Resource], tmp_path: Path) -> None:
    # Raises ConfigError, naming the field, if the shipped config were invalid.
    config = loaded_config(rendered, tmp_path)
    subscriptions = yaml.safe_load(config_text(rendered))["subscriptions"]
    assert [s.name for s in config.subscriptions] == [s["name"] for s in subscriptions]
    namespace = only(rendered, "Deployment")["metadata"].get("namespace")
    assert config.project == ("example-project" if namespace == "orders" else "my-project")


def test_sidecar_container_runs_a_command_line_the_cli_accepts(rendered: list[Resource]) -> None:
    container = sidecar_container(rendered)
    # No `command`: the image's ENTRYPOINT (`pubsub-sidecar`) runs with these arguments.
    assert "command" not in container
    args = sidecar_args(rendered)
    assert args.command == "run"
    config_path = Path(args.config)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume_name = mounts[str(config_path.parent)]
    (volume,) = [v for v in pod_spec(rendered)["volumes"] if v["name"] == volume_name]
    configmap = only(rendered, "ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert config_path.name in configmap["data"]


def test_sidecar_is_a_native_sidecar(rendered: list[Resource]) -> None:
    assert sidecar_container(rendered)["restartPolicy"] == "Always"
    assert all(c["name"] != SIDECAR_CONTAINER for c in app_containers(rendered))


def test_app_reaches_the_sidecar_over_the_unix_socket_the_config_listens_on(
    rendered: list[Resource], tmp_path: Path
) -> None:
    listen = loaded_config(rendered, tmp_path).listen
    assert listen.startswith("unix:///")
    socket_directory = str(Path(listen.removeprefix("unix://")).parent)

    def socket_volume(container: dict[str, Any]) -> str:
        (name,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == socket_directory]
        return name

    volume_name = socket_volume(sidecar_container(rendered))
    (volume,) = [v for v in pod_spec(rendered)["volumes"] if v["name"] == volume_name]
    assert "emptyDir" in volume
    for app in app_containers(rendered):
        assert socket_volume(app) == volume_name
        env = {e["name"]: e.get("value") for e in app.get("env", [])}
        assert env["SIDECAR_TARGET"] == listen


def test_probes_use_the_http_port_of_the_config_on_all_interfaces(rendered: list[Resource], tmp_path: Path) -> None:
    config = loaded_config(rendered, tmp_path)
    host = config.http.rpartition(":")[0]
    # The kubelet probes the pod IP: a loopback-only endpoint would fail every probe.
    assert not ipaddress.ip_address(host).is_loopback
    container = sidecar_container(rendered)
    found = probes(container)
    assert set(found) == {"livenessProbe", "readinessProbe", "startupProbe"}
    for probe in found.values():
        assert resolve_port(container, probe["httpGet"]["port"]) == http_port(config)
    assert found["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert found["readinessProbe"]["httpGet"]["path"] == "/readyz"


@pytest.fixture
async def http_endpoint() -> AsyncIterator[tuple[str, Readiness]]:
    readiness = Readiness({})
    endpoint = HttpEndpoint("127.0.0.1:0", Metrics(), readiness)
    await endpoint.start()
    try:
        yield f"http://127.0.0.1:{endpoint.bound_port}", readiness
    finally:
        await endpoint.stop()


async def test_probe_paths_are_served_by_the_sidecars_http_endpoint(http_endpoint: tuple[str, Readiness]) -> None:
    base_url, readiness = http_endpoint
    container = sidecar_container(rendered_copy(OVERLAY))
    paths = {kind: probe["httpGet"]["path"] for kind, probe in probes(container).items()}
    annotations = only(rendered_copy(OVERLAY), "Deployment")["spec"]["template"]["metadata"]["annotations"]
    async with aiohttp.ClientSession() as session:

        async def status_of(path: str) -> int:
            async with session.get(base_url + path) as response:
                return response.status

        # Liveness and startup answer as soon as the process serves HTTP.
        assert await status_of(paths["livenessProbe"]) == 200
        assert await status_of(paths["startupProbe"]) == 200
        # Readiness follows recovery.
        assert await status_of(paths["readinessProbe"]) == 503
        readiness.mark_recovered()
        assert await status_of(paths["readinessProbe"]) == 200
        assert await status_of(annotations["prometheus.io/path"]) == 200


def test_scrape_annotations_point_at_the_metrics_port(rendered: list[Resource], tmp_path: Path) -> None:
    annotations = only(rendered, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == http_port(loaded_config(rendered, tmp_path))


def test_containers_are_locked_down_and_sized(rendered: list[Resource]) -> None:
    spec = pod_spec(rendered)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod_containers(only(rendered, "Deployment")):
        name = container["name"]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"]["drop"] == ["ALL"], name
        assert "add" not in context["capabilities"], name
        for section in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][section]), f"{name} {section}"


def test_service_account_is_annotated_for_workload_identity(rendered: list[Resource]) -> None:
    account = only(rendered, "ServiceAccount")
    assert pod_spec(rendered)["serviceAccountName"] == account["metadata"]["name"]
    email = account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
    assert re.fullmatch(r"[a-z][a-z0-9-]{4,28}[a-z0-9]@[A-Za-z0-9_-]+\.iam\.gserviceaccount\.com", email), email
    # Workload Identity goes through the metadata server; no Kubernetes API token is needed.
    assert account["automountServiceAccountToken"] is False
