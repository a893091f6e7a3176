"""Which shard a key belongs to: the unit of ownership when several pods share one subscription.

Pure. ``shard_of`` must never change for a given (key, count): every pod, every version of the
sidecar and every tool (``pubsub-sidecar status``, the crash simulation) must agree on it, or two
pods would deliver one key. It is the first 8 bytes of sha256 over a domain tag and the key's UTF-8
bytes, read big-endian, modulo the shard count: uniform for any key set, independent of Python's
per-process ``hash()`` seed.
"""

from __future__ import annotations

import functools
import hashlib

MAX_SHARDS = 1024
"""Upper bound on ``shards`` per subscription: each shard is a lease document that every pod reads
on each lease round, so the count is kept to what balancing needs (a few per pod)."""


@functools.lru_cache(maxsize=1 << 16)
def shard_of(key: str, count: int) -> int:
    """The shard of ``key`` among ``count`` shards (0 .. count-1). A key's shard is asked several
    times per message (intake, delivery, acks, cursors): the recently used keys' are remembered."""
    if not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"shard count must be 1..{MAX_SHARDS}, got {count}")
    digest = hashlib.sha256(b"pubsub-sidecar/shard\x00" + key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % count
