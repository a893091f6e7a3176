"""The ``peering:`` section: the peer channel between the pods of a subscription (docs/forwarding.md).

Rules (the file's rules of ``sidecar.config.model`` hold here too: unknown fields and wrong YAML
types are errors, one line each):

- Without the section the peer channel is off: a message of another pod's shard is stored for its
  owner in Firestore (the inbox), as before forwarding existed. With it, ``port`` (default 7100)
  turns it on; ``port: 0`` turns it off again.
- **Not open to anyone.** With the channel on, ``secret_file`` (a mounted Kubernetes Secret) is
  required, unless ``trusted_network: true`` says the network is the deployment's alone; otherwise
  the file is refused (one line, exit 2). The file must be readable and hold a non-empty secret when
  the sidecar starts (``read_peer_secret``, called by the ``run`` command's wiring: one line, exit 2).
- ``advertise_address`` is what the other pods dial (``host:port``); empty: ``$POD_IP:<port>``
  (``POD_IP`` from the downward API), and without ``POD_IP`` this pod forwards but is not forwarded to.

The reference is docs/config.md (``peering``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from sidecar.config.fields import StrictModel, check_host_port

DEFAULT_PORT = 7100
POD_IP_ENV = "POD_IP"
MAX_SECRET_BYTES = 4096


def _check_advertise(value: str) -> str:
    return check_host_port(value) if value else value


class PeeringConfig(StrictModel):
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """The peer server's port on every interface; 0 turns the peer channel off (the inbox path only)."""
    advertise_address: Annotated[str, AfterValidator(_check_advertise)] = ""
    """``host:port`` the other pods dial; empty: ``$POD_IP:<port>``."""
    secret_file: str = ""
    """File holding the shared secret (a mounted Kubernetes Secret); required unless ``trusted_network``."""
    trusted_network: bool = False
    """Run the peer channel without a secret: only where nothing but the deployment's pods reach the port."""

    @property
    def enabled(self) -> bool:
        return self.port != 0

    @model_validator(mode="after")
    def _credentials_required(self) -> PeeringConfig:
        if self.enabled and not self.secret_file and not self.trusted_network:
            raise PydanticCustomError(
                "peer_credentials",
                "the peer channel (port {port}) needs secret_file (a mounted Secret), or trusted_network: true "
                "to run it without credentials; port: 0 turns it off",
                {"port": self.port, "at": ("secret_file",)},
            )
        return self

    def advertised(self, env: Mapping[str, str]) -> str:
        """What the other pods dial: ``advertise_address``, else ``$POD_IP:<port>``; "" when unknown."""
        if self.advertise_address:
            return self.advertise_address
        pod_ip = env.get(POD_IP_ENV, "").strip()
        if not pod_ip:
            return ""
        host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
        return f"{host}:{self.port}"


class PeerSecretError(Exception):
    """The secret file cannot be used; one line naming the file and why."""


def read_peer_secret(path: str) -> bytes:
    """The secret in ``path`` with surrounding whitespace (a trailing newline) removed; raises
    ``PeerSecretError`` when it cannot be read, is empty, or is larger than ``MAX_SECRET_BYTES``."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PeerSecretError(f"peering.secret_file {path!r} cannot be read: {exc.strerror or exc}") from None
    secret = raw.strip()
    if not secret:
        raise PeerSecretError(f"peering.secret_file {path!r} is empty")
    if len(secret) > MAX_SECRET_BYTES:
        raise PeerSecretError(f"peering.secret_file {path!r} holds more than {MAX_SECRET_BYTES} bytes")
    return secret
