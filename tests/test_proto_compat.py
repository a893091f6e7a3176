"""The compatibility rule for proto/ (scripts/proto_compat.py): what breaks existing clients fails.

The committed baseline is the API as clients know it. Each kind of break is shown caught on a mutated
copy of the baseline; additions (a new field, a new method, ...) pass, and
only ask for the baseline to be refreshed with `make proto-baseline`.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts"

FieldProto = descriptor_pb2.FieldDescriptorProto
Descriptors = descriptor_pb2.FileDescriptorSet


@pytest.fixture(scope="module")
def compat() -> ModuleType:
    # scripts/ is not a package: import the script the way `python scripts/proto_compat.py` runs it
    # (its directory first on sys.path, so that it finds gen_proto next to it).
    sys.path.insert(0, str(SCRIPTS))
    try:
        import proto_compat

        return proto_compat
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture
def baseline(compat: ModuleType) -> Descriptors:
    return compat.load()


def file_of(descriptors: Descriptors) -> descriptor_pb2.FileDescriptorProto:
    (file,) = descriptors.file
    return file


def message(descriptors: Descriptors, name: str) -> descriptor_pb2.DescriptorProto:
    (found,) = [m for m in file_of(descriptors).message_type if m.name == name]
    return found


def field(descriptors: Descriptors, message_name: str, field_name: str) -> FieldProto:
    (found,) = [f for f in message(descriptors, message_name).field if f.name == field_name]
    return found


def method(descriptors: Descriptors, name: str) -> descriptor_pb2.MethodDescriptorProto:
    (found,) = [m for m in file_of(descriptors).service[0].method if m.name == name]
    return found


def remove(container: object, item: object) -> None:
    container.remove(item)  # type: ignore[attr-defined]


def _renumber(d: Descriptors) -> None:
    field(d, "OrderedMessage", "sequence").number = 13


def _retype_scalar(d: Descriptors) -> None:
    field(d, "OrderedMessage", "sequence").type = FieldProto.TYPE_STRING


def _retype_message(d: Descriptors) -> None:
    field(d, "OrderedMessage", "publish_time").type_name = ".google.protobuf.Duration"


def _retype_map_value(d: Descriptors) -> None:
    (entry,) = message(d, "OrderedMessage").nested_type
    (value,) = [f for f in entry.field if f.name == "value"]
    value.type = FieldProto.TYPE_BYTES


def _remove_field(d: Descriptors) -> None:
    remove(message(d, "OrderedMessage").field, field(d, "OrderedMessage", "late"))


def _rename_field(d: Descriptors) -> None:
    renamed = field(d, "OrderedMessage", "delivery_id")
    renamed.name, renamed.json_name = "id", "id"


def _change_json_name(d: Descriptors) -> None:
    field(d, "OrderedMessage", "delivery_id").json_name = "deliveryID"


def _change_label(d: Descriptors) -> None:
    field(d, "Ack", "delivery_ids").label = FieldProto.LABEL_OPTIONAL


def _leave_oneof(d: Descriptors) -> None:
    field(d, "SubscribeRequest", "nack").ClearField("oneof_index")


def _drop_presence(d: Descriptors) -> None:
    optional = field(d, "KeyStatus", "next_sequence")
    optional.proto3_optional = False
    optional.ClearField("oneof_index")


def _remove_message(d: Descriptors) -> None:
    remove(file_of(d).message_type, message(d, "SkippedRange"))


def _rename_message(d: Descriptors) -> None:
    message(d, "SkippedRange").name = "Gap"
    field(d, "OrderedMessage", "skipped").type_name = ".pubsub_sidecar.v1.Gap"


def _remove_service(d: Descriptors) -> None:
    del file_of(d).service[0]


def _rename_service(d: Descriptors) -> None:
    file_of(d).service[0].name = "Delivery"


def _remove_method(d: Descriptors) -> None:
    remove(file_of(d).service[0].method, method(d, "GetStatus"))


def _rename_method(d: Descriptors) -> None:
    method(d, "GetStatus").name = "Status"


def _change_request_type(d: Descriptors) -> None:
    method(d, "GetStatus").input_type = ".pubsub_sidecar.v1.Open"


def _change_streaming(d: Descriptors) -> None:
    method(d, "Subscribe").client_streaming = False


def _move_file(d: Descriptors) -> None:
    file_of(d).name = "pubsub_sidecar/v1/api.proto"


def _change_file_options(d: Descriptors) -> None:
    file_of(d).options.java_package = "com.example.sidecar"


M = "pubsub_sidecar.v1.OrderedMessage"
BREAKS: list[tuple[str, Callable[[Descriptors], None], list[str]]] = [
    ("field renumbered", _renumber, [f"{M}.sequence (8): field renumbered 8 -> 13"]),
    ("field retyped (scalar)", _retype_scalar, [f"{M}.sequence (8): field retyped int64 -> string"]),
    (
        "field retyped (message)",
        _retype_message,
        [f"{M}.publish_time (7): field retyped google.protobuf.Timestamp -> google.protobuf.Duration"],
    ),
    ("map value retyped", _retype_map_value, [f"{M}.AttributesEntry.value (2): field retyped string -> bytes"]),
    ("field removed", _remove_field, [f"{M}.late (11): field removed"]),
    ("field renamed", _rename_field, [f"{M}.delivery_id (1): field renamed to 'id'"]),
    ("JSON name changed", _change_json_name, [f"{M}.delivery_id (1): JSON name changed 'deliveryId' -> 'deliveryID'"]),
    ("label changed", _change_label, ["pubsub_sidecar.v1.Ack.delivery_ids (1): label changed repeated -> optional"]),
    ("oneof left", _leave_oneof, ["pubsub_sidecar.v1.SubscribeRequest.nack (3): oneof changed request -> None"]),
    (
        "presence dropped",
        _drop_presence,
        ["pubsub_sidecar.v1.KeyStatus.next_sequence (7): presence changed (optional True -> False)"],
    ),
    ("message removed", _remove_message, ["pubsub_sidecar.v1.SkippedRange: message removed or renamed"]),
    (
        "message renamed",
        _rename_message,
        [
            f"{M}.skipped (12): field retyped pubsub_sidecar.v1.SkippedRange -> pubsub_sidecar.v1.Gap",
            "pubsub_sidecar.v1.SkippedRange: message removed or renamed",
        ],
    ),
    ("service removed", _remove_service, ["pubsub_sidecar.v1.OrderedDelivery: service removed or renamed"]),
    ("service renamed", _rename_service, ["pubsub_sidecar.v1.OrderedDelivery: service removed or renamed"]),
    ("method removed", _remove_method, ["pubsub_sidecar.v1.OrderedDelivery/GetStatus: method removed or renamed"]),
    ("method renamed", _rename_method, ["pubsub_sidecar.v1.OrderedDelivery/GetStatus: method removed or renamed"]),
    (
        "method request type changed",
        _change_request_type,
        [
            "pubsub_sidecar.v1.OrderedDelivery/GetStatus: request type changed "
            "pubsub_sidecar.v1.GetStatusRequest -> pubsub_sidecar.v1.Open"
        ],
    ),
    (
        "method streaming changed",
        _change_streaming,
        ["pubsub_sidecar.v1.OrderedDelivery/Subscribe: client streaming changed True -> False"],
    ),
    ("file moved", _move_file, ["pubsub_sidecar/v1/sidecar.proto: file removed or moved"]),
    (
        "file options changed",
        _change_file_options,
        ["pubsub_sidecar/v1/sidecar.proto: file options changed (they name the generated code of other languages)"],
    ),
]


def mutated(baseline: Descriptors, mutate: Callable[[Descriptors], None]) -> Descriptors:
    copy = Descriptors()
    copy.CopyFrom(baseline)
    mutate(copy)
    return copy


def test_proto_is_compatible_with_the_committed_baseline_and_the_baseline_is_current(compat: ModuleType) -> None:
    assert compat.check() == []


@pytest.mark.parametrize(("mutate", "expected"), [(m, e) for _, m, e in BREAKS], ids=[i for i, _, _ in BREAKS])
def test_each_kind_of_break_is_caught(
    compat: ModuleType, baseline: Descriptors, mutate: Callable[[Descriptors], None], expected: list[str]
) -> None:
    assert sorted(compat.breaking_changes(baseline, mutated(baseline, mutate))) == sorted(expected)


def test_a_renamed_package_breaks_every_service_and_message(compat: ModuleType, baseline: Descriptors) -> None:
    def rename_package(d: Descriptors) -> None:
        file_of(d).package = "pubsub_sidecar.v2"

    problems = compat.breaking_changes(baseline, mutated(baseline, rename_package))
    assert "pubsub_sidecar.v1.OrderedDelivery: service removed or renamed" in problems
    assert f"{M}: message removed or renamed" in problems


def test_enum_values_may_be_added_but_not_removed_or_renamed(compat: ModuleType, baseline: Descriptors) -> None:
    # The API has no enum yet: give the baseline one, then change it.
    def add_enum(d: Descriptors) -> None:
        enum = file_of(d).enum_type.add(name="Mode")
        for number, name in enumerate(("MODE_UNSPECIFIED", "MODE_SEQUENCE", "MODE_WATERMARK")):
            enum.value.add(name=name, number=number)

    with_enum = mutated(baseline, add_enum)

    def change(d: Descriptors) -> None:
        values = file_of(d).enum_type[0].value
        values[1].name = "MODE_SEQ"
        del values[2]
        values.add(name="MODE_NONE", number=3)

    assert sorted(compat.breaking_changes(with_enum, mutated(with_enum, change))) == [
        "pubsub_sidecar.v1.Mode.MODE_SEQUENCE (1): enum value renamed to 'MODE_SEQ'",
        "pubsub_sidecar.v1.Mode.MODE_WATERMARK (2): enum value removed",
    ]
    assert compat.breaking_changes(with_enum, baseline) == ["pubsub_sidecar.v1.Mode: enum removed or renamed"]


def test_additions_are_compatible(compat: ModuleType, baseline: Descriptors) -> None:
    def add(d: Descriptors) -> None:
        message(d, "OrderedMessage").field.add(
            name="note", number=40, label=FieldProto.LABEL_OPTIONAL, type=FieldProto.TYPE_STRING, json_name="note"
        )
        file_of(d).message_type.add(name="ReleaseKeyRequest")
        file_of(d).service[0].method.add(
            name="ReleaseKey", input_type=".pubsub_sidecar.v1.ReleaseKeyRequest", output_type=".pubsub_sidecar.v1.Ack"
        )
        file_of(d).service.add(name="Admin")

    assert compat.breaking_changes(baseline, mutated(baseline, add)) == []


def _proto_tree(tmp_path: Path, edit: Callable[[str], str]) -> Path:
    """A copy of proto/ with sidecar.proto edited as a person would."""
    root = tmp_path / "proto"
    shutil.copytree(REPO_ROOT / "proto", root)
    source = root / "pubsub_sidecar" / "v1" / "sidecar.proto"
    edited = edit(source.read_text())
    assert edited != source.read_text(), "the edit did not apply"
    source.write_text(edited)
    return root


def test_an_added_field_in_the_proto_source_passes_and_asks_for_the_baseline_update(
    compat: ModuleType, tmp_path: Path
) -> None:
    root = _proto_tree(
        tmp_path,
        lambda text: text.replace(
            "  repeated SkippedRange skipped = 12;\n",
            "  repeated SkippedRange skipped = 12;\n  // A note for the app.\n  string note = 40;\n",
        ),
    )
    baseline_copy = tmp_path / "baseline.txtpb"
    shutil.copy(compat.BASELINE, baseline_copy)
    descriptors = compat.current(root)

    (problem,) = compat.check(baseline_copy, descriptors)
    assert problem.startswith("proto/ has compatible changes the baseline does not record yet")
    assert "run `make proto-baseline`" in problem
    assert 'name: "note"' in problem  # the diff shows what is new
    compat.update(baseline_copy, descriptors)
    assert compat.check(baseline_copy, descriptors) == []


def test_a_retyped_field_in_the_proto_source_fails_and_update_refuses_it(compat: ModuleType, tmp_path: Path) -> None:
    root = _proto_tree(tmp_path, lambda text: text.replace("  int64 sequence = 8;", "  string sequence = 8;"))
    baseline_copy = tmp_path / "baseline.txtpb"
    shutil.copy(compat.BASELINE, baseline_copy)
    descriptors = compat.current(root)

    assert compat.check(baseline_copy, descriptors) == [f"breaking: {M}.sequence (8): field retyped int64 -> string"]
    with pytest.raises(compat.BreakingBaseline, match="field retyped int64 -> string"):
        compat.update(baseline_copy, descriptors)
    assert baseline_copy.read_text() == compat.BASELINE.read_text()
    # Deliberately (a new major version): recorded, and from then on the new type is the one protected.
    compat.update(baseline_copy, descriptors, accept_breaking=True)
    assert compat.check(baseline_copy, descriptors) == []
