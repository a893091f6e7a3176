"""What every bench process and measurement shares: the error, polls with deadlines, the kernel's
figures of a process, and the plumbing of the child processes the bench starts.

Rules this module keeps:
- What is measured about a process comes from the kernel: CPU seconds from ``/proc/<pid>/stat``
  (utime + stime), peak RSS from ``/proc/<pid>/status`` (``VmHWM``), so the figures cost the measured
  process nothing to report.
- Every wait is a poll with a deadline that names what it waited for; a deadline missed raises
  ``BenchError`` (with the process's last output where there is one), never a hang.
- A child process gets the caller's environment without any ``*_EMULATOR_HOST`` (it is given the
  ones it needs) and unbuffered output, read by an ``OutputPump`` thread so it never blocks on a pipe.
- It imports nothing of the bench: every other bench module may import it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

PROJECT = "bench-project"

START_TIMEOUT_SECONDS = 120.0
"""A cold ``python -m sidecar`` on two shared cores takes seconds; recovery of 100,000 messages more."""

_CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
"""Units of utime/stime in /proc/<pid>/stat."""


class BenchError(Exception):
    """A benchmark step failed or timed out; the message says which and why."""


def wait_until(predicate: Callable[[], _T], timeout: float, what: str, interval: float = 0.05) -> _T:
    """Poll ``predicate`` until it returns something truthy; raise ``BenchError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ---- /proc ---------------------------------------------------------------------------------------


class CpuSplit:
    """CPU seconds each process of a phase used between ``start()`` and ``stop()``: where the
    machine's cores go (on 2 cores the publisher, the emulators, the sidecar and the app share them,
    so one's throughput follows the others' CPU)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._before: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def start(self) -> None:
        self._before = {name: cpu_seconds(pid) for name, pid in self._pids.items()}

    def stop(self) -> None:
        self.used = {name: cpu_seconds(pid) - self._before[name] for name, pid in self._pids.items()}

    def per_10k(self, messages: int) -> dict[str, float]:
        """Each process's CPU seconds per 10,000 messages."""
        return {name: round(seconds / messages * 10_000, 3) for name, seconds in self.used.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may contain spaces: split after its closing parenthesis.
    fields = raw[raw.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLOCK_TICKS_PER_SECOND


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise BenchError(f"/proc/{pid}/status has no VmHWM line")


# ---- processes -------------------------------------------------------------------------------------


class OutputPump:
    """Reads a process's output in a thread and keeps the lines (for diagnostics and parsing)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: Any) -> None:
        for raw in stream:
            with self._lock:
                self.lines.append(raw.rstrip("\n"))
                # A long run logs a lot; only the tail is ever shown.
                if len(self.lines) > 5000:
                    del self.lines[:1000]

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.snapshot()[-n:])


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process: ours without ``*_EMULATOR_HOST``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_EMULATOR_HOST")}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop_process(proc: subprocess.Popen[str] | None, timeout: float) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code (None: never started)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile (None for no values): no interpolation between two samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1))
    return ordered[rank]
