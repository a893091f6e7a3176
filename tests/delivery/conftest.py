"""Fixtures of the delivery-layer tests: ``delivery_fixtures`` (in tests/support, shared by every layer's tests)."""

from delivery_fixtures import harness, make_harness  # noqa: F401  (fixtures: pytest finds them here)
