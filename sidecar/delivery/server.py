"""The app-facing gRPC server: OrderedDelivery, grpc.health.v1.Health and server reflection.

Listens on ``host:port`` (port 0 picks a free port) or ``unix:///path``; ``start()`` returns the
address actually bound, or raises ``ListenError`` (one line) when the address is in use: never
shared with another process (no ``SO_REUSEPORT``; a live Unix socket is not replaced).

Health has one entry per subscription name, one for
``pubsub_sidecar.v1.OrderedDelivery`` and the overall ``""``. All start NOT_SERVING: the caller marks
subscriptions ready (``set_serving``) once they recovered; the service and overall entries turn
SERVING when every subscription is. ``enter_graceful_shutdown()`` turns everything NOT_SERVING for
good, before ``stop(grace)`` ends the streams (each gives its in-flight messages back).

The only module that imports grpcio-health-checking and grpcio-reflection.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar.delivery.handlers import SERVICE_NAME, ordered_delivery_handler
from sidecar.delivery.servicer import OrderedDeliveryServicer, StatusReports
from sidecar.ops.listening import GRPC_SERVER_OPTIONS, ListenError, ensure_tcp_port_free, is_socket_listening
from sidecar.pipeline.runtime import SubscriptionRuntime

_LOGGER = logging.getLogger(__name__)


_UNIX_PREFIX = "unix://"


class GrpcServer:
    """Owns the grpc.aio server: start, health state, graceful stop."""

    def __init__(
        self,
        runtimes: Mapping[str, SubscriptionRuntime],
        listen: str,
        *,
        servicer: OrderedDeliveryServicer | None = None,
        pull_failures: Mapping[str, Callable[[], str | None]] | None = None,
        reports: StatusReports | None = None,
    ) -> None:
        self._runtimes = dict(runtimes)
        self._listen = listen
        self.servicer = servicer or OrderedDeliveryServicer(
            self._runtimes, pull_failures=pull_failures, reports=reports
        )
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._serving: set[str] = set()
        self.address: str | None = None
        """The bound address (``host:port`` with the real port, or ``unix:///path``) once started."""

    async def start(self) -> str:
        """Bind and start serving; returns the bound address. Health starts NOT_SERVING."""
        if self._server is not None:
            raise RuntimeError("GrpcServer.start() called twice")
        for name in ["", SERVICE_NAME, *self._runtimes]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        # Not the generated add_OrderedDeliveryServicer_to_server: ours refuses undecodable requests
        # with INVALID_ARGUMENT instead of failing inside grpc (sidecar.delivery.handlers).
        server.add_generic_rpc_handlers((ordered_delivery_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME],
            server,
        )
        address = _bind(server, self._listen)
        await server.start()
        self._server = server
        self.address = address
        _LOGGER.info("gRPC server listening on %s", address)
        return address

    async def set_serving(self, names: Iterable[str] | None = None) -> None:
        """Mark subscriptions SERVING (all when ``names`` is None); overall follows once all are."""
        chosen = list(self._runtimes) if names is None else list(names)
        for name in chosen:
            if name not in self._runtimes:
                raise ValueError(f"set_serving: unknown subscription {name!r}")
            self._serving.add(name)
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self._serving >= set(self._runtimes):
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
            await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self, name: str) -> None:
        """One subscription cannot serve (e.g. its runtime failed): it and the overall entries go down."""
        if name not in self._runtimes:
            raise ValueError(f"set_not_serving: unknown subscription {name!r}")
        self._serving.discard(name)
        for entry in (name, SERVICE_NAME, ""):
            await self.health.set(entry, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """Everything NOT_SERVING from now on, so probes and load balancers stop sending work."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_seconds: float | None = 5.0) -> None:
        """Stop accepting streams; open ones get ``grace_seconds`` then are cancelled. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        await self.enter_graceful_shutdown()
        # Streams stop receiving new messages and end once their outstanding ones are acked and
        # confirmed; whatever is still open when the grace period ends is cancelled and given back.
        self.servicer.drain()
        await server.stop(grace_seconds)
        if self.address is not None and self.address.startswith(_UNIX_PREFIX):
            _remove_stale_socket(self.address[len(_UNIX_PREFIX) :])


def _bind(server: grpc.aio.Server, listen: str) -> str:
    if listen.startswith(_UNIX_PREFIX):
        path = listen[len(_UNIX_PREFIX) :]
        if not path.startswith("/"):
            raise ListenError(f"listen {listen!r}: a Unix socket needs an absolute path, e.g. unix:///run/sidecar.sock")
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            raise ListenError(f"listen {listen!r}: directory {directory} does not exist")
        _remove_stale_socket(path)
        _add_port(server, listen)
        return listen
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ListenError(f"listen {listen!r}: expected host:port (port 0..65535) or unix:///path")
    ensure_tcp_port_free(host, int(port_text), "listen")
    port = _add_port(server, listen)
    return f"{host}:{port}"


def _add_port(server: grpc.aio.Server, address: str) -> int:
    try:
        port: int = server.add_insecure_port(address)
    except RuntimeError as exc:
        # grpc's text points at GRPC_VERBOSITY; what it means here is one of these two.
        raise ListenError(f"cannot listen on {address} (listen): the address is in use or not local") from exc
    if port == 0 and not address.startswith(_UNIX_PREFIX):
        raise ListenError(f"cannot listen on {address} (listen): the address is in use or not local")
    return port


def _remove_stale_socket(path: str) -> None:
    """A socket file left by an earlier run would make bind fail: removed. A socket another process
    listens on is refused, and anything else is not ours to delete."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
    if is_socket_listening(path):
        raise ListenError(f"cannot listen on unix://{path} (listen): another process listens on it (another sidecar?)")
    os.unlink(path)
