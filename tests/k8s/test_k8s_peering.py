"""The peer channel in k8s/: its port, its address, its Secret and the NetworkPolicy around it.

Rendered with the real kustomize (base and example overlay, the ``rendered`` fixture). Pods of one
Deployment forward messages to the owner of their key over the sidecar's peer port
(docs/forwarding.md, docs/operations.md "Scaling out"); what the manifests must give them:

- the sidecar container's port named ``peer``, and ``POD_IP`` from the downward API (the address a
  pod advertises to the others defaults to ``$POD_IP:<peering.port>``);
- the shared secret, mounted read-only from the Secret ``pubsub-sidecar-peer`` (key ``secret``), a
  Secret the base does not carry (docs/deploy.md creates it);
- a NetworkPolicy that admits only pods of the same Deployment (its selector) on the peer port, and
  leaves the metrics and probe port open as it was.

``policy_problems`` returns every way a rendering breaks the last rule; the drift tests run it on
mutated renderings to show that each kind of opening is caught.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kustomize_build import Resource
from rendered_manifests import BASE, CONFIG_KEY, loaded_config, only, pod_spec, rendered_copy, sidecar_container

PEER_PORT_NAME = "peer"
PEER_PORT = 7100
"""The config's ``peering.port`` default; the manifests and the config name the same number."""
METRICS_PORT_NAME = "http"
SECRET_NAME = "pubsub-sidecar-peer"
SECRET_KEY = "secret"

# ---- helpers ---------------------------------------------------------------------------------


def container_port(container: dict[str, Any], name: str) -> int:
    (number,) = [int(p["containerPort"]) for p in container.get("ports", []) if p.get("name") == name]
    return number


def rule_admits_port(rule: dict[str, Any], container: dict[str, Any], port: int) -> bool:
    """Whether an ingress rule admits TCP traffic to ``port`` of the container (no ``ports``: all)."""
    entries = rule.get("ports")
    if not entries:
        return True
    for entry in entries:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in entry:
            return True  # every port of that protocol
        first = entry["port"]
        if isinstance(first, str):
            named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == first]
            if port in named:
                return True
            continue
        if first <= port <= entry.get("endPort", first):
            return True
    return False


