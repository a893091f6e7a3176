"""pubsub-sidecar-client is its own distribution: built as a wheel, it declares only grpcio and
protobuf, ships its typing markers and the committed generated code, and works in a fresh virtualenv
that holds nothing else (no google-cloud-* library).

The fresh virtualenv gets the client's dependency closure without a package index: each distribution
the closure needs is linked in file by file from this environment's own install (its RECORD), so the
test runs offline and proves exactly which distributions the client needs.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parent.parent
CLIENT_ROOT = REPO_ROOT / "clients" / "python"

pytestmark = pytest.mark.timeout(300)

_PROBE = r"""
import asyncio, importlib.metadata, importlib.util, sys

import grpc
import pubsub_sidecar_client
from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc

assert pubsub_sidecar_client.__file__.startswith(sys.prefix), pubsub_sidecar_client.__file__
installed = sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions())
assert not any(name.startswith("google-cloud") for name in installed), installed
assert importlib.util.find_spec("google.cloud") is None
assert importlib.util.find_spec("sidecar") is None


async def main() -> None:
    # Nothing listens on port 1: the stream is refused with UNAVAILABLE (transient), so the
    # subscriber keeps trying; closing it ends the attempts cleanly.
    sub = pubsub_sidecar_client.OrderedSubscriber("127.0.0.1:1", "orders", reconnect_backoff_max_seconds=0.2)
    async with sub:
        # Polled with a deadline: a fresh interpreter on busy cores can take more than a second
        # to fail its first attempt.
        deadline = asyncio.get_running_loop().time() + 60
        while sub.reconnects < 1:
            assert asyncio.get_running_loop().time() < deadline, "no reconnect within 60 s"
            await asyncio.sleep(0.05)
        assert sub.is_running
    try:
        await pubsub_sidecar_client.get_status("127.0.0.1:1", timeout_seconds=2)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc.code()
    else:
        raise AssertionError("GetStatus against a closed port succeeded")

asyncio.run(main())
print("ok", " ".join(installed))
"""
"""Runs inside the fresh virtualenv: imports, checks what is installed, and drives a real channel."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client's wheel, built offline from a copy of clients/python (the worktree stays clean)."""
    work = tmp_path_factory.mktemp("client-wheel")
    source = work / "src"
    shutil.copytree(
        CLIENT_ROOT, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "tests")
    )
    out = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out), str(source)],
        check=True,
        capture_output=True,
        text=True,
    )  # fmt: skip
    (built,) = out.glob("pubsub_sidecar_client-*.whl")
    return built


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_wheel_declares_only_grpcio_and_protobuf(wheel: Path) -> None:
    metadata = _metadata(wheel)
    assert metadata["Name"] == "pubsub-sidecar-client"
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    runtime = {canonicalize_name(r.name) for r in requirements if r.marker is None}
    assert runtime == {"grpcio", "protobuf"}


def test_wheel_ships_typing_markers_and_the_committed_generated_code(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        typing_files = {
            "pubsub_sidecar_client/py.typed",
            "pubsub_sidecar/py.typed",
            "pubsub_sidecar/v1/sidecar_pb2.pyi",
        }
        assert typing_files <= names
        generated = sorted(n for n in names if n.startswith("pubsub_sidecar/"))
        for name in generated:
            assert archive.read(name) == (CLIENT_ROOT / "src" / name).read_bytes(), name
    committed = sorted(
        str(p.relative_to(CLIENT_ROOT / "src"))
        for p in (CLIENT_ROOT / "src" / "pubsub_sidecar").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert generated == committed
    # The server's own code is not in the client.
    assert not any(n.startswith("sidecar/") for n in names)


def _closure(requirements: list[Requirement]) -> list[importlib.metadata.Distribution]:
    """The installed distributions that ``requirements`` need, transitively (markers evaluated here)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        dist = importlib.metadata.distribution(name)
        assert dist.version in requirement.specifier, f"installed {name} {dist.version} does not meet {requirement}"
        found[name] = dist
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or child.marker.evaluate({"extra": ""}):
                pending.append(child)
    return list(found.values())


def _link_into(dist: importlib.metadata.Distribution, site_packages: Path) -> None:
    """Make ``dist`` installed in ``site_packages`` by linking each file its RECORD lists."""
    for file in dist.files or []:
        if file.parts[0] == "..":
            continue  # console scripts: not needed to import
        source = Path(str(dist.locate_file(file)))
        if not source.exists():
            continue  # .pyc files listed but not compiled
        target = site_packages / file
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(source)


def test_client_installs_and_runs_in_a_fresh_venv_without_google_cloud(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    requirements = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    closure = _closure(requirements)
    names = sorted(canonicalize_name(d.metadata["Name"]) for d in closure)
    assert not any(n.startswith("google-cloud") for n in names), names
    for dist in closure:
        _link_into(dist, site_packages)

    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([*pip, "install", "--quiet", "--no-index", "--no-deps", str(wheel)], check=True, env=env)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stdout + check.stderr

    # Run from an empty directory, so nothing of the repository is importable by accident.
    probe = subprocess.run(
        [str(python), "-I", "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.startswith("ok ")
    assert sorted(canonicalize_name(n) for n in probe.stdout.split()[1:]) == sorted([*names, "pubsub-sidecar-client"])
