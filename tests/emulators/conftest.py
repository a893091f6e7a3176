"""Fixtures for the emulator conformance suite.

By default the emulators run as a real subprocess (``python -m sidecar emulators`` on port 0 with a
1 s metric period and 2 s delay); the export lines it prints are the readiness signal. When
``PUBSUB_EMULATOR_HOST`` is already set, the suite runs against that endpoint instead (the official
emulator, say), and tests needing our admin API or metric timing are skipped.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from pubsub_clients import PrivateEmulators

_START_TIMEOUT_SECONDS = 60.0
_STOP_TIMEOUT_SECONDS = 20.0
METRIC_PERIOD_SECONDS = 1.0
METRIC_DELAY_SECONDS = 2.0
# Read when pytest loads this file, before any test runs: what the user pointed the suite at, not
# what another suite's test may have left in the environment.
_EXTERNAL_PUBSUB_HOST = os.environ.get("PUBSUB_EMULATOR_HOST")
_EXTERNAL_MONITORING_HOST = os.environ.get("MONITORING_EMULATOR_HOST")


@dataclass(frozen=True)
class Emulators:
    """Where the emulators are; ``admin_url`` None means an external endpoint without our admin API."""

    pubsub_host: str
    monitoring_host: str | None
    admin_url: str | None
    project: str
    metric_period_seconds: float = METRIC_PERIOD_SECONDS
    metric_delay_seconds: float = METRIC_DELAY_SECONDS

    def require_admin(self) -> str:
        if self.admin_url is None:
            pytest.skip("needs this project's emulators (admin API); running against an external endpoint")
        return self.admin_url

    def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """Call the admin API; returns (HTTP status, decoded JSON body)."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(self.require_admin() + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")


def _read_exports(proc: subprocess.Popen[str]) -> dict[str, str]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="emulator-stdout", daemon=True).start()
    exports: dict[str, str] = {}
    deadline = time.monotonic() + _START_TIMEOUT_SECONDS
    while "EMULATORS_ADMIN_URL" not in exports:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("emulators printed no export lines in time")
        line = lines.get(timeout=remaining)
        if line is None:
            raise RuntimeError(f"emulators exited early with code {proc.wait()}")
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").strip().partition("=")
            exports[name] = value
    return exports


def _start(log_path: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """``python -m sidecar emulators`` on port 0; returns the process and the variables it exported."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "sidecar", "emulators", "--host", "127.0.0.1",
                "--pubsub-port", "0", "--firestore-port", "0", "--monitoring-port", "0", "--admin-port", "0",
                "--metric-period", str(METRIC_PERIOD_SECONDS), "--metric-delay", str(METRIC_DELAY_SECONDS),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )  # fmt: skip
    try:
        return proc, _read_exports(proc)
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(_STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture(scope="session")
def emulators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulators]:
    project = os.environ.get("GOOGLE_CLOUD_PROJECT", "conformance-test")
    external = _EXTERNAL_PUBSUB_HOST
    if external:
        yield Emulators(external, _EXTERNAL_MONITORING_HOST, None, project)
        return
    log_path: Path = tmp_path_factory.mktemp("emulators") / "stderr.log"
    proc, exports = _start(log_path)
    monkeypatch = pytest.MonkeyPatch()
    try:
        for name in ("PUBSUB_EMULATOR_HOST", "MONITORING_EMULATOR_HOST"):
            monkeypatch.setenv(name, exports[name])
        yield Emulators(exports["PUBSUB_EMULATOR_HOST"], exports["MONITORING_EMULATOR_HOST"],
                        exports["EMULATORS_ADMIN_URL"], project)  # fmt: skip
    finally:
        monkeypatch.undo()
        returncode = _stop(proc)
    assert returncode == 0, f"emulators exited with {returncode}; stderr in {log_path}"


@pytest.fixture(scope="module")
def private_emulators(emulators: Emulators, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateEmulators]:
    """A separate emulators process, so that what a module does to its clock reaches no other test."""
    emulators.require_admin()
    log_path: Path = tmp_path_factory.mktemp("private-emulators") / "stderr.log"
    proc, exports = _start(log_path)
    try:
        # The clients read PUBSUB_EMULATOR_HOST when they are built.
        with mock.patch.dict(os.environ, {"PUBSUB_EMULATOR_HOST": exports["PUBSUB_EMULATOR_HOST"]}):
            publisher = pubsub_v1.PublisherClient()
            subscriber = pubsub_v1.SubscriberClient()
        own = Emulators(exports["PUBSUB_EMULATOR_HOST"], exports["MONITORING_EMULATOR_HOST"],
                        exports["EMULATORS_ADMIN_URL"], emulators.project)  # fmt: skip
        yield PrivateEmulators(own, publisher, subscriber)
        subscriber.close()
    finally:
        returncode = _stop(proc)
    assert returncode == 0, f"private emulators exited with {returncode}; stderr in {log_path}"


@pytest.fixture(scope="session")
def publisher(emulators: Emulators) -> Any:
    return pubsub_v1.PublisherClient()


@pytest.fixture(scope="session")
def subscriber(emulators: Emulators) -> Iterator[Any]:
    client = pubsub_v1.SubscriberClient()
    yield client
    client.close()


@dataclass
class Resources:
    """Unique topic/subscription names for one test; everything created is deleted afterwards."""

    project: str
    publisher: Any
    subscriber: Any
    topics: list[str] = field(default_factory=list)
    subscriptions: list[str] = field(default_factory=list)

    def topic(self, name: str = "t") -> str:
        path = self.publisher.topic_path(self.project, f"{name}-{uuid.uuid4().hex[:12]}")
        self.publisher.create_topic(name=path)
        self.topics.append(path)
        return path

    def subscription(self, topic: str, name: str = "s", **fields: Any) -> str:
        path = self.subscriber.subscription_path(self.project, f"{name}-{uuid.uuid4().hex[:12]}")
        self.subscriber.create_subscription(request={"name": path, "topic": topic, **fields})
        self.subscriptions.append(path)
        return path

    def cleanup(self) -> None:
        for path in self.subscriptions:
            try:
                self.subscriber.delete_subscription(subscription=path)
            except exceptions.NotFound:
                pass
        for path in self.topics:
            try:
                self.publisher.delete_topic(topic=path)
            except exceptions.NotFound:
                pass


@pytest.fixture
def resources(emulators: Emulators, publisher: Any, subscriber: Any) -> Iterator[Resources]:
    res = Resources(emulators.project, publisher, subscriber)
    yield res
    res.cleanup()


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
