"""The sidecar's configuration file (DESIGN §7): typed, validated, with one-line errors.

Rules:

- Every level rejects unknown fields, and values must have the YAML type they are documented
  with (``max_delivery_attempts: "5"`` is an error, not 5): a typo must stop the sidecar at start,
  not silently fall back to a default.
- ``ordering`` is a union tagged by ``mode``; each mode accepts only its own fields, so
  ``timestamp`` in sequence mode, or ``sequence`` in watermark mode, is an error.
- Durations are strings with a unit (``sidecar.config.durations``); bare numbers are rejected.
- Pub/Sub names may be short (``orders``) or full (``projects/P/subscriptions/orders``); short
  names are resolved under ``project`` when the whole file is validated (``SidecarConfig``).
  ``project`` itself defaults to ``GOOGLE_CLOUD_PROJECT`` (``load_config`` supplies it).
- ``load_config`` never lets an exception other than ``ConfigError`` out, and a ``ConfigError``
  reads as one line: ``<file>: <field path>: <reason>`` (``subscriptions[0].ordering.key: ...``),
  with the YAML line when known (``sidecar.config.errors`` does the reading and the wording).
  The run command prints it and exits with code 2 (``config_error_exit``).
- Models are frozen: the config read at start is the config for the whole run.

The reference with every field, type and default is docs/config.md.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TextIO

from pydantic import AfterValidator, Field, ValidationError, model_validator
from pydantic import field_validator as _field_validator
from pydantic_core import PydanticCustomError

from sidecar.config.errors import ConfigError as ConfigError  # re-exported: callers catch it from here
from sidecar.config.errors import Lines, describe, format_loc, line_of, read_yaml_file, type_name
from sidecar.config.fields import MAX_SEQUENCE as MAX_SEQUENCE  # re-exported: classify reads it from here
from sidecar.config.fields import PROJECT_PATTERN as _PROJECT
from sidecar.config.fields import (
    AttributeName,
    ByteSize,
    NonNegativeDurationMs,
    OptionalPositiveDurationMs,
    PositiveDurationMs,
    SubscriptionName,
    TopicName,
)
from sidecar.config.fields import StrictModel as _Model
from sidecar.config.fields import check_collection_id as _check_collection_id
from sidecar.config.fields import check_host_port as _check_host_port
from sidecar.config.fields import check_listen as _check_listen
from sidecar.config.fields import check_name as _check_name
from sidecar.config.fields import check_project as _check_project
from sidecar.config.peering import PeeringConfig
from sidecar.config.relays import RelayConfig, resolve_topics, unique_relay_names
from sidecar.config.tracing import TracingConfig
from sidecar.engine.types import EngineConfig
from sidecar.shards import MAX_SHARDS

EXIT_CONFIG = 2
"""Exit code for a config file the user must fix (the same as for a bad command line)."""

PROJECT_ENV = "GOOGLE_CLOUD_PROJECT"


# ---- ordering --------------------------------------------------------------------------------


class KeyConfig(_Model):
    """Where a message's key comes from: exactly one of ``attribute`` or ``ordering_key: true``."""

    attribute: AttributeName | None = None
    ordering_key: bool | None = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> KeyConfig:
        if self.ordering_key is False:
            raise ValueError("ordering_key: false names no key; use ordering_key: true or attribute: NAME")
        if (self.attribute is None) == (self.ordering_key is None):
            raise ValueError("set exactly one of attribute: NAME or ordering_key: true")
        return self


class SequenceConfig(_Model):
    attribute: AttributeName
    start: int = Field(1, ge=0, le=MAX_SEQUENCE)


