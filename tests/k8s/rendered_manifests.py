"""The manifests of k8s/ as kustomize renders them, and the parts of them the tests look at.

Shared by the manifest tests (``test_k8s_manifests``, ``test_k8s_scale_out``); the ``rendered``
fixture (base and overlay) is in this folder's conftest.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from kustomize_build import Resource, render

from sidecar.commands.main import build_parser
from sidecar.config.model import SidecarConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"

SIDECAR_CONTAINER = "pubsub-sidecar"
CONFIG_KEY = "sidecar.yaml"


@functools.cache
def _rendered(directory: Path) -> list[Resource]:
    return render(directory)


def rendered_copy(directory: Path) -> list[Resource]:
    """kustomize's rendering of ``directory`` (run once per directory), a copy the test may change."""
    return copy.deepcopy(_rendered(directory))


def only(resources: list[Resource], kind: str) -> Resource:
    found = [resource for resource in resources if resource["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(resources: list[Resource]) -> dict[str, Any]:
    return only(resources, "Deployment")["spec"]["template"]["spec"]


def sidecar_container(resources: list[Resource]) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(resources).get("initContainers", []) if c["name"] == SIDECAR_CONTAINER]
    return container


def app_containers(resources: list[Resource]) -> list[dict[str, Any]]:
    return pod_spec(resources)["containers"]


def config_text(resources: list[Resource]) -> str:
    return only(resources, "ConfigMap")["data"][CONFIG_KEY]


def loaded_config(resources: list[Resource], directory: Path) -> SidecarConfig:
    """The ConfigMap's config as the sidecar itself loads it (raises ConfigError if invalid)."""
    path = directory / CONFIG_KEY
    path.write_text(config_text(resources))
    return load_config(path)


def sidecar_args(resources: list[Resource]) -> Any:
    """The sidecar container's command line as the CLI parses it (its defaults filled in)."""
    return build_parser().parse_args(sidecar_container(resources)["args"])
