"""A minimal kustomize renderer for the tests (kustomize itself is not installed on these machines).

It implements exactly the kustomization features k8s/ uses, and refuses any other field, so the
tests can never pass on a rendering that differs from what `kubectl apply -k` would produce:

- ``resources``: YAML files, or directories holding a ``kustomization.yaml`` (rendered recursively);
- ``namespace``: set on every resource (all ours are namespaced);
- ``images``: ``name`` -> ``newName`` / ``newTag`` on containers and init containers;
- ``patches`` with ``path``: strategic-merge patches matched by apiVersion, kind and name. Lists
  merge by their Kubernetes patch merge key (``name`` for containers, init containers, volumes and
  env; ``mountPath`` for volume mounts; ``containerPort`` for ports); other lists are replaced; a
  ``null`` value deletes the field.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

_SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "namespace", "images", "patches"})

_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
"""Kubernetes' patchMergeKey for the lists our patches touch."""


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def load_yaml_documents(path: Path) -> list[Resource]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def render(directory: Path) -> list[Resource]:
    """The resources ``kustomize build directory`` would output, in resource order."""
    kustomization_path = directory / "kustomization.yaml"
    (kustomization,) = load_yaml_documents(kustomization_path)
    unsupported = set(kustomization) - _SUPPORTED_FIELDS
    if unsupported:
        raise UnsupportedKustomization(f"{kustomization_path}: fields not supported: {sorted(unsupported)}")

    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        resources.extend(render(target) if target.is_dir() else load_yaml_documents(target))

    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise UnsupportedKustomization(f"{kustomization_path}: only `patches: - path:` is supported")
        for patch in load_yaml_documents(directory / patch_entry["path"]):
            _apply_patch(resources, patch, kustomization_path)

    for image in kustomization.get("images", []):
        _set_image(resources, image)

    namespace = kustomization.get("namespace")
    if namespace:
        for resource in resources:
            resource.setdefault("metadata", {})["namespace"] = namespace
    return resources


def _identity(resource: Resource) -> tuple[str, str, str]:
    return resource["apiVersion"], resource["kind"], resource["metadata"]["name"]


def _apply_patch(resources: list[Resource], patch: Resource, origin: Path) -> None:
    matches = [i for i, resource in enumerate(resources) if _identity(resource) == _identity(patch)]
    if len(matches) != 1:
        raise UnsupportedKustomization(f"{origin}: patch {_identity(patch)} matches {len(matches)} resources")
    resources[matches[0]] = strategic_merge(resources[matches[0]], patch)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    merge_key = _MERGE_KEYS.get(field)
    if merge_key and isinstance(base, list) and isinstance(patch, list):
        merged_list = copy.deepcopy(base)
        for item in patch:
            position = next((i for i, old in enumerate(merged_list) if old.get(merge_key) == item[merge_key]), None)
            if position is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[position] = strategic_merge(merged_list[position], item)
        return merged_list
    return copy.deepcopy(patch)


def pod_containers(resource: Resource) -> list[dict[str, Any]]:
    """Init containers then containers of a workload's pod template ([] for other kinds)."""
    spec = resource.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _set_image(resources: list[Resource], image: dict[str, str]) -> None:
    unsupported = set(image) - {"name", "newName", "newTag"}
    if unsupported:
        raise UnsupportedKustomization(f"images: fields not supported: {sorted(unsupported)}")
    for resource in resources:
        for container in pod_containers(resource):
            name, _, tag = container["image"].partition(":")
            if name != image["name"]:
                continue
            new_name = image.get("newName", name)
            new_tag = image.get("newTag", tag)
            container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name
