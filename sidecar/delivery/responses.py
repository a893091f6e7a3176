"""Engine types to protobuf: the Subscribe responses, a subscription's GetStatus entry, UnblockKey's and
SkipGap's answers.

The only module that turns engine types into ``pubsub_sidecar.v1`` messages. Rules:

- Pure conversions: no runtime call but the reads ``subscription_status`` makes of the runtime's
  counters and shards; the instant to measure ages against (``now_ms``) is an argument.
- Messages are packed into as few responses as fit under ``_MAX_RESPONSE_BYTES`` (clients' default
  receive limit is 4 MiB; a single larger message goes alone, so clients that expect messages above
  4 MiB must raise it). Confirmations ride on the first response.
- Each message is built in place in its response (``messages.add``): no copy of its payload.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import duration_pb2, timestamp_pb2

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.engine.payloads import attributes_text
from sidecar.engine.types import Deliver, EngineStatus, KeyStatus, SkippedRange
from sidecar.ops.capacity import Capacity
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.runtime_actions import Unblocked

_MAX_RESPONSE_BYTES = 3 * 1024 * 1024
"""Stay under the 4 MiB default receive limit of gRPC clients, with room for our size estimate's error."""

_MESSAGE_OVERHEAD_BYTES = 160
"""Rough protobuf framing per OrderedMessage (tags, lengths, timestamps, attempt, flags) and its
traceparent (55 characters)."""


def subscribe_responses(
    deliveries: list[Deliver], confirmations: list[str], traceparents: list[str] | None = None
) -> list[sidecar_pb2.SubscribeResponse]:
    """Pack messages into responses under ``_MAX_RESPONSE_BYTES``; confirmations ride on the first.
    Each message is built in place in its response (``messages.add``): no copy of its payload.
    ``traceparents``: each delivery's ``OrderedMessage.traceparent`` (``MessageTraces.delivered``)."""
    response = sidecar_pb2.SubscribeResponse()
    responses = [response]
    batch_bytes = 0
    for index, delivery in enumerate(deliveries):
        size = _estimated_size(delivery)
        if batch_bytes and batch_bytes + size > _MAX_RESPONSE_BYTES:
            response = sidecar_pb2.SubscribeResponse()
            responses.append(response)
            batch_bytes = 0
        proto = response.messages.add()
        _fill_ordered_message(proto, delivery)
        if traceparents is not None and traceparents[index]:
            proto.traceparent = traceparents[index]
        batch_bytes += size
    if confirmations:
        responses[0].ack_confirmations.extend(confirmations)
    return responses


def _estimated_size(delivery: Deliver) -> int:
    message = delivery.message
    size = _MESSAGE_OVERHEAD_BYTES + len(delivery.delivery_id) + len(message.key)
    size += len(message.message_id) + len(message.dedup_id)
    payload = message.payload
    if payload is not None:
        size += len(payload.data) + attributes_text(payload.attributes) + 8 * len(payload.attributes)
    return size + 16 * len(delivery.skipped)


def _fill_ordered_message(proto: sidecar_pb2.OrderedMessage, delivery: Deliver) -> None:
    message = delivery.message
    payload = message.payload
    proto.delivery_id = delivery.delivery_id
    proto.key = message.key
    proto.message_id = message.message_id
    proto.dedup_id = message.dedup_id
    proto.sequence = message.sequence or 0
    proto.delivery_attempt = delivery.attempt
    proto.late = delivery.late
    proto.replayed = delivery.replayed
    proto.epoch = delivery.epoch
    for skipped in delivery.skipped:
        proto.skipped.add(first=skipped.first, last=skipped.last)
    if payload is not None:
        proto.data = payload.data
        attributes = proto.attributes
        for name, value in payload.attributes.items():  # a third faster than the map's generic update()
            attributes[name] = value
        _set_timestamp(proto.publish_time, payload.publish_time_ms)
    if message.timestamp_ms is not None:
        _set_timestamp(proto.event_time, message.timestamp_ms)


def _set_timestamp(target: timestamp_pb2.Timestamp, ms: int) -> None:
    seconds, millis = divmod(ms, 1000)
    target.seconds = seconds
    target.nanos = millis * 1_000_000


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    seconds, millis = divmod(ms, 1000)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=millis * 1_000_000)


def _duration(ms: int) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(ms)
    return duration


