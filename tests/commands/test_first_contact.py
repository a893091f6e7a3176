"""First contact: a command that cannot reach Google says in one line what to set, and exits 2.

Each command runs as a real subprocess (`python -m sidecar`) with every ``*_EMULATOR_HOST`` export
removed, ``GOOGLE_APPLICATION_CREDENTIALS`` unset or naming a missing file, and ``HOME`` an empty
directory (no gcloud ADC file). Nothing here reaches the network: where the metadata server is
asked, it is either the machine's (there is none here) or a local socket that accepts and never
answers, which shows the search is bounded (``sidecar.config.credentials.SEARCH_DEADLINE_SECONDS``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.config import credentials

pytestmark = pytest.mark.timeout(180)

_REPO = Path(__file__).resolve().parent.parent

_SEQUENCE_CONFIG = """\
project: demo-project
subscriptions:
  - name: orders
    subscription: projects/demo-project/subscriptions/orders
    ordering: {mode: sequence, key: {attribute: order_id}, sequence: {attribute: seq}}
"""

_WATERMARK_CONFIG = """\
project: demo-project
subscriptions:
  - name: orders
    subscription: projects/demo-project/subscriptions/orders
    ordering: {mode: watermark, key: {attribute: order_id}, timestamp: {source: publish_time}}
"""


def _env(home: Path, *, credentials_file: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a new user's shell: no emulator export, no credentials, an empty HOME."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.endswith("_EMULATOR_HOST")
        and not name.startswith(("GOOGLE_", "GCE_", "CLOUDSDK_"))
        and name not in ("EMULATORS_ADMIN_URL", "NO_GCE_CHECK")
    }
    env["HOME"] = str(home)
    env["PYTHONPATH"] = str(_REPO)
    if credentials_file is not None:
        env["GOOGLE_APPLICATION_CREDENTIALS"] = credentials_file
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _one_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The command's only output: one stderr line starting with ``pubsub-sidecar <command>:``."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"pubsub-sidecar {command}: "), lines[0]
    assert "Traceback" not in result.stderr and "DefaultCredentialsError" not in result.stderr
    return lines[0]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "sidecar.yaml"
    path.write_text(_SEQUENCE_CONFIG)
    return path


@pytest.fixture
def silent_metadata_server() -> Iterator[str]:
    """host:port of a socket that accepts connections and never answers (a firewalled metadata address)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("credentials_file", [None, "missing"], ids=["credentials-unset", "credentials-missing-file"])
def test_run_without_emulator_exports_or_credentials_names_what_to_set(
    home: Path, config: Path, tmp_path: Path, credentials_file: str | None
) -> None:
    named = None if credentials_file is None else str(tmp_path / "no-such-key.json")
    line = _one_line(_run(["run", "--config", str(config)], _env(home, credentials_file=named), tmp_path), "run")
    assert "PUBSUB_EMULATOR_HOST and FIRESTORE_EMULATOR_HOST are not set" in line
    assert "MONITORING_EMULATOR_HOST" not in line  # sequence mode never asks Monitoring
    assert "export what `pubsub-sidecar emulators` prints" in line
    assert "set GOOGLE_APPLICATION_CREDENTIALS" in line
    if named is None:
        assert line.startswith("pubsub-sidecar run: no Google credentials found")
    else:
        assert f"GOOGLE_APPLICATION_CREDENTIALS names {named!r}, which is not a file" in line


def test_an_unusable_credentials_file_is_named_with_google_s_reason(home: Path, tmp_path: Path) -> None:
    key = tmp_path / "key.json"
    key.write_text("{}")
    args = ["dead-letters", "list", "--dead-letter-subscription", "projects/demo-project/subscriptions/dl"]
    line = _one_line(_run(args, _env(home, credentials_file=str(key)), tmp_path), "dead-letters")
    assert line.startswith("pubsub-sidecar dead-letters: the Google credentials cannot be used (")
    assert str(key) in line and "and PUBSUB_EMULATOR_HOST is not set" in line


def test_an_empty_credentials_variable_is_taken_as_unset(home: Path, config: Path, tmp_path: Path) -> None:
    line = _one_line(_run(["run", "--config", str(config)], _env(home, credentials_file=""), tmp_path), "run")
    assert line.startswith("pubsub-sidecar run: no Google credentials found")