class TimestampConfig(_Model):
    """``{source: publish_time}`` (the default) or ``{attribute: NAME, allowed_skew: 2s}``."""

    source: Literal["publish_time", "attribute"]
    attribute: AttributeName | None = None
    allowed_skew_ms: NonNegativeDurationMs | None = Field(None, alias="allowed_skew")
    """Set (default 2s) exactly when the timestamp comes from an attribute."""

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        has_attribute = data.get("attribute") is not None
        filled = dict(data)
        filled.setdefault("source", "attribute" if has_attribute else "publish_time")
        if has_attribute and filled["source"] == "attribute" and filled.get("allowed_skew") is None:
            filled["allowed_skew"] = "2s"
        return filled

    @model_validator(mode="after")
    def _consistent(self) -> TimestampConfig:
        if self.source == "attribute" and self.attribute is None:
            raise ValueError("source: attribute needs attribute: NAME")
        if self.source == "publish_time" and self.attribute is not None:
            raise ValueError("source: publish_time and attribute: are exclusive; keep one")
        if self.source == "publish_time" and self.allowed_skew_ms is not None:
            raise ValueError("allowed_skew applies only to a timestamp attribute (publish_time is Pub/Sub's clock)")
        return self


class WatermarkConfig(_Model):
    poll_interval_ms: PositiveDurationMs = Field(30_000, alias="poll_interval")
    safety_margin_ms: NonNegativeDurationMs = Field(10_000, alias="safety_margin")
    max_metric_delay_ms: PositiveDurationMs = Field(180_000, alias="max_metric_delay")


GapPolicy = Literal["hold", "skip"]
LatePolicy = Literal["dead_letter", "deliver"]


