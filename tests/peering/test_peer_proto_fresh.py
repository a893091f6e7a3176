"""The committed generated package ``sidecar/peering/proto/`` matches what `make proto` makes from
``proto/sidecar/peering/proto/peer.proto``, and the service has the names both ends rely on."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def _load_gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", REPO_ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
