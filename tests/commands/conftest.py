"""Fixtures of the command tests: ``ingest_fixtures`` (in tests/support, shared by every layer's tests)."""

from ingest_fixtures import admin, emulators, make_harness, pubsub_env  # noqa: F401  (fixtures: pytest finds them here)
