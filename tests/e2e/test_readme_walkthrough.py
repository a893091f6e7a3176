"""The README's quick start, run as a new user runs it by hand: its shell blocks in order.

Every fenced ``sh``/``bash`` block of the "Quick start" section runs, in order, with ``bash -e``, in
a shell with no emulator export, no Google credentials and an empty ``HOME``. An HTML comment just
above a block says how a reader runs it; a block without one runs in the foreground and must exit 0:

- ``<!-- walkthrough: skip (REASON) -->``: not run, and listed here (``SKIPPED``), so a block is never
  left out silently;
- ``<!-- walkthrough: background until "TEXT" -->``: runs in a terminal of its own until Ctrl-C
  (SIGINT to its process group); ``until`` names what it prints once ready;
- ``<!-- walkthrough: exports (...) -->``: the lines to paste into every later terminal.

What is substituted, and only that:

- the directory: the blocks run in a temporary directory holding a ``.venv`` link to the repository's,
  not in the repository root, so ``sidecar.yaml`` lands there (several checkouts' tests share a tree);
- ports: the emulators get ``--*-port 0``, and the exports pasted are the lines they printed (checked
  against the README's: the same variables, in the same order, on the README's host); the sidecar's
  ``127.0.0.1:50051`` and ``127.0.0.1:9090`` become port 0 in the config, and the ports its ready line
  names in every later block (the machine is shared; fixed ports may be taken);
- ``PYTHONUNBUFFERED=1``: a terminal shows each line as it is printed, a pipe would hold them;
- for the prose's "Publish ``seq=6`` alone", step 6's block with ``(6,)`` as its sequences.

Then what the prose says is checked: ``/readyz`` answers 200, the app prints ``order-1`` 1 to 4 in
order and once, ``status`` shows ``order-1`` waiting for sequence 5, and Ctrl-C stops the sidecar
with exit code 0. A second test checks that every topic and subscription the README names is one the
quick start created (troubleshooting once named ``orders-dead-letters``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_processes import OutputPump

_REPO = Path(__file__).resolve().parents[2]
README = _REPO / "README.md"

SKIPPED = ["make demo   # emulators + sidecar + a publisher + a consumer app, with a summary"]
"""First line of each block the README marks as skipped: a new skip marker must be added here too."""

START_SECONDS = 60.0
STEP_SECONDS = 60.0

_MARKER = re.compile(r"<!--\s*walkthrough:\s*(?P<kind>skip|background|exports)\b(?P<rest>.*?)-->")
_UNTIL = re.compile(r'until\s+"(?P<text>[^"]+)"')
_READY = re.compile(r"gRPC on (?P<grpc>\S+), HTTP on (?P<http>\S+)")


@dataclass(frozen=True)
class Block:
    code: str
    kind: str  # "run", "skip", "background", "exports"
    until: str | None = None
    reason: str = ""


def quick_start(text: str) -> str:
    """The README's "## Quick start" section, up to the next ``## `` heading."""
    start = text.index("\n## Quick start\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(section: str) -> list[Block]:
    """The fenced sh/bash blocks of ``section`` in order, each with the marker just above it."""
    out: list[Block] = []
    lines = section.split("\n")
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w*)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence.group(1) in ("sh", "bash"):
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.search(above)
            code = "\n".join(lines[i + 1 : end]) + "\n"
            if marker is None:
                out.append(Block(code, "run"))
            else:
                until = _UNTIL.search(marker.group("rest"))
                reason = marker.group("rest").strip()
                out.append(Block(code, marker.group("kind"), until.group("text") if until else None, reason))
        i = end + 1
    return out


class Terminal:
    """One block running until Ctrl-C, in a process group of its own, its output kept."""

    def __init__(self, script: str, env: dict[str, str], cwd: Path) -> None:
        self.process = subprocess.Popen(
            ["bash", "-e", "-c", script],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output = OutputPump(self.process.stdout)

    def wait_for(self, text: str, timeout: float) -> list[str]:
        if not self.output.wait_for(lambda lines: any(text in line for line in lines), timeout):
            raise AssertionError(f"{text!r} not printed within {timeout} s:\n{self.output.tail()}")
        return self.output.snapshot()

    def ctrl_c(self, timeout: float) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="walkthrough-") as name:
        path = Path(name)
        (path / ".venv").symlink_to(_REPO / ".venv")
        (path / "home").mkdir()
        yield path


