"""Structural checks of the Dockerfile (no Docker engine runs on these machines, so it is never built here).

What they hold the image to: multi-stage, the final stage on python:3.11-slim with nothing but the
installed virtualenv (no compiler, no package manager runs), a non-root user that matches the
Kubernetes manifests, the CLI as entrypoint with a default command the CLI accepts, and a build
context (.dockerignore) that still holds every file the builder copies.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kustomize_build import load_yaml_documents

from sidecar.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
FINAL_BASE_IMAGE = "python:3.11-slim"

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
