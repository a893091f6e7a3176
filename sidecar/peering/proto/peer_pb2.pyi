import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardRequest(_message.Message):
    __slots__ = ("subscription", "messages")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    messages: _containers.RepeatedCompositeFieldContainer[ForwardedMessage]
    def __init__(self, subscription: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ForwardedMessage, _Mapping]]] = ...) -> None: ...

class ForwardedMessage(_message.Message):
    __slots__ = ("local_id", "shard", "epoch", "message_id", "data", "attributes", "ordering_key", "publish_time", "delivery_attempt")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOCAL_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    local_id: int
    shard: int
    epoch: int
    message_id: str
    data: bytes
    attributes: _containers.ScalarMap[str, str]
    ordering_key: str
    publish_time: _timestamp_pb2.Timestamp
    delivery_attempt: int
    def __init__(self, local_id: _Optional[int] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., message_id: _Optional[str] = ..., data: _Optional[bytes] = ..., attributes: _Optional[_Mapping[str, str]] = ..., ordering_key: _Optional[str] = ..., publish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., delivery_attempt: _Optional[int] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[Outcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("local_id", "verdict", "reason")
    class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VERDICT_UNSPECIFIED: _ClassVar[Outcome.Verdict]
        ACCEPTED: _ClassVar[Outcome.Verdict]
        REFUSED: _ClassVar[Outcome.Verdict]
    VERDICT_UNSPECIFIED: Outcome.Verdict
    ACCEPTED: Outcome.Verdict
    REFUSED: Outcome.Verdict
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Outcome.Reason]
        NOT_OWNER: _ClassVar[Outcome.Reason]
        STALE_EPOCH: _ClassVar[Outcome.Reason]
        OVERLOADED: _ClassVar[Outcome.Reason]
        STOPPING: _ClassVar[Outcome.Reason]
        FAILED: _ClassVar[Outcome.Reason]
    REASON_UNSPECIFIED: Outcome.Reason
    NOT_OWNER: Outcome.Reason
    STALE_EPOCH: Outcome.Reason
    OVERLOADED: Outcome.Reason
    STOPPING: Outcome.Reason
    FAILED: Outcome.Reason
    LOCAL_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    local_id: int
    verdict: Outcome.Verdict
    reason: Outcome.Reason
    def __init__(self, local_id: _Optional[int] = ..., verdict: _Optional[_Union[Outcome.Verdict, str]] = ..., reason: _Optional[_Union[Outcome.Reason, str]] = ...) -> None: ...
