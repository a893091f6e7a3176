"""Resource-name rules of the Pub/Sub emulator, as the production service enforces them.

Rules (from the Pub/Sub resource-name documentation):
- topics are ``projects/{project}/topics/{id}``, subscriptions ``projects/{project}/subscriptions/{id}``,
  snapshots ``projects/{project}/snapshots/{id}``;
- an id is 3-255 characters, starts with a letter, uses only ``[A-Za-z0-9-_.~+%]`` and does not start
  with ``goog``;
- a project is non-empty and contains no ``/``.

Every violation is an :class:`InvalidName` whose message names the offending resource, which the gRPC
layer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import re

_ID_RE = re.compile(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}")
"""3-255 characters starting with a letter: the production rule for topic, subscription and snapshot ids."""

_PROJECT_RE = re.compile(r"[^/]+")

DELETED_TOPIC = "_deleted-topic_"
"""What production reports as the topic of a subscription whose topic was deleted."""


class InvalidName(ValueError):
    """A resource name that production would reject with INVALID_ARGUMENT."""


def _parse(name: str, collection: str) -> tuple[str, str]:
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "projects" or parts[2] != collection:
        raise InvalidName(f"Invalid [{collection}] name: (name={name!r}); expected projects/P/{collection}/ID")
    project, resource_id = parts[1], parts[3]
    if not _PROJECT_RE.fullmatch(project):
        raise InvalidName(f"Invalid [{collection}] name: (name={name!r}); empty project")
    if not _ID_RE.fullmatch(resource_id) or resource_id.lower().startswith("goog"):
        raise InvalidName(
            f"Invalid [{collection}] name: (name={name!r}); the id must be 3-255 characters, start with a "
            "letter, use only letters, digits and -_.~+% and not start with 'goog'"
        )
    return project, resource_id


def parse_topic(name: str) -> tuple[str, str]:
    """(project, topic id) of a topic name; raises InvalidName."""
    return _parse(name, "topics")


def parse_subscription(name: str) -> tuple[str, str]:
    """(project, subscription id) of a subscription name; raises InvalidName."""
    return _parse(name, "subscriptions")


def parse_snapshot(name: str) -> tuple[str, str]:
    """(project, snapshot id) of a snapshot name; raises InvalidName."""
    return _parse(name, "snapshots")


def parse_project(name: str) -> str:
    """The project of ``projects/P``; raises InvalidName."""
    parts = name.split("/")
    if len(parts) != 2 or parts[0] != "projects" or not parts[1]:
        raise InvalidName(f"Invalid [projects] name: (name={name!r}); expected projects/P")
    return parts[1]
