"""A config change rolls the pods: the ConfigMap is generated, so its name carries its content's hash.

The sidecar reads its config once, at start. kustomize's configMapGenerator names the ConfigMap
``pubsub-sidecar-config-<hash of sidecar.yaml>`` and rewrites the Deployment's reference to it, so
``kubectl apply -k`` after an edit of sidecar.yaml changes the pod template and the Deployment rolls
(one pod at a time, as for an image change); a rollback (``kubectl rollout undo``) goes back to the
old template, which names the old ConfigMap, still there. Checked here by rendering a copy of k8s/
with the real kustomize before and after a change to the config.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kustomize_build import Resource, render
from rendered_manifests import CONFIG_KEY, K8S, only, pod_spec

CONFIG_VOLUME = "sidecar-config"
GENERATED_NAME = "pubsub-sidecar-config"

# Each overlay directory with the sidecar.yaml its ConfigMap is generated from.
DIRECTORIES = {
    "base": ("base", "base/sidecar.yaml"),
    "example": ("overlays/example", "overlays/example/sidecar.yaml"),
    "keda": ("overlays/keda", "overlays/example/sidecar.yaml"),
}


def referenced_configmap(resources: list[Resource]) -> str:
    (volume,) = [v for v in pod_spec(resources)["volumes"] if v["name"] == CONFIG_VOLUME]
    name: str = volume["configMap"]["name"]
    return name


@pytest.fixture
def k8s_copy(tmp_path: Path) -> Path:
    shutil.copytree(K8S, tmp_path / "k8s")
    return tmp_path / "k8s"


@pytest.mark.parametrize("which", DIRECTORIES)
def test_config_change_changes_the_configmap_the_pod_template_names(k8s_copy: Path, which: str) -> None:
    directory, config_file = DIRECTORIES[which]
    before = render(k8s_copy / directory)
    configmap = only(before, "ConfigMap")
    name = configmap["metadata"]["name"]
    # Generated: the name carries the content's hash, and the pod template names that ConfigMap.
    assert name.startswith(f"{GENERATED_NAME}-") and name != GENERATED_NAME
    assert referenced_configmap(before) == name
    assert configmap["data"][CONFIG_KEY] == (k8s_copy / config_file).read_text()

    config = k8s_copy / config_file
    config.write_text(config.read_text().replace("drain_timeout: 5s", "drain_timeout: 6s"))
    after = render(k8s_copy / directory)
    new_name = only(after, "ConfigMap")["metadata"]["name"]
    assert new_name != name, "a config change must give the ConfigMap a new name"
    assert referenced_configmap(after) == new_name
    template_before = only(before, "Deployment")["spec"]["template"]
    template_after = only(after, "Deployment")["spec"]["template"]
    assert template_after != template_before, "the pod template must change, or the pods do not roll"
    # ... and nothing else of the pod template changed: the roll is the config's.
    (volume,) = [v for v in template_after["spec"]["volumes"] if v["name"] == CONFIG_VOLUME]
    volume["configMap"]["name"] = name
    assert template_after == template_before


def test_same_config_renders_the_same_name(k8s_copy: Path) -> None:
    """A re-apply without a change must not roll the pods (each roll moves shard leases)."""
    first = render(k8s_copy / "overlays" / "example")
    second = render(k8s_copy / "overlays" / "example")
    assert referenced_configmap(first) == referenced_configmap(second)
