"""A Pub/Sub subscriber transport whose StreamingPull attempts are reported to a ``PullHealth``.

The subscriber reopens failed streams by itself and says so only at DEBUG; the one place that sees
every attempt and how it ended is the gRPC channel. ``watched_transport`` returns a subclass of the
client's own gRPC transport (the client accepts a transport class, also with
``PUBSUB_EMULATOR_HOST``) that puts a client interceptor on the channel before the client's stubs
are made. The interceptor reports each StreamingPull call's start and its status when it ends (a
``grpc.Future`` done callback on the client's threads); it changes nothing in the calls, and every
other method passes untouched. The client library itself is not modified.

Lives beside ``sidecar.pipeline.ingest_pull``, which alone imports it (the Pub/Sub client stays behind the
streaming pull).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.pubsub_v1.services.subscriber.transports.grpc import SubscriberGrpcTransport

from sidecar.pipeline.pull_health import PullHealth

_STREAMING_PULL = "/google.pubsub.v1.Subscriber/StreamingPull"


class _StreamingPullWatch(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]  # grpcio ships no types
    def __init__(self, health: PullHealth) -> None:
        self._health = health

    def intercept_stream_stream(
        self,
        continuation: Callable[[Any, Iterator[Any]], Any],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: Iterator[Any],
    ) -> Any:
        call = continuation(client_call_details, request_iterator)
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if method == _STREAMING_PULL:
            health = self._health
            attempt = health.attempt_started()

            def ended(finished: Any) -> None:
                code = finished.code()
                health.attempt_ended(attempt, code.name if code is not None else "UNKNOWN", finished.details() or "")

            call.add_done_callback(ended)
        return call


def watched_transport(health: PullHealth) -> type[SubscriberGrpcTransport]:
    """A transport class for ``SubscriberClient(transport=...)`` that reports to ``health``."""
    interceptor = _StreamingPullWatch(health)

    class WatchedSubscriberTransport(SubscriberGrpcTransport):
        def __init__(self, *, channel: Any = None, **kwargs: Any) -> None:
            if isinstance(channel, grpc.Channel):  # the emulator's insecure channel
                channel = grpc.intercept_channel(channel, interceptor)
            else:  # production: the client's own channel, made the client's way, then wrapped
                make = channel if channel is not None else SubscriberGrpcTransport.create_channel

                def make_watched(*args: Any, **channel_kwargs: Any) -> grpc.Channel:
                    return grpc.intercept_channel(make(*args, **channel_kwargs), interceptor)

                channel = make_watched
            super().__init__(channel=channel, **kwargs)

    return WatchedSubscriberTransport
