"""Rendering k8s/ with the real kustomize, as ``kubectl apply -k`` would, for the manifest tests.

``kubectl kustomize DIR`` is used (kustomize v5 is built into kubectl since 1.27); a standalone
``kustomize`` binary (``kustomize build DIR``) is the fallback. The machine image ships kubectl
(the ``kubectl`` package of google-cloud-cli); ``make check-tools`` says what to install where it
is missing. A missing or too old kustomize fails the tests with that message: skipping them
would hide that the manifests were never rendered.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

MIN_KUSTOMIZE_MAJOR = 5
"""The overlays use ``patches:`` (kustomize >= 3.1); v5 is what kubectl has embedded since 1.27.
Debian's own kubernetes-client (kubectl 1.20) embeds kustomize v2, which cannot render them."""

_RENDER_TIMEOUT_SECONDS = 60
_INSTALL_HINT = (
    "tests/k8s render the manifests with the real kustomize: install kubectl >= 1.27 (the `kubectl` "
    "package of google-cloud-cli, which this project's machine image ships) or a standalone "
    f"kustomize >= v{MIN_KUSTOMIZE_MAJOR}, then run `make check-tools`."
)


class KustomizeUnavailable(RuntimeError):
    """No kustomize of a usable version on PATH."""


class KustomizeFailed(RuntimeError):
    """kustomize refused to render a directory (its own message attached)."""


def load_yaml_documents(path: Path) -> list[Resource]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


@functools.cache
def kustomize_command() -> tuple[str, ...]:
    """The command that renders a kustomization directory given as its last argument."""
    candidates: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    if shutil.which("kubectl"):
        candidates.append((("kubectl", "kustomize"), ("kubectl", "version", "--client")))
    if shutil.which("kustomize"):
        candidates.append((("kustomize", "build"), ("kustomize", "version")))
    found = []
    for build, version_command in candidates:
        version = _kustomize_major(version_command)
        found.append(f"{' '.join(build)} (kustomize major version {version})")
        if version is not None and version >= MIN_KUSTOMIZE_MAJOR:
            return build
    raise KustomizeUnavailable(f"{_INSTALL_HINT} Found: {', '.join(found) or 'neither kubectl nor kustomize'}.")


def _kustomize_major(command: tuple[str, ...]) -> int | None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_RENDER_TIMEOUT_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # kubectl: "Kustomize Version: v5.5.0"; kustomize: "v5.5.0" or "{Version:kustomize/v5.5.0 ...}".
    match = re.search(r"(?:Kustomize Version: |kustomize/|^)v(\d+)\.", result.stdout, re.MULTILINE)
    return int(match.group(1)) if match else None


def render(directory: Path) -> list[Resource]:
    """The resources ``kubectl apply -k directory`` would apply, as kustomize renders them."""
    command = [*kustomize_command(), str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=_RENDER_TIMEOUT_SECONDS, check=False)
    if result.returncode != 0:
        raise KustomizeFailed(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def pod_containers(resource: Resource) -> list[dict[str, Any]]:
    """Init containers then containers of a workload's pod template ([] for other kinds)."""
    spec = resource.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]
