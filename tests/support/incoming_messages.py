"""Sequence-mode messages as ingest hands them to a store, for the top-level command tests."""

from __future__ import annotations

import hashlib

from sidecar.pipeline.runtime import wall_clock_ms
from sidecar.store.api import IncomingMessage


def sequence_message(key: str, seq: int) -> IncomingMessage:
    """Key ``key``, sequence ``seq``, data ``key:seq``, one attribute ``seq``."""
    return IncomingMessage(
        key=key,
        dedup_id=f"{key}/{seq}",
        message_id=f"m-{key}-{seq}",
        data=f"{key}:{seq}".encode(),
        attributes={"seq": str(seq)},
        ordering_key="",
        publish_time_ms=wall_clock_ms(),
        known_fingerprint=hashlib.sha256(f"{key}:{seq}".encode()).digest(),
        sequence=seq,
    )