def _user_env(home: Path) -> dict[str, str]:
    """A new user's shell: no emulator export, no Google credentials, an empty HOME."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.endswith("_EMULATOR_HOST")
        and not name.startswith(("GOOGLE_", "CLOUDSDK_"))
        and name not in ("EMULATORS_ADMIN_URL", "VIRTUAL_ENV", "PYTHONPATH")
    }
    env["HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _substitute(code: str, ports: dict[str, str]) -> str:
    for readme, actual in ports.items():
        code = code.replace(readme, actual)
    return code


def _foreground(script: str, env: dict[str, str], cwd: Path) -> str:
    result = subprocess.run(
        ["bash", "-e", "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=STEP_SECONDS
    )
    assert result.returncode == 0, f"block failed ({result.returncode}):\n{script}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _export_names(lines: list[str]) -> list[tuple[str, str]]:
    """(variable, host) of each ``export NAME=[scheme://]HOST:PORT`` line."""
    out = []
    for line in lines:
        found = re.match(r"export (\w+)=(?:\w+://)?([^:\s]+):\d+", line.strip())
        if found:
            out.append((found.group(1), found.group(2)))
    return out


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_quick_start_runs_as_written(workdir: Path) -> None:
    steps = blocks(quick_start(README.read_text(encoding="utf-8")))
    assert [b.code.splitlines()[0] for b in steps if b.kind == "skip"] == SKIPPED
    assert all(b.reason.startswith("(") for b in steps if b.kind == "skip"), "a skip says why"
    env = _user_env(workdir / "home")
    exports = ""
    ports = {"127.0.0.1:50051": "127.0.0.1:0", "127.0.0.1:9090": "127.0.0.1:0"}
    terminals: list[Terminal] = []
    emulators: Terminal | None = None
    sidecar: Terminal | None = None
    app: Terminal | None = None
    publish_block = ""
    try:
        for block in steps:
            if block.kind == "skip":
                continue
            if block.kind == "exports":
                assert emulators is not None, "the exports come from the emulators"
                printed = [line for line in emulators.output.snapshot() if line.startswith("export ")]
                assert _export_names(printed) == _export_names(block.code.splitlines()), (printed, block.code)
                exports = "\n".join(printed) + "\n"
                continue
            code = _substitute(block.code, ports)
            if "pubsub-sidecar emulators" in code:
                code = code.replace(
                    "pubsub-sidecar emulators",
                    "pubsub-sidecar emulators --pubsub-port 0 --firestore-port 0 --monitoring-port 0 --admin-port 0",
                )
            if block.kind == "background":
                terminal = Terminal(exports + code, env, workdir)
                terminals.append(terminal)
                if block.until is not None:
                    lines = terminal.wait_for(block.until, START_SECONDS)
                    ready = next((m for m in map(_READY.search, lines) if m), None)
                    if ready is not None:  # the sidecar: later blocks use the ports it bound
                        ports = {"127.0.0.1:50051": ready.group("grpc"), "127.0.0.1:9090": ready.group("http")}
                        sidecar = terminal
                    elif emulators is None:
                        emulators = terminal
                else:
                    app = terminal
                continue
            output = _foreground(exports + code, env, workdir)
            if "publisher.publish(" in code:
                publish_block = code
                assert output.strip().endswith("published")

        assert emulators is not None and sidecar is not None and app is not None and publish_block
        # "`curl -s 127.0.0.1:9090/readyz` then answers 200"
        with urllib.request.urlopen(f"http://{ports['127.0.0.1:9090']}/readyz", timeout=10) as response:
            assert response.status == 200
        # "The app prints `order-1 1`, `2`, `3`, `4`: in order, the duplicate dropped."
        app.wait_for("order-1 4 ", STEP_SECONDS)
        printed = [line for line in app.output.snapshot() if line.startswith("order-1 ")]
        assert printed == [f"order-1 {seq} order step {seq}" for seq in (1, 2, 3, 4)], app.output.tail()
        # "Publish `seq=6` alone and `.venv/bin/pubsub-sidecar status --target 127.0.0.1:50051` shows
        # `order-1` waiting for sequence 5"
        assert "for seq in (3, 1, 2, 2, 4):" in publish_block
        _foreground(exports + publish_block.replace("(3, 1, 2, 2, 4)", "(6,)"), env, workdir)
        prose = re.search(r"`(\.venv/bin/pubsub-sidecar status --target [^`]+)`", README.read_text(encoding="utf-8"))
        assert prose is not None, "the quick start names the status command"
        status = _substitute(prose.group(1), ports)
        waiting: list[str] = []
        deadline = time.monotonic() + STEP_SECONDS
        while not waiting and time.monotonic() < deadline:  # until the sidecar holds seq 6
            output = _foreground(exports + status, env, workdir)
            waiting = [line for line in output.splitlines() if "order-1" in line and "waiting_sequence" in line]
            if not waiting:
                time.sleep(0.2)  # poll interval
        assert waiting and "5" in waiting[0], output
        # "7. Stop with Ctrl-C ... and exits 0."
        assert sidecar.ctrl_c(STEP_SECONDS) == 0, sidecar.output.tail()
    finally:
        for terminal in reversed(terminals):
            try:
                terminal.ctrl_c(15)
            except subprocess.TimeoutExpired:
                terminal.kill()


def test_every_topic_and_subscription_the_readme_names_is_one_the_quick_start_created() -> None:
    text = README.read_text(encoding="utf-8")
    created_in = re.search(r"for topic in \(([^)]*)\):", quick_start(text))
    assert created_in is not None, "the quick start creates its topics and subscriptions in one loop"
    created = set(re.findall(r'"([\w-]+)"', created_in.group(1)))
    assert created == {"orders", "orders-dead-letter"}
    named = set(re.findall(r"projects/[\w-]+/(?:topics|subscriptions)/([\w-]+)", text))
    assert named and named <= created, f"named but never created: {sorted(named - created)}"
