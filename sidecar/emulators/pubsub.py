"""The Pub/Sub emulator's gRPC surface: ``google.pubsub.v1.Publisher`` and ``Subscriber``.

Requests arrive as raw protobuf messages (the proto-plus types' ``.pb()`` classes, no code
generation); the broker in ``pubsub_state.py`` does the work. Snapshots and Seek are served by
``pubsub_snapshots.py``, ``google.iam.v1.IAMPolicy`` by ``pubsub_iam.py``, both on this server.
Rules kept here:
- every refusal is the status code production gives (INVALID_ARGUMENT for malformed names, values
  or oversize publishes, NOT_FOUND, ALREADY_EXISTS), with a message; an unexpected exception is logged
  and becomes INTERNAL, never UNKNOWN (the publisher retries UNKNOWN silently for ten minutes);
- StreamingPull fails with NOT_FOUND when the subscription is missing (the client never checks it
  first) and is only ever ended by the server with a non-OK code (OK would stop the subscriber);
- every way a StreamingPull ends goes through ``Broker.end_stream`` (the reader on half-close or a
  bad request, the RPC's done callback on cancel, lost connection or abort, the broker on a break
  or deletion), so the broker never leases to a stream whose RPC is over;
- push delivery, exactly-once delivery, filters and schemas are refused (see docs/emulators.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import empty_pb2
from google.pubsub_v1 import types

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.pubsub_admin import PubsubAdmin
from sidecar.emulators.pubsub_counters import RpcCounters
from sidecar.emulators.pubsub_iam import IamService
from sidecar.emulators.pubsub_model import (
    MAX_ACK_DEADLINE_SECONDS,
    MIN_ACK_DEADLINE_SECONDS,
    Backlog,
    Lease,
    PubsubError,
    StreamState,
    Subscription,
)
from sidecar.emulators.pubsub_names import (
    DELETED_TOPIC,
    InvalidName,
    parse_project,
    parse_subscription,
    parse_topic,
)
from sidecar.emulators.pubsub_replay import Replay, check_retention
from sidecar.emulators.pubsub_rpc import apply_mask, invalid, page, unary
from sidecar.emulators.pubsub_snapshots import SnapshotService
from sidecar.emulators.pubsub_state import Broker
from sidecar.emulators.pubsub_validation import check_modack_seconds, validate_messages, validate_subscription

_LOGGER = logging.getLogger(__name__)

PULL_WAIT_SECONDS = 1.0
"""A unary Pull with nothing available waits this long for a message before answering empty."""

_PubsubMessage = types.PubsubMessage.pb()
_Topic = types.Topic.pb()
_Subscription = types.Subscription.pb()
_StreamingPullRequest = types.StreamingPullRequest.pb()
_StreamingPullResponse = types.StreamingPullResponse.pb()
_Empty = empty_pb2.Empty


class PubsubEmulator:
    """The Pub/Sub emulator: broker + gRPC handlers + its admin routes and stream breaker."""

    def __init__(self, injector: FaultInjector) -> None:
        self.broker = Broker()
        self.replay = Replay(self.broker)
        self._snapshots = SnapshotService(self.broker, self.replay)
        self._iam = IamService(self.broker, self.replay)
        self.counters = RpcCounters()
        self._injector = injector
        self._stream_tasks: set[asyncio.Task[None]] = set()
        injector.stream_breakers["pubsub"] = self.break_streams

    # -- wiring ----------------------------------------------------------------------------------

    def add_to_server(self, server: grpc.aio.Server) -> None:
        publisher = {
            "CreateTopic": unary(self.create_topic, _Topic, _Topic),
            "UpdateTopic": unary(self.update_topic, types.UpdateTopicRequest.pb(), _Topic),
            "Publish": unary(self.publish, types.PublishRequest.pb(), types.PublishResponse.pb()),
            "GetTopic": unary(self.get_topic, types.GetTopicRequest.pb(), _Topic),
            "ListTopics": unary(self.list_topics, types.ListTopicsRequest.pb(), types.ListTopicsResponse.pb()),
            "ListTopicSubscriptions": unary(
                self.list_topic_subscriptions,
                types.ListTopicSubscriptionsRequest.pb(),
                types.ListTopicSubscriptionsResponse.pb(),
            ),
            "DeleteTopic": unary(self.delete_topic, types.DeleteTopicRequest.pb(), _Empty),
        }
        subscriber = {
            "CreateSubscription": unary(self.create_subscription, _Subscription, _Subscription),
            "GetSubscription": unary(self.get_subscription, types.GetSubscriptionRequest.pb(), _Subscription),
            "UpdateSubscription": unary(self.update_subscription, types.UpdateSubscriptionRequest.pb(), _Subscription),
            "ListSubscriptions": unary(
                self.list_subscriptions, types.ListSubscriptionsRequest.pb(), types.ListSubscriptionsResponse.pb()
            ),
            "DeleteSubscription": unary(self.delete_subscription, types.DeleteSubscriptionRequest.pb(), _Empty),
            "ModifyAckDeadline": unary(self.modify_ack_deadline, types.ModifyAckDeadlineRequest.pb(), _Empty),
            "Acknowledge": unary(self.acknowledge, types.AcknowledgeRequest.pb(), _Empty),
            "Pull": unary(self.pull, types.PullRequest.pb(), types.PullResponse.pb()),
            "ModifyPushConfig": unary(self.modify_push_config, types.ModifyPushConfigRequest.pb(), _Empty),
            "StreamingPull": grpc.stream_stream_rpc_method_handler(
                self.streaming_pull, _StreamingPullRequest.FromString, _StreamingPullResponse.SerializeToString
            ),
            **self._snapshots.handlers(),
        }
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler("google.pubsub.v1.Publisher", publisher),
                grpc.method_handlers_generic_handler("google.pubsub.v1.Subscriber", subscriber),
            )
        )
        self._iam.add_to_server(server)

    def admin_routes(self) -> list[web.RouteDef]:
        return PubsubAdmin(self.broker, self.replay, self.counters).routes()

    def backlogs(self) -> dict[str, Backlog]:
        """Per subscription with unacked messages: oldest publish time and count (for Monitoring)."""
        return self.broker.backlogs()

    async def break_streams(self, code: grpc.StatusCode) -> int:
        return self.broker.break_streams(code, f"stream closed by the emulator ({code.name})")

    async def close(self) -> None:
        self.broker.break_streams(grpc.StatusCode.UNAVAILABLE, "emulator shutting down")
        self.replay.close()
        self.broker.close()
        self._injector.stream_breakers.pop("pubsub", None)

    # -- Publisher -------------------------------------------------------------------------------

    async def create_topic(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_topic(request.name)
        if request.schema_settings.schema:
            raise invalid("schemas are not supported by this emulator")
        if request.HasField("message_retention_duration"):
            check_retention(request.message_retention_duration, "message_retention_duration")
        config = _Topic()
        config.CopyFrom(request)
        self.broker.add_topic(config)
        self.replay.start_sweeper()
        return config

    async def get_topic(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_topic(request.topic)
        return self.broker.topic(request.topic)

    async def update_topic(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_topic(request.topic.name)
        current = self.broker.topic(request.topic.name)
        updated = _Topic()
        updated.CopyFrom(current)
        apply_mask(updated, request.topic, request.update_mask, {"name"})
        if updated.HasField("message_retention_duration"):
            check_retention(updated.message_retention_duration, "message_retention_duration")
        self.broker.topics[current.name] = updated
        self.broker.set_topic_retention(updated)
        return updated

    async def list_topics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        project = parse_project(request.project)
        prefix = f"projects/{project}/topics/"
        names = sorted(n for n in self.broker.topics if n.startswith(prefix))
        chosen, token = page(names, request.page_size, request.page_token)
        return types.ListTopicsResponse.pb()(topics=[self.broker.topics[n] for n in chosen], next_page_token=token)

    async def list_topic_subscriptions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_topic(request.topic)
        names = self.broker.topic_subscriptions(request.topic)
        chosen, token = page(names, request.page_size, request.page_token)
        return types.ListTopicSubscriptionsResponse.pb()(subscriptions=chosen, next_page_token=token)

    async def delete_topic(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_topic(request.topic)
        self.broker.delete_topic(request.topic, DELETED_TOPIC)
        return _Empty()

    async def publish(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_topic(request.topic)
        self.broker.topic(request.topic)
        validate_messages(request)
        ids = self.broker.publish(request.topic, request.messages)
        return types.PublishResponse.pb()(message_ids=ids)

    # -- Subscriber admin --------------------------------------------------------------------------

    async def create_subscription(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_subscription(request.name)
        parse_topic(request.topic)
        if request.push_config.push_endpoint or request.HasField("bigquery_config"):
            raise invalid("push, BigQuery and Cloud Storage subscriptions are not supported by this emulator")
        if request.filter:
            raise invalid("subscription filters are not supported by this emulator")
        if request.enable_exactly_once_delivery:
            raise invalid("exactly-once delivery is not supported by this emulator")
        config = _Subscription()
        config.CopyFrom(request)
        validate_subscription(config)
        config.ClearField("topic_message_retention_duration")  # output only: the topic's, set by the broker
        self.broker.add_subscription(config)
        self.replay.start_sweeper()
        return config

    async def get_subscription(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_subscription(request.subscription)
        return self.broker.subscription(request.subscription).config

    async def update_subscription(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_subscription(request.subscription.name)
        sub = self.broker.subscription(request.subscription.name)
        updated = _Subscription()
        updated.CopyFrom(sub.config)
        apply_mask(
            updated,
            request.subscription,
            request.update_mask,
            {"name", "topic", "enable_message_ordering", "enable_exactly_once_delivery", "state",
             "topic_message_retention_duration"},
        )  # fmt: skip
        validate_subscription(updated)
        sub.config = updated
        if not updated.retain_acked_messages:
            sub.acked.clear()
        self.replay.expunge()  # a shorter retention applies at once
        return updated

    async def list_subscriptions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        project = parse_project(request.project)
        prefix = f"projects/{project}/subscriptions/"
        names = sorted(n for n in self.broker.subscriptions if n.startswith(prefix))
        chosen, token = page(names, request.page_size, request.page_token)
        configs = [self.broker.subscriptions[n].config for n in chosen]
        return types.ListSubscriptionsResponse.pb()(subscriptions=configs, next_page_token=token)

    async def delete_subscription(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_subscription(request.subscription)
        self.broker.delete_subscription(request.subscription)
        return _Empty()

    async def modify_push_config(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_subscription(request.subscription)
        sub = self.broker.subscription(request.subscription)
        if request.push_config.push_endpoint:
            raise invalid("push delivery is not supported by this emulator")
        sub.config.push_config.CopyFrom(request.push_config)
        return _Empty()

    # -- Subscriber delivery -----------------------------------------------------------------------

    def _subscription(self, name: str) -> Subscription:
        parse_subscription(name)
        return self.broker.subscription(name)

    async def acknowledge(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sub = self._subscription(request.subscription)
        if not request.ack_ids:
            raise invalid("Acknowledge: ack_ids must not be empty")
        self.counters.count_ack(len(request.ack_ids))
        self.broker.acknowledge(sub, request.ack_ids)
        return _Empty()

    async def modify_ack_deadline(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sub = self._subscription(request.subscription)
        if not request.ack_ids:
            raise invalid("ModifyAckDeadline: ack_ids must not be empty")
        check_modack_seconds(request.ack_deadline_seconds)
        self.counters.count_modack(request.ack_deadline_seconds, len(request.ack_ids))
        self.broker.modify_deadline(sub, request.ack_ids, request.ack_deadline_seconds)
        return _Empty()

    async def pull(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sub = self._subscription(request.subscription)
        if request.max_messages <= 0:
            raise invalid(f"Pull: max_messages must be positive (got {request.max_messages})")
        leases = self.broker.take(sub, request.max_messages)
        if not leases and not request.return_immediately:
            sub.pull_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sub.pull_wake.wait(), PULL_WAIT_SECONDS)
            if sub.deleted:
                raise PubsubError(grpc.StatusCode.NOT_FOUND, f"Subscription does not exist: {sub.name}")
            leases = self.broker.take(sub, request.max_messages)
        response = types.PullResponse.pb()()
        _fill(response.received_messages, sub, leases)
        return response

    async def streaming_pull(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """One StreamingPull stream: a reader task takes acks/modacks, this generator writes what the
        broker's dispatcher leased to the stream (its outbox)."""
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        try:
            sub, stream = self._open_stream(first)
        except (PubsubError, InvalidName) as exc:
            code = exc.code if isinstance(exc, PubsubError) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(exc))
            return
        stream.routing = _routing_header(context)
        # However the RPC ends (client cancel, lost connection, a failed write, a server abort), the
        # stream is forgotten when it ends, not when its generator happens to be finalized.
        context.add_done_callback(lambda _: self.broker.end_stream(stream, grpc.StatusCode.CANCELLED, "RPC ended"))
        reader = asyncio.create_task(self._read_stream(requests, stream))
        try:
            while True:
                stream.wake.clear()
                if stream.break_code is not None:
                    if stream.break_code is grpc.StatusCode.OK:
                        return  # the client half-closed: it is shutting down
                    await context.abort(stream.break_code, stream.break_message)
                leases = stream.next_response()
                if leases:
                    response = _StreamingPullResponse()
                    _fill(response.received_messages, sub, leases)
                    response.subscription_properties.message_ordering_enabled = sub.config.enable_message_ordering
                    stream.writing_since = asyncio.get_running_loop().time()
                    yield response
                    stream.writing_since = None
                else:
                    self.broker.writer_idle(stream)
                    await stream.wake.wait()
        finally:
            reader.cancel()
            self.broker.close_stream(stream)

    def _open_stream(self, first: Any) -> tuple[Subscription, StreamState]:
        if not first.subscription:
            raise invalid("StreamingPull: the first request must name the subscription")
        sub = self._subscription(first.subscription)
        deadline = first.stream_ack_deadline_seconds
        if not MIN_ACK_DEADLINE_SECONDS <= deadline <= MAX_ACK_DEADLINE_SECONDS:
            raise invalid(
                f"StreamingPull: stream_ack_deadline_seconds must be between {MIN_ACK_DEADLINE_SECONDS} and "
                f"{MAX_ACK_DEADLINE_SECONDS} (got {deadline})"
            )
        self._stream_acks(sub, first)
        stream = self.broker.open_stream(
            sub, deadline, first.max_outstanding_messages, first.max_outstanding_bytes, first.client_id
        )
        return sub, stream

    def _stream_acks(self, sub: Subscription, request: Any) -> None:
        if len(request.modify_deadline_ack_ids) != len(request.modify_deadline_seconds):
            raise invalid(
                "StreamingPull: modify_deadline_ack_ids and modify_deadline_seconds must have the same length"
            )
        for seconds in request.modify_deadline_seconds:
            check_modack_seconds(seconds)
        if request.ack_ids:
            self.counters.count_ack(len(request.ack_ids))
            self.broker.acknowledge(sub, request.ack_ids)
        for seconds in set(request.modify_deadline_seconds):
            self.counters.count_modack(seconds, request.modify_deadline_seconds.count(seconds))
        for ack_id, seconds in zip(request.modify_deadline_ack_ids, request.modify_deadline_seconds, strict=True):
            self.broker.modify_deadline(sub, (ack_id,), seconds)

    async def _read_stream(self, requests: AsyncIterator[Any], stream: StreamState) -> None:
        sub = stream.subscription
        try:
            async for request in requests:
                if request.subscription or request.max_outstanding_messages or request.max_outstanding_bytes:
                    raise invalid(
                        "StreamingPull: subscription and max_outstanding_* may only be set in the first request"
                    )
                if not request.ByteSize():
                    stream.heartbeats += 1
                if request.stream_ack_deadline_seconds:
                    deadline = request.stream_ack_deadline_seconds
                    if not MIN_ACK_DEADLINE_SECONDS <= deadline <= MAX_ACK_DEADLINE_SECONDS:
                        raise invalid(f"StreamingPull: stream_ack_deadline_seconds out of range (got {deadline})")
                    stream.deadline_seconds = deadline
                self._stream_acks(sub, request)
            self.broker.end_stream(stream, grpc.StatusCode.OK, "client half-closed the stream")
        except PubsubError as exc:
            self.broker.end_stream(stream, exc.code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the transport failed under us: end the stream, the client reconnects
            self.broker.end_stream(stream, grpc.StatusCode.UNAVAILABLE, f"stream read failed: {exc}")


def _routing_header(context: grpc.aio.ServicerContext) -> str:
    """The call's ``x-goog-request-params`` (how Google's front ends route a call to its resource)."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-goog-request-params":
            return value if isinstance(value, str) else value.decode()
    return ""


def _fill(received: Any, sub: Subscription, leases: list[Lease]) -> None:
    counted = sub.max_delivery_attempts > 0
    for lease in leases:
        item = received.add()
        item.ack_id = lease.ack_id
        item.message.CopyFrom(lease.pending.message)
        if counted:
            item.delivery_attempt = lease.pending.attempts