class SequenceOrdering(_Model):
    mode: Literal["sequence"]
    key: KeyConfig
    sequence: SequenceConfig
    gap_timeout_ms: OptionalPositiveDurationMs = Field(None, alias="gap_timeout")
    on_gap_timeout: GapPolicy = "hold"
    first_sequence: Literal["start", "any"] = "start"
    on_late: LatePolicy = "dead_letter"
    """For a message whose sequence was skipped by ``on_gap_timeout: skip`` and that shows up later."""
    fast_path: bool = True
    """A message that arrives exactly in order, at its key's owner, with nothing of its key held,
    is delivered without a Firestore document; Pub/Sub keeps it until its ack is durable in the
    key's cursor (docs/store.md, the in-order fast path). False: every message is stored first."""

    @_field_validator("gap_timeout_ms")
    @classmethod
    def _positive_gap_timeout(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("gap_timeout must be longer than 0s; use null to hold gaps forever")
        return value


class WatermarkOrdering(_Model):
    mode: Literal["watermark"]
    key: KeyConfig
    timestamp: TimestampConfig
    watermark: WatermarkConfig = Field(default_factory=WatermarkConfig)
    on_late: LatePolicy = "dead_letter"


class NoneOrdering(_Model):
    mode: Literal["none"]
    key: KeyConfig | None = None
    """Optional: informational only in this mode (it is passed to the app and shown in status)."""


Ordering = Annotated[SequenceOrdering | WatermarkOrdering | NoneOrdering, Field(discriminator="mode")]
_ORDERING_BY_MODE: dict[str, type[_Model]] = {
    "sequence": SequenceOrdering,
    "watermark": WatermarkOrdering,
    "none": NoneOrdering,
}


# ---- dedup, delivery, flow control -----------------------------------------------------------


class DedupConfig(_Model):
    """``{by: message_id}`` (default) or ``{attribute: NAME}`` (``by: attribute`` optional)."""

    by: Literal["message_id", "attribute"] = "message_id"
    attribute: AttributeName | None = None
    ttl_ms: PositiveDurationMs = Field(7 * 24 * 3600 * 1000, alias="ttl")
    memory_max_entries: int = Field(200_000, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _fill_by(cls, data: Any) -> Any:
        if isinstance(data, dict) and "by" not in data:
            return {**data, "by": "attribute" if data.get("attribute") is not None else "message_id"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DedupConfig:
        if self.by == "attribute" and self.attribute is None:
            raise ValueError("by: attribute needs attribute: NAME")
        if self.by == "message_id" and self.attribute is not None:
            raise ValueError("by: message_id and attribute: are exclusive; keep one")
        return self


class BackoffConfig(_Model):
    initial_ms: PositiveDurationMs = Field(1_000, alias="initial")
    maximum_ms: PositiveDurationMs = Field(600_000, alias="maximum")

    @model_validator(mode="after")
    def _ordered(self) -> BackoffConfig:
        if self.maximum_ms < self.initial_ms:
            raise ValueError("maximum must be at least initial")
        return self


class DeliveryConfig(_Model):
    max_in_flight_per_key: int = Field(1, ge=1)
    ack_deadline_ms: PositiveDurationMs = Field(60_000, alias="ack_deadline")
    max_delivery_attempts: int = Field(5, ge=1)
    backoff: BackoffConfig = Field(default_factory=BackoffConfig)
    on_dead_letter: Literal["block", "skip"] = "block"
    on_replay_behind: Literal["deliver_flagged", "refuse"] = "refuse"
    """A replayed dead letter whose key already went past it: ``refuse`` (dead-lettered again as
    ``replay_behind``; the default: an app that does not read the ``replayed`` flag never gets a
    message out of its order) or ``deliver_flagged`` (delivered with ``replayed`` set)."""


MIN_LEASE_EXTENSION_MS = 10_000
MAX_LEASE_EXTENSION_MS = 600_000
"""Pub/Sub's range for an ack deadline; the client silently clamps a lease extension into it."""


class FlowControlConfig(_Model):
    max_undelivered_messages: Annotated[int, Field(ge=1)] | None = 10_000
    """Stop persisting new messages while more than this many are releasable or in flight to the
    app (never counting those held for ordering); null: no limit."""
    max_outstanding_messages: int = Field(5_000, ge=1)
    """The Pub/Sub client's flow control: messages received and not yet acked or nacked. A fast-path
    message stays unacked in Pub/Sub until its key's next checkpoint (half a second on average), so
    this caps the fast path at about twice this many messages per second; ``max_outstanding_bytes``
    bounds the memory whatever the count."""
    max_outstanding_bytes: ByteSize = 100 * 1024 * 1024
    max_lease_extension_ms: OptionalPositiveDurationMs = Field(10_000, alias="max_lease_extension")
    """The longest single lease extension the Pub/Sub client asks for (its
    ``max_duration_per_lease_extension``), and so the longest a crash of this process hides a
    message it had pulled but not yet persisted. null: the client's own default, unbounded (up to
    600 s; see docs/ingest.md)."""

    @_field_validator("max_lease_extension_ms")
    @classmethod
    def _lease_extension_in_range(cls, value: int | None) -> int | None:
        if value is None:
            return value
        if not MIN_LEASE_EXTENSION_MS <= value <= MAX_LEASE_EXTENSION_MS:
            raise ValueError("must be between 10s and 600s (Pub/Sub's ack deadline range), or null")
        if value % 1000:
            raise ValueError("must be whole seconds (Pub/Sub ack deadlines are in seconds)")
        return value

    max_idle_keys: int = Field(10_000, ge=0)
    """Keys with nothing pending kept in memory; past it the longest idle are forgotten and rebuilt
    from their durable cursor when a message for them arrives (no I/O: the store keeps cursors)."""
    max_held_bytes: ByteSize = 64 * 1024 * 1024
    """Payload bytes kept in memory for messages held for ordering (behind a gap, above the
    watermark). Past it a held message keeps only its metadata in memory, and its payload is read
    back from Firestore (one read) when it is delivered. Recovery keeps to the same budget."""


class ShardingConfig(_Model):
    """Several pods on one subscription: keys are spread over ``shards`` shards, each leased to one
    pod at a time (docs/operations.md, "Scaling out"). The same values must be used by every pod of a subscription."""

    shards: int = Field(16, ge=1, le=MAX_SHARDS)
    """S: how many shards the subscription's keys hash into. Aim for 4 or more per pod at the
    largest replica count; changing it needs every pod stopped first (docs/operations.md, "Scaling out")."""
    lease_duration_ms: PositiveDurationMs = Field(10_000, alias="lease_duration")
    """How long a shard's lease lasts without renewal: the failover time after a pod dies (kill -9,
    node loss). Renewed every third of it."""
    drain_timeout_ms: PositiveDurationMs = Field(5_000, alias="drain_timeout")
    """On a graceful hand-over (scale-out, SIGTERM), how long the pod waits for its app to ack what it
    holds of the shard before handing it over anyway (unconfirmed acks are delivered again)."""

    @_field_validator("lease_duration_ms")
    @classmethod
    def _lease_in_range(cls, value: int) -> int:
        if not 2_000 <= value <= 600_000:
            raise ValueError("must be between 2s and 10m")
        return value


# ---- subscription and file -------------------------------------------------------------------


class SubscriptionConfig(_Model):
    name: Annotated[str, AfterValidator(_check_name)]
    subscription: SubscriptionName
    """Full ``projects/P/subscriptions/S`` once loaded through ``SidecarConfig``."""
    ordering: Ordering
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)
    dead_letter_topic: TopicName | None = None
    """Without one, messages the sidecar gives up on stay un-acked in Pub/Sub (see docs/config.md)."""
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    intake: Literal["stream", "client"] = "stream"
    """How messages are pulled: ``stream``, the sidecar's own StreamingPull on its event loop
    (``sidecar.pipeline.ingest_stream``), or ``client``, the official subscriber's streaming pull
    manager (needed for exactly-once subscriptions, whose ack results the stream intake does not read)."""

    def engine_config(self) -> EngineConfig:
        """The engine's view of this subscription: policies only, durations in milliseconds."""
        ordering = self.ordering
        delivery = self.delivery
        common: dict[str, Any] = {
            "mode": ordering.mode,
            "dedup_ttl_ms": self.dedup.ttl_ms,
            "dedup_memory_max_entries": self.dedup.memory_max_entries,
            "max_idle_keys": self.flow_control.max_idle_keys,
            "max_in_flight_per_key": delivery.max_in_flight_per_key,
            "ack_deadline_ms": delivery.ack_deadline_ms,
            "max_delivery_attempts": delivery.max_delivery_attempts,
            "backoff_initial_ms": delivery.backoff.initial_ms,
            "backoff_maximum_ms": delivery.backoff.maximum_ms,
            "on_dead_letter": delivery.on_dead_letter,
            "on_replay_behind": delivery.on_replay_behind,
        }
        if isinstance(ordering, SequenceOrdering):
            common.update(
                sequence_start=ordering.sequence.start,
                first_sequence_any=ordering.first_sequence == "any",
                gap_timeout_ms=ordering.gap_timeout_ms,
                on_gap_timeout=ordering.on_gap_timeout,
                on_late=ordering.on_late,
            )
        elif isinstance(ordering, WatermarkOrdering):
            common["on_late"] = ordering.on_late
        return EngineConfig(**common)


class FirestoreConfig(_Model):
    database: Annotated[str, Field(min_length=1)] = "(default)"
    root: Annotated[str, AfterValidator(_check_collection_id)] = "pubsub-sidecar"


class SidecarConfig(_Model):
    project: Annotated[str, AfterValidator(_check_project)]
    listen: Annotated[str, AfterValidator(_check_listen)] = "127.0.0.1:50051"
    http: Annotated[str, AfterValidator(_check_host_port)] = "127.0.0.1:9090"
    firestore: FirestoreConfig = Field(default_factory=FirestoreConfig)
    subscriptions: list[SubscriptionConfig] = Field(default_factory=list)
    relays: list[RelayConfig] = Field(default_factory=list)
    """Outbox relays (``sidecar.config.relays``): with relays, subscriptions may be left out."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """A span per message, exported with OpenTelemetry (``sidecar.config.tracing``); off by default."""
    peering: PeeringConfig | None = None
    """The peer channel between pods (``sidecar.config.peering``); without the section it is off."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_short_names(cls, data: Any) -> Any:
        """Expand short subscription and topic names under ``project``; anything odd is left for
        the field validators to report."""
        if not isinstance(data, dict):
            return data
        project = data.get("project")
        subs = data.get("subscriptions")
        if not isinstance(project, str) or not re.fullmatch(_PROJECT, project):
            return data
        data = {**data, **_relays_resolved(data, project)}
        if not isinstance(subs, list):
            return data
        resolved = []
        for sub in subs:
            if isinstance(sub, dict):
                sub = dict(sub)
                for field, collection in (("subscription", "subscriptions"), ("dead_letter_topic", "topics")):
                    value = sub.get(field)
                    if isinstance(value, str) and "/" not in value:
                        sub[field] = f"projects/{project}/{collection}/{value}"
            resolved.append(sub)
        return {**data, "subscriptions": resolved}

    @_field_validator("relays")
    @classmethod
    def _unique_relay_names(cls, relays: list[RelayConfig]) -> list[RelayConfig]:
        return unique_relay_names(relays)

    @model_validator(mode="after")
    def _something_to_run(self) -> SidecarConfig:
        if not self.subscriptions and not self.relays:
            given = "subscriptions" in self.model_fields_set
            reason = "must not be empty" if given else "required"
            raise PydanticCustomError("nothing_to_run", f"{reason} (or relays:)", {"at": ("subscriptions",)})
        return self

    @_field_validator("subscriptions")
    @classmethod
    def _unique_names(cls, subs: list[SubscriptionConfig]) -> list[SubscriptionConfig]:
        first_index: dict[str, int] = {}
        for index, sub in enumerate(subs):
            if sub.name in first_index:
                raise PydanticCustomError(
                    "duplicate_name",
                    "duplicate name '{name}': subscriptions[{first}] has it already",
                    {"name": sub.name, "first": first_index[sub.name], "at": (index, "name")},
                )
            first_index[sub.name] = index
        return subs


def _relays_resolved(data: dict[str, Any], project: str) -> dict[str, Any]:
    """``relays`` with short topic names resolved (``sidecar.config.relays``), when the file has any."""
    return {"relays": resolve_topics(data["relays"], project)} if "relays" in data else {}


# ---- loading --------------------------------------------------------------------------------


def config_error_exit(err: ConfigError, stream: TextIO | None = None) -> int:
    """Print the error's one line to stderr and return the exit code for it (2)."""
    print(f"pubsub-sidecar: {err}", file=stream if stream is not None else sys.stderr)
    return EXIT_CONFIG


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> SidecarConfig:
    """Read, parse and validate a config file; raises ConfigError (and nothing else).

    ``env`` (default ``os.environ``) supplies ``GOOGLE_CLOUD_PROJECT`` when the file has no project.
    """
    file = str(path)
    environ = os.environ if env is None else env
    data, lines = read_yaml_file(file)
    if data is None:
        raise ConfigError(file, "", "the file is empty; it needs subscriptions and project (or GOOGLE_CLOUD_PROJECT)")
    if not isinstance(data, dict):
        kind = type_name(data)
        raise ConfigError(file, "", f"the top level must be a mapping (project:, subscriptions:, ...), got {kind}")
    if data.get("project") is None and environ.get(PROJECT_ENV):
        data = {**data, "project": environ[PROJECT_ENV]}
    return parse_config(data, file, lines)


def parse_config(data: Any, file: str = "<config>", lines: Lines | None = None) -> SidecarConfig:
    """Validate already-parsed data; raises ConfigError naming the first problem."""
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        loc, reason = describe(errors[0], SidecarConfig, _ORDERING_BY_MODE, PROJECT_ENV)
        line = line_of(loc, lines or {})
        if line is not None:
            reason += f" (line {line})"
        if len(errors) > 1:
            reason += f" [+{len(errors) - 1} more]"
        raise ConfigError(file, format_loc(loc), reason) from None
