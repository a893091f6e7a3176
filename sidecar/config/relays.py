"""The ``relays:`` section (DESIGN §12): outbox relays, the publisher half of sequence mode.

Rules (the file's rules of ``sidecar.config.model`` hold here too: unknown fields and wrong YAML
types are errors, one line each):

- A relay names its outbox (``outbox.database``, ``outbox.collection``: a top-level collection the
  app writes its entries to), the default ``topic`` (short names resolve under ``project``, as a
  subscription's do: ``resolve_topics``), the attribute that carries the key (``key_attribute``) and
  the sequence attribute with the key's first number (``sequence.attribute``, ``sequence.start``),
  as the subscriber side's ``ordering.key.attribute`` and ``ordering.sequence`` expect them.
- The key and sequence attributes differ and neither starts with ``goog`` (Pub/Sub reserves those).
- ``shards`` and ``lease_duration``: the relay's keys are spread over shards, each with a lease
  (``sidecar.cluster.leases``): one writer per key across the pods that run the relay.
- ``max_batch``: entries per publish and commit (a Commit holds 500 writes: the entries' deletes and
  the shard's counter document).
- Relay names are unique; they name the relay's documents and metrics.

The reference is docs/config.md (``relays``) and docs/publishing.md.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sidecar.config.fields import (
    MAX_SEQUENCE,
    AttributeName,
    PositiveDurationMs,
    StrictModel,
    TopicName,
    check_collection_id,
    check_name,
)
from sidecar.shards import MAX_SHARDS

MAX_BATCH = 499
"""A Commit holds at most 500 writes: a batch's deletes and its shard's counter document."""

MIN_LEASE_MS = 300
MAX_LEASE_MS = 600_000
"""The bounds ``sidecar.cluster.leases`` accepts for a lease (checked here, where the file is read)."""


class OutboxConfig(StrictModel):
    database: Annotated[str, Field(min_length=1)] = "(default)"
    collection: Annotated[str, AfterValidator(check_collection_id)]


class RelaySequenceConfig(StrictModel):
    attribute: AttributeName
    start: int = Field(1, ge=0, le=MAX_SEQUENCE)


class RelayConfig(StrictModel):
    name: Annotated[str, AfterValidator(check_name)]
    outbox: OutboxConfig
    topic: TopicName
    key_attribute: AttributeName
    sequence: RelaySequenceConfig
    ordering_key: bool = False
    shards: int = Field(16, ge=1, le=MAX_SHARDS)
    lease_duration_ms: PositiveDurationMs = Field(10_000, alias="lease_duration")
    max_batch: int = Field(MAX_BATCH, ge=1, le=MAX_BATCH)

    @model_validator(mode="after")
    def _attributes(self) -> RelayConfig:
        if self.key_attribute == self.sequence.attribute:
            raise ValueError(f"key_attribute and sequence.attribute are both {self.key_attribute!r}: they must differ")
        for name in (self.key_attribute, self.sequence.attribute):
            if name.lower().startswith("goog"):
                raise ValueError(f"attribute {name!r}: Pub/Sub reserves attribute names starting with 'goog'")
        return self

    @field_validator("lease_duration_ms")
    @classmethod
    def _lease_in_range(cls, value: int) -> int:
        if not MIN_LEASE_MS <= value <= MAX_LEASE_MS:
            raise ValueError(f"must be between {MIN_LEASE_MS}ms and {MAX_LEASE_MS // 60_000}m")
        return value

    @property
    def topic_id(self) -> str:
        return self.topic.rpartition("/")[2]


def resolve_topics(relays: Any, project: str) -> Any:
    """``relays`` (the raw list from the file) with short topic names expanded under ``project``;
    anything odd is left for the field validators to report."""
    if not isinstance(relays, list):
        return relays
    resolved = []
    for relay in relays:
        if isinstance(relay, dict):
            topic = relay.get("topic")
            if isinstance(topic, str) and "/" not in topic:
                relay = {**relay, "topic": f"projects/{project}/topics/{topic}"}
        resolved.append(relay)
    return resolved


def unique_relay_names(relays: list[RelayConfig]) -> list[RelayConfig]:
    """``relays`` unchanged, or the error naming the first repeated name."""
    first_index: dict[str, int] = {}
    for index, relay in enumerate(relays):
        if relay.name in first_index:
            raise PydanticCustomError(
                "duplicate_name",
                "duplicate name '{name}': relays[{first}] has it already",
                {"name": relay.name, "first": first_index[relay.name], "at": (index, "name")},
            )
        first_index[relay.name] = index
    return relays
