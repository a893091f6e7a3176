"""Waiting in end-to-end tests: polls with deadlines or events, never bare sleeps.

Every wait names what it waits for, and at its deadline fails with an ``AssertionError`` naming it.
The default deadline, ``WAIT_SECONDS``, is generous: other suites may share the two cores. A
blocking predicate (one that makes RPCs) is polled in a thread (``async_wait_until_threaded``), so
the event loop goes on serving the app's streams meanwhile.

The end-to-end helper modules are named ``e2e_*`` (none is ``harness``): test directories have no
``__init__.py``, so the helper modules of every test folder share one namespace, and
``tests/engine/harness.py`` exists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")


WAIT_SECONDS = 60.0
"""Default deadline for a test's polls: generous, since other suites may share the two cores."""


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


async def async_wait_until(
    predicate: Callable[[], _T], what: str, within_seconds: float = WAIT_SECONDS, interval: float = 0.05
) -> _T:
    """``wait_until`` for async tests: the event loop (and the app client on it) keeps running."""
    timeout = within_seconds
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def async_poll(
    probe: Callable[[], Awaitable[_T | None]], what: str, within_seconds: float = WAIT_SECONDS, interval: float = 0.1
) -> _T:
    """Await ``probe`` until it returns something truthy (e.g. a GetStatus answer showing a state)."""
    deadline = time.monotonic() + within_seconds
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_seconds:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def async_wait_until_threaded(
    predicate: Callable[[], bool], what: str, within_seconds: float = WAIT_SECONDS
) -> None:
    """Poll a blocking predicate in a thread (it makes RPCs) until true or the deadline."""
    timeout = within_seconds
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)