def fill_reports(
    proto: sidecar_pb2.SubscriptionStatus,
    capacity: Capacity,
    lease_problem: str | None,
    dead_letters: Mapping[str, int],
) -> None:
    """Capacity (once sampled long enough to mean something), why leases are lost, if they are, and
    ingest's dead letters added to the counts (``dead_lettered`` and ``dead_lettered:<reason>``)."""
    counts = proto.counts
    for reason, count in dead_letters.items():
        if count:
            counts[f"dead_lettered:{reason}"] = counts.get(f"dead_lettered:{reason}", 0) + count
            counts["dead_lettered"] = counts.get("dead_lettered", 0) + count
    if capacity.known:
        proto.capacity.intake_per_second = capacity.intake_per_second
        proto.capacity.delivered_per_second = capacity.delivered_per_second
        proto.capacity.deficit_per_second = capacity.deficit_per_second
        proto.capacity.growing_for.CopyFrom(_duration(round(capacity.growing_for_seconds * 1000)))
    proto.lease_problem = lease_problem or ""


def subscription_status(
    runtime: SubscriptionRuntime, status: EngineStatus, keys: list[KeyStatus], now_ms: int
) -> sidecar_pb2.SubscriptionStatus:
    """One subscription's GetStatus entry: the engine's status, the runtime's counters, its shards."""
    counts = dict(status.counts)
    runtime_counters = runtime.counters
    counts["unknown_delivery_ids"] = runtime_counters.unknown_ids
    counts["ack_commits"] = runtime_counters.ack_commits
    counts["store_retries"] = runtime_counters.store_retries
    counts["dead_letter_publish_failures"] = runtime_counters.dead_letter_publish_failures
    counts["dead_letters_pending"] = runtime.dead_letters_pending  # a current value, not a running count
    counts.update(runtime.extra_counts())
    proto = sidecar_pb2.SubscriptionStatus(
        name=runtime.name,
        mode=status.mode,
        buffered=status.buffered,
        ready=status.ready,
        in_flight=status.in_flight,
        keys=status.keys,
        keys_blocked=status.keys_blocked,
        counts=counts,
    )
    if runtime.sharded:
        proto.pod = runtime.pod
        proto.shard_count = runtime.shard_count
        for shard, epoch in sorted(runtime.shards().items()):
            proto.shards.add(shard=shard, epoch=epoch)
    if status.oldest_undelivered_ms is not None:
        proto.oldest_undelivered_age.CopyFrom(_duration(max(0, now_ms - status.oldest_undelivered_ms)))
    if status.watermark_ms is not None:
        proto.watermark.CopyFrom(_timestamp(status.watermark_ms))
        proto.watermark_lag.CopyFrom(_duration(max(0, now_ms - status.watermark_ms)))
    for key in keys:
        detail = proto.keys_detail.add(
            key=key.key,
            state=key.state,
            waiting_for=key.waiting_for,
            buffered=key.buffered,
            in_flight=key.in_flight,
        )
        if key.since_ms is not None:
            detail.since.CopyFrom(_timestamp(key.since_ms))
        if key.next_sequence is not None:
            detail.next_sequence = key.next_sequence
        if key.missing_sequence is not None:
            detail.missing_sequence = key.missing_sequence
        if key.last_missing_sequence is not None:
            detail.last_missing_sequence = key.last_missing_sequence
        if key.blocked_message_id:
            detail.blocked_message_id = key.blocked_message_id
        if key.blocked_sequence is not None:
            detail.blocked_sequence = key.blocked_sequence
    return proto


def unblock_response(unblocked: Unblocked) -> sidecar_pb2.UnblockKeyResponse:
    """What UnblockKey answers: the skipped dead letter's message id and its sequence or event time."""
    response = sidecar_pb2.UnblockKeyResponse(skipped_message_id=unblocked.message_id or "")
    if isinstance(unblocked.position, int):
        response.skipped_sequence = unblocked.position
    elif isinstance(unblocked.position, tuple):
        response.skipped_timestamp.CopyFrom(_timestamp(int(unblocked.position[0])))
    return response


def skip_gap_response(skipped: SkippedRange) -> sidecar_pb2.SkipGapResponse:
    """What SkipGap answers: the range of missing sequences skipped."""
    return sidecar_pb2.SkipGapResponse(skipped_from=skipped.first, skipped_through=skipped.last)
