"""Binding the sidecar's listeners (gRPC ``listen``, HTTP ``http``, the peer port): refuse an address in
use; the options every gRPC server of the sidecar runs with (``GRPC_SERVER_OPTIONS``).

Rules:
- Nobody shares a port with a running sidecar. gRPC's Linux default (``SO_REUSEPORT``) let a second
  sidecar bind a running one's port and take part of its apps' streams and status calls; the gRPC
  server turns it off (``grpc.so_reuseport`` 0), and ``ensure_tcp_port_free`` checks the address
  first so that the refusal is our one line, not grpc's own log line (``add_port.cc``) beside it.
- A Unix socket file is replaced only when nothing listens on it (a stale file from an earlier
  run); a live one is refused like a TCP port in use.
- Every refusal is a ``ListenError``: one line naming the address and the config field. The sidecar
  prints it and exits 2 (the user must fix the config or stop the other process), before anything
  else started.
"""

from __future__ import annotations

import errno
import socket

GRPC_SERVER_OPTIONS: list[tuple[str, int]] = [
    # Ping idle clients so that a vanished client (pod network gone, process frozen) ends its streams
    # and their in-flight messages go back within about a minute, not at TCP's hours-long timeout.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Accept client keepalive pings as often as every 10 s (the default 5 min would GOAWAY them).
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Linux's SO_REUSEPORT (gRPC's default) let a second sidecar bind this port and answer part of
    # its clients' calls: a port in use is refused instead (``ensure_tcp_port_free``).
    ("grpc.so_reuseport", 0),
]
"""The app-facing server's and the peer server's options (keepalive, no shared port)."""


class ListenError(RuntimeError):
    """A server could not listen on its configured address (one line, for the user)."""


def ensure_tcp_port_free(host: str, port: int, what: str) -> None:
    """Raise ``ListenError`` when ``host:port`` is taken (port 0 always binds).

    A bind test with ``SO_REUSEADDR`` (as both servers bind): connections in TIME_WAIT from an
    earlier run do not count, a socket that listens does. Racy by nature (another process may bind
    in between); the server's own bind still fails then, only less tidily.
    """
    if port == 0:
        return
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port} ({what}): {exc.strerror}") from None
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise ListenError(describe_bind_error(f"{host}:{port}", what, exc)) from None


def describe_bind_error(address: str, what: str, exc: OSError) -> str:
    """The one line for a failed bind of ``address`` (``what``: the config field, e.g. "listen")."""
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {address} ({what}): the address is in use (another sidecar on this port?)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {address} ({what}): not an address of this host"
    reason = exc.strerror or str(exc)
    return f"cannot listen on {address} ({what}): {reason}"


def is_socket_listening(path: str) -> bool:
    """True when a process accepts connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True
