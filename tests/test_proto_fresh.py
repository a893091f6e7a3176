"""The committed generated packages match what `make proto` makes from ``proto/``: the app-facing API's
``clients/python/src/pubsub_sidecar/``, and the peer channel's ``sidecar/peering/proto/`` (whose service
also keeps the names both ends rely on).

Fails when someone edits the .proto without running `make proto`, or edits generated code by hand.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_gen_proto() -> ModuleType:
    # scripts/ is not a package: load the script by path, as `make proto` runs it.
    spec = importlib.util.spec_from_file_location("gen_proto", REPO_ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_matches_proto() -> None:
    problems = _load_gen_proto().stale_files()
    assert problems == [], "generated code is stale:\n" + "\n".join(problems)


def test_check_detects_a_stale_file(tmp_path: Path) -> None:
    gen_proto = _load_gen_proto()
    # A copy of the committed package with one generated file changed by hand, and one stray file.
    package = tmp_path / gen_proto.PACKAGE
    gen_proto.generate(tmp_path)
    stub = package / "v1" / "sidecar_pb2_grpc.py"
    stub.write_text(stub.read_text() + "# edited by hand\n")
    (package / "v1" / "old_pb2.py").write_text("")
    problems = gen_proto.stale_files(tmp_path)
    assert [p.split(":")[0] for p in problems] == [
        "pubsub_sidecar/v1/old_pb2.py",
        "pubsub_sidecar/v1/sidecar_pb2_grpc.py",
    ]
    assert "edited by hand" in problems[1]


def test_generated_package_lives_in_the_client_distribution() -> None:
    gen_proto = _load_gen_proto()
    assert gen_proto.OUT_ROOT == REPO_ROOT / "clients" / "python" / "src"
    # The import resolves to that copy: the server carries none of its own.
    import pubsub_sidecar

    assert Path(pubsub_sidecar.__file__).resolve().parent == gen_proto.OUT_ROOT / "pubsub_sidecar"
    assert not (REPO_ROOT / "pubsub_sidecar").exists()


def test_generated_service_has_the_contract_names() -> None:
    from pubsub_sidecar.v1 import sidecar_pb2

    service = sidecar_pb2.DESCRIPTOR.services_by_name["OrderedDelivery"]
    assert service.full_name == "pubsub_sidecar.v1.OrderedDelivery"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "Subscribe": ("SubscribeRequest", "SubscribeResponse"),
        "GetStatus": ("GetStatusRequest", "GetStatusResponse"),
        "UnblockKey": ("UnblockKeyRequest", "UnblockKeyResponse"),
        "SkipGap": ("SkipGapRequest", "SkipGapResponse"),
        "Publish": ("PublishRequest", "PublishResponse"),
    }
    message = sidecar_pb2.OrderedMessage.DESCRIPTOR
    assert [(f.name, f.number) for f in message.fields] == [
        ("delivery_id", 1), ("key", 2), ("message_id", 3), ("dedup_id", 4), ("data", 5),
        ("attributes", 6), ("publish_time", 7), ("sequence", 8), ("event_time", 9),
        ("delivery_attempt", 10), ("late", 11), ("skipped", 12), ("epoch", 13), ("replayed", 14),
        ("traceparent", 15),
    ]  # fmt: skip


def test_committed_peer_code_matches_its_proto() -> None:
    problems = _load_gen_proto().stale_peer_files()
    assert problems == [], "generated peer code is stale:\n" + "\n".join(problems)


def test_check_detects_a_hand_edited_peer_file(tmp_path: Path) -> None:
    gen_proto = _load_gen_proto()
    gen_proto.generate_peer(tmp_path)
    stub = tmp_path / gen_proto.PEER_PACKAGE / "peer_pb2_grpc.py"
    stub.write_text(stub.read_text() + "# edited by hand\n")
    problems = gen_proto.stale_peer_files(tmp_path)
    assert [p.split(":")[0] for p in problems] == ["sidecar/peering/proto/peer_pb2_grpc.py"]


def test_peer_service_has_the_names_both_ends_use() -> None:
    from sidecar.peering.proto import peer_pb2

    service = peer_pb2.DESCRIPTOR.services_by_name["PeerIntake"]
    assert service.full_name == "pubsub_sidecar.peer.v1.PeerIntake"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "Forward": ("ForwardRequest", "ForwardResponse")
    }
    assert {v.name for v in peer_pb2.Outcome.Reason.DESCRIPTOR.values} >= {
        "NOT_OWNER", "STALE_EPOCH", "OVERLOADED", "STOPPING", "FAILED",
    }  # fmt: skip
