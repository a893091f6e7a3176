"""The config file's field types, shared by every section of it (``model`` and the sections in their
own modules, e.g. ``relays``): names, Pub/Sub names, attribute names, durations and sizes, and the
strict, frozen base model. Validation rules only; no section lives here.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from sidecar.config.durations import parse_byte_size, parse_duration_ms, parse_optional_duration_ms

MAX_SEQUENCE = 2**63 - 1
"""Sequences travel as protobuf int64 (``OrderedMessage.sequence``)."""

_PUBSUB_ID = r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}"
"""Pub/Sub's rule for topic and subscription ids: 3-255 characters, starting with a letter."""
PROJECT_PATTERN = r"[^/\s]+"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
"""Subscription names appear in Firestore document paths, metric labels and gRPC health service
names: a conservative alphabet keeps them valid in all three."""
_MAX_ATTRIBUTE_NAME_BYTES = 256
"""Pub/Sub's limit on attribute keys: a longer name can never be present on a message."""


# ---- field types -----------------------------------------------------------------------------


def check_attribute_name(value: str) -> str:
    if not value:
        raise ValueError("an attribute name must not be empty")
    if len(value.encode()) > _MAX_ATTRIBUTE_NAME_BYTES:
        raise ValueError(f"an attribute name is at most {_MAX_ATTRIBUTE_NAME_BYTES} bytes (Pub/Sub's limit)")
    return value


def check_name(value: str) -> str:
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a valid name: use 1-100 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return value


def check_pubsub_name(collection: str) -> typing.Callable[[str], str]:
    full = re.compile(rf"projects/({PROJECT_PATTERN})/{collection}/({_PUBSUB_ID})")
    short = re.compile(_PUBSUB_ID)

    def check(value: str) -> str:
        match = full.fullmatch(value)
        resource_id = match.group(2) if match else value
        if match is None and not short.fullmatch(value):
            raise ValueError(
                f"{value!r} is neither projects/PROJECT/{collection}/ID nor a bare ID; an ID has 3-255 characters, "
                "starts with a letter and uses only letters, digits and -_.~+%"
            )
        if resource_id.lower().startswith("goog"):
            raise ValueError(f"{value!r}: Pub/Sub ids must not start with 'goog'")
        return value

    return check


def check_project(value: str) -> str:
    if not re.fullmatch(PROJECT_PATTERN, value):
        raise ValueError(f"{value!r} is not a project id (non-empty, no '/' or spaces)")
    return value


def check_host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, e.g. 127.0.0.1:9090, got {value!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"an IPv6 host goes in brackets, e.g. [::1]:50051, got {value!r}")
    return value


def check_listen(value: str) -> str:
    if value.startswith("unix:"):
        if not value.startswith("unix:///") or len(value) == len("unix:///"):
            raise ValueError(f"a Unix socket is unix:///absolute/path, got {value!r}")
        return value
    return check_host_port(value)


def check_collection_id(value: str) -> str:
    if not value or "/" in value or value in (".", "..") or (value.startswith("__") and value.endswith("__")):
        raise ValueError(f"{value!r} is not a Firestore collection id (non-empty, no '/', not '.', '..' or __x__)")
    return value


AttributeName = Annotated[str, AfterValidator(check_attribute_name)]
DurationMs = Annotated[int, BeforeValidator(parse_duration_ms)]
PositiveDurationMs = Annotated[int, BeforeValidator(parse_duration_ms), Field(gt=0)]
NonNegativeDurationMs = Annotated[int, BeforeValidator(parse_duration_ms), Field(ge=0)]
OptionalPositiveDurationMs = Annotated[int | None, BeforeValidator(parse_optional_duration_ms)]
ByteSize = Annotated[int, BeforeValidator(parse_byte_size), Field(ge=1)]
SubscriptionName = Annotated[str, AfterValidator(check_pubsub_name("subscriptions"))]
TopicName = Annotated[str, AfterValidator(check_pubsub_name("topics"))]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
