import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("open", "ack", "nack")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    open: Open
    ack: Ack
    nack: Nack
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., nack: _Optional[_Union[Nack, _Mapping]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("subscription", "max_outstanding_messages")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTSTANDING_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    max_outstanding_messages: int
    def __init__(self, subscription: _Optional[str] = ..., max_outstanding_messages: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("delivery_ids",)
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, delivery_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Nack(_message.Message):
    __slots__ = ("delivery_ids", "retry_after", "dead_letter")
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[str]
    retry_after: _duration_pb2.Duration
    dead_letter: bool
    def __init__(self, delivery_ids: _Optional[_Iterable[str]] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., dead_letter: _Optional[bool] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("messages", "ack_confirmations")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ACK_CONFIRMATIONS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[OrderedMessage]
    ack_confirmations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, messages: _Optional[_Iterable[_Union[OrderedMessage, _Mapping]]] = ..., ack_confirmations: _Optional[_Iterable[str]] = ...) -> None: ...

class OrderedMessage(_message.Message):
    __slots__ = ("delivery_id", "key", "message_id", "dedup_id", "data", "attributes", "publish_time", "sequence", "event_time", "delivery_attempt", "late", "skipped", "epoch", "replayed", "traceparent")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    DEDUP_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    key: str
    message_id: str
    dedup_id: str
    data: bytes
    attributes: _containers.ScalarMap[str, str]
    publish_time: _timestamp_pb2.Timestamp
    sequence: int
    event_time: _timestamp_pb2.Timestamp
    delivery_attempt: int
    late: bool
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedRange]
    epoch: int
    replayed: bool
    traceparent: str
    def __init__(self, delivery_id: _Optional[str] = ..., key: _Optional[str] = ..., message_id: _Optional[str] = ..., dedup_id: _Optional[str] = ..., data: _Optional[bytes] = ..., attributes: _Optional[_Mapping[str, str]] = ..., publish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., sequence: _Optional[int] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., delivery_attempt: _Optional[int] = ..., late: _Optional[bool] = ..., skipped: _Optional[_Iterable[_Union[SkippedRange, _Mapping]]] = ..., epoch: _Optional[int] = ..., replayed: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SkippedRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("subscription", "max_keys")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    max_keys: int
    def __init__(self, subscription: _Optional[str] = ..., max_keys: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("subscriptions", "relays")
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionStatus]
    relays: _containers.RepeatedCompositeFieldContainer[RelayStatus]
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[SubscriptionStatus, _Mapping]]] = ..., relays: _Optional[_Iterable[_Union[RelayStatus, _Mapping]]] = ...) -> None: ...

class RelayStatus(_message.Message):
    __slots__ = ("name", "pending_entries", "shards_held", "waiting_entries", "blocked_keys", "waiting", "published", "publish_failures")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PENDING_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_HELD_FIELD_NUMBER: _ClassVar[int]
    WAITING_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    pending_entries: int
    shards_held: int
    waiting_entries: int
    blocked_keys: int
    waiting: _containers.RepeatedCompositeFieldContainer[WaitingEntry]
    published: int
    publish_failures: int
    def __init__(self, name: _Optional[str] = ..., pending_entries: _Optional[int] = ..., shards_held: _Optional[int] = ..., waiting_entries: _Optional[int] = ..., blocked_keys: _Optional[int] = ..., waiting: _Optional[_Iterable[_Union[WaitingEntry, _Mapping]]] = ..., published: _Optional[int] = ..., publish_failures: _Optional[int] = ...) -> None: ...

class WaitingEntry(_message.Message):
    __slots__ = ("entry_id", "key", "reason", "retry_helps")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_HELPS_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    key: str
    reason: str
    retry_helps: bool
    def __init__(self, entry_id: _Optional[str] = ..., key: _Optional[str] = ..., reason: _Optional[str] = ..., retry_helps: _Optional[bool] = ...) -> None: ...

