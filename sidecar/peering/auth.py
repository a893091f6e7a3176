"""The peer channel's credentials: a shared secret, read from a file, sent with every call.

Rules:

- The secret is the content of ``peering.secret_file`` (a Kubernetes Secret mounted as a file), with
  surrounding whitespace (a trailing newline) removed; an empty or unreadable file is an error at
  start (``sidecar.config.peering.read_peer_secret``: one line, exit 2), never an open channel.
- Every call carries it as the binary metadata ``x-sidecar-peer-secret-bin``; the server compares it
  with its own in constant time (``hmac.compare_digest``), so a wrong guess takes as long as any.
  Missing or wrong: UNAUTHENTICATED, counted (``pubsub_sidecar_peer_unauthenticated_total``).
- Without a secret (``peering.trusted_network: true``) nothing is sent and every call is admitted.
- The secret never appears in logs, errors or metrics; neither do the payloads of forwarded messages.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

METADATA_KEY = "x-sidecar-peer-secret-bin"
"""Binary metadata (``-bin``): any bytes may be a secret."""


class PeerCredentials:
    """One pod's view of the shared secret: what it sends and what it admits (None: trusted network)."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    @property
    def trusted_network(self) -> bool:
        return self._secret is None

    def call_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """Metadata for an outgoing call."""
        return () if self._secret is None else ((METADATA_KEY, self._secret),)

    def admits(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """True when the call's metadata carries the secret (always, on a trusted network)."""
        if self._secret is None:
            return True
        given = b""
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value if isinstance(value, bytes) else value.encode()
                break
        # Constant time in the secret's content; an absent value is compared too.
        return hmac.compare_digest(given, self._secret)

    def __repr__(self) -> str:
        return "PeerCredentials(trusted network)" if self._secret is None else "PeerCredentials(secret set)"
