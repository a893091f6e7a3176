"""Real processes for end-to-end tests: the emulators and the sidecar, started as the user would.

Both are started with ``python -m sidecar``; tests talk to them only over the network (the official
Google clients, the project's app client, HTTP). Waits are polls with deadlines, never bare sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

START_TIMEOUT_SECONDS = 60.0
"""Two cores shared with other tests: a cold `python -m sidecar` with the Google clients takes seconds."""


def wait_until(predicate: Callable[[], _T], timeout: float, what: str, interval: float = 0.05) -> _T:
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class _OutputPump:
    """Reads a process's output in a thread, keeping every line (for diagnostics and parsing)."""

    def __init__(self, stream: Any, echo_prefix: str | None = None) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._echo = echo_prefix
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: Any) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
            if self._echo is not None:
                print(f"{self._echo}{line}", file=sys.stderr)

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.lines), timeout)

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])


def _python_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_EMULATOR_HOST")}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class EmulatorsProcess:
    """``pubsub-sidecar emulators`` on port 0, with the addresses it printed."""

    metric_period: float = 1.0
    metric_delay: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    admin_url: str = ""
    _proc: subprocess.Popen[str] | None = None
    _out: _OutputPump | None = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "sidecar", "emulators",
            "--pubsub-port", "0", "--firestore-port", "0", "--monitoring-port", "0", "--admin-port", "0",
            "--metric-period", str(self.metric_period), "--metric-delay", str(self.metric_delay),
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_python_env({})
        )
        self._out = _OutputPump(self._proc.stdout)
        wanted = ("PUBSUB_EMULATOR_HOST", "FIRESTORE_EMULATOR_HOST", "MONITORING_EMULATOR_HOST")

        def has_all(lines: list[str]) -> bool:
            return all(any(line.startswith(f"export {name}=") for line in lines) for name in wanted)

        if not self._out.wait_for(has_all, START_TIMEOUT_SECONDS):
            self.stop()
            raise AssertionError(f"emulators did not start:\n{self._out.tail()}")
        for line in self._out.lines:
            if line.startswith("export ") and "=" in line:
                name, _, value = line[len("export ") :].partition("=")
                value = value.strip().strip("'\"")
                if name == "EMULATORS_ADMIN_URL":
                    self.admin_url = value
                else:
                    self.env[name] = value
        if not self.admin_url:
            self.stop()
            raise AssertionError(f"emulators printed no EMULATORS_ADMIN_URL:\n{self._out.tail()}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)

    # ---- admin API ---------------------------------------------------------------------------

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.admin_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def add_fault(self, **rule: Any) -> Any:
        return self.admin("POST", "/faults", rule)

    def clear_faults(self) -> None:
        self.admin("DELETE", "/faults")

    def firestore_counters(self) -> dict[str, int]:
        return dict(self.admin("GET", "/firestore/counters"))


@dataclass
class SidecarProcess:
    """``pubsub-sidecar run --config FILE`` as a real process."""

    config_path: Path
    env: dict[str, str]
    http: str
    grace_period: float = 10.0
    echo: bool = False
    _proc: subprocess.Popen[str] | None = None
    _out: _OutputPump | None = None

    def start(self, wait_ready: bool = True) -> None:
        cmd = [
            sys.executable, "-m", "sidecar", "run", "--config", str(self.config_path),
            "--log-format", "json", "--grace-period", str(self.grace_period),
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_python_env(self.env)
        )
        self._out = _OutputPump(self._proc.stdout, "[sidecar] " if self.echo else None)
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {self._proc.returncode}:\n{self.output_tail()}")
            return self.http_get("/readyz")[0] == 200

        wait_until(ready, timeout, "the sidecar's /readyz")

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def kill9(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGKILL)
        self._proc.wait(10)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        return self._proc.wait(timeout)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def output_tail(self, n: int = 60) -> str:
        return self._out.tail(n) if self._out is not None else ""

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        for line in list(self._out.lines if self._out else []):
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records
