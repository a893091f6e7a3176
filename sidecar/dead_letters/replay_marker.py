"""The replay marker: the attributes ``pubsub-sidecar dead-letters replay`` adds to a replayed message. Pure.

The replay command publishes a dead letter back to its original topic with its original data and
attributes (the dead letter's ``sidecar_*`` attributes removed) plus these, which ingest
(``sidecar.pipeline.classify``) reads:

- ``sidecar_replay_of``: the original message's Pub/Sub id. With ``dedup: {by: message_id}`` it is
  the replay's dedup id, so the app sees its original's dedup id (its idempotency key), and in
  watermark mode its original's position ``(timestamp, dedup id)``.
- ``sidecar_replay_id``: the dead letter's own Pub/Sub id, the same on every run of the command. It
  is the replay's identity: a replay is no duplicate of its original (whose record is a tombstone),
  while a second publish of one replay (the command killed after its publish, before its ack, and run
  again) is a duplicate of the first, and is delivered once.
- ``sidecar_replay_timestamp_ms``: the original's event time, when the dead letter recorded one
  (watermark mode): with ``timestamp: {source: publish_time}`` the replay's own publish time is new,
  and its original's keeps its place in its key's order.

Both of the first two must be present and non-empty, or the message is malformed (dead-lettered with
that reason): a half marker is never read as an ordinary message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

REPLAY_OF = "sidecar_replay_of"
REPLAY_ID = "sidecar_replay_id"
REPLAY_TIMESTAMP_MS = "sidecar_replay_timestamp_ms"
PREFIX = "sidecar_replay_"
"""Every attribute of the marker starts with this: the fingerprint leaves them out."""


@dataclass(frozen=True, slots=True)
class ReplayMarker:
    replay_of: str
    replay_id: str
    timestamp_ms: str | None
    """As published (the caller parses it with the timestamp rules)."""


class BadMarker(ValueError):
    """A replay marker with a part missing or empty."""


def read_marker(attributes: Mapping[str, str]) -> ReplayMarker | None:
    """The marker of a replayed message; None for an ordinary one. Raises BadMarker."""
    if REPLAY_OF not in attributes and REPLAY_ID not in attributes:
        return None
    replay_of, replay_id = attributes.get(REPLAY_OF, ""), attributes.get(REPLAY_ID, "")
    if not replay_of or not replay_id:
        missing = REPLAY_OF if not replay_of else REPLAY_ID
        raise BadMarker(f"replay marker without {missing!r} (a replay needs both {REPLAY_OF!r} and {REPLAY_ID!r})")
    return ReplayMarker(replay_of, replay_id, attributes.get(REPLAY_TIMESTAMP_MS))


def marker_attributes(replay_of: str, replay_id: str, timestamp_ms: str | None) -> dict[str, str]:
    """The attributes the replay command adds."""
    marker = {REPLAY_OF: replay_of, REPLAY_ID: replay_id}
    if timestamp_ms:
        marker[REPLAY_TIMESTAMP_MS] = timestamp_ms
    return marker


def without_marker(attributes: Mapping[str, str]) -> dict[str, str]:
    """The attributes a fingerprint covers: a replay has its original's content."""
    return {name: value for name, value in attributes.items() if not name.startswith(PREFIX)}
