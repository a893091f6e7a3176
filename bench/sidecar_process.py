"""The sidecar as the bench runs it: ``pubsub-sidecar run --config FILE`` as a real process, its
config file, and the optional profiler it runs under.

Rules this module keeps:
- The sidecar runs as a real process, started the way a user starts it (``python -m sidecar run``,
  JSON logs); the bench talks to it only over the network. It listens on port 0 and the bench learns
  its ports from the ready line it logs, then waits for ``/readyz``.
- Its figures come from the kernel (``bench.harness``) and from its own ``/metrics``: reading them
  costs the sidecar nothing it would not do anyway.
- ``Sidecar.pid`` is always the sidecar's own process, also under ``py-spy``: signals (SIGTERM,
  SIGKILL) and ``/proc`` readings go to it, never to the profiler.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import PROJECT, START_TIMEOUT_SECONDS, BenchError, OutputPump, child_env, stop_process, wait_until

_READY_LINE = re.compile(r"sidecar ready: .*gRPC on (?P<grpc>[^\s\",]+), HTTP on (?P<http>[^\s\",]+)")
"""``sidecar.wiring.app`` logs this once recovery is done; with port 0 it is how the bench learns the ports."""


@dataclass
class Profiler:
    """``python -m bench --py-spy DIR``: every sidecar process runs under ``py-spy record --gil``
    (samples only while a thread holds the GIL: the work that competes for the one interpreter),
    writing collapsed stacks to ``DIR/<scenario>[-N].txt`` (``bench/profile_report.py`` summarises
    and draws them). py-spy starts the sidecar itself: attaching to a running pid is refused here."""

    directory: Path | None = None
    rate: int = 250
    _runs: dict[str, int] = field(default_factory=dict)

    def wrap(self, cmd: list[str], name: str) -> list[str] | None:
        if self.directory is None:
            return None
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(py_spy).exists():
            raise BenchError("--py-spy: the py-spy command is not installed (pip install py-spy)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._runs[name] = self._runs.get(name, 0) + 1
        suffix = "" if self._runs[name] == 1 else f"-{self._runs[name]}"
        out = self.directory / f"{name}{suffix}.txt"
        return [py_spy, "record", "--gil", "--rate", str(self.rate), "--format", "raw", "-o", str(out), "--", *cmd]


PROFILER = Profiler()
"""Set by ``--py-spy``; off by default."""


def _child_pid(parent: int, timeout: float = 10.0) -> int:
    """The first child of ``parent`` (the process py-spy started)."""
    path = Path(f"/proc/{parent}/task/{parent}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = path.read_text().split() if path.exists() else []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise BenchError(f"py-spy (pid {parent}) started no sidecar within {timeout:.0f}s")


@dataclass
class Sidecar:
    """``pubsub-sidecar run --config FILE`` as a real process."""

    config_path: Path
    env: dict[str, str]
    grpc: str = ""
    http: str = ""
    _proc: subprocess.Popen[str] | None = None
    _out: OutputPump | None = None

    _pid: int = 0
    _profiled: list[str] | None = None

    @property
    def pid(self) -> int:
        """The sidecar's own process (under a profiler, the profiler's child)."""
        if self._proc is None:
            raise BenchError("the sidecar is not running")
        return self._pid

    def start(self) -> None:
        """Start the process; returns at once (``wait_ready`` waits for /readyz). Under
        ``PROFILER.directory`` the sidecar runs under ``py-spy record``."""
        if self._proc is not None and self._proc.poll() is None:
            raise BenchError("the sidecar is already running")
        cmd = [sys.executable, "-m", "sidecar", "run", "--config", str(self.config_path), "--log-format", "json"]
        self._profiled = PROFILER.wrap(cmd, self.config_path.stem)
        self._proc = subprocess.Popen(
            self._profiled or cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(self.env)
        )
        self._out = OutputPump(self._proc.stdout)
        self.grpc = self.http = ""
        self._pid = self._proc.pid if not self._profiled else _child_pid(self._proc.pid)

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS, interval: float = 0.05) -> None:
        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise BenchError(f"the sidecar exited with {self._proc.returncode}:\n{self.output_tail()}")
            if not self.http:
                for line in self._out.snapshot() if self._out else []:
                    match = _READY_LINE.search(line)
                    if match:
                        self.grpc, self.http = match["grpc"], match["http"]
                        break
                else:
                    return False
            return self.http_get("/readyz")[0] == 200

        try:
            wait_until(ready, timeout, "the sidecar's /readyz", interval)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.output_tail()}") from None

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on ``/metrics`` (0 when absent)."""
        status, body = self.http_get("/metrics")
        if status != 200:
            raise BenchError(f"the sidecar's /metrics answered {status}")
        return sum(
            sample.value
            for family in text_string_to_metric_families(body)
            for sample in family.samples
            if sample.name == name
        )

    def stop(self) -> int | None:
        """SIGTERM (the sidecar drains and exits) and wait; returns the exit code."""
        if self._profiled and self._proc is not None and self._proc.poll() is None:
            # The profiler writes its file once its child exits: signal the sidecar, not py-spy.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        return stop_process(self._proc, 60)

    def kill9(self) -> int | None:
        """SIGKILL (a crash: no drain, no hand-over) and wait; returns the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)  # the sidecar's own pid, also under a profiler
        return self._proc.wait(10)

    def output_tail(self, n: int = 30) -> str:
        return self._out.tail(n) if self._out is not None else ""

    def error_log_lines(self) -> list[str]:
        """The JSON log lines at ERROR or above (kept within the output pump's window)."""
        lines = self._out.snapshot() if self._out is not None else []
        return [line for line in lines if '"severity": "ERROR"' in line or '"severity": "CRITICAL"' in line]


def write_sidecar_config(
    path: Path,
    *,
    root: str,
    subscription: Mapping[str, Any],
    tracing: Mapping[str, Any] | None = None,
    peering: Mapping[str, Any] | None = None,
) -> Path:
    body: dict[str, Any] = {
        "project": PROJECT,
        "listen": "127.0.0.1:0",
        "http": "127.0.0.1:0",
        "firestore": {"database": "(default)", "root": root},
        "subscriptions": [dict(subscription)],
    }
    if tracing is not None:
        body["tracing"] = dict(tracing)
    if peering is not None:
        body["peering"] = dict(peering)
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path