def test_a_forgotten_export_is_named_alone(home: Path, config: Path, tmp_path: Path) -> None:
    env = _env(home, PUBSUB_EMULATOR_HOST="127.0.0.1:1")
    line = _one_line(_run(["run", "--config", str(config)], env, tmp_path), "run")
    assert "and FIRESTORE_EMULATOR_HOST is not set" in line and "PUBSUB_EMULATOR_HOST" not in line


def test_watermark_mode_names_the_monitoring_export_too(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "watermark.yaml"
    config.write_text(_WATERMARK_CONFIG)
    env = _env(home, PUBSUB_EMULATOR_HOST="127.0.0.1:1", FIRESTORE_EMULATOR_HOST="127.0.0.1:1")
    line = _one_line(_run(["run", "--config", str(config)], env, tmp_path), "run")
    assert "and MONITORING_EMULATOR_HOST is not set" in line


@pytest.mark.parametrize(
    "action",
    [
        ["list"],
        ["replay", "--dry-run"],
        ["discard", "--note", "cancelled"],
    ],
    ids=["list", "replay", "discard"],
)
def test_dead_letters_without_the_pubsub_export_names_it(home: Path, tmp_path: Path, action: list[str]) -> None:
    args = ["dead-letters", *action, "--dead-letter-subscription", "projects/demo-project/subscriptions/dl"]
    line = _one_line(_run(args, _env(home), tmp_path), "dead-letters")
    assert "and PUBSUB_EMULATOR_HOST is not set" in line and "GOOGLE_APPLICATION_CREDENTIALS" in line


def test_a_metadata_server_that_never_answers_is_waited_for_a_bounded_time(
    home: Path, config: Path, tmp_path: Path, silent_metadata_server: str
) -> None:
    # google.auth alone would ping it 3 times for 3 s each, with backoff between: over 10 s.
    env = _env(home, GCE_METADATA_IP=silent_metadata_server, GCE_METADATA_HOST=silent_metadata_server)
    line = _one_line(_run(["run", "--config", str(config)], env, tmp_path), "run")
    bound = f"{credentials.SEARCH_DEADLINE_SECONDS:g} s"
    assert f"no Google credentials found within {bound}" in line and "the metadata server did not answer" in line
    assert "PUBSUB_EMULATOR_HOST and FIRESTORE_EMULATOR_HOST are not set" in line


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--target", "127.0.0.1:1", "--timeout", "1"],
        ["unblock", "--target", "127.0.0.1:1", "--subscription", "orders", "--key", "k", "--timeout", "1"],
    ],
    ids=["status", "unblock"],
)
def test_commands_that_talk_to_the_sidecar_need_no_credentials(home: Path, tmp_path: Path, args: list[str]) -> None:
    result = _run(args, _env(home), tmp_path)
    assert result.returncode == 1, (result.stdout, result.stderr)
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"pubsub-sidecar {args[0]}: cannot reach the sidecar at 127.0.0.1:1")
    assert "credentials" not in line and "EMULATOR_HOST" not in line


@pytest.mark.e2e
def test_the_demo_needs_no_export_and_no_credentials(home: Path, tmp_path: Path) -> None:
    result = _run(["demo", "--orders", "2"], _env(home), tmp_path)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    assert "result:               OK" in result.stdout
    assert "Traceback" not in result.stderr


def test_with_every_export_set_nothing_is_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check reads the environment only: the credential search runs only for a service whose
    # export is missing, so an unreachable or absent credential is no concern against the emulators.
    searched: list[str] = []

    def problem(environ: object) -> str:
        searched.append("searched")
        return "no Google credentials found"

    monkeypatch.setattr(credentials, "_credentials_problem", problem)
    env = {credentials.PUBSUB: "127.0.0.1:1", credentials.FIRESTORE: "127.0.0.1:2"}
    credentials.require_google_access([credentials.PUBSUB, credentials.FIRESTORE], env)
    assert searched == []
    with pytest.raises(credentials.GoogleAccessMissing, match="and MONITORING_EMULATOR_HOST is not set"):
        credentials.require_google_access([credentials.PUBSUB, credentials.MONITORING], env)
    assert searched == ["searched"]
