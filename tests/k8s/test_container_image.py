"""Structural checks of the two image builds (docs/image.md) and of what `make image` publishes.

No Docker engine runs on these machines: the Dockerfile (python:3.11-slim based, for `docker build`
users) is checked here, never built. `make image` builds the image that is built and smoke-tested
here (scripts/image/, buildah FROM scratch out of Debian packages and locked wheels); building it
needs root, podman and buildah, so .ci/run does it after `make test`, and these tests check what it
leaves in the repository.

What they hold the Dockerfile to: multi-stage, the final stage on python:3.11-slim with nothing but
the installed virtualenv (no compiler, no package manager runs), a non-root user that matches the
Kubernetes manifests, the CLI as entrypoint with a default command the CLI accepts, and a build
context (.dockerignore) that still holds every file the builder copies.

What they hold `make image` to: the Containerfile has the Dockerfile's runtime settings (user,
entrypoint, command, environment, port); the example overlay pins the sidecar's image by a sha256
digest, the one build/image/digest holds and the SBOM describes; the lock file pins every
dependency of pyproject.toml at a version it allows, with a hash.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from kustomize_build import load_yaml_documents, render
from packaging.requirements import Requirement

from sidecar.commands.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
FINAL_BASE_IMAGE = "python:3.11-slim"
IMAGE_BUILD = ROOT / "scripts" / "image"
CONTAINERFILE = IMAGE_BUILD / "Containerfile"
OVERLAY = ROOT / "k8s" / "overlays" / "example"
DIGEST_FILE = ROOT / "build" / "image" / "digest"
SBOM_FILE = ROOT / "build" / "image" / "sbom.cdx.json"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

_BUILD_TOOLS = ("gcc", "g++", "make", "build-essential", "apt-get install", "apk add", "pip install", "pip wheel")
"""Nothing in the final stage may compile or install: it copies the builder's virtualenv."""


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [argument for kw, argument in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages with their (KEYWORD, argument) instructions; joins continuation lines, drops comments."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"

    stages: list[Stage] = []
    for line in logical:
        keyword, _, argument = line.partition(" ")
        keyword = keyword.upper()
        argument = argument.strip()
        if keyword == "FROM":
            words = argument.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(base=words[0], name=name))
        elif keyword != "ARG" or stages:
            assert stages, f"instruction before FROM: {line}"
            stages[-1].instructions.append((keyword, argument))
    return stages


def exec_form(argument: str) -> list[str]:
    value = json.loads(argument)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), argument
    return value


def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_image_is_built_in_stages_and_the_final_stage_only_copies_the_result() -> None:
    builder, *_, final = stages()
    assert len(stages()) >= 2
    assert final.base == FINAL_BASE_IMAGE
    assert builder.name, "the builder stage needs a name for COPY --from"
    assert any("pip wheel" in run for run in builder.all("RUN"))
    copies = final.all("COPY")
    assert copies and all(copy.startswith(f"--from={builder.name} ") for copy in copies)
    for run in final.all("RUN"):
        for tool in _BUILD_TOOLS:
            assert tool not in run, f"final stage runs {tool!r}: {run}"


