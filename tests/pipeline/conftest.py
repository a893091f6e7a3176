"""Fixtures of the pipeline tests: ``ingest_fixtures`` (in tests/support, shared by every layer's tests),
and ``world``, a started runtime of several shards (``test_runtime_shards``), for the tests of shards."""

from ingest_fixtures import admin, emulators, make_harness, pubsub_env  # noqa: F401  (fixtures: pytest finds them here)
from test_runtime_shards import world  # noqa: F401  (a fixture: pytest finds it here)
