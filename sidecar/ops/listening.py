"""Binding the sidecar's two listeners (gRPC ``listen``, HTTP ``http``): refuse an address in use.

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