def test_image_runs_as_the_non_root_user_the_manifests_use() -> None:
    final = stages()[-1]
    (user,) = final.all("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER must be a numeric non-root uid (runAsNonRoot checks it): {user}"
    # USER comes after everything that needs root.
    keywords = [keyword for keyword, _ in final.instructions]
    assert "RUN" not in keywords[keywords.index("USER") :]
    (deployment,) = load_yaml_documents(ROOT / "k8s" / "base" / "deployment.yaml")
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsUser"] == int(uid)
    assert pod_security["runAsGroup"] == int(gid)


def test_entrypoint_is_the_cli_and_the_default_command_is_what_the_manifests_run() -> None:
    final = stages()[-1]
    (entrypoint,) = final.all("ENTRYPOINT")
    (cmd,) = final.all("CMD")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert exec_form(entrypoint) == ["pubsub-sidecar"]
    assert "pubsub-sidecar" in scripts
    args = build_parser().parse_args(exec_form(cmd))
    assert args.command == "run"
    (deployment,) = load_yaml_documents(ROOT / "k8s" / "base" / "deployment.yaml")
    (sidecar,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert sidecar["args"] == exec_form(cmd)


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule for plain patterns: a path is excluded when it or one of its parents matches."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(c, p) or fnmatch.fnmatch(c, p.removeprefix("**/")) for c in candidates for p in patterns)


def test_build_context_keeps_what_the_builder_copies_and_drops_the_rest() -> None:
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "negations are not modelled here"
    builder = stages()[0]
    sources = [src for copy in builder.all("COPY") for src in shlex.split(copy)[:-1] if not src.startswith("--")]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    for heavy in (".venv", ".git", "tests", "sidecar/__pycache__"):
        assert _ignored(heavy, patterns), f"{heavy} would be sent to the Docker daemon"


# ---- make image (scripts/image/) ------------------------------------------------------------


def _pin_digest_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pin_digest", IMAGE_BUILD / "pin_digest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sidecar_image_entry() -> dict[str, str]:
    (kustomization,) = load_yaml_documents(OVERLAY / "kustomization.yaml")
    (entry,) = [image for image in kustomization["images"] if image["name"] == "pubsub-sidecar"]
    return dict(entry)


def test_containerfile_is_scratch_plus_the_root_filesystem_with_the_dockerfiles_runtime_settings() -> None:
    (scratch,) = parse_dockerfile(CONTAINERFILE.read_text())
    assert scratch.base == "scratch"
    assert scratch.all("ADD") == ["rootfs.tar /"]
    assert not scratch.all("RUN") and not scratch.all("COPY"), "the root filesystem is made outside, by base.sh"
    final = stages()[-1]
    for keyword in ("USER", "ENTRYPOINT", "CMD", "EXPOSE"):
        assert scratch.all(keyword) == final.all(keyword), keyword

    def env(stage: Stage) -> dict[str, str]:
        return dict(word.split("=", 1) for argument in stage.all("ENV") for word in shlex.split(argument))

    dockerfile_env, containerfile_env = env(final), env(scratch)
    assert dockerfile_env.keys() == containerfile_env.keys()
    for name in dockerfile_env.keys() - {"PATH"}:
        assert containerfile_env[name] == dockerfile_env[name], name
    # The Dockerfile prepends the venv to the base image's PATH; the Containerfile spells it out.
    venv_bin = dockerfile_env["PATH"].removesuffix(":$PATH")
    assert containerfile_env["PATH"].split(":")[0] == venv_bin


def test_overlay_pins_the_sidecar_image_by_the_digest_make_image_wrote() -> None:
    entry = _sidecar_image_entry()
    assert "newTag" not in entry, "pin the image by digest: a tag can be moved to other bytes"
    assert DIGEST.fullmatch(entry.get("digest", "")), f"not a sha256 digest: {entry.get('digest')!r}"
    assert DIGEST_FILE.read_text().strip() == entry["digest"], "run `make image`: it rewrites both"
    sbom = json.loads(SBOM_FILE.read_text())
    image = sbom["metadata"]["component"]
    assert image["type"] == "container"
    assert {"name": "oci:manifest-digest", "value": entry["digest"]} in image["properties"]
    # kustomize renders the digest into the sidecar container's image reference.
    (deployment,) = [r for r in render(OVERLAY) if r["kind"] == "Deployment"]
    (sidecar,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert sidecar["image"] == f"{entry['newName']}@{entry['digest']}"


def test_sbom_lists_the_venvs_packages_and_the_debian_packages_the_rootfs_is_made_of() -> None:
    sbom = json.loads(SBOM_FILE.read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    components = sbom["components"]
    debian = {c["name"] for c in components if c.get("purl", "").startswith("pkg:deb/debian/")}
    # The project's own two distributions come from local wheels: cyclonedx-py gives them no purl.
    python = {c["name"] for c in components if c.get("purl", "pkg:pypi/").startswith("pkg:pypi/")}
    assert {"pubsub-sidecar", "pubsub-sidecar-client", "grpcio", "google-cloud-firestore"} <= python
    listed = {line.split("#")[0].strip() for line in (IMAGE_BUILD / "debian-packages.txt").read_text().splitlines()}
    assert debian == listed - {""}
    assert "serialNumber" not in sbom and "timestamp" not in sbom["metadata"], "the same image gives the same SBOM"


def test_pin_rewrites_only_the_sidecar_entry_and_is_idempotent() -> None:
    pin = _pin_digest_module().pin
    text = (OVERLAY / "kustomization.yaml").read_text()
    digest = "sha256:" + "ab" * 32
    pinned = pin(text, digest)
    assert pin(pinned, digest) == pinned
    changed = [(a, b) for a, b in zip(text.splitlines(), pinned.splitlines(), strict=True) if a != b]
    assert len(changed) <= 1 and all(b == f"    digest: {digest}" for _, b in changed)
    unpinned = text.replace(f"digest: {_sidecar_image_entry()['digest']}", "newTag: 0.1.0")
    assert pin(unpinned, digest) == pinned, "a tag is replaced by the digest"


def test_image_lock_pins_every_dependency_at_an_allowed_version_with_a_hash() -> None:
    locked: dict[str, str] = {}
    for line in (IMAGE_BUILD / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            requirement, _, hashes = line.partition(" ")
            assert re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", hashes), line
            name, _, version = requirement.partition("==")
            locked[_normalise(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in map(Requirement, project["dependencies"]):
        name = _normalise(dependency.name)
        if name == "pubsub-sidecar-client":
            assert name not in locked, "built from clients/python at every build, never locked"
            continue
        assert name in locked, f"{name} is not in scripts/image/requirements.txt: run scripts/image/lock.py"
        assert dependency.specifier.contains(locked[name]), f"{name}=={locked[name]} outside {dependency.specifier}"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
