"""The ``peering`` section: off without it, never open without credentials, one line for each refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from config_support import error_of, minimal, write

from sidecar.commands.main import main
from sidecar.config.model import load_config
from sidecar.config.peering import PeerSecretError, read_peer_secret


def _load(tmp_path: Path, peering: object) -> object:
    return load_config(write(tmp_path, yaml.safe_dump({**minimal(), "peering": peering})), env={}).peering


def test_without_the_section_the_peer_channel_is_off(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, yaml.safe_dump(minimal())), env={}).peering is None


def test_the_channel_on_without_a_secret_is_refused_unless_the_network_is_trusted(tmp_path: Path) -> None:
    error = error_of(tmp_path, {**minimal(), "peering": {"port": 7100}})
    assert "peering.secret_file" in str(error) and "trusted_network: true" in str(error)
    trusted = _load(tmp_path, {"trusted_network": True})
    assert trusted is not None and trusted.port == 7100 and trusted.trusted_network  # type: ignore[attr-defined]
    off = _load(tmp_path, {"port": 0})
    assert off is not None and not off.enabled  # type: ignore[attr-defined]


def test_the_advertised_address_defaults_to_the_pod_ip_and_port(tmp_path: Path) -> None:
    config = _load(tmp_path, {"secret_file": "/var/run/secrets/peer/secret", "port": 7200})
    assert config.advertised({"POD_IP": "10.1.2.3"}) == "10.1.2.3:7200"  # type: ignore[attr-defined]
    assert config.advertised({"POD_IP": "fd00::5"}) == "[fd00::5]:7200"  # type: ignore[attr-defined]
    assert config.advertised({}) == ""  # type: ignore[attr-defined]
    named = _load(tmp_path, {"secret_file": "/s", "advertise_address": "pod-0.peers:7100"})
    assert named.advertised({"POD_IP": "10.1.2.3"}) == "pod-0.peers:7100"  # type: ignore[attr-defined]
    assert "advertise_address" in str(error_of(tmp_path, {**minimal(), "peering": {"advertise_address": "x"}}))


def test_the_secret_is_read_stripped_and_an_empty_or_missing_file_is_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"  abc123\n")
    assert read_peer_secret(str(secret)) == b"abc123"
    secret.write_bytes(b"\n")
    with pytest.raises(PeerSecretError, match="is empty"):
        read_peer_secret(str(secret))
    with pytest.raises(PeerSecretError, match="cannot be read"):
        read_peer_secret(str(tmp_path / "missing"))


def test_run_refuses_to_start_with_an_unreadable_secret_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {**minimal(), "peering": {"secret_file": str(tmp_path / "missing")}}
    path = write(tmp_path, yaml.safe_dump(data))
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "peering.secret_file" in err and "cannot be read" in err
