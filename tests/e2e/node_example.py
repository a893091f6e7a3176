"""The Node.js example app (examples/node/) as a real process, for the end-to-end tests.

``install()`` runs ``npm ci`` from the committed package-lock.json once per session; ``NodeApp`` starts
``node subscriber.js --json`` and parses what it prints: one JSON object per message on stdout, one
line per event on stderr.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from e2e_processes import START_TIMEOUT_SECONDS, OutputPump
from npm_install import npm_ci

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"

NODE_MISSING = (
    "`node` is not on PATH: the Node.js example's end-to-end test needs Node.js >= 18 and npm "
    "(.ci/run refuses to run without them)"
)


def install() -> None:
    """``npm ci`` of examples/node/ from its lockfile."""
    npm_ci(EXAMPLE_DIR)


class NodeApp:
    """``node subscriber.js`` for one subscription; ``messages`` are the parsed stdout lines."""

    def __init__(self, target: str, subscription: str) -> None:
        node = shutil.which("node")
        assert node is not None, NODE_MISSING
        # Short backoffs keep the restart test quick; the app's defaults are for production.
        cmd = [
            node, "subscriber.js", "--json", "--target", target, "--subscription", subscription,
            "--backoff-initial-ms", "50", "--backoff-max-ms", "500",
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, cwd=EXAMPLE_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._out = OutputPump(self._proc.stdout)
        self._err = OutputPump(self._proc.stderr)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self._out.snapshot() if line.strip()]

    @property
    def stderr_lines(self) -> list[str]:
        return self._err.snapshot()

    def sequences(self, key: str) -> list[int]:
        return [int(m["sequence"]) for m in self.messages if m["key"] == key]

    def wait_for_stderr(self, fragment: str, timeout: float = START_TIMEOUT_SECONDS) -> None:
        if not self._err.wait_for(lambda lines: any(fragment in line for line in lines), timeout):
            raise AssertionError(f"no stderr line with {fragment!r} within {timeout:.0f}s:\n{self.describe()}")

    def wait_for_count(self, count: int, timeout: float = START_TIMEOUT_SECONDS) -> None:
        if not self._out.wait_for(lambda lines: len(lines) >= count, timeout):
            raise AssertionError(f"fewer than {count} messages within {timeout:.0f}s:\n{self.describe()}")

    def wait_exit(self, timeout: float) -> int:
        return self._proc.wait(timeout)

    def terminate(self) -> None:
        self._proc.send_signal(signal.SIGTERM)

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def describe(self) -> str:
        return f"stdout:\n{self._out.tail()}\nstderr:\n{self._err.tail()}"
