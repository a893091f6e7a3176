"""Fixtures for the relay's tests against the project's emulators: Pub/Sub and Firestore in a thread
(one stack per module), the official clients pointed at them, a project per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.emulators.stack import EmulatorStack

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def stack() -> Iterator[EmulatorStack]:
    emulators = EmulatorStack(ttl_sweep_seconds=0)
    emulators.start_in_thread()
    saved = {name: os.environ.get(name) for name in emulators.env}
    os.environ.update(emulators.env)
    try:
        yield emulators
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        emulators.stop_thread()


@pytest.fixture
def project(stack: EmulatorStack) -> Iterator[str]:
    yield f"relay-{uuid.uuid4().hex[:10]}"
    stack.injector.clear()