class SubscriptionStatus(_message.Message):
    __slots__ = ("name", "mode", "buffered", "ready", "in_flight", "keys", "keys_blocked", "oldest_undelivered_age", "watermark", "watermark_lag", "counts", "keys_detail", "pod", "shard_count", "shards", "pull_failure", "capacity", "lease_problem")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_BLOCKED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_UNDELIVERED_AGE_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_LAG_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PULL_FAILURE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    name: str
    mode: str
    buffered: int
    ready: int
    in_flight: int
    keys: int
    keys_blocked: int
    oldest_undelivered_age: _duration_pb2.Duration
    watermark: _timestamp_pb2.Timestamp
    watermark_lag: _duration_pb2.Duration
    counts: _containers.ScalarMap[str, int]
    keys_detail: _containers.RepeatedCompositeFieldContainer[KeyStatus]
    pod: str
    shard_count: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    pull_failure: str
    capacity: CapacityStatus
    lease_problem: str
    def __init__(self, name: _Optional[str] = ..., mode: _Optional[str] = ..., buffered: _Optional[int] = ..., ready: _Optional[int] = ..., in_flight: _Optional[int] = ..., keys: _Optional[int] = ..., keys_blocked: _Optional[int] = ..., oldest_undelivered_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., watermark: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., watermark_lag: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., counts: _Optional[_Mapping[str, int]] = ..., keys_detail: _Optional[_Iterable[_Union[KeyStatus, _Mapping]]] = ..., pod: _Optional[str] = ..., shard_count: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., pull_failure: _Optional[str] = ..., capacity: _Optional[_Union[CapacityStatus, _Mapping]] = ..., lease_problem: _Optional[str] = ...) -> None: ...

class CapacityStatus(_message.Message):
    __slots__ = ("intake_per_second", "delivered_per_second", "deficit_per_second", "growing_for")
    INTAKE_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DEFICIT_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GROWING_FOR_FIELD_NUMBER: _ClassVar[int]
    intake_per_second: float
    delivered_per_second: float
    deficit_per_second: float
    growing_for: _duration_pb2.Duration
    def __init__(self, intake_per_second: _Optional[float] = ..., delivered_per_second: _Optional[float] = ..., deficit_per_second: _Optional[float] = ..., growing_for: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard", "epoch")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    shard: int
    epoch: int
    def __init__(self, shard: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class KeyStatus(_message.Message):
    __slots__ = ("key", "state", "waiting_for", "since", "buffered", "in_flight", "next_sequence", "missing_sequence", "blocked_message_id", "blocked_sequence", "last_missing_sequence")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MISSING_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAST_MISSING_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    state: str
    waiting_for: str
    since: _timestamp_pb2.Timestamp
    buffered: int
    in_flight: int
    next_sequence: int
    missing_sequence: int
    blocked_message_id: str
    blocked_sequence: int
    last_missing_sequence: int
    def __init__(self, key: _Optional[str] = ..., state: _Optional[str] = ..., waiting_for: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., buffered: _Optional[int] = ..., in_flight: _Optional[int] = ..., next_sequence: _Optional[int] = ..., missing_sequence: _Optional[int] = ..., blocked_message_id: _Optional[str] = ..., blocked_sequence: _Optional[int] = ..., last_missing_sequence: _Optional[int] = ...) -> None: ...

class UnblockKeyRequest(_message.Message):
    __slots__ = ("subscription", "key")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    key: str
    def __init__(self, subscription: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class UnblockKeyResponse(_message.Message):
    __slots__ = ("skipped_sequence", "skipped_timestamp", "skipped_message_id")
    SKIPPED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    skipped_sequence: int
    skipped_timestamp: _timestamp_pb2.Timestamp
    skipped_message_id: str
    def __init__(self, skipped_sequence: _Optional[int] = ..., skipped_timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., skipped_message_id: _Optional[str] = ...) -> None: ...

class SkipGapRequest(_message.Message):
    __slots__ = ("subscription", "key", "through")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    key: str
    through: int
    def __init__(self, subscription: _Optional[str] = ..., key: _Optional[str] = ..., through: _Optional[int] = ...) -> None: ...

class SkipGapResponse(_message.Message):
    __slots__ = ("skipped_from", "skipped_through")
    SKIPPED_FROM_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    skipped_from: int
    skipped_through: int
    def __init__(self, skipped_from: _Optional[int] = ..., skipped_through: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("relay", "key", "data", "attributes", "topic", "traceparent", "tracestate", "entry_id")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RELAY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    relay: str
    key: str
    data: bytes
    attributes: _containers.ScalarMap[str, str]
    topic: str
    traceparent: str
    tracestate: str
    entry_id: str
    def __init__(self, relay: _Optional[str] = ..., key: _Optional[str] = ..., data: _Optional[bytes] = ..., attributes: _Optional[_Mapping[str, str]] = ..., topic: _Optional[str] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., entry_id: _Optional[str] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("entry_id",)
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    def __init__(self, entry_id: _Optional[str] = ...) -> None: ...