def secret_volume(resources: list[Resource]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sidecar's mount of the peer Secret and the volume it mounts."""
    volumes = {v["name"]: v for v in pod_spec(resources)["volumes"]}
    ((mount, volume),) = [
        (m, volumes[m["name"]])
        for m in sidecar_container(resources)["volumeMounts"]
        if volumes[m["name"]].get("secret", {}).get("secretName") == SECRET_NAME
    ]
    return mount, volume


def policy_problems(resources: list[Resource]) -> list[str]:
    """Every way the rendered NetworkPolicies fail "only the Deployment's pods reach the peer port,
    the metrics port stays open"; empty when they hold."""
    found: list[str] = []
    deployment = only(resources, "Deployment")
    selector = deployment["spec"]["selector"]
    namespace = deployment["metadata"].get("namespace")
    container = sidecar_container(resources)
    peer = container_port(container, PEER_PORT_NAME)
    metrics = container_port(container, METRICS_PORT_NAME)
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    # Policies are additive: any policy that selects the pods and admits the peer port counts.
    selecting = [p for p in policies if p["spec"]["podSelector"] == selector]
    if not selecting:
        found.append(f"no NetworkPolicy selects the Deployment's pods ({selector})")
    for policy in policies:
        name = policy["metadata"]["name"]
        spec = policy["spec"]
        if policy["metadata"].get("namespace") != namespace:
            found.append(f"{name}: in namespace {policy['metadata'].get('namespace')}, not the Deployment's")
        if spec["podSelector"] != selector:
            found.append(f"{name}: podSelector {spec['podSelector']} is not the Deployment's selector {selector}")
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
            found.append(f"{name}: does not restrict ingress")
        for rule in spec.get("ingress", []):
            for entry in rule.get("ports", []):
                if isinstance(entry.get("port"), str):
                    # A native sidecar is an init container: network plugins have resolved named ports
                    # against the regular containers only (kubernetes/kubernetes#125285).
                    found.append(f"{name}: names port {entry['port']!r}; the sidecar's ports must be numbers")
        admitting = [rule for rule in spec.get("ingress", []) if rule_admits_port(rule, container, peer)]
        for rule in admitting:
            sources = rule.get("from")
            if sources != [{"podSelector": selector}]:
                found.append(f"{name}: admits {sources or 'every source'} on the peer port {peer}")
        if policy in selecting and not admitting:
            found.append(f"{name}: admits nobody on the peer port {peer}: forwarding would be cut off")
        if policy in selecting and not any(
            rule_admits_port(rule, container, metrics) and not rule.get("from") for rule in spec.get("ingress", [])
        ):
            found.append(f"{name}: the metrics port {metrics} is no longer open to Prometheus")
    return found


# ---- the port, the address and the secret ----------------------------------------------------


def test_the_sidecar_serves_the_peer_port_and_knows_its_pod_ip(rendered: list[Resource]) -> None:
    container = sidecar_container(rendered)
    assert container_port(container, PEER_PORT_NAME) == PEER_PORT
    ports = [p["containerPort"] for p in container["ports"]]
    assert len(ports) == len(set(ports)), ports
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_the_shared_secret_is_mounted_read_only_from_its_secret(rendered: list[Resource]) -> None:
    mount, volume = secret_volume(rendered)
    assert mount["readOnly"] is True
    secret = volume["secret"]
    assert secret["items"] == [{"key": SECRET_KEY, "path": SECRET_KEY}]
    # Not optional: a pod without the Secret waits for it rather than start without credentials.
    assert secret.get("optional", False) is False
    # 0440: the group is the pod's fsGroup, the sidecar's; nobody else may read it.
    assert secret["defaultMode"] == 0o440
    pod_context = pod_spec(rendered)["securityContext"]
    assert pod_context["fsGroup"] == pod_context["runAsGroup"]
    assert "runAsGroup" not in sidecar_container(rendered)["securityContext"]
    # Only the sidecar holds it: the app container has no reason to.
    for app in pod_spec(rendered)["containers"]:
        assert volume["name"] not in {m["name"] for m in app.get("volumeMounts", [])}, app["name"]


def test_the_secret_itself_is_not_in_the_manifests(rendered: list[Resource]) -> None:
    """Each deployment creates its own (docs/deploy.md); a secret in git would be everyone's."""
    assert [r for r in rendered if r["kind"] == "Secret"] == []


# ---- the NetworkPolicy -----------------------------------------------------------------------


def test_only_pods_of_the_deployment_reach_the_peer_port(rendered: list[Resource]) -> None:
    policy = only(rendered, "NetworkPolicy")
    deployment = only(rendered, "Deployment")
    selector = deployment["spec"]["selector"]
    # The selector is the Deployment's own, and its labels are on every pod the Deployment makes.
    assert policy["spec"]["podSelector"] == selector
    assert selector["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    container = sidecar_container(rendered)
    (peer_rule,) = [rule for rule in policy["spec"]["ingress"] if rule_admits_port(rule, container, PEER_PORT)]
    assert peer_rule["from"] == [{"podSelector": selector}]
    (entry,) = peer_rule["ports"]
    assert entry["port"] == container_port(container, PEER_PORT_NAME)
    assert policy_problems(rendered) == []


def _peer_rule(policy: Resource) -> dict[str, Any]:
    rules: list[dict[str, Any]] = policy["spec"]["ingress"]
    (rule,) = [r for r in rules if r.get("ports", [{}])[0].get("port") == PEER_PORT]
    return rule


def _name_the_peer_port(resources: list[Resource]) -> None:
    _peer_rule(only(resources, "NetworkPolicy"))["ports"][0]["port"] = PEER_PORT_NAME


def _move_the_peer_port(resources: list[Resource]) -> None:
    _peer_rule(only(resources, "NetworkPolicy"))["ports"][0]["port"] = PEER_PORT + 1


DRIFTS: dict[str, tuple[Callable[[list[Resource]], None], str]] = {
    "any-namespace": (
        lambda rs: _peer_rule(only(rs, "NetworkPolicy"))["from"].append({"namespaceSelector": {}}),
        "on the peer port",
    ),
    "any-source": (lambda rs: _peer_rule(only(rs, "NetworkPolicy")).pop("from"), "every source on the peer port"),
    "all-ports-open": (lambda rs: only(rs, "NetworkPolicy")["spec"]["ingress"][1].pop("ports"), "on the peer port"),
    "port-range-over-peer": (
        lambda rs: only(rs, "NetworkPolicy")["spec"]["ingress"][1]["ports"].append(
            {"port": 7000, "endPort": 7200, "protocol": "TCP"}
        ),
        "on the peer port",
    ),
    "other-app": (
        lambda rs: only(rs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/name": "payments-app"}
        ),
        "is not the Deployment's selector",
    ),
    "named-port": (_name_the_peer_port, "names port 'peer'"),
    "another-port": (_move_the_peer_port, "admits nobody on the peer port"),
    "metrics-closed": (lambda rs: only(rs, "NetworkPolicy")["spec"]["ingress"].pop(1), "metrics port"),
}


@pytest.mark.parametrize("drift", DRIFTS)
def test_an_opening_in_the_policy_is_caught(drift: str) -> None:
    """Guards the check above: each way of opening the peer port (or closing the metrics port)."""
    mutate, mentioned = DRIFTS[drift]
    resources = rendered_copy(BASE)
    assert policy_problems(resources) == []
    mutate(resources)
    found = policy_problems(resources)
    assert any(mentioned in problem for problem in found), found


# ---- the config names what the pod has --------------------------------------------------------


def peering_problems(resources: list[Resource], directory: Path) -> list[str]:
    """Every way the ConfigMap's ``peering`` section, as the sidecar loads it, misses the pod."""
    found: list[str] = []
    peering = loaded_config(resources, directory).peering
    if peering is None or not peering.enabled:
        return ["no peering section with a port: the peer channel is off, every forward goes the inbox's way"]
    container = sidecar_container(resources)
    mount, volume = secret_volume(resources)
    files = [f"{mount['mountPath']}/{item['path']}" for item in volume["secret"]["items"]]
    if peering.secret_file not in files:
        found.append(f"peering.secret_file {peering.secret_file!r} is not the mounted secret {files}")
    if peering.port != container_port(container, PEER_PORT_NAME):
        found.append(f"peering.port {peering.port} is not the container port `peer`")
    if peering.trusted_network:
        found.append("peering.trusted_network is on: the peer channel would take calls without the secret")
    env = {e["name"] for e in container.get("env", [])}
    if not peering.advertise_address and "POD_IP" not in env:
        found.append("peering.advertise_address defaults to $POD_IP, which the container lacks")
    return found


def test_the_config_names_the_mounted_secret_and_the_peer_port(rendered: list[Resource], tmp_path: Path) -> None:
    config = loaded_config(rendered, tmp_path)
    assert config.peering is not None
    assert config.peering.port == PEER_PORT
    assert config.peering.secret_file == f"/var/run/secrets/{SECRET_NAME}/{SECRET_KEY}"
    assert peering_problems(rendered, tmp_path) == []


def _edit_config(old: str, new: str) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        data = only(resources, "ConfigMap")["data"]
        assert old in data[CONFIG_KEY], old
        data[CONFIG_KEY] = data[CONFIG_KEY].replace(old, new)

    return mutate


def _move_the_mount(resources: list[Resource]) -> None:
    mount, _ = secret_volume(resources)
    mount["mountPath"] = "/etc/peer"


def _change_the_container_port(resources: list[Resource]) -> None:
    (port,) = [p for p in sidecar_container(resources)["ports"] if p["name"] == PEER_PORT_NAME]
    port["containerPort"] = 7200


def _drop_pod_ip(resources: list[Resource]) -> None:
    container = sidecar_container(resources)
    container["env"] = [e for e in container["env"] if e["name"] != "POD_IP"]


def _drop_the_section(resources: list[Resource]) -> None:
    data = only(resources, "ConfigMap")["data"]
    config = yaml.safe_load(data[CONFIG_KEY])
    del config["peering"]
    data[CONFIG_KEY] = yaml.safe_dump(config)


CONFIG_DRIFTS: dict[str, tuple[Callable[[list[Resource]], None], str]] = {
    "secret-file-elsewhere": (
        _edit_config(f"/var/run/secrets/{SECRET_NAME}/{SECRET_KEY}", "/etc/peer/secret"),
        "is not the mounted secret",
    ),
    "mount-moved": (_move_the_mount, "is not the mounted secret"),
    "config-port": (_edit_config("port: 7100", "port: 7101"), "is not the container port"),
    "container-port": (_change_the_container_port, "is not the container port"),
    "trusted-network": (_edit_config("trusted_network: false", "trusted_network: true"), "without the secret"),
    "no-pod-ip": (_drop_pod_ip, "$POD_IP"),
    "channel-off": (_edit_config("port: 7100", "port: 0"), "the peer channel is off"),
    "no-section": (_drop_the_section, "the peer channel is off"),
}


@pytest.mark.parametrize("drift", CONFIG_DRIFTS)
def test_a_config_that_misses_the_pod_is_caught(drift: str, tmp_path: Path) -> None:
    """Guards the check above: the config and the pod drifting apart, on either side."""
    mutate, mentioned = CONFIG_DRIFTS[drift]
    resources = rendered_copy(BASE)
    assert peering_problems(resources, tmp_path) == []
    mutate(resources)
    found = peering_problems(resources, tmp_path)
    assert any(mentioned in problem for problem in found), found
