"""Fixtures for the client tests; the fake servicer lives in fake_ordered_delivery.py."""

from __future__ import annotations

import pytest
from fake_ordered_delivery import FakeSidecar


@pytest.fixture
def fake() -> FakeSidecar:
    return FakeSidecar()
