"""Publishing a relay's batches with the official Pub/Sub client; the relay's only Pub/Sub importer.

Rules:

- ``publish`` sends a batch's messages as one ``Publish`` request per topic (the plan keeps a batch
  under Pub/Sub's request limit and a key's run in one topic), in executor threads: the event loop
  never blocks. A request is all or nothing, so each message's outcome is its request's.
- One retry layer, the relay's: the client's own retries are off (``retry=None``), so a failing topic
  shows in the relay's counters within seconds and its keys back off with jitter, in order.
- Outcomes say whether a failure is for good (``PublishFailure.permanent``: the topic is missing,
  publishing to it is denied, the request is invalid) or transient (anything else, an unknown
  outcome included: the relay publishes again with the same numbers, which the subscriber drops).
- ``can_publish`` asks Pub/Sub's IAM (``TestIamPermissions`` on the topic, ``pubsub.topics.publish``)
  at start: the answer is a reason to refuse the relay, or None.
- Payloads never appear in logs or errors.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1 import PublisherClient as GapicPublisherClient
from google.pubsub_v1 import PubsubMessage

from sidecar.publishing.entries import Message

PUBLISH_PERMISSION = "pubsub.topics.publish"
_TIMEOUT_SECONDS = 30.0
_PERMANENT = (
    api_exceptions.NotFound,
    api_exceptions.PermissionDenied,
    api_exceptions.InvalidArgument,
    api_exceptions.FailedPrecondition,
)


@dataclass(frozen=True, slots=True)
class PublishFailure:
    reason: str
    permanent: bool
    """For good as far as Pub/Sub says (topic missing, denied, invalid); the relay still retries a few
    times before its keys wait for an operator."""


class Publisher(Protocol):
    async def publish(self, messages: Sequence[Message]) -> list[PublishFailure | None]:
        """Each message's outcome, index-aligned: None when Pub/Sub took it."""
        ...

    async def can_publish(self, topic: str) -> str | None:
        """Why this process cannot publish to ``topic``, or None."""
        ...

    async def aclose(self) -> None: ...


class PubsubPublisher:
    """``Publisher`` on ``google.cloud.pubsub_v1.PublisherClient`` (``PUBSUB_EMULATOR_HOST`` honoured)."""

    def __init__(self, client: pubsub_v1.PublisherClient | None = None, timeout_seconds: float = _TIMEOUT_SECONDS):
        self._owns_client = client is None
        self._client = client if client is not None else pubsub_v1.PublisherClient()
        self._timeout = timeout_seconds
        self.requests = 0
        self.failures = 0

    async def publish(self, messages: Sequence[Message]) -> list[PublishFailure | None]:
        by_topic: dict[str, list[int]] = {}
        for index, m in enumerate(messages):
            by_topic.setdefault(m.topic, []).append(index)
        topics = list(by_topic)
        answers = await asyncio.gather(
            *(self._request(topic, [messages[i] for i in by_topic[topic]]) for topic in topics),
            return_exceptions=True,
        )
        outcomes: list[PublishFailure | None] = [None] * len(messages)
        for topic, answer in zip(topics, answers, strict=True):
            if isinstance(answer, BaseException):
                if isinstance(answer, asyncio.CancelledError):
                    raise answer
                self.failures += 1
                failure = PublishFailure(f"publishing to {topic}: {_describe(answer)}", isinstance(answer, _PERMANENT))
                for i in by_topic[topic]:
                    outcomes[i] = failure
        return outcomes

    async def _request(self, topic: str, messages: list[Message]) -> Any:
        self.requests += 1
        call = functools.partial(
            GapicPublisherClient.publish,
            self._client,
            topic=topic,
            messages=[
                PubsubMessage(data=m.data, attributes=m.attributes, ordering_key=m.ordering_key) for m in messages
            ],
            retry=None,
            timeout=self._timeout,
        )
        return await asyncio.get_running_loop().run_in_executor(None, call)

    async def can_publish(self, topic: str) -> str | None:
        call = functools.partial(
            self._client.test_iam_permissions,
            request={"resource": topic, "permissions": [PUBLISH_PERMISSION]},
            timeout=self._timeout,
        )
        try:
            answer = await asyncio.get_running_loop().run_in_executor(None, call)
        except api_exceptions.NotFound:
            return f"topic {topic} does not exist"
        except api_exceptions.GoogleAPICallError as exc:
            return f"cannot check publishing to {topic}: {_describe(exc)}"
        if PUBLISH_PERMISSION not in list(answer.permissions):
            return f"the service account may not publish to {topic} (no {PUBLISH_PERMISSION})"
        return None

    async def aclose(self) -> None:
        if self._owns_client:
            await asyncio.get_running_loop().run_in_executor(None, self._client.transport.close)


def _pubsub_message(m: Message) -> PubsubMessage:
    return PubsubMessage(data=m.data, attributes=m.attributes, ordering_key=m.ordering_key)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return f"{exc.__class__.__name__} {exc.code}: {exc.message}"
    return f"{exc.__class__.__name__}: {exc}"
